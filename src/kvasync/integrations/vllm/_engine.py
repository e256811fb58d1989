"""One engine's kvasync allocator, shared by vLLM's worker and scheduler in one process."""

from __future__ import annotations

import threading
import time
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

    vLLM pads block tables with block 0 and its dummy runs write their KV there, so block 0 is on a
    mapped page for the engine's whole life. The pool hands out the lowest page with a free block
    first, but a fresh pool's first blocks need not come from page 0: when page 0's map is not there
    yet and the map asked for this alloc lands first, the first blocks come from a higher page. By
    design, e.g.: the refill of pages 0..r-1 fails, or is queued (by a watcher tick after the share
    refused the open's refill) just after this alloc read the clock for its deadline, so the alloc's
    own map of page r has the earlier deadline and runs first (a CPU stress of fresh pools beside a
    member churning at the share's budget: 2 of 2550 starts after the pool fixes below, the one
    traced this way). So blocks are taken, and held, until block 0 comes: once every mapped free
    block is held the next alloc maps the lowest unmapped page, and a page 0 that lands meanwhile is
    the lowest with a free block. Everything taken but block 0 is freed. (Seen on the H200: a second
    engine starting beside a busy one in an 8 GiB share got 64 blocks of another page first. In that
    stress, 47 of 1030 starts did, by two pool bugs fixed since (tests/test_pool_fresh_in_share.py):
    the drain under a fair share that fell while the first maps were in flight unmapped page 0 and
    served a higher page; and a refill took the budget of page 0's map queued while the ledger's
    lock was busy.)

    Raises:
        RuntimeError: the allocator has blocks allocated already (it is not fresh).
        AllocTimeout, MapError: block 0's page could not be mapped within ``timeout``.
    """
    # Taking blocks until block 0 comes needs block 0 free: on an allocator in use it may not be.
    if kv.stats().used_blocks:
        raise RuntimeError(
            "kvasync's vLLM plugin: block 0 (vLLM's null block) may be held elsewhere: the "
            "engine's allocator must be fresh (none of its blocks allocated)"
        )
    deadline = time.monotonic() + timeout
    taken: list[int] = []
    try:
        chunk = 1  # the common case: the first block is 0
        while True:
            got = kv.alloc(chunk, timeout=max(0.001, deadline - time.monotonic()))
            if 0 in got:
                got.remove(0)
                taken.extend(got)
                return
            taken.extend(got)
            # Within the memory limit: a chunk past it would wait for blocks nobody frees.
            room = kv.stats().memory_limit_blocks - len(taken)
            if room <= 0:
                raise RuntimeError(
                    f"kvasync's vLLM plugin: block 0 (vLLM's null block) did not come within the "
                    f"memory limit's {len(taken)} blocks; the allocator must be fresh"
                )
            chunk = min(_NULL_BLOCK_CHUNK, room)
    finally:
        if taken:
            kv.free(taken)


# Blocks taken at a time while block 0 has not come: a page holds hundreds of vLLM blocks.
_NULL_BLOCK_CHUNK = 64
