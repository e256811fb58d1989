#!/usr/bin/env bash
# Packs SGLang for the H200 device image (Python 3.12, torch 2.11.0+cu130, triton 3.6, CUDA 13; no
# registry there; one device call carries at most 64 MiB) into folders that each fit one call:
#   bash bench/engines/sglang/pack.sh [0.5.17 | 0.5.15.post1]        (default 0.5.17)
# writes build/sglang-device/c1 .. cN for 0.5.17 (build/sglang-device-0.5.15.post1/c1 .. for the
# other), each holding parts of one xz-compressed tar of a site folder; the last folder also holds
# SHA256SUMS, setup.sh and smoke.py. README.md beside this says how the device calls go.
# Run from the project root on the CPU machine (needs pip, unzip, xz, split, sha256sum). Small wheels
# are cached in build/sglang-device/wheels; sglang-kernel's wheel (~380 MB, of which the carried part
# is ~60 MB unpacked) is downloaded to scratch, unpacked and deleted. Scratch is $TMPDIR (else /tmp):
# it needs ~0.8 GB; TMPDIR=/dev/shm keeps it off a full disk.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ver=${1:-0.5.17}
# The pins are sglang's own (Requires-Dist) where the image's version differs; tokenizers 0.22.2
# because transformers 5.12.1 checks tokenizers<=0.23.0 at import and the image has 0.23.2.
case $ver in
  0.5.17) kernel=0.4.5 fi=0.6.15.post1 out=build/sglang-device extra=() ;;
  # flashinfer 0.6.12's flashinfer.comm imports cuda.tile at module level (0.6.15's does not).
  0.5.15.post1) kernel=0.4.4 fi=0.6.12 out=build/sglang-device-0.5.15.post1 extra=(cuda-tile==1.7.0) ;;
  *) echo "pack.sh: SGLang $ver is not one this script knows (0.5.17, 0.5.15.post1): its pins need checking first" >&2; exit 2 ;;
esac
w=build/sglang-device/wheels
mkdir -p "$w"
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
dl() { pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any "$@" 2>&1 \
  | { grep -v -i "location\|warn" || true; }; }
# What the offline Engine imports for a dense Llama on Hopper (the engine, scheduler, detokenizer,
# model runner, llama, the Triton and FlashInfer attention backends, the pytorch sampler) that the
# image lacks, found by importing those modules against this site on the CPU machine. Not carried,
# though sglang requires them, because that path does not import them: flash-attn-4, quack-kernels,
# nvidia-cutlass-dsl, sgl-deep-gemm (fp8 only), tilelang, helion, humming-kernels, tokenspeed_mla,
# torchao, numba, outlines, llguidance, kernels, modelscope, datasets, anthropic, blobfile,
# smg-grpc-servicer, torchcodec, soundfile, timm, py-spy, flashinfer-cubin/-jit-cache, and
# IPython's own dependencies (sglang.utils imports only IPython.display, which needs traitlets).
pkgs=(sglang==$ver flashinfer-python==$fi torch_memory_saver==0.0.10 transformers==5.12.1 tokenizers==0.22.2
  xgrammar==0.2.1 apache-tvm-ffi==0.1.11 openai==2.6.1 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 fastapi==0.165.0
  starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.55.0 python-multipart==0.0.34 msgspec==0.23.0
  pyzmq==27.3.0 orjson==3.13.0 pybase64==1.5.1 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7
  dill==0.4.1 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 ipython==9.18.1 traitlets==5.16.1
  ${extra[@]+"${extra[@]}"})
dl -d "$w" "${pkgs[@]}"
dl -d "$scratch" sglang-kernel==$kernel
site=$scratch/site; mkdir "$site"
# One wheel per name: the cache may hold other versions from an earlier pack.
pick() { python3 - "$w" "$@" <<'PY'
import re, sys, pathlib
w = pathlib.Path(sys.argv[1]); norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
for spec in sys.argv[2:]:
    name, _, v = spec.partition("==")
    hits = sorted(p for p in w.glob("*.whl") if norm(p.name.split("-")[0]) == norm(name)
                  and (not v or p.name.split("-")[1] == v))
    if not hits: sys.exit(f"pack.sh: no wheel for {spec} in {w}")
    print(hits[-1])
PY
}
mapfile -t wheels < <(pick "${pkgs[@]}")
for f in "${wheels[@]}"; do
  case $(basename "$f") in
    # sglang's three Rust extensions serve the gRPC server, the Rust HTTP server and one model's
    # image preprocessing; the offline Engine imports none of them.
    sglang-*) unzip -q -o "$f" -d "$site" -x 'sglang/srt/*/_core.cpython-*.so' ;;
    # The static library is for building against xgrammar; Python loads only the bindings.
    xgrammar-*) unzip -q -o "$f" -d "$site" -x 'xgrammar/lib/*' ;;
    *) unzip -q -o "$f" -d "$site" ;;
  esac
done
# sgl_kernel without what a dense model on Hopper does not load: flash_ops (FlashAttention-3,
# 1.12 GB, imported only by sgl_kernel.flash_attn, i.e. by the fa3 backend), infllm_ops (loaded on
# demand by InfLLM-v2 attention), flashmla_ops (MLA models; sgl_kernel.flash_mla imports it inside
# try) and sm100/common_ops (what sgl_kernel loads on any GPU that is not compute capability 9.0,
# and with no GPU at all: on the H200 it loads sm90/common_ops).
unzip -q -o "$scratch"/sglang_kernel-$kernel-*.whl -d "$site" -x 'sgl_kernel/flash_ops.abi3.so' \
  'sgl_kernel/infllm_ops*' 'sgl_kernel/flashmla_ops*' 'sgl_kernel/sm100/*' 2>&1 | { grep -v 'excluded filename not matched' || true; }
rm -f "$scratch"/sglang_kernel-*.whl
{ echo "SGLang $ver for the H200 image, packed $(date -u +%FT%TZ) by bench/engines/sglang/pack.sh from:"
  for f in "${wheels[@]}"; do basename "$f"; done; echo "sglang_kernel-$kernel (less flash_ops, infllm_ops, flashmla_ops, sm100)"
} > "$site/SGLANG_PACK.txt"
echo "site: $(du -sm "$site" | cut -f1) MiB unpacked"
t=$(date +%s)
tar -cf - -C "$site" . | xz -T"${XZ_THREADS:-2}" -6 > "$scratch/site.tar.xz"
echo "xz -6: $(( $(stat -c %s "$scratch/site.tar.xz") / 1048576 )) MiB in $(( $(date +%s) - t )) s"
rm -rf "$site"
# Parts of at most 60 MiB: with the project tree (~6 MiB) beside a folder, one call stays under 64.
rm -rf "$out"/c[0-9]*
name=sgl-$ver.part.
split -b 60M -a 2 "$scratch/site.tar.xz" "$scratch/$name"
(cd "$scratch" && sha256sum $name* > SHA256SUMS)
k=0
for p in "$scratch/$name"*; do k=$((k + 1)); mkdir -p "$out/c$k"; mv "$p" "$out/c$k/"; done
cp "$scratch/SHA256SUMS" "$here/setup.sh" "$here/smoke.py" "$out/c$k/"
echo "$k part(s), $(du -cm "$out"/c[0-9]*/$name* | tail -1 | cut -f1) MiB in all:"
du -sm "$out"/c[0-9]*
