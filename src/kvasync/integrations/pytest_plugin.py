"""kvasync's pytest plugin (registered through the ``pytest11`` entry point).

Fixtures for a user's own test suite:

* ``kv_allocator``: a factory; ``async with kv_allocator(**overrides) as kv`` opens a small
  allocator (host backend by default) and closes it. Keyword arguments override the layout
  (``layout=``) or any ``Config`` field.
* ``kv_allocator_sync``: the same for a plain (not async) test: ``with kv_allocator_sync() as
  kv`` opens a ``SyncAllocator`` (no event loop, no async plugin needed).
* ``kv_faults``: the ``FaultInjector`` the factories' allocators use. Released when an allocator
  closes, before it closes (a map left hung would otherwise hold the close for its whole
  timeout, 5 s), and at teardown, so a hung map never outlives its test.

The backend comes from ``--kvasync-backend`` (host by default) or, per test, the marker
``@pytest.mark.kvasync_backend("cuda")``; a cuda test skips on a machine without a GPU.

The fixtures are plain (not async) fixtures: ``kv_allocator``'s context manager is entered inside
the test, on the test's own loop, so the plugin works the same under pytest-asyncio's strict and
auto modes and under anyio's plugin (asyncio or trio). An async test needs one of those plugins
(pytest runs no coroutine by itself); ``kv_allocator_sync`` needs none. kvasync itself (and
torch) is imported only when a fixture is used, so installing kvasync costs other test suites
nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .. import Allocator, Config, KVLayout, SyncAllocator
    from ..testing import FaultInjector

__all__ = ["kv_allocator", "kv_allocator_sync", "kv_faults"]

BACKENDS = ("host", "cuda", "auto")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvasync")
    group.addoption(
        "--kvasync-backend",
        choices=BACKENDS,
        default="host",
        help="the backend of kv_allocator's allocators (default: host)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kvasync_backend(name): run this test's kv_allocator on backend name (host, cuda, auto)",
    )


def _backend(request: pytest.FixtureRequest) -> str:
    marker = request.node.get_closest_marker("kvasync_backend")
    name = str(marker.args[0]) if marker else str(request.config.getoption("kvasync_backend"))
    if name not in BACKENDS:
        raise pytest.UsageError(f"kvasync_backend must be one of {BACKENDS}, got {name!r}")
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("the cuda backend needs an NVIDIA GPU")
    return name


@pytest.fixture
def kv_faults() -> Iterator[FaultInjector]:
    """A ``FaultInjector`` (delay, hang, fail maps) wired into ``kv_allocator``'s allocators."""
    from ..testing import FaultInjector

    faults = FaultInjector()
    yield faults
    faults.release()


def _layout_and_config(
    backend: str, faults: FaultInjector, overrides: dict[str, Any]
) -> tuple[KVLayout, Config]:
    """The factories' defaults, with ``overrides`` applied (``layout=`` and Config fields)."""
    import kvasync

    layout = overrides.pop("layout", None) or kvasync.KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16
    )
    settings: dict[str, Any] = {
        "backend": backend,
        "max_blocks": 2048,
        "reserve_pages": (0, 2),
        "default_timeout": 5.0,
        "faults": faults,
    }
    settings.update(overrides)
    return layout, kvasync.Config(**settings)


@pytest.fixture
def kv_allocator(
    request: pytest.FixtureRequest, kv_faults: FaultInjector
) -> Callable[..., AbstractAsyncContextManager[Allocator]]:
    """A factory of small allocators: ``async with kv_allocator(max_blocks=64) as kv: ...``.

    Defaults: 2 layers, 2 KV heads of 64, 16-token fp16 blocks (4 KiB, 512 per 2 MiB page);
    ``Config(max_blocks=2048, reserve_pages=(0, 2), default_timeout=5.0, faults=kv_faults)`` on
    the selected backend. Any keyword overrides a ``Config`` field; ``layout=`` the layout.
    """
    backend = _backend(request)

    @asynccontextmanager
    async def open_allocator(**overrides: Any) -> AsyncIterator[Allocator]:
        import kvasync

        layout, config = _layout_and_config(backend, kv_faults, overrides)
        async with kvasync.open_allocator(layout, config) as kv:
            try:
                yield kv
            finally:
                kv_faults.release()  # before the close: a hung map would hold it

    return open_allocator


@pytest.fixture
def kv_allocator_sync(
    request: pytest.FixtureRequest, kv_faults: FaultInjector
) -> Callable[..., AbstractContextManager[SyncAllocator]]:
    """``kv_allocator`` for plain tests: ``with kv_allocator_sync(max_blocks=64) as kv: ...``
    opens a ``SyncAllocator`` (its own loop thread) with the same defaults and overrides."""
    backend = _backend(request)

    @contextmanager
    def open_allocator(**overrides: Any) -> Iterator[SyncAllocator]:
        import kvasync

        layout, config = _layout_and_config(backend, kv_faults, overrides)
        with kvasync.open_allocator_sync(layout, config) as kv:
            try:
                yield kv
            finally:
                kv_faults.release()  # before the close: a hung map would hold it

    return open_allocator
