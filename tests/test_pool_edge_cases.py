"""Edge cases of the page pool and the allocator on it: bitmap bounds, the memory limit, close.

The C++ pool is driven directly through kvasync._core where an exact interleaving matters; every
wait is bounded (select on the completion fd, or wait_until in asyncio tests).
"""

from __future__ import annotations

import asyncio
import random
import select
import time

import pytest
from conftest import wait_until

import kvasync
from kvasync import _core
from kvasync.testing import FaultInjector

# -- helpers ----------------------------------------------------------------------------------


def open_pool(
    num_pages: int,
    blocks_per_page: int,
    *,
    num_blocks: int | None = None,
    limit_pages: int | None = None,
    reserve: tuple[int, int] = (0, 0),
) -> _core.PagePool:
    backend = _core.HostBackend(1, num_pages, 4096)
    return _core.PagePool(
        backend,
        num_pages * blocks_per_page if num_blocks is None else num_blocks,
        blocks_per_page,
        num_pages if limit_pages is None else limit_pages,
        *reserve,
        5.0,
    )


def wait_records(pool: _core.PagePool, want: int, timeout: float = 5.0) -> list[tuple]:
    """Drains completion records until ``want`` arrived or the deadline passed."""
    deadline = time.monotonic() + timeout
    records: list[tuple] = []
    while len(records) < want:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        select.select([pool.completion_fd], [], [], left)
        records.extend(pool.drain())
    return records


def wait_idle(pool: _core.PagePool, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = pool.stats()
        if (
            s["queued_jobs"] + s["mapping_pages"] + s["unmapping_pages"] == 0
            and s["mapper_op"] is None
        ):
            return s
        assert time.monotonic() < deadline, f"mapper still busy after {timeout} s: {s}"
        select.select([pool.completion_fd], [], [], 0.005)


def alloc_now(pool: _core.PagePool, n: int, timeout: float = 10.0) -> list[int]:
    """An alloc, waiting (bounded) for its completion when it became a waiter."""
    result = pool.alloc(n, time.monotonic() + timeout)
    if isinstance(result, list):
        return result
    records = wait_records(pool, 1, timeout)
    assert len(records) == 1, records
    request, status, blocks, message = records[0]
    assert (request, status) == (result, 0), message
    return blocks


# -- PageSet (csrc/pool/page_set.h) at word and summary boundaries: regression, passes -------------

BOUNDARY_PAGES = [0, 1, 62, 63, 64, 65, 127, 128, 4031, 4032, 4095, 4096, 4097, 4159, 4160]
BOUNDARY_PAGES += [8190, 8191, 8192, 8193, 8299]


def test_pageset_next_and_prev_at_word_and_summary_boundaries_through_the_pool():
    # One block per page: block id == page id, so the pool's lowest-first (next) and
    # highest-first (prev) searches are visible in the block ids it hands out and unmaps.
    num_pages = 8300  # two full summary words and part of a third
    pool = open_pool(num_pages, 1, reserve=(0, num_pages))
    try:
        everything = alloc_now(pool, num_pages)
        assert sorted(everything) == list(range(num_pages))
        shuffled = BOUNDARY_PAGES[:]
        random.Random(7).shuffle(shuffled)
        pool.free(shuffled)
        # with_free_.first() (next) finds them lowest first, across empty words and summaries.
        assert [pool.alloc_nowait(1) for _ in BOUNDARY_PAGES] == [[p] for p in BOUNDARY_PAGES]
        assert pool.alloc_nowait(1) is None
        pool.free(shuffled)
        # trim unmaps through highest_reserve (prev), then the lowest unmapped are mapped first.
        request = pool.trim(time.monotonic() + 10.0)
        assert request > 0
        ((done, status, _, _),) = wait_records(pool, 1)
        assert (done, status) == (request, 0)
        s = wait_idle(pool)
        assert (s["unmapped_pages"], s["unmaps_done"]) == (len(BOUNDARY_PAGES),) * 2
        again = alloc_now(pool, len(BOUNDARY_PAGES))
        assert sorted(again) == BOUNDARY_PAGES
        pool.free(everything)
    finally:
        assert pool.close(10.0)


def test_pageset_random_sets_match_a_model_across_summary_words():
    num_pages = 4096 * 2 + 70
    rng = random.Random(99)
    pool = open_pool(num_pages, 1, reserve=(0, num_pages))
    try:
        held = set(alloc_now(pool, num_pages))
        for _ in range(6):
            chosen = rng.sample(sorted(held), rng.randint(1, 40))
            pool.free(chosen)
            held -= set(chosen)
            got = [pool.alloc_nowait(1)[0] for _ in chosen]
            assert got == sorted(chosen)
            held |= set(got)
        pool.free(sorted(held))
    finally:
        assert pool.close(10.0)


# -- PagePool: waiters, protected blocks, FIFO: regression, passes ---------------------------


def test_a_newcomer_cannot_take_blocks_a_waiter_at_the_memory_limit_counts_on():
    # Two pages of 8 at the limit, both fully in use. W (12 blocks) waits at the limit.
    pool = open_pool(4, 8, limit_pages=2)
    try:
        held = alloc_now(pool, 16)
        waiter = pool.alloc(12, time.monotonic() + 5.0)
        assert isinstance(waiter, int)
        s = pool.stats()
        assert (s["mapping_pages"], s["queued_jobs"]) == (0, 0)  # no headroom: nothing to map
        pool.free(held[:8])  # 8 free < 12: W keeps waiting, and protects them
        assert pool.alloc_nowait(1) is None
        assert isinstance(pool.alloc(1, time.monotonic() + 5.0), int)  # queued behind W
        pool.free(held[8:13])  # now 13 free: W first, then the newcomer
        records = wait_records(pool, 2, 2.0)
        assert [(r[0], r[1], len(r[2])) for r in records] == [(waiter, 0, 12), (waiter + 1, 0, 1)]
        pool.free(held[13:] + records[0][2] + records[1][2])
    finally:
        assert pool.close(5.0)


# -- a short last page parked at the memory limit must not starve a waiter that fits -------


def test_waiter_that_fits_the_limit_is_served_when_the_short_last_page_holds_a_page_of_it():
    # 20 blocks of 8 a page: pages 0 and 1 hold 8 blocks, page 2 only 4. Limit 2 pages = 16
    # blocks, so alloc(16) is accepted as fitting. With page 2 the mapped one, the pool maps page 0
    # (headroom 1) and sits at the limit with 12 free blocks: it must give page 2 back and map
    # page 1 instead, or the waiter could never be served.
    pool = open_pool(3, 8, num_blocks=20, limit_pages=3)
    try:
        blocks = alloc_now(pool, 20)
        low = [b for b in blocks if b < 16]
        high = [b for b in blocks if b >= 16]
        pool.free(low)  # pages 0 and 1 empty out and go (no reserve)
        wait_idle(pool)
        assert pool.stats()["unmapped_pages"] == 2
        assert pool.set_limit_pages(2, time.monotonic() + 5.0) == 0
        request = pool.alloc(16, time.monotonic() + 3.0)
        assert isinstance(request, int)
        wait_idle(pool)  # page 0 mapped for it; now at the limit (pages 0 and 2)
        pool.free(high)  # page 2 is now entirely free: nothing in use at all
        records = wait_records(pool, 1, 2.0)
        s = pool.stats()
        assert [(r[0], r[1]) for r in records] == [(request, 0)], (
            f"a 16-block alloc under a 16-block limit, with nothing in use, was not served: {s}"
        )
    finally:
        pool.close(5.0)


# -- free() after close() only records the blocks as freed ------------------------------------


def test_free_after_close_leaves_every_page_unmapped():
    pool = open_pool(4, 8, reserve=(0, 0))
    blocks = alloc_now(pool, 8)
    assert pool.close(5.0)
    s = pool.stats()
    assert (s["mapped_pages"], s["unmapped_pages"]) == (0, 4), s
    pool.free(blocks)  # what Allocator.close() itself does for an abandoned request's record
    s = pool.stats()
    # close() unmapped the page; freeing its blocks must not make it "mapped" again.
    assert (s["mapped_pages"], s["reserve_pages"], s["unmapped_pages"]) == (0, 0, 4), s
    assert (s["used_blocks"], s["free_blocks"]) == (0, 0), s


async def test_allocator_free_after_close_raises_and_reports_no_mapped_memory(small_layout):
    cfg = kvasync.Config(backend="host", max_blocks=4 * 512, reserve_pages=(0, 0))
    kv = await kvasync.Allocator.open(small_layout, cfg)
    blocks = await kv.alloc(10)
    await kv.close()
    assert kv.stats().mapped_pages == 0
    # An engine that frees its sequences after shutting the allocator down: the pages went with
    # the close, so there is nothing to give back, and saying so is the rule for every call on a
    # closed allocator (issue 27). It must not make a page "mapped" again either.
    with pytest.raises(kvasync.AllocatorClosed):
        kv.free(blocks)
    stats = kv.stats()
    assert (stats.mapped_pages, stats.reserve_pages, stats.mapped_bytes) == (0, 0, 0), stats


# -- Python ownership: regression, passes -----------------------------------------------------


async def test_close_settles_every_waiter_behind_a_hung_map_and_leaves_nothing_pending(
    small_layout,
):
    faults = FaultInjector()
    cfg = kvasync.Config(backend="host", max_blocks=4 * 512, reserve_pages=(0, 0), faults=faults)
    kv = await kvasync.Allocator.open(small_layout, cfg)
    faults.hang()
    try:
        waiters = [asyncio.create_task(kv.alloc(4, timeout=30.0)) for _ in range(3)]
        await wait_until(lambda: faults.hung_maps == 1 and kv.stats().waiters == 3)
        await kv.close(timeout=0.2)
        for task in waiters:
            with pytest.raises(kvasync.AllocatorClosed):
                await task
        assert kv._pending == {}
    finally:
        faults.release()


# -- close(timeout=0) still joins an idle mapper and unmaps everything -----------------------


async def test_close_with_zero_timeout_and_an_idle_mapper_still_unmaps_everything(small_layout):
    cfg = kvasync.Config(backend="host", max_blocks=4 * 512, reserve_pages=(0, 0))
    kv = await kvasync.Allocator.open(small_layout, cfg)
    kv.free(await kv.alloc(10))
    await wait_until(lambda: kv.stats().mapped_pages == 0)
    blocks = await kv.alloc(10)  # one page mapped and in use; the mapper then goes idle
    await wait_until(lambda: kv.stats().mapper_op is None and kv.stats().queued_jobs == 0)
    await kv.close(timeout=0)
    # No driver call was in progress, so nothing justified abandoning the thread: the page
    # should be given back as with any other timeout.
    assert kv.stats().mapped_pages == 0, kv.stats()
    del blocks
