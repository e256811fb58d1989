"""Completions taken by spinning (csrc/pool/completion_queue.h, PagePool::take_completion).

An awaited request whose map the mapper expects to finish soon is awaited by spinning for its
own record (Note [Spinning wake-up] in csrc/common/wakeup.h); every other record stays queued for
the
loop's drain, and a record that has not come is left to the loop too.
"""

from __future__ import annotations

import select
import time

import pytest
import torch

import kvasync
from kvasync import _core

BLOCKS_PER_PAGE = 8
NUM_PAGES = 8


def open_pool(backend: _core.Backend) -> _core.PagePool:
    return _core.PagePool(
        backend, NUM_PAGES * BLOCKS_PER_PAGE, BLOCKS_PER_PAGE, NUM_PAGES, 0, 0, 5.0
    )


def wait_for_records(pool: _core.PagePool, count: int, timeout: float = 5.0) -> None:
    """Waits (bounded) until the mapper has completed `count` requests."""
    deadline = time.monotonic() + timeout
    while pool.stats()["waiters"] + pool.stats()["queued_jobs"] > 0 or pool.stats()["mapper_op"]:
        assert time.monotonic() < deadline, f"no completion after {timeout} s: {pool.stats()}"
        select.select([pool.completion_fd], [], [], 0.005)
    assert pool.stats()["maps_done"] >= count


def test_take_completion_takes_the_requested_record_and_leaves_the_others_queued():
    pool = open_pool(_core.HostBackend(2, NUM_PAGES, 4096))
    try:
        first = pool.alloc(BLOCKS_PER_PAGE, time.monotonic() + 5.0)
        second = pool.alloc(BLOCKS_PER_PAGE, time.monotonic() + 5.0)
        assert isinstance(first, int) and isinstance(second, int)
        wait_for_records(pool, 2)
        taken = pool.take_completion(second, 0.0)
        assert taken is not None
        status, blocks, message = taken
        assert (status, len(blocks), message) == (0, BLOCKS_PER_PAGE, "")
        assert [record[0] for record in pool.drain()] == [first]
        assert pool.take_completion(second, 0.0) is None  # taken once
    finally:
        pool.close(5.0)


def test_take_completion_leaves_a_record_that_has_not_come_to_the_loop():
    faults = _core.FaultState()
    faults.hang()
    pool = open_pool(_core.with_faults(_core.HostBackend(2, NUM_PAGES, 4096), faults))
    try:
        request = pool.alloc(1, time.monotonic() + 5.0)
        assert isinstance(request, int)
        deadline = time.monotonic() + 5.0
        while faults.hung_maps == 0:
            assert time.monotonic() < deadline, "the map never reached the backend"
            select.select([], [], [], 0.001)
        started = time.monotonic()
        assert pool.take_completion(request, 0.01) is None
        assert time.monotonic() - started < 1.0  # bounded by its spin, not by the hung map
        faults.release()
        wait_for_records(pool, 1)
        assert [record[0] for record in pool.drain()] == [request]
    finally:
        faults.release()
        pool.close(5.0)


@pytest.mark.asyncio
async def test_cold_allocs_and_trims_awaited_by_spinning_hand_out_mapped_blocks():
    layout = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    config = kvasync.Config(
        backend="host", max_blocks=4096, page_size=1 << 16, reserve_pages=(0, 0)
    )
    async with kvasync.open_allocator(layout, config) as kv:
        seen = set()
        for round_ in range(20):  # the first rounds teach the pool how long a map takes
            await kv.trim(release_handles=round_ % 2 == 0)
            assert kv.stats().mapped_pages == 0
            ids = await kv.alloc(1)
            k = kv.layer(1)[0]
            k[ids[0]] = round_  # mapped: a write to an unmapped block would fault
            assert torch.all(k[ids[0]] == round_)
            seen.update(ids)
            kv.free(ids)
        assert seen <= set(range(kv.num_blocks))
        assert not kv._pending  # nothing left waiting on the loop
        stats = kv.stats()
        assert (stats.used_blocks, stats.waiters, stats.timeouts) == (0, 0, 0)
