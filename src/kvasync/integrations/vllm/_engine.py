"""One engine's kvasync allocator, shared by vLLM's worker and scheduler in one process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..._sync import SyncAllocator

__all__ = ["EngineKV", "current_engine", "hold_null_block", "register_engine", "take_engine"]


@dataclass
class EngineKV:
    """The allocator of the engine in this process, and what its block pool needs to know.

    Args:
        allocator: the engine's allocator; vLLM block id ``b`` is kvasync block id ``b``.
        fence: what a free waits for before its pages may be unmapped (the worker's CUDA
            stream), or None on the host backend.
        prefix_cache_blocks: freed blocks that keep their prefix-cache entry; None = no bound.
        owned: the pool closes the allocator when it is closed (the pool opened it itself).
    """

    allocator: SyncAllocator
    fence: Callable[[], object] | None = None
    prefix_cache_blocks: int | None = None
    owned: bool = False


_lock = threading.Lock()
_engine: EngineKV | None = None


def register_engine(engine: EngineKV) -> None:
    """Makes ``engine`` the one the next block pool of this process takes.

    Raises:
        RuntimeError: another engine's allocator is registered and not yet taken.
    """
    global _engine
    with _lock:
        if _engine is not None and _engine is not engine:
            raise RuntimeError(
                "kvasync's vLLM plugin: a second engine in one process is not supported (one "
                "engine per process, as vLLM's EngineCore runs)"
            )
        _engine = engine


def current_engine() -> EngineKV | None:
    """The registered engine, or None."""
    with _lock:
        return _engine


def take_engine() -> EngineKV | None:
    """The registered engine, unregistered (for a test that opens several pools)."""
    global _engine
    with _lock:
        engine, _engine = _engine, None
        return engine


def hold_null_block(kv: SyncAllocator, timeout: float) -> None:
    """Allocates kvasync block 0 and keeps it: vLLM's null block.

    vLLM pads block tables with block 0 and its dummy runs write their KV there, so block 0 is on
    a mapped page for the engine's whole life. A fresh allocator hands out its lowest pages
    first, so its first block is 0; what comes before 0 (an allocator already in use) is freed.

    Raises:
        RuntimeError: block 0 was not handed out within the first page's blocks.
        AllocTimeout, MapError: block 0's page could not be mapped within ``timeout``.
    """
    taken: list[int] = []
    try:
        for _ in range(64):
            got = kv.alloc(1, timeout=timeout)
            if got == [0]:
                return
            taken.extend(got)
        raise RuntimeError(
            "kvasync's vLLM plugin: block 0 (vLLM's null block) is held elsewhere; the "
            "engine's allocator must be fresh"
        )
    finally:
        if taken:
            kv.free(taken)
