"""kvasync's pytest plugin (registered through the ``pytest11`` entry point).

Fixtures for a user's own test suite:

* ``kv_allocator``: a factory; ``async with kv_allocator(**overrides) as kv`` opens a small
  allocator (host backend by default) and closes it. Keyword arguments override the layout
  (``layout=``) or any ``Config`` field.
* ``kv_faults``: the ``FaultInjector`` the factory's allocators use; released at teardown so a
  hung map never outlives its test.

The backend comes from ``--kvasync-backend`` (host by default) or, per test, the marker
``@pytest.mark.kvasync_backend("cuda")``; a cuda test skips on a machine without a GPU.

Both fixtures are plain (not async) fixtures: the factory's context manager is entered inside the
test, on the test's own loop, so the plugin works the same under pytest-asyncio's strict and auto
modes and under anyio's plugin (asyncio or trio). kvasync itself (and torch) is imported only when
a fixture is used, so installing kvasync costs other test suites nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .. import Allocator
    from ..testing import FaultInjector

__all__ = ["kv_allocator", "kv_faults"]

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

        layout = overrides.pop("layout", None) or kvasync.KVLayout(
            num_layers=2, num_kv_heads=2, head_dim=64, block_size=16
        )
        settings: dict[str, Any] = {
            "backend": backend,
            "max_blocks": 2048,
            "reserve_pages": (0, 2),
            "default_timeout": 5.0,
            "faults": kv_faults,
        }
        settings.update(overrides)
        async with kvasync.open_allocator(layout, kvasync.Config(**settings)) as kv:
            yield kv

    return open_allocator
