#!/usr/bin/env bash
# Packs a vLLM release, with the torch, Triton and NCCL it pins, for the H200 device machine, which
# reaches no registry and takes at most 64 MiB per call. Usage, from the project root on the CPU
# machine (needs pip, unzip, xz, strip, python3):
#
#   bash bench/engines/vllm/pack.sh 0.33.0              # STACK=carried (default)
#   STACK=image bash bench/engines/vllm/pack.sh 0.33.0  # plan B: vLLM alone, against the image's torch
#
# It writes build/vllm-device-VER/c1..cN (each at most PART_MIB, 52 MiB by default, so that a call
# has room for the project's tree beside it) and SHA256SUMS. cN also holds setup.sh, which the last
# device call runs; README.md beside this file gives the device sequence. One xz stream of the
# whole site is split over the carries, so every carry but the last holds parts only.
#
# What travels (STACK=carried): vLLM's wheel without the kernels a dense model on Hopper does not
# load (fa2, the Rust front end, deep_gemm, the sm100 fmha, flashmla, qutlass, flashkda,
# deepselect, the Swagger bundle; fa3, for FLASH_ATTN, about 12 MiB of xz, stays unless FA3=0);
# torch (without headers, cmake files and protoc); Triton (without CUPTI, the
# Blackwell ptxas, the instrumentation library, proton and the AMD libraries; debug info
# stripped); libnccl.so.2 (debug info stripped); torchvision at vLLM's pin (so that the image's,
# built for its own torch, is never imported); and the small pure packages vLLM imports that the
# image lacks. Every CUDA library's GPU code for other architectures than sm_90 is zeroed
# (keep_arch.py), which xz then all but drops. The CUDA toolkit libraries (cuBLAS, cuFFT, cuSPARSE,
# cuSOLVER, cuRAND, NVRTC, cudart, CUPTI, cuFile, nvJitLink), cuDNN, cuSPARSELt and NVSHMEM come
# from the image: setup.sh links them into the site (same sonames; see README.md).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
VER=${1:-0.33.0}
STACK=${STACK:-carried}
FA3=${FA3:-1}
PART_MIB=${PART_MIB:-52}
ARCH=${ARCH:-90}
XZ_LEVEL=${XZ_LEVEL:-9}
case $STACK in carried | image) ;; *) echo "STACK is carried or image" >&2; exit 2 ;; esac
out=build/vllm-device-$VER
[ "$STACK" = carried ] || out=build/vllm-device-$VER-image
w=${WHEELS:-build/vllm-wheels}
mkdir -p "$w"
dl() {
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_18_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$w" "$1" 2>&1 |
    grep -v -i "location\|warn" || true
}
wheel() { # the cached wheel of NAME (a file-name prefix) VERSION, downloaded if missing
  local f
  f=$(ls "$w/$1-$2-"*.whl 2>/dev/null | head -1 || true)
  if [ -z "$f" ]; then
    dl "$3"
    f=$(ls "$w/$1-$2-"*.whl 2>/dev/null | head -1 || true)
  fi
  [ -n "$f" ] || { echo "no wheel for $3" >&2; exit 1; }
  echo "$f"
}
pin() { # the == pin of package $2 in wheel $1's metadata (its unconditional Requires-Dist)
  unzip -p "$1" '*.dist-info/METADATA' | python3 "$here/pins.py" "$2"
}
vllm_whl=$(wheel vllm "$VER" "vllm==$VER")
torch_v=$(pin "$vllm_whl" torch)
tv_v=$(pin "$vllm_whl" torchvision)
echo "vLLM $VER pins torch $torch_v, torchvision $tv_v"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/vllm-pack.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
site=$tmp/site
mkdir -p "$site"
# vLLM without what a dense model on Hopper never loads.
skip=('vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' 'vllm/third_party/fmha_sm100/*'
  'vllm/third_party/deep_gemm/*' 'vllm/_flashmla_C.abi3.so' 'vllm/_flashmla_extension_C.abi3.so'
  'vllm/_qutlass_C.abi3.so' 'vllm/_flashkda_C.abi3.so' 'vllm/_deepselect_C.abi3.so'
  'vllm/entrypoints/serve/instrumentator/static/*')
[ "$FA3" = 1 ] || skip+=('vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so')
unzip -q "$vllm_whl" -d "$site" -x "${skip[@]}"

# The small packages vLLM imports on an offline LLM's path (and its server's) that the image lacks.
# loguru: compressed-tensors imports it at module level, and 0.33's model loader imports
# compressed-tensors on every load (a pack without it failed every engine's start on the H200).
extras=(cachetools blake3 pydantic pydantic-core annotated-types typing-inspection msgspec pyzmq cbor2
  pybase64 ijson setproctitle compressed-tensors==0.17.0 loguru==0.7.3 depyf==0.20.0 astor dill partial-json-parser
  python-json-logger watchfiles "openai>=2,<3" jiter distro sniffio "fastapi>=0.133,<0.137"
  "starlette>=1.0.1" uvicorn uvloop lark==1.2.2 diskcache jsonschema referencing rpds-py
  jsonschema-specifications outlines_core==0.2.14 lm-format-enforcer==0.11.3 interegular
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
  opentelemetry-semantic-conventions-ai gguf pydantic-extra-types nvtx==0.2.15
  prometheus-fastapi-instrumentator oss-harmony llguidance==1.6.1 xgrammar==0.2.8 apache-tvm-ffi==0.1.11)
ew=$w/extras-$VER
mkdir -p "$ew"
# The marker holds the list it was downloaded for: a package added to the list is fetched next time.
if [ "$(cat "$ew/.done" 2>/dev/null)" != "${extras[*]}" ]; then
  for p in "${extras[@]}"; do
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_26_x86_64 \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$ew" "$p" 2>&1 |
      grep -v -i "location\|warn" || true
  done
  echo "${extras[*]}" > "$ew/.done"
fi
for f in "$ew"/*.whl; do unzip -q -o "$f" -d "$site"; done

if [ "$STACK" = carried ]; then
  torch_whl=$(wheel torch "$torch_v" "torch==$torch_v")
  triton_v=$(pin "$torch_whl" triton)
  nccl_v=$(pin "$torch_whl" nvidia-nccl-cu13)
  echo "torch $torch_v pins triton $triton_v, nvidia-nccl-cu13 $nccl_v"
  triton_whl=$(wheel triton "$triton_v" "triton==$triton_v")
  nccl_whl=$(wheel nvidia_nccl_cu13 "$nccl_v" "nvidia-nccl-cu13==$nccl_v")
  tv_whl=$(wheel torchvision "$tv_v" "torchvision==$tv_v")
  unzip -q "$torch_whl" -d "$site" -x 'torch/include/*' 'torch/share/*' 'torch/bin/protoc*'
  unzip -q "$triton_whl" -d "$site" -x 'triton/backends/nvidia/lib/cupti*' \
    'triton/backends/nvidia/bin/ptxas-blackwell' 'triton/instrumentation/*' 'triton/_C/libproton.so' \
    'triton/backends/amd/include/*' 'triton/backends/amd/lib/*'
  unzip -q "$nccl_whl" 'nvidia/nccl/lib/libnccl.so.2' -d "$site"
  unzip -q "$tv_whl" -d "$site"
  strip --strip-debug "$site/triton/_C/libtriton.so" "$site/nvidia/nccl/lib/libnccl.so.2"
fi
find "$site" -name '*.so*' -type f -size +1M -print0 | xargs -0 python3 "$here/keep_arch.py" --keep "$ARCH" |
  grep -v ' 0 containers' || true
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
echo "site: $(du -sh --apparent-size "$site" | cut -f1) unpacked"

# One xz stream (x86 filter for the libraries, then LZMA2), split evenly over as few carries as fit.
tar -cf - -C "$site" . | xz -T2 --x86 --lzma2=preset="$XZ_LEVEL" > "$tmp/site.tar.xz"
total=$(stat -c %s "$tmp/site.tar.xz")
limit=$((PART_MIB * 1024 * 1024 - 64 * 1024)) # the last carry also holds setup.sh and the sums
n=$(((total + limit - 1) / limit))
size=$(((total + n - 1) / n))
rm -rf "$out"
mkdir -p "$out"
(cd "$tmp" && split -a 2 -b "$size" site.tar.xz part.)
i=0
for p in "$tmp"/part.*; do
  i=$((i + 1))
  mkdir -p "$out/c$i"
  mv "$p" "$out/c$i/"
done
(cd "$out" && sha256sum c*/part.* | sed 's| c[0-9]*/| |' > SHA256SUMS)
cp "$out/SHA256SUMS" "$here/setup.sh" "$out/c$n/"
printf 'VER=%s\nSTACK=%s\nFA3=%s\nPARTS=%s\n' "$VER" "$STACK" "$FA3" "$n" > "$out/c$n/pack.env"
echo "$out: $n carries, $((total / 1024 / 1024)) MiB of xz"
du -sh "$out"/c*
