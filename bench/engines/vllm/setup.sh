#!/usr/bin/env bash
# Device side of bench/engines/vllm/pack.sh, run from the last carry's folder (cN) after the calls
# before it copied their parts to $VST. Checks every part against SHA256SUMS, unpacks the site into
# $VSITE, links the image's CUDA libraries the site does not carry into its nvidia/ folder
# (STACK=carried), and imports torch, Triton and vLLM from it, printing their versions. Defaults:
# $HOME/vst-VER and $HOME/vsite-VER (vst-VER-image and vsite-VER-image for a STACK=image pack).
# Then use the site with
#   PYTHONPATH=$VSITE PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 python3 ...
# PYTHON (default python3) is the image's interpreter; CHECK=0 skips the import check, CHECK=only
# runs it alone on a site already unpacked.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
. "$here/pack.env" # VER, STACK, FA3, PARTS (written by pack.sh)
tag=$VER
[ "$STACK" = carried ] || tag=$VER-image # plan B's site stays apart from the carried stack's
VST=${VST:-$HOME/vst-$tag}
VSITE=${VSITE:-$HOME/vsite-$tag}
PY=${PYTHON:-python3}
t0=$(date +%s)
check_only=0
[ "${CHECK:-1}" != only ] || check_only=1
if [ $check_only = 0 ]; then
  mkdir -p "$VST"
  cp "$here"/part.* "$VST/"
  (cd "$VST" && sha256sum --quiet -c "$here/SHA256SUMS") || {
    echo "setup: a part is missing or damaged in $VST (want $PARTS parts: see SHA256SUMS)" >&2
    exit 1
  }
  rm -rf "$VSITE"
  mkdir -p "$VSITE"
  # shellcheck disable=SC2046
  cat $(awk '{print $2}' "$here/SHA256SUMS" | sed "s|^|$VST/|") | xz -d -T0 | tar -x -C "$VSITE"

  if [ "$STACK" = carried ]; then
    # The carried torch finds its CUDA libraries through its RPATH, $ORIGIN/../../nvidia/*/lib: link
    # the image's there, all but those the site carries (NCCL: torch needs a newer one).
    img=$(cd / && env -u PYTHONPATH "$PY" -c \
      "import importlib.util as u; print(*u.find_spec('nvidia').submodule_search_locations)")
    for root in $img; do
      for d in "$root"/*/; do
        n=$(basename "$d")
        [ -e "$VSITE/nvidia/$n" ] || ln -s "${d%/}" "$VSITE/nvidia/$n"
      done
    done
  fi
  echo "setup: $VSITE unpacked in $(($(date +%s) - t0)) s ($(du -sh "$VSITE" | cut -f1))"
fi
[ "${CHECK:-1}" != 0 ] || exit 0
cd / && PYTHONPATH=$VSITE PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 "$PY" - <<'PY'
import torch, triton
print("torch", torch.__version__, torch.__file__, "cuda", torch.version.cuda)
print("triton", triton.__version__, triton.__file__)
if torch.cuda.is_available():
    print("nccl", torch.cuda.nccl.version(), "cudnn", torch.backends.cudnn.version(),
          "device", torch.cuda.get_device_name(0))
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    print("matmul ok", float((x @ x).float().abs().sum()) > 0)
import vllm
import vllm._C_stable_libtorch  # noqa: F401
print("vllm", vllm.__version__, vllm.__file__, "rms_norm op:", torch.ops._C.rms_norm is not None)
PY
