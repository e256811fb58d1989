"""Shared test setup.

NOTE: Triton decides at kernel definition whether to interpret, so TRITON_INTERPRET must be set
before kvasync.kernels is first imported; this module is imported before any test module.
Without a GPU, Triton's interpreter runs the kernels on CPU tensors (~1 ms per program instance).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# -- allocator fixtures -----------------------------------------------------------------------
import asyncio
import contextlib
import inspect
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvasync
from kvasync import share as ledger


def _has_cuda_driver() -> bool:
    return torch.cuda.is_available()


@pytest.fixture(
    params=[
        "host",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not _has_cuda_driver(), reason="needs an NVIDIA GPU"),
            ],
        ),
    ]
)
def backend_name(request: pytest.FixtureRequest) -> str:
    """Every backend the contract tests run on: host always, cuda where a GPU is present."""
    return str(request.param)


SMALL_LAYOUTS = {
    # 4 KiB blocks, 512 per 2 MiB page.
    "pow2": kvasync.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16),
    # DeepSeek-V3's MLA latent cache: 18432-byte blocks, 113.8 per 2 MiB page.
    "mla576-bf16": kvasync.KVLayout(
        num_layers=4,
        num_kv_heads=1,
        head_dim=576,
        block_size=16,
        dtype=torch.bfloat16,
        kv_buffers=1,
    ),
    # Phi-2's head_dim, fewer heads: 5120-byte blocks, 409.6 per 2 MiB page.
    "hd80": kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=80, block_size=16),
}


@pytest.fixture(params=list(SMALL_LAYOUTS))
def small_layout(request: pytest.FixtureRequest) -> kvasync.KVLayout:
    """Small per-layer layouts: one whose blocks fill a 2 MiB page exactly and two whose blocks
    do not (a block id per page boundary is never handed out)."""
    return SMALL_LAYOUTS[request.param]


def whole_blocks(layout: kvasync.KVLayout, page_size: int, num_blocks: int) -> list[int]:
    """The ids of ``range(num_blocks)`` that lie inside one page of ``layout.page_unit(page_size)``
    bytes: the ids an allocator hands out, lowest first (worked out from the byte offsets)."""
    unit, stride = layout.page_unit(page_size), layout.range_block_bytes
    return [i for i in range(num_blocks) if i * stride // unit == ((i + 1) * stride - 1) // unit]


def blocks_per_page(layout: kvasync.KVLayout, page_size: int, num_blocks: int) -> int:
    """The fewest whole blocks a page other than the last holds: what each page of a memory
    limit promises."""
    unit = layout.page_unit(page_size)
    counts: dict[int, int] = {}
    for i in whole_blocks(layout, page_size, num_blocks):
        page = i * layout.range_block_bytes // unit
        counts[page] = counts.get(page, 0) + 1
    pages = sorted(counts)
    return min(counts[p] for p in (pages[:-1] or pages))


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Waits for ``predicate`` to hold, checking each loop iteration, failing at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s")
        await asyncio.sleep(0.001)


# -- the HTTP server --------------------------------------------------------------------------

SERVER_WAIT_S = 20.0  # the deadline of every wait for an in-process server


def wait_until_sync(
    condition: Callable[[], bool], what: str, timeout: float = SERVER_WAIT_S
) -> None:
    """Waits on this thread for ``condition``, failing after ``timeout`` s naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.005)  # a poll interval under a deadline, not a settle


@contextlib.contextmanager
def serving(config: Any, **options: Any) -> Iterator[str]:
    """``kvasync serve``'s app (``create_app(config, **options)``) under uvicorn in a thread, on
    a free port; yields its base URL and stops it (within 15 s) at the end."""
    import uvicorn

    from kvasync.serve._http import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(config, **options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until_sync(
            lambda: server.started or not thread.is_alive(), "the server to start", timeout=30.0
        )
        assert thread.is_alive(), "the server thread died at startup"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
    assert not thread.is_alive(), "the server did not stop within 15 s"


def _free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # NOTE: a small race with other processes for the port; the test then fails
    return int(port)


@contextlib.contextmanager
def kvasync_serve(
    *options: str, output: Path | None = None, open_files: int | None = None
) -> Iterator[str]:
    """``python -m kvasync serve`` as a process, on a free port, until it answers /health; its
    output goes to ``output`` (a file) when given; ``open_files`` sets its RLIMIT_NOFILE."""
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "kvasync", "serve", "--preset", "tiny", "--port", str(port)]

    def limit_files() -> None:  # in the child, before exec
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    with contextlib.ExitStack() as files:
        sink = files.enter_context(open(output, "wb")) if output else subprocess.PIPE
        server = subprocess.Popen(
            [*command, *options], stdout=sink, stderr=subprocess.STDOUT, preexec_fn=limit_files
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                assert server.poll() is None, server.stdout.read().decode() if server.stdout else ""
                assert time.monotonic() < deadline, "kvasync serve did not answer within 60 s"
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.05)  # not listening yet: poll again (bounded by the deadline)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait(timeout=15)
            if server.stdout is not None:
                server.stdout.close()


# -- a device share of one test: its name, and a process holding its ledger's lock -------------


@pytest.fixture
def share() -> Iterator[str]:
    """A fresh share name; its ledger file is removed after the test."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    if os.path.exists(ledger.path(name)):
        os.unlink(ledger.path(name))


def ledger_lock_taken(share: str) -> bool:
    """Whether another process holds the share's ledger lock (a snapshot cannot take it)."""
    try:
        ledger.snapshot(share, timeout=0.01)
    except kvasync.KVAsyncError:
        return True
    return False


@pytest.fixture
def lock_holder(share: str) -> Iterator[Callable[[], subprocess.Popen[str]]]:
    """Starts a second process that takes the share's ledger lock and keeps it; at teardown it
    is continued (a test may have stopped it) and killed."""
    started: list[subprocess.Popen[str]] = []

    def start() -> subprocess.Popen[str]:
        code = (
            "import sys; from kvasync import _core; print('taking', flush=True); "
            "_core.ledger_hold_lock_for_test(sys.argv[1], 600.0)"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, ledger.path(share)], stdout=subprocess.PIPE, text=True
        )
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=10.0)
            if proc.stdout is not None:
                proc.stdout.close()


def calls_after_close(kv: Any, held: list[int], data: Any) -> dict[str, Callable[[], Any]]:
    """Every public call of an allocator face (``Allocator`` or ``SyncAllocator``) that must
    raise ``AllocatorClosed`` once it is closed (issue 27), by name; ``held`` are blocks it
    allocated before the close and ``data`` a gather of the first."""
    return {
        "alloc": lambda: kv.alloc(1, timeout=1.0),
        "alloc_nowait": lambda: kv.alloc_nowait(1),
        "available_blocks": kv.available_blocks,
        "set_demand": lambda: kv.set_demand(5),
        "drain_from": kv.drain_from,
        "free_block_ids": kv.free_block_ids,
        "free": lambda: kv.free(held[:1]),
        "trim": lambda: kv.trim(timeout=1.0),
        "resize": lambda: kv.resize(memory_limit=None, timeout=1.0),
        "gather": lambda: kv.gather(held[:1]),
        "scatter": lambda: kv.scatter(held[:1], data),
        "zero": lambda: kv.zero(held[:1]),
        "copy": lambda: kv.copy(held[:1], held[1:2]),
        "layer": lambda: kv.layer(0),
        "add_alloc_observer": lambda: kv.add_alloc_observer(lambda waited, seconds: None),
    }


def public_methods(cls: type) -> set[str]:
    """The public methods of ``cls`` (properties left out), for walks that must cover them."""
    return {
        name
        for name, value in inspect.getmembers(cls)
        if not name.startswith("_") and not isinstance(value, property)
    }
