#!/usr/bin/env bash
# Device side: builds the reference allocator, kvcached, from the source that pack_kvcached.sh packed
# (carried as build/kvcached) against the image's torch, into a site folder of its own:
#   bash bench/reference/build_kvcached.sh [PACK (build/kvcached)] [SITE ($HOME/kvcached-site)]
# SITE then holds kvcached (with its vmm_ops extension), wrapt, posix_ipc and kvcached's
# kvcached_autopatch.pth. Nothing is installed into the image's site-packages, so stock and kvasync
# engines never import kvcached; bench_vllm.py's kvcached engines add SITE with site.addsitedir,
# which runs the .pth as an installed kvcached would. Idempotent: a SITE built from the same commit
# is kept. About a minute on 16 cores (six C++ files against torch's headers, with ninja).
set -euo pipefail
pack=$(cd "${1:-build/kvcached}" && pwd)
site=${2:-$HOME/kvcached-site}
commit=$(cat "$pack/COMMIT")
if [ -f "$site/.kvcached-commit" ] && [ "$(cat "$site/.kvcached-commit")" = "$commit" ] \
   && ls "$site"/kvcached/vmm_ops*.so >/dev/null 2>&1; then
  echo "kvcached $commit already built in $site"; exit 0
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
staging=$site.partial; rm -rf "$staging"
tar -xzf "$pack/kvcached-src.tar.gz" -C "$work"
python3 -m pip install -q --no-deps --no-index --target "$staging" "$pack"/wheels/*.whl
# ninja from its wheel (torch's BuildExtension compiles serially without it); gcc as the host
# compiler, as for kvasync's own build on this image.
export PATH="$staging/bin:$PATH" CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# kvcached links the driver API (-lcuda). A container may have only the driver's libcuda.so.1 and
# no unversioned libcuda.so for the linker: then link against the toolkit's stub, or that .so.1.
if ! echo 'int main(void){return 0;}' | gcc -x c - -lcuda -o "$work/probe" 2>/dev/null; then
  cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
  for candidate in "$cuda_home/lib64/stubs/libcuda.so" \
      "$cuda_home/targets/x86_64-linux/lib/stubs/libcuda.so" \
      $(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF}'); do
    if [ -e "$candidate" ]; then
      mkdir -p "$work/lib"; ln -sf "$candidate" "$work/lib/libcuda.so"
      export LIBRARY_PATH="$work/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
      echo "linking -lcuda against $candidate"; break
    fi
  done
fi
python3 -m pip install --no-build-isolation --no-deps --no-index --target "$staging" "$work/kvcached"
[ -f "$staging/kvcached_autopatch.pth" ] || { echo "the build left no kvcached_autopatch.pth" >&2; exit 1; }
PYTHONPATH="$staging" python3 -c "import torch, kvcached.vmm_ops, wrapt.importer, posix_ipc; print('kvcached built against torch', torch.__version__)"
echo "$commit" > "$staging/.kvcached-commit"
rm -rf "$site"; mv "$staging" "$site"
echo "kvcached $commit in $site"
