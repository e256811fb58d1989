#!/usr/bin/env bash
# The GPU session of the serving engine (issue 11): build, the serving tests (the gpu-marked ones
# run the Triton paged-attention kernel against the dense forward), then bench_serving.py with the
# small preset (~100M parameters). Run from the repository root on a machine with an NVIDIA GPU and
# the project's Python packages installed; logs go to $OUT (default ./gpu-logs), plots and the
# table to bench/serving/.
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out" bench/serving
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
CC=/usr/bin/gcc CXX=/usr/bin/g++ python3 -m pip install -q --no-build-isolation --no-deps -e . \
  >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
python3 -m pytest -q -p no:cacheprovider tests/test_serve_model.py tests/test_serve_engine.py \
  tests/test_serve_http.py 2>&1 | tail -15 | tee "$out/tests_serve.log"
python3 bench/bench_serving.py --preset small --device cuda --duration "${DURATION:-60}" \
  --out bench/serving 2>&1 | tee "$out/bench_serving_small.log" | tail -25
cp bench/serving/*small* "$out/" 2>/dev/null || true
