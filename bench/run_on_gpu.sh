#!/usr/bin/env bash
# The GPU session behind bench/RESULTS.md: build, every test (the gpu-marked ones included), then
# the benchmarks. Run from the repository root on a machine with an NVIDIA GPU and the project's
# Python packages installed; logs go to $OUT (default ./gpu-logs).
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
CC=/usr/bin/gcc CXX=/usr/bin/g++ python3 -m pip install -q --no-build-isolation --no-deps -e . \
  >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
python3 -m pytest -q -p no:cacheprovider 2>&1 | tail -15 | tee "$out/tests.log"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py 2>&1 | tail -4 \
  | tee "$out/tests_cuda_alone.log"
python3 bench/bench_kernels.py 2>&1 | tee "$out/bench_kernels.log" | tail -30
python3 bench/bench_map.py --repeats 15 2>&1 | tee "$out/bench_map.log" | tail -20
for layout in small kvcached; do
  python3 bench/bench_alloc.py --backend cuda --layout "$layout" --quick 2>&1 \
    | tee "$out/bench_alloc_$layout.log" | tail -12
done
