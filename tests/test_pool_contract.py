"""Regressions of the C++ core's contract (issue 7): far deadlines, trim, capacity and sizes.

The concurrent side of the same contract (races, fences outside the lock, exceptions and failed
rollbacks in the mapper thread) is pinned by tests/cpp/pool_stress.cpp under the sanitizers
(``make sanitize``).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from conftest import wait_until, whole_blocks

import kvasync
from kvasync.testing import FaultInjector


def first_page_blocks(layout: kvasync.KVLayout) -> int:
    """The whole blocks of page 0 at the default 2 MiB page (the geometry may not divide it)."""
    unit = layout.page_unit(2 << 20)
    ids = whole_blocks(layout, 2 << 20, 4096)
    return sum(1 for i in ids if i * layout.range_block_bytes // unit == 0)


def host_config(**overrides: object) -> kvasync.Config:
    settings: dict[str, object] = {"backend": "host", "max_blocks": 4096, "reserve_pages": (0, 0)}
    settings.update(overrides)
    return kvasync.Config(**settings)  # type: ignore[arg-type]


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- far deadlines (defect 1) ---------------------------------------------------------------------


async def test_alloc_on_an_empty_pool_completes_with_a_huge_default_timeout(small_layout):
    # now + 1e10 s in int64 nanoseconds wrapped into the past: the map job was dropped at once.
    async with kvasync.open_allocator(small_layout, host_config(default_timeout=1e10)) as kv:
        assert kv.stats().mapped_pages == 0
        blocks = await asyncio.wait_for(kv.alloc(1), timeout=5.0)
        assert len(blocks) == 1
        assert kv.stats().mapped_pages == 1
        kv.free(blocks)


async def test_a_huge_fault_delay_holds_the_mapper_until_release(small_layout):
    faults = FaultInjector()
    async with kvasync.open_allocator(small_layout, host_config(faults=faults)) as kv:
        faults.delay(1e10)  # overflowed to a negative delay: no delay at all
        try:
            with pytest.raises(kvasync.AllocTimeout, match="map of 1 page"):
                await kv.alloc(1, timeout=0.2)
        finally:
            faults.release()  # ends the delay under way
        blocks = await asyncio.wait_for(kv.alloc(1, timeout=5.0), timeout=6.0)
        kv.free(blocks)
        await asyncio.wait_for(kv.close(timeout=2.0), timeout=5.0)
        assert kv.stats().mapped_pages == 0  # the mapper was joined and everything unmapped


# -- trim (defect 3) ------------------------------------------------------------------------------


async def test_trim_unmaps_the_refill_that_was_mapping_when_it_was_called(small_layout):
    faults = FaultInjector()
    faults.delay(0.3)  # the refill started at open is still mapping when trim is called
    cfg = host_config(reserve_pages=(2, 4), faults=faults)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        assert kv.stats().inflight_pages > 0
        await kv.trim(timeout=5.0)
        stats = kv.stats()
        assert (stats.mapped_pages, stats.reserve_pages, stats.inflight_pages) == (0, 0, 0)
        # No refill until there is demand again: nothing is queued or running.
        assert (stats.queued_jobs, stats.mapper_op) == (0, None)
        faults.release()
        blocks = await kv.alloc(1, timeout=5.0)  # demand: the reserve fills again
        await wait_until(lambda: kv.stats().reserve_pages >= 2)
        kv.free(blocks)


async def test_trim_unmaps_a_map_whose_waiter_a_free_served_first(small_layout):
    faults = FaultInjector()
    async with kvasync.open_allocator(small_layout, host_config(faults=faults)) as kv:
        held = await kv.alloc(first_page_blocks(small_layout))  # one full page
        faults.delay(0.3)
        waiter = asyncio.create_task(kv.alloc(1, timeout=5.0))
        await wait_until(lambda: kv.stats().mapping_pages == 1)
        kv.free(held)  # serves the waiter; the page mapping for it lands in the reserve later
        (block,) = await waiter
        await kv.trim(timeout=5.0)
        stats = kv.stats()
        # Only the page holding the waiter's block is left.
        assert (stats.mapped_pages, stats.reserve_pages, stats.inflight_pages) == (1, 0, 0)
        assert (stats.queued_jobs, stats.mapper_op) == (0, None)
        faults.release()
        kv.free([block])


async def test_trim_unmaps_the_pages_of_an_unmap_dropped_at_its_deadline(small_layout):
    # A free's unmap waits in the mapper's queue behind a slow one and is dropped at its deadline
    # (default_timeout): its page is mapped-free again. A trim called meanwhile waited for that
    # unmap; it completed as if it had run, leaving the page mapped (seen by group_stress with
    # slow ranks). It must sweep again.
    faults = FaultInjector()
    cfg = host_config(default_timeout=0.3, faults=faults)
    page = first_page_blocks(small_layout)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        first, second = await kv.alloc(page, timeout=5.0), await kv.alloc(page, timeout=5.0)
        assert kv.stats().mapped_pages == 2
        faults.delay(0.8)  # each unmap: longer than an unmap's deadline
        kv.free(first)
        await wait_until(lambda: kv.stats().mapper_op is not None)  # the first unmap running
        kv.free(second)  # its unmap queued behind, due in 0.3 s
        try:
            await kv.trim(timeout=5.0)
            stats = kv.stats()
            assert stats.dropped_jobs >= 1  # the second unmap was dropped, as this test means
            assert (stats.mapped_pages, stats.reserve_pages) == (0, 0)
        finally:
            faults.release()


# -- capacity and sizes (defect 6) ----------------------------------------------------------------


async def test_a_capacity_beyond_64_bit_sizes_is_a_clear_value_error(small_layout):
    with pytest.raises(ValueError, match=r"max_blocks=4611686018427387904 .* beyond 64-bit"):
        await kvasync.Allocator.open(small_layout, host_config(max_blocks=2**62))


async def test_a_capacity_whose_bookkeeping_would_cost_gigabytes_is_refused_without_allocating():
    # 16-byte blocks, 256 per 4 KiB page: 2**31 blocks reserve only 32 GiB of address space per
    # range, but the pool's per-block bookkeeping would take over 2 GiB of RAM.
    tiny = kvasync.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=1)
    before = resident_bytes()
    with pytest.raises(ValueError, match=r"max_blocks=2147483648 .* bookkeeping"):
        await kvasync.Allocator.open(tiny, host_config(max_blocks=2**31, page_size=4096))
    assert resident_bytes() - before < 64 << 20


async def test_a_large_capacity_opens_without_costing_memory_for_unmapped_pages():
    tiny = kvasync.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=1)
    before = resident_bytes()
    cfg = host_config(max_blocks=2**24, page_size=4096)
    async with kvasync.open_allocator(tiny, cfg) as kv:
        blocks = await kv.alloc(300, timeout=5.0)
        kv.layer(0)[0][blocks] = torch.ones(1, dtype=torch.float16)
        # 16 Mi blocks: 16 MiB of block flags and 65536 pages' state, nothing of the 256 MiB of
        # KV they describe.
        assert resident_bytes() - before < 64 << 20
        kv.free(blocks)
