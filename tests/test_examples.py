"""Every file in examples/ runs as a new user would run it: a subprocess with a deadline.

The README and the manual show code only from these files (tests/test_docs.py checks that), so
an example that no longer runs fails here instead of going stale on a page. An example that
needs what this machine lacks (a GPU, vLLM, an optional extra) is skipped, saying which.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DEADLINE = 90.0  # seconds an example may run (most take 2-5 s here)
SERVER_DEADLINE = 60.0  # seconds `kvasync serve` may take to answer /health


@dataclass(frozen=True)
class Needs:
    """What an example needs beyond the base install, and what it must print."""

    modules: tuple[str, ...] = ()  # importable modules (an extra's packages)
    extra: str = ""  # the install that brings them, for the skip message
    gpu: bool = False
    server: bool = False  # `kvasync serve` up, its URL in OPENAI_BASE_URL
    pytest: bool = False  # run with pytest, not as a script
    prints: tuple[str, ...] = ()


NEEDS = {
    "quickstart.py": Needs(
        prints=("8 blocks written, 8 in use", "after free and trim: 0 in use, 0 pages mapped")
    ),
    "allocator_api.py": Needs(
        prints=("alloc_nowait: 64 mapped free blocks", "OutOfBlocks:", "AllocTimeout:")
    ),
    "sync_allocator.py": Needs(prints=("workers: [4, 4, 4, 4]", "used after free: 0")),
    "trio_allocator.py": Needs(modules=("trio",), extra='"kvasync[trio]"', prints=("trio: [",)),
    "engine.py": Needs(prints=("2 finished, 0 preemptions",)),
    "metrics.py": Needs(
        modules=("prometheus_client",),
        extra='"kvasync[metrics]"',
        prints=('kvasync_used_blocks{allocator="chat"} 8.0',),
    ),
    "openai_client.py": Needs(
        modules=("openai", "fastapi", "uvicorn"),
        extra='"kvasync[serve]" openai',
        server=True,
        prints=("completion:", "chat:", "stream: ["),
    ),
    "colocate.py": Needs(prints=("second committed", "second: 128 blocks")),
    "tensor_parallel.py": Needs(
        prints=("scheduler: 64 blocks, mapped on every rank", "rank 0:", "rank 1:")
    ),
    "test_with_kvasync.py": Needs(
        modules=("pytest_asyncio",),
        extra="pytest pytest-asyncio",
        pytest=True,
        prints=("3 passed",),
    ),
    "vllm_offline.py": Needs(modules=("vllm",), extra='".[vllm]"', gpu=True),
}


def example_names() -> list[str]:
    return sorted(path.name for path in EXAMPLES.glob("*.py"))


def test_every_example_is_known_and_every_entry_is_an_example() -> None:
    # A new example runs here whatever it is; an entry whose file was removed is a stale one.
    assert set(NEEDS) == set(example_names())


def skip_reason(needs: Needs) -> str | None:
    missing = [name for name in needs.modules if importlib.util.find_spec(name) is None]
    if missing:
        return f"needs {', '.join(missing)}: pip install {needs.extra}"
    if needs.gpu:
        import torch

        if not torch.cuda.is_available():
            return "needs an NVIDIA GPU with a CUDA driver"
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def kvasync_server() -> Iterator[str]:
    """`kvasync serve --preset tiny` on a free port, up (its /health answers) within a deadline."""
    port = free_port()
    command = [sys.executable, "-m", "kvasync", "serve", "--preset", "tiny", "--device", "cpu"]
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + SERVER_DEADLINE
        while True:
            assert server.poll() is None, f"kvasync serve exited:\n{server.communicate()[0]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "kvasync serve did not come up in time"
                time.sleep(0.1)  # polling the server's own readiness, with the deadline above
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        try:
            server.communicate(timeout=20.0)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate(timeout=20.0)


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE, check=False
    )


@pytest.mark.timeout(DEADLINE + SERVER_DEADLINE + 30)
@pytest.mark.parametrize("name", example_names())
def test_the_example_runs_and_prints_what_the_docs_say(name: str) -> None:
    needs = NEEDS.get(name, Needs())
    reason = skip_reason(needs)
    if reason is not None:
        pytest.skip(f"{name} {reason}")
    path = EXAMPLES / name
    command = [sys.executable, str(path)]
    if needs.pytest:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    env = dict(os.environ)
    with contextlib.ExitStack() as stack:
        if needs.server:
            env["OPENAI_BASE_URL"] = stack.enter_context(kvasync_server())
        done = run(command, env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} exited with {done.returncode}:\n{output}"
    for text in needs.prints:
        assert text in done.stdout, f"{name} did not print {text!r}:\n{output}"
