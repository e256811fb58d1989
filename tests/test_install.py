"""What a new user installs: the extras name what each feature needs, and kvasync works on a CPU
without the GPU extra (Triton)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement_names(requirements: list[str]) -> set[str]:
    """``["triton>=3.2", "anyio>=4.4"]`` -> ``{"triton", "anyio"}``."""
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_triton_is_the_gpu_extra_and_the_test_suite_still_gets_it():
    # 999 MB of Triton on a CPU install, where the block ops run as torch indexing (issue 18).
    assert "triton" not in requirement_names(PROJECT["dependencies"])
    extras = PROJECT["optional-dependencies"]
    assert "triton" in requirement_names(extras["gpu"])
    # The CPU suite runs the kernels under Triton's interpreter: the test extra and the Makefile
    # install it.
    assert "triton" in requirement_names(extras["test"])
    assert '"triton>=' in (ROOT / "Makefile").read_text()


def test_the_trio_extra_installs_anyio_which_the_trio_path_needs():
    assert {"trio", "anyio"} <= requirement_names(PROJECT["optional-dependencies"]["trio"])


# Runs with Triton made unimportable (a None entry in sys.modules is how Python spells "not
# installed" to an import): what a CPU install without the gpu extra sees.
WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None
import torch
import kvasync
from kvasync import _block_ops

layout = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
with kvasync.open_allocator_sync(layout, kvasync.Config(backend="host")) as kv:
    ids = kv.alloc(4, timeout=5.0)
    src = torch.randn(4, *kv.gather(ids).shape[1:]).to(torch.float16)
    kv.scatter(ids, src)
    assert torch.equal(kv.gather(ids), src)
    kv.copy(ids[:2], ids[2:])
    assert torch.equal(kv.gather(ids[2:]), src[:2])
    kv.zero(ids[:1])
    assert not kv.gather(ids[:1]).any()
    kv.free(ids)
assert "kvasync.kernels" not in sys.modules, "the kernels were imported on a CPU"
try:
    _block_ops._kernels()  # what a launch on a CUDA device calls first
except kvasync.KVAsyncError as error:
    print("refused:", error)
"""


def test_import_and_the_block_ops_work_on_a_cpu_without_triton():
    # Even with the interpreter asked for: without Triton there is nothing to interpret.
    done = run_python(WITHOUT_TRITON, TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr
    # On a CUDA device without Triton, the error names the extra to install.
    assert "refused: the block ops" in done.stdout
    assert 'pip install "kvasync[gpu]"' in done.stdout


# The serve engine asked for the Triton kernel (what "auto" picks on a CUDA device), without
# Triton: refused at open with the extra named, and the KV cache it opened is closed again.
ENGINE_WITHOUT_TRITON = """
import asyncio, os, sys, uuid
sys.modules["triton"] = None
import kvasync
from kvasync import share
from kvasync.serve import EngineConfig, open_engine
from kvasync.serve._attention import paged_attention_kernel

async def main():
    name = f"test-install-{uuid.uuid4().hex[:12]}"
    config = EngineConfig(
        preset="tiny", device="cpu", attention="triton", max_blocks=64, share=name,
        device_budget=64 << 20,
    )
    try:
        async with open_engine(config):
            print("opened")
    except kvasync.KVAsyncError as error:
        print("refused:", error)
    # The allocator joined the share, and left it with its close: the last member out removes it.
    print("share left:", not os.path.exists(share.path(name)))
    try:
        paged_attention_kernel()
    except kvasync.KVAsyncError:
        print("refused again")

asyncio.run(main())
"""


def test_the_engines_paged_attention_without_triton_names_the_gpu_extra():
    # Was a bare ModuleNotFoundError: No module named 'triton', at the first step.
    done = run_python(ENGINE_WITHOUT_TRITON)
    assert done.returncode == 0, done.stderr
    assert "refused: the serve engine's paged attention" in done.stdout, done.stdout
    assert 'pip install "kvasync[gpu]"' in done.stdout
    assert "opened" not in done.stdout and "refused again" in done.stdout
    assert "share left: True" in done.stdout
