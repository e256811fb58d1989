#!/usr/bin/env bash
# The GPU session of the serving engine (issue 11), in parts that each fit a 10-minute call:
#   bench/run_serving_on_gpu.sh tests      build; the serving tests (the gpu-marked ones run the
#                                          Triton paged-attention kernel against the dense forward)
#   bench/run_serving_on_gpu.sh single     build; bench_serving.py, small preset: (a) elastic vs
#                                          (b) static on one trace (b a a b), ~4 min at 30 s
#   bench/run_serving_on_gpu.sh colocated  build; (c) two engine processes sharing one budget vs
#                                          static halves (needs Config(share=...)), ~3 min
# Run from the repository root on a machine with an NVIDIA GPU and the project's Python packages
# installed. Logs go to $OUT (default ./gpu-logs); plots and tables to bench/serving/ and $OUT.
set -uo pipefail
part=${1:-tests}
out=${OUT:-gpu-logs}
duration=${DURATION:-30}
mkdir -p "$out" bench/serving
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
CC=/usr/bin/gcc CXX=/usr/bin/g++ python3 -m pip install -q --no-build-isolation --no-deps -e . \
  >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
case "$part" in
  tests)
    python3 -m pytest -q -p no:cacheprovider tests/test_serve_model.py tests/test_serve_engine.py \
      tests/test_serve_http.py tests/test_serve_demo.py 2>&1 | tail -15 | tee "$out/tests_serve.log"
    ;;
  single)
    python3 bench/bench_serving.py --preset small --device cuda --duration "$duration" \
      --skip-colocated --out bench/serving 2>&1 | tee "$out/bench_serving_single.log" | tail -12
    ;;
  colocated)
    python3 bench/bench_serving.py --preset small --device cuda --duration "$duration" \
      --colocated-only --out bench/serving 2>&1 | tee "$out/bench_serving_colocated.log" | tail -12
    ;;
  *)
    echo "usage: $0 tests|single|colocated" >&2
    exit 2
    ;;
esac
cp bench/serving/*small* "$out/" 2>/dev/null || true
