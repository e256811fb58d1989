#!/usr/bin/env bash
# Checks a pack from pack.sh on the CPU machine, as far as a machine without a GPU can: the device
# sequence (parts copied to a staging folder, then cN/setup.sh) into a temporary folder, then torch,
# Triton, vLLM and vLLM's kernel libraries imported with the image's interpreter, and the modules an
# offline LLM on a dense Llama loads. Usage, from the project root:
#
#   bash bench/engines/vllm/check_on_cpu.sh [build/vllm-device-0.33.0]
#
# PYTHON is the interpreter that stands in for the image's. Without it, a venv at $IMAGE_VENV
# (build/vllm-image-venv) is made from python3.12 on PATH with what the image has that matters
# here (torch 2.11 with its CUDA 13 wheels, Triton 3.6, transformers 5.17, numba; a 3 GB download,
# once). No GPU here: libcuda.so.1 is a stub built from the symbols the libraries ask for, so the
# check is "every library loads and every symbol resolves", not "the kernels run".
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
pack=${1:-build/vllm-device-0.33.0}
pack=$(cd "$pack" && pwd)
last=$(ls -d "$pack"/c* | sort -V | tail -1)
if [ -z "${PYTHON:-}" ]; then
  venv=${IMAGE_VENV:-build/vllm-image-venv}
  if [ ! -x "$venv/bin/python" ]; then
    py312=$(command -v python3.12 || true)
    if [ -z "$py312" ]; then
      echo "check: no python3.12 on PATH to make $venv from: put one on PATH, or set PYTHON to" \
        "an interpreter with the image's torch 2.11, Triton 3.6 and transformers 5.17" >&2
      exit 2
    fi
    "$py312" -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.11.0 triton==3.6.0 "transformers==5.17.*" numba tokenizers \
      safetensors sentencepiece psutil py-cpuinfo regex tqdm requests pyyaml einops cloudpickle pillow \
      aiohttp prometheus_client tiktoken protobuf huggingface_hub filelock ninja 2>&1 |
      grep -v -i "location\|warn" || true
  fi
  PYTHON=$(cd "$venv" && pwd)/bin/python
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/vllm-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# The device's calls: each carry but the last copies its parts, the last runs setup.sh.
mkdir -p "$tmp/vst"
for c in $(ls -d "$pack"/c* | sort -V); do
  [ "$c" = "$last" ] || cp "$c"/part.* "$tmp/vst/"
done
# A stub libcuda.so.1 that defines every driver symbol the site's libraries ask for.
mkdir -p "$tmp/stub"
VST=$tmp/vst VSITE=$tmp/site PYTHON=$PYTHON CHECK=0 bash "$last/setup.sh"
for f in $(find "$tmp/site" -name '*.so*' -type f); do
  if readelf -d "$f" 2>/dev/null | grep -q "libcuda.so.1"; then
    readelf -W --dyn-syms "$f" | awk '$7=="UND" {print $8}' | sed 's/@.*//' | grep -E '^cu[A-Z]' || true
  fi
done | sort -u | awk '{print "int " $1 "(void) { return 100; }"}' > "$tmp/stub/stub.c"
echo "int cuInit(void) { return 100; } int cuDriverGetVersion(int *v) { *v = 0; return 100; }" >> "$tmp/stub/stub.c"
sort -u -o "$tmp/stub/stub.c" "$tmp/stub/stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$tmp/stub/libcuda.so.1" "$tmp/stub/stub.c"
export LD_LIBRARY_PATH=$tmp/stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
VST=$tmp/vst VSITE=$tmp/site PYTHON=$PYTHON CHECK=only bash "$last/setup.sh"
# The import check setup.sh runs on the device, then the modules of an offline engine's path.
cd "$tmp" && PYTHONPATH=$tmp/site PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 "$PYTHON" - "$tmp/site" "$(sed -n 's/^STACK=//p' "$last/pack.env")" <<'PY'
import importlib, sys, traceback
site, stack = sys.argv[1], sys.argv[2]
# What must come from the site: all four with the carried stack, vLLM alone with the image's.
ours = ("torch", "triton", "vllm", "torchvision") if stack == "carried" else ("vllm",)
import torch, triton
print("torch", torch.__version__, "from", torch.__file__)
print("triton", triton.__version__, "from", triton.__file__)
try:
    print("nccl", torch.cuda.nccl.version())
except Exception as e:
    print("nccl: not loadable without a GPU here:", e)
import vllm
import vllm._C_stable_libtorch  # noqa: F401
print("vllm", vllm.__version__, "from", vllm.__file__)
failed = []
for name in ["vllm._moe_C_stable_libtorch", "vllm.cumem_allocator", "vllm.vllm_flash_attn._vllm_fa3_C",
             "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
             "vllm.model_executor.models.llama", "vllm.v1.attention.backends.triton_attn",
             "vllm.v1.attention.backends.flash_attn", "vllm.v1.worker.gpu_worker",
             "vllm.v1.worker.gpu_model_runner", "vllm.v1.core.sched.scheduler",
             # every model load reaches it (0.33: log_online_quantization)
             "vllm.model_executor.layers.quantization.online.base",
             *(["torchvision"] if stack == "carried" else [])]:
    try:
        importlib.import_module(name)
        print("ok", name)
    except Exception as e:
        failed.append(name)
        print("FAIL", name, type(e).__name__, e)
        traceback.print_exc(limit=-2)
ops = [torch.ops._C.rms_norm, torch.ops._C_cache_ops.reshape_and_cache_flash]
print("ops ok:", [str(o) for o in ops])
# Modules of these packages loaded from a file outside the site (torch.ops' namespaces have a
# made-up __file__ that is no path: those are left out).
outside = sorted(m for m, mod in sys.modules.items()
                 if m.split(".")[0] in ours
                 and mod is not None and str(getattr(mod, "__file__", None) or "").startswith("/")
                 and not str(mod.__file__).startswith(site))
print("from the image instead of the site:", outside or "none")
sys.exit(1 if failed or outside else 0)
PY
echo "check: $pack passes on the CPU"
