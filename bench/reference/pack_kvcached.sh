#!/usr/bin/env bash
# Packs the reference allocator, kvcached, for bench/bench_vllm.py on the H200 device machine (no
# network there; one call carries at most 64 MiB): its source at a pinned commit and the wheels it
# needs that the device image lacks, into build/kvcached/ (ignored by git; about 0.6 MiB).
#   build/kvcached/kvcached-src.tar.gz  csrc/, kvcached/, setup.py, ... at $KVCACHED_COMMIT
#   build/kvcached/wheels/              wrapt, posix_ipc (its runtime deps), ninja (a parallel build)
#   build/kvcached/COMMIT               the commit packed
# The device side is bench/reference/build_kvcached.sh (bench_vllm.py runs it before the first
# kvcached engine). No kvcached code enters this repository: it is built from its own source, for
# the benchmark only.
#
# Run from the project root on the CPU machine. Reads kvcached from a git copy holding the commit:
# KVCACHED_GIT (a clone or a bare git directory) when set; else a bare clone of KVCACHED_URL
# (default https://github.com/ovg-project/kvcached) made once in build/kvcached-git.
set -euo pipefail
commit=${KVCACHED_COMMIT:-e8e640638ba79f3ba7ce88d9692342d29d996e6d} # the earlier benches' (issue 8)
url=${KVCACHED_URL:-https://github.com/ovg-project/kvcached}
out=build/kvcached
if [ -n "${KVCACHED_GIT:-}" ]; then
  git_dir=$KVCACHED_GIT
  [ -d "$git_dir" ] || { echo "KVCACHED_GIT=$git_dir: no such directory (a kvcached clone or bare git directory)" >&2; exit 1; }
else
  git_dir=build/kvcached-git
  if [ ! -d "$git_dir" ]; then
    echo "cloning $url into $git_dir (set KVCACHED_GIT to use a git copy you have)" >&2
    git clone -q --bare "$url" "$git_dir" ||
      { rm -rf "$git_dir"; echo "could not clone $url: set KVCACHED_GIT to a kvcached git copy holding $commit" >&2; exit 1; }
  fi
fi
# A clone (with a .git inside) or a bare git directory.
g() { if [ -d "$git_dir/.git" ]; then git -C "$git_dir" "$@"; else git --git-dir="$git_dir" "$@"; fi; }
g cat-file -e "$commit^{commit}" ||
  { echo "$git_dir lacks commit $commit (fetch it there, or set KVCACHED_GIT to a copy holding it)" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
src=$tmp/kvcached
# What setup.py builds and installs (its README is read as the long description), file by file from
# the commit's tree: the snapshot may lack blobs (large assets) that no build needs.
paths=(csrc kvcached setup.py pyproject.toml MANIFEST.in kvcached_autopatch.pth README.md LICENSE requirements.txt)
g ls-tree -r --full-tree "$commit" -- "${paths[@]}" | while read -r mode type blob path; do
  [ "$type" = blob ] || continue
  mkdir -p "$src/$(dirname "$path")"
  g cat-file blob "$blob" > "$src/$path"
  [ "$mode" != 100755 ] || chmod +x "$src/$path"
done
for need in setup.py csrc/torch_bindings.cpp kvcached/integration/vllm/autopatch.py kvcached_autopatch.pth; do
  [ -s "$src/$need" ] || { echo "packed tree lacks $need" >&2; exit 1; }
done
rm -rf "$out"; mkdir -p "$out/wheels"
tar -czf "$out/kvcached-src.tar.gz" -C "$tmp" kvcached
echo "$commit" > "$out/COMMIT"
# The device image's Python is 3.12 (x86_64); kvcached's pyproject asks numpy (the image has it),
# posix_ipc and wrapt (pinned: the versions checked with it here). ninja lets torch's
# BuildExtension compile its six files in parallel.
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$out/wheels" wrapt==2.5.2 posix_ipc==1.3.2 ninja==1.13.2 2>&1 | grep -v -i "location\|warn" || true
for w in wrapt posix_ipc ninja; do
  ls "$out"/wheels/"$w"-*.whl >/dev/null 2>&1 || { echo "no $w wheel downloaded" >&2; exit 1; }
done
du -sh "$out"; ls -l "$out" "$out/wheels"
