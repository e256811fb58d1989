#!/usr/bin/env bash
# Device side, in the call that carries the last folder (README.md beside this says which): checks
# and assembles SGLang into ${SSITE:-$HOME/ssite} from the parts beside this script and those the
# earlier calls copied to ${SST:-$HOME/sst}, then imports it once. Use it as PYTHONPATH=$SSITE with
# the image's python3. A separate folder from vLLM's $HOME/vsite: the two pin different versions of
# the same packages (transformers, xgrammar, flashinfer), so each engine runs in its own process.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
S=${SSITE:-$HOME/ssite}; stage=${SST:-$HOME/sst}
mkdir -p "$stage"
cp "$here"/sgl-*.part.* "$stage"/
parts=$(awk '{printf "%s ", $2}' "$here/SHA256SUMS")
(cd "$stage" && sha256sum -c --quiet "$here/SHA256SUMS") || {
  echo "setup.sh: a part in $stage is missing or damaged (listed: $parts); make the earlier calls again" >&2; exit 1; }
rm -rf "$S"; mkdir -p "$S"
t=$(date +%s)
(cd "$stage" && cat $parts) | xz -d -T0 | tar -x -C "$S"
echo "unpacked $(du -sm "$S" | cut -f1) MiB into $S in $(( $(date +%s) - t )) s"
PYTHONPATH=$S python3 - <<'PY'
import importlib.metadata as md
import flashinfer, sgl_kernel, sglang, torch, transformers
from sglang.srt.entrypoints.engine import Engine  # noqa: F401  (the offline engine's import graph)
print("sglang", sglang.__version__, "| sglang-kernel", md.version("sglang-kernel"), "| flashinfer",
      flashinfer.__version__, "| transformers", transformers.__version__, "| torch", torch.__version__,
      "| GPU", torch.cuda.get_device_name(0))
PY
echo "SGLang ready: PYTHONPATH=$S python3 ..."
