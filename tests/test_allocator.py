"""The core contract of kvasync.Allocator, on every backend (cuda runs where a GPU is present)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
import math
import subprocess
import sys
import textwrap
import threading

import anyio.from_thread
import pytest
import torch
from conftest import blocks_per_page, calls_after_close, public_methods, wait_until, whole_blocks

import kvasync
from kvasync.testing import FaultInjector

MAX_BLOCKS = 8192
PAGE = 2 << 20  # the default page size


@pytest.fixture
def bpp(small_layout: kvasync.KVLayout) -> int:
    """Blocks each page of small_layout promises (512 where they fill it; fewer where a block
    id per page boundary is never handed out)."""
    return blocks_per_page(small_layout, PAGE, MAX_BLOCKS)


def config(backend_name: str, **overrides: object) -> kvasync.Config:
    settings: dict[str, object] = {"backend": backend_name, "max_blocks": MAX_BLOCKS}
    settings.update(overrides)
    return kvasync.Config(**settings)  # type: ignore[arg-type]


async def test_alloc_returns_distinct_ids_in_range(backend_name, small_layout):
    async with kvasync.open_allocator(small_layout, config(backend_name)) as kv:
        first = await kv.alloc(8)
        second = await kv.alloc(700, timeout=2.0)
        third = kv.alloc_nowait(3)
        every = first + second + third
        assert len(set(every)) == len(every) == 711
        assert all(0 <= block < kv.num_blocks for block in every)
        assert kv.stats().used_blocks == 711
        kv.free(every)
        assert kv.stats().used_blocks == 0


async def test_alloc_of_mapped_free_blocks_completes_without_suspending(backend_name, small_layout):
    async with kvasync.open_allocator(small_layout, config(backend_name)) as kv:
        kv.free(await kv.alloc(1))  # the first page is now mapped
        coroutine = kv.alloc(4)
        with pytest.raises(StopIteration) as done:
            coroutine.send(None)  # one step, no suspension: the result is already there
        blocks = done.value.value
        assert len(blocks) == 4
        kv.free(blocks)


async def test_blocks_are_packed_into_the_lowest_mapped_page_first(backend_name, small_layout, bpp):
    cfg = config(backend_name, reserve_pages=(0, 0))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        blocks = await kv.alloc(bpp + 10)
        assert sorted(blocks) == whole_blocks(small_layout, PAGE, MAX_BLOCKS)[: bpp + 10]
        kv.free(blocks[:5])  # holes in page 0 are reused before page 1's free blocks
        again = await kv.alloc(5)
        assert sorted(again) == sorted(blocks[:5])
        kv.free(blocks[5:] + again)


async def test_alloc_maps_on_demand_with_the_reserve_disabled(backend_name, small_layout, bpp):
    cfg = config(backend_name, reserve_pages=(0, 0))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        assert kv.stats().mapped_pages == 0
        blocks = await kv.alloc(3 * bpp)
        stats = kv.stats()
        assert stats.mapped_pages == 3
        assert stats.maps_done == 3
        assert stats.reserve_pages == 0
        kv.free(blocks)
        # With no reserve, pages that empty out are unmapped at once.
        await wait_until(lambda: kv.stats().mapped_pages == 0 and kv.stats().inflight_pages == 0)
        assert kv.stats().unmaps_done == 3


async def test_reserve_refills_to_its_high_watermark_in_the_background(
    backend_name, small_layout, bpp
):
    cfg = config(backend_name, reserve_pages=(2, 5))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        await wait_until(lambda: kv.stats().reserve_pages == 5)
        held = [kv.alloc_nowait(bpp) for _ in range(4)]  # reserve 5 -> 1 < low 2
        await wait_until(lambda: kv.stats().reserve_pages == 5)
        assert kv.stats().mapped_pages == 9
        for blocks in held:
            kv.free(blocks)
        # Above the high watermark: the excess is unmapped.
        await wait_until(lambda: kv.stats().mapped_pages == 5 and kv.stats().inflight_pages == 0)


@pytest.mark.parametrize("n", [0, -1])
async def test_alloc_rejects_a_non_positive_count_and_changes_nothing(
    backend_name, small_layout, n
):
    async with kvasync.open_allocator(small_layout, config(backend_name)) as kv:
        before = kv.stats().used_blocks
        with pytest.raises(ValueError, match="positive"):
            await kv.alloc(n)
        with pytest.raises(ValueError, match="positive"):
            kv.alloc_nowait(n)
        assert kv.stats().used_blocks == before
        assert kv.stats().waiters == 0


@pytest.mark.parametrize("timeout", [-0.1, math.nan, math.inf, -math.inf])
async def test_alloc_rejects_a_bad_timeout(backend_name, small_layout, timeout):
    async with kvasync.open_allocator(small_layout, config(backend_name)) as kv:
        with pytest.raises(ValueError, match="timeout"):
            await kv.alloc(1, timeout=timeout)
        assert kv.stats().used_blocks == 0


async def test_alloc_rejects_both_timeout_and_deadline(backend_name, small_layout):
    async with kvasync.open_allocator(small_layout, config(backend_name)) as kv:
        loop = asyncio.get_running_loop()
        with pytest.raises(ValueError, match="not both"):
            await kv.alloc(1, timeout=1.0, deadline=loop.time() + 1.0)
        with pytest.raises(ValueError, match="deadline"):
            await kv.alloc(1, deadline=math.nan)
        assert kv.stats().used_blocks == 0


async def test_alloc_accepts_a_loop_time_deadline(backend_name, small_layout):
    cfg = config(backend_name, reserve_pages=(0, 0))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        loop = asyncio.get_running_loop()
        blocks = await kv.alloc(10, deadline=loop.time() + 2.0)
        assert len(blocks) == 10
        kv.free(blocks)


async def test_free_of_a_block_not_allocated_raises_and_frees_nothing(backend_name, small_layout):
    async with kvasync.open_allocator(small_layout, config(backend_name)) as kv:
        blocks = await kv.alloc(4)
        with pytest.raises(ValueError, match="not allocated"):
            kv.free([blocks[0], 4000])  # 4000 is in range but was never handed out
        with pytest.raises(ValueError, match="out of range"):
            kv.free([blocks[0], kv.num_blocks])
        with pytest.raises(ValueError, match="twice"):
            kv.free([blocks[1], blocks[1]])
        assert kv.stats().used_blocks == 4  # nothing was freed by the failed calls
        kv.free(blocks)
        with pytest.raises(ValueError, match="not allocated"):
            kv.free(blocks[:1])  # already free
        assert kv.stats().used_blocks == 0


async def test_out_of_blocks_is_raised_at_once_when_a_request_can_never_fit(
    backend_name, small_layout, bpp
):
    page_bytes = small_layout.page_unit(PAGE) * small_layout.num_ranges
    cfg = config(backend_name, memory_limit=2 * page_bytes)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(kvasync.OutOfBlocks, match="can never fit"):
            await kv.alloc(kv.num_blocks + 1, timeout=10.0)
        with pytest.raises(kvasync.OutOfBlocks, match="memory limit"):
            await kv.alloc(2 * bpp + 1, timeout=10.0)
        with pytest.raises(kvasync.OutOfBlocks):
            kv.alloc_nowait(2 * bpp + 1)
        assert loop.time() - started < 5.0  # raised, not waited for
        stats = kv.stats()
        assert (stats.used_blocks, stats.waiters, stats.timeouts) == (0, 0, 0)
        blocks = await kv.alloc(2 * bpp)  # exactly the limit fits
        kv.free(blocks)


async def test_alloc_nowait_raises_would_block_instead_of_waiting_for_a_map(
    backend_name, small_layout
):
    cfg = config(backend_name, reserve_pages=(0, 0))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        with pytest.raises(kvasync.WouldBlock):
            kv.alloc_nowait(1)
        assert kv.stats().used_blocks == 0


async def test_waiters_are_served_first_come_first_served_as_blocks_are_freed(
    backend_name, small_layout, bpp
):
    page_bytes = small_layout.page_unit(PAGE) * small_layout.num_ranges
    cfg = config(backend_name, memory_limit=page_bytes, reserve_pages=(0, 0))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        held = await kv.alloc(bpp)  # the whole memory limit (less a block or two, at most)
        big = bpp * 300 // 512
        first = asyncio.create_task(kv.alloc(big, timeout=5.0))
        await wait_until(lambda: kv.stats().waiters == 1)
        second = asyncio.create_task(kv.alloc(10, timeout=5.0))
        await wait_until(lambda: kv.stats().waiters == 2)
        # A newcomer may not jump the queue for blocks the first waiter counts on.
        kv.free(held[: bpp // 5])
        with pytest.raises(kvasync.WouldBlock):
            kv.alloc_nowait(10)
        assert not first.done() and not second.done()
        kv.free(held[bpp // 5 :])
        got_first, got_second = await asyncio.wait_for(asyncio.gather(first, second), 5.0)
        assert len(got_first) == big and len(got_second) == 10
        kv.free(got_first + got_second)
        assert kv.stats().used_blocks == 0


async def test_timeout_says_what_the_alloc_was_waiting_for(backend_name, small_layout, bpp):
    page_bytes = small_layout.page_unit(PAGE) * small_layout.num_ranges
    cfg = config(backend_name, memory_limit=page_bytes, reserve_pages=(0, 0))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        held = await kv.alloc(bpp)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(kvasync.AllocTimeout) as caught:
            await kv.alloc(5, timeout=0.2)
        waited = loop.time() - started
        assert isinstance(caught.value, TimeoutError)
        message = str(caught.value)
        assert "alloc of 5 blocks timed out after" in message
        assert "memory limit" in message and "freed" in message
        assert 0.2 <= waited < 2.0
        stats = kv.stats()
        assert (stats.timeouts, stats.waiters, stats.used_blocks) == (1, 0, bpp)
        kv.free(held)


async def test_a_hung_map_times_out_its_waiters_while_mapped_blocks_stay_allocatable(
    backend_name, small_layout, bpp
):
    faults = FaultInjector()
    cfg = config(backend_name, reserve_pages=(0, 0), faults=faults)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        mapped = await kv.alloc(10)  # page 0 is mapped before the driver "hangs"
        faults.hang()
        try:
            waiter = asyncio.create_task(kv.alloc(bpp, timeout=0.3))
            await wait_until(lambda: faults.hung_maps == 1)
            more = kv.alloc_nowait(5)  # blocks already mapped keep working
            stats = kv.stats()
            assert stats.mapper_op == "map of 1 page(s)"
            assert stats.mapper_op_age >= 0.0
            assert stats.mapping_pages == 1
            with pytest.raises(kvasync.AllocTimeout, match="mapper busy on map"):
                await waiter
            assert kv.stats().mapper_op_age > 0.25  # still stuck, and stats show for how long
            kv.free(more + mapped)
        finally:
            faults.release()
        await wait_until(lambda: kv.stats().inflight_pages == 0)
        # The late map landed in the pool; nothing leaked and the allocator works again.
        blocks = await kv.alloc(bpp, timeout=2.0)
        kv.free(blocks)
        assert kv.stats().used_blocks == 0


async def test_close_finishes_within_its_deadline_with_the_mapper_stuck(backend_name, small_layout):
    faults = FaultInjector()
    cfg = config(backend_name, reserve_pages=(0, 0), faults=faults)
    kv = await kvasync.Allocator.open(small_layout, cfg)
    faults.hang()
    try:
        waiter = asyncio.create_task(kv.alloc(1, timeout=30.0))
        await wait_until(lambda: faults.hung_maps == 1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await kv.close(timeout=0.3)
        assert loop.time() - started < 2.0
        with pytest.raises(kvasync.AllocatorClosed):
            await waiter
        with pytest.raises(kvasync.AllocatorClosed):
            await kv.alloc(1)
    finally:
        faults.release()  # the abandoned mapper thread finishes its call and exits


async def test_a_delayed_map_still_completes_within_the_deadline(backend_name, small_layout, bpp):
    faults = FaultInjector()
    faults.delay(0.05)
    cfg = config(backend_name, reserve_pages=(0, 0), faults=faults)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        blocks = await kv.alloc(2 * bpp, timeout=2.0)
        assert len(blocks) == 2 * bpp
        faults.release()
        kv.free(blocks)


async def test_a_failed_map_raises_map_error_and_the_allocator_keeps_working(
    backend_name, small_layout
):
    faults = FaultInjector()
    cfg = config(backend_name, reserve_pages=(0, 0), faults=faults)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        faults.fail(1)
        with pytest.raises(kvasync.MapError, match=r"OUT_OF_MEMORY|ENOMEM"):
            await kv.alloc(4, timeout=2.0)
        stats = kv.stats()
        assert (stats.map_errors, stats.used_blocks, stats.mapped_pages) == (1, 0, 0)
        assert stats.waiters == 0 and stats.inflight_pages == 0
        blocks = await kv.alloc(4, timeout=2.0)
        assert len(blocks) == 4
        kv.free(blocks)


async def test_cancelling_a_waiting_alloc_leaks_nothing(backend_name, small_layout):
    faults = FaultInjector()
    faults.delay(0.05)
    cfg = config(backend_name, reserve_pages=(0, 0), faults=faults)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        task = asyncio.create_task(kv.alloc(20, timeout=5.0))
        await wait_until(lambda: kv.stats().mapping_pages == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert kv.stats().waiters == 0
        # The map completes later; its page lands unused in the pool, then goes (no reserve).
        await wait_until(lambda: kv.stats().maps_done == 1 and kv.stats().inflight_pages == 0)
        assert kv.stats().used_blocks == 0


async def test_a_timeout_around_alloc_from_asyncio_leaks_nothing(backend_name, small_layout):
    faults = FaultInjector()
    faults.hang()
    cfg = config(backend_name, reserve_pages=(0, 0), faults=faults)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await kv.alloc(8, timeout=5.0)
            assert kv.stats().waiters == 0
        finally:
            faults.release()
        await wait_until(lambda: kv.stats().inflight_pages == 0 and kv.stats().mapped_pages == 0)
        assert kv.stats().used_blocks == 0


async def test_zero_on_alloc_hands_out_blocks_that_read_as_zeros(backend_name, small_layout):
    cfg = config(backend_name, zero_on_alloc=True, reserve_pages=(1, 1))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        blocks = await kv.alloc(6)
        for layer in range(small_layout.num_layers):
            for buffer in kv.layer(layer):
                buffer[blocks] = 7
        kv.free(blocks)
        again = await kv.alloc(6)
        assert sorted(again) == sorted(blocks)  # the same blocks, reused
        for layer in range(small_layout.num_layers):
            for buffer in kv.layer(layer):
                assert torch.count_nonzero(buffer[again]).item() == 0
        kv.free(again)


async def test_trim_unmaps_every_mapped_free_page(backend_name, small_layout):
    cfg = config(backend_name, reserve_pages=(2, 4))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        await wait_until(lambda: kv.stats().reserve_pages == 4)
        held = await kv.alloc(10)  # keeps one page in use
        await kv.trim()
        stats = kv.stats()
        assert (stats.mapped_pages, stats.reserve_pages, stats.inflight_pages) == (1, 0, 0)
        kv.free(held)


async def test_resize_lowers_the_memory_limit_and_unmaps_above_it(backend_name, small_layout, bpp):
    page_bytes = small_layout.page_unit(PAGE) * small_layout.num_ranges
    cfg = config(backend_name, reserve_pages=(0, 0))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        blocks = await kv.alloc(4 * bpp)
        kv.free(blocks[bpp:])
        await kv.resize(memory_limit=2 * page_bytes)
        await wait_until(lambda: kv.stats().mapped_pages == 1)
        assert kv.stats().memory_limit_pages == 2
        with pytest.raises(kvasync.OutOfBlocks):
            await kv.alloc(2 * bpp + 1)
        more = await kv.alloc(bpp)  # up to the new limit still fits
        with pytest.raises(ValueError, match="below one page"):
            await kv.resize(memory_limit=page_bytes - 1)
        await kv.resize(memory_limit=None)
        big = await kv.alloc(2 * bpp)
        kv.free(blocks[:bpp] + more + big)


def first_pages(layout: kvasync.KVLayout, count: int) -> list[list[int]]:
    """The block ids of pages 0..count-1, page by page (pages may hold different numbers)."""
    unit = layout.page_unit(PAGE)
    pages: list[list[int]] = [[] for _ in range(count)]
    for block in whole_blocks(layout, PAGE, MAX_BLOCKS):
        page = block * layout.range_block_bytes // unit
        if page >= count:
            break
        pages[page].append(block)
    return pages


async def test_a_lowered_limit_drains_the_pages_above_it(backend_name, small_layout):
    # Note [Limit policy], the drain: blocks in use on every page, so no page can be unmapped at
    # once.
    page_bytes = small_layout.page_unit(PAGE) * small_layout.num_ranges
    pages = first_pages(small_layout, 4)
    cfg = config(backend_name, reserve_pages=(0, 0))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        blocks = await kv.alloc(sum(map(len, pages)))
        assert sorted(blocks) == sorted(b for page in pages for b in page)
        assert kv.drain_from() is None
        kv.free([b for page in pages for b in page[::2]])  # half of every page
        kept = [page[1::2] for page in pages]
        await kv.resize(memory_limit=2 * page_bytes)
        assert kv.drain_from() == pages[2][0]
        # Only the free halves of the two pages within the limit count, and only they are handed
        # out, though the draining pages have free slots too.
        below = sum(len(page[::2]) for page in pages[:2])
        assert kv.available_blocks() == below
        more = kv.alloc_nowait(below)
        assert max(more) < pages[2][0]
        with pytest.raises(kvasync.WouldBlock):
            kv.alloc_nowait(1)
        assert kv.stats().mapped_pages == 4
        # Vacating the draining pages gives each back as soon as its last block is freed.
        kv.free(kept[3])
        await wait_until(lambda: kv.stats().mapped_pages == 3)
        assert kv.drain_from() == pages[2][0]
        kv.free(kept[2])
        await wait_until(lambda: kv.drain_from() is None)  # once its unmap is done
        assert kv.stats().mapped_pages == 2
        assert kv.available_blocks() == 0
        kv.free(more + kept[0] + kept[1])


async def test_a_draining_page_goes_back_even_while_a_request_waits(backend_name, small_layout):
    page_bytes = small_layout.page_unit(PAGE) * small_layout.num_ranges
    pages = first_pages(small_layout, 3)
    cfg = config(backend_name, reserve_pages=(0, 0))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        await kv.alloc(sum(map(len, pages)))
        await kv.resize(memory_limit=2 * page_bytes)
        assert kv.drain_from() == pages[2][0]
        waiting = asyncio.ensure_future(kv.alloc(len(pages[0]), timeout=5.0))
        await asyncio.sleep(0)
        kv.free(pages[2])  # the draining page: unmapped, not given to the waiter
        await wait_until(lambda: kv.stats().mapped_pages == 2)
        assert not waiting.done()
        kv.free(pages[0])  # a page within the limit: the waiter gets it
        got = await asyncio.wait_for(waiting, 5.0)
        assert sorted(got) == pages[0]
        kv.free(got + pages[1])


# 512 blocks of 4 KiB per 2 MiB page, pages uniform: the drain cases below count whole pages.
UNIFORM = kvasync.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)


def uniform_pages(count: int) -> list[list[int]]:
    return [list(range(i * 512, (i + 1) * 512)) for i in range(count)]


async def test_the_drain_covers_only_what_is_over_after_free_pages_go_back():
    # Free pages over the limit are unmapped first; the drain is what is left over after them.
    page_bytes = UNIFORM.page_unit(PAGE) * UNIFORM.num_ranges
    pages = uniform_pages(6)
    cfg = kvasync.Config(backend="host", max_blocks=8192, reserve_pages=(0, 1))
    async with kvasync.open_allocator(UNIFORM, cfg) as kv:
        assert sorted(await kv.alloc(6 * 512)) == [b for page in pages for b in page]
        kv.free(pages[1])  # wholly free: kept as the reserve
        kv.free(pages[4][::2] + pages[5][::2])
        await kv.resize(memory_limit=4 * page_bytes, timeout=5.0)  # unmaps page 1
        assert kv.stats().mapped_pages == 5
        assert kv.drain_from() == pages[5][0]  # one page over: the highest, not pages 4 and 5
        assert kv.available_blocks() == 256  # page 4's free half
        kv.free(kv.alloc_nowait(256) + pages[0] + pages[2] + pages[3])
        kv.free(pages[4][1::2] + pages[5][1::2])


async def test_a_map_in_flight_when_the_limit_drops_is_not_counted_on():
    # Note [Waiters] with Note [Limit policy] (the drain): a waiter counted on a page being mapped
    # for it; once the limit drops below it, that page drains as it lands, so the waiter's demand
    # protects the free blocks again: a later request does not jump ahead of it.
    page_bytes = UNIFORM.page_unit(PAGE) * UNIFORM.num_ranges
    faults = FaultInjector()
    cfg = kvasync.Config(
        backend="host",
        max_blocks=8192,
        reserve_pages=(0, 0),
        faults=faults,
        memory_limit=8 * page_bytes,
    )
    async with kvasync.open_allocator(UNIFORM, cfg) as kv:
        held = sorted(await kv.alloc(4 * 512))
        kv.free(held[:256])
        faults.hang()  # the map for the waiter below stays in flight
        waiter = asyncio.ensure_future(kv.alloc(300, timeout=10.0))
        await wait_until(lambda: kv.stats().mapping_pages == 1)
        await kv.resize(memory_limit=4 * page_bytes, timeout=5.0)
        with pytest.raises(kvasync.WouldBlock):
            kv.alloc_nowait(200)  # 256 free, but the waiter for 300 came first
        faults.release()
        kv.free(held[256:768])  # frees within the limit serve the waiter
        got = await asyncio.wait_for(waiter, 10.0)
        assert max(got) < 4 * 512
        await wait_until(lambda: kv.stats().mapped_pages == 4)
        kv.free(got + held[768:])


async def test_free_block_ids_lists_what_the_next_alloc_hands_out_in_that_order(backend_name):
    cfg = kvasync.Config(backend=backend_name, max_blocks=8192, reserve_pages=(0, 0))
    async with kvasync.open_allocator(UNIFORM, cfg) as kv:
        held = await kv.alloc(3 * 512)
        # Holes on pages 2, 0 and 1, freed out of order: the listing follows the pool's order
        # (lowest page first, and within a page what it takes first), not the order of the frees.
        freed = held[1100:1110] + held[7:3:-1] + held[600:605] + held[40:43]
        kv.free(freed)
        before = kv.stats()
        listed = kv.free_block_ids()
        assert sorted(listed) == sorted(freed)
        assert kv.free_block_ids(limit=6) == listed[:6]
        assert kv.free_block_ids(limit=0) == []
        assert kv.stats() == before  # listing takes nothing
        assert kv.alloc_nowait(6) == listed[:6]
        assert await kv.alloc(len(listed) - 6) == listed[6:]
        assert kv.free_block_ids() == []  # every mapped block is in use
        kv.free(held)


async def test_free_block_ids_leave_out_unmapped_and_draining_pages(backend_name):
    page_bytes = UNIFORM.page_unit(PAGE) * UNIFORM.num_ranges
    pages = uniform_pages(4)
    cfg = kvasync.Config(backend=backend_name, max_blocks=8192, reserve_pages=(0, 0))
    async with kvasync.open_allocator(UNIFORM, cfg) as kv:
        first = await kv.alloc(10)  # maps page 0 only; pages 1.. stay unmapped
        assert sorted(kv.free_block_ids()) == pages[0][10:]
        rest = await kv.alloc(4 * 512 - 10)
        kv.free([b for page in pages for b in page[::2]])  # half of every page
        await kv.resize(memory_limit=2 * page_bytes)
        assert kv.drain_from() == pages[2][0]
        listed = kv.free_block_ids()
        assert sorted(listed) == sorted(pages[0][::2] + pages[1][::2])
        again = kv.alloc_nowait(len(listed))
        assert again == listed  # the draining pages' free halves stay free
        assert sorted(first + rest) == [b for page in pages for b in page]
        kv.free(again + [b for page in pages for b in page[1::2]])
        await kv.trim()
        assert kv.free_block_ids() == []  # nothing mapped, nothing listed


@pytest.mark.parametrize(
    ("limit", "error"),
    [(-1, ValueError), (2**63, ValueError), (1.5, TypeError), (True, TypeError), ("3", TypeError)],
)
async def test_free_block_ids_reject_a_bad_limit_and_change_nothing(backend_name, limit, error):
    # A wrong type is a TypeError (issue 27: it was a ValueError), a wrong value a ValueError.
    cfg = kvasync.Config(backend=backend_name, max_blocks=8192, reserve_pages=(0, 0))
    async with kvasync.open_allocator(UNIFORM, cfg) as kv:
        held = await kv.alloc(5)
        before = kv.stats()
        with pytest.raises(error, match="limit must be"):
            kv.free_block_ids(limit)
        assert kv.stats() == before
        kv.free(held)
    with pytest.raises(kvasync.AllocatorClosed):
        kv.free_block_ids()


@pytest.mark.parametrize("contiguous", [False, True])
async def test_layer_views_cover_distinct_memory_for_every_buffer(backend_name, contiguous):
    layout = kvasync.KVLayout(
        num_layers=3, num_kv_heads=2, head_dim=32, block_size=8, contiguous=contiguous
    )
    # 6 buffers x 1 KiB blocks: the contiguous layout needs a page that is a multiple of 6 KiB.
    page_size = (6 if contiguous else 2) << 20
    cfg = kvasync.Config(backend=backend_name, max_blocks=64, page_size=page_size)
    async with kvasync.open_allocator(layout, cfg) as kv:
        blocks = await kv.alloc(5)
        buffers = [b for layer in range(3) for b in kv.layer(layer)]
        assert len(buffers) == 6
        for value, buffer in enumerate(buffers, start=1):
            assert buffer.shape == (64, 8, 2, 32)
            assert buffer.dtype == torch.float16
            buffer[blocks] = value
        for value, buffer in enumerate(buffers, start=1):
            assert bool((buffer[blocks] == value).all())
        kv.free(blocks)


async def test_layer_rejects_a_layer_out_of_range(backend_name, small_layout):
    async with kvasync.open_allocator(small_layout, config(backend_name)) as kv:
        with pytest.raises(IndexError):
            kv.layer(small_layout.num_layers)


async def test_mla_layout_has_one_buffer_per_layer(backend_name):
    layout = kvasync.KVLayout(
        num_layers=2, num_kv_heads=1, head_dim=64, block_size=16, kv_buffers=1
    )
    async with kvasync.open_allocator(layout, kvasync.Config(backend=backend_name)) as kv:
        (latent,) = kv.layer(1)
        assert latent.shape == (4096, 16, 1, 64)


async def test_calls_on_a_closed_allocator_raise_allocator_closed(backend_name, small_layout):
    kv = await kvasync.Allocator.open(small_layout, config(backend_name))
    blocks = await kv.alloc(2)
    await kv.close()
    await kv.close()  # idempotent
    with pytest.raises(kvasync.AllocatorClosed):
        await kv.alloc(1)
    with pytest.raises(kvasync.AllocatorClosed):
        kv.alloc_nowait(1)
    with pytest.raises(kvasync.AllocatorClosed):
        await kv.trim()
    assert kv.stats().mapped_pages == 0  # close gave the memory back
    del blocks


async def test_every_public_method_raises_allocator_closed_after_close(backend_name, small_layout):
    # Issue 27: after close, free raised ValueError ("block 0 is not allocated") and set_demand,
    # available_blocks, drain_from and free_block_ids returned None, 0, None and []. The walk
    # covers every public method; one added later without an entry here fails the first assert.
    cfg = config(backend_name, reserve_pages=(0, 0))
    kv = await kvasync.Allocator.open(small_layout, cfg)
    held = await kv.alloc(4)
    data = kv.gather(held[:1])
    await kv.close()
    calls = {**calls_after_close(kv, held, data), "__aenter__": kv.__aenter__}
    public = public_methods(kvasync.Allocator)
    still_served = {"close", "stats", "take_map_seconds", "open"}  # open: a classmethod
    assert public == set(calls) - {"__aenter__"} | still_served
    served = []
    for name, call in calls.items():
        try:
            result = call()
            if inspect.isawaitable(result):
                result = await result
        except kvasync.AllocatorClosed:
            continue
        except Exception as error:
            served.append(f"{name}: {type(error).__name__}: {error}")
        else:  # the type only: a view's repr would read it
            served.append(f"{name}: returned {type(result).__name__}")
    assert not served, served
    await kv.close()  # idempotent
    # Documented to work after close: the final counters, and the one map's duration, once.
    assert kv.stats().mapped_pages == 0
    durations = kv.take_map_seconds()
    assert len(durations) == 1 and durations[0] > 0
    assert kv.take_map_seconds() == []
    assert (kv.num_blocks, kv.layout, kv.backend) == (MAX_BLOCKS, small_layout, backend_name)


@pytest.mark.parametrize("library", ["asyncio", "trio"])
def test_calls_from_another_event_loop_raise_and_change_nothing(library):
    # Issue 27: resize from another loop raised RuntimeError after it had lowered the limit from
    # 64 pages to 2; trim had started its unmaps, alloc had queued its map, and close had closed
    # the pool and then failed for good. The allocator runs on a loop in a thread of its own.
    layout = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    page = 64 << 10  # 16 blocks of 4 KiB, in each of 4 ranges
    cfg = kvasync.Config(
        backend="host",
        max_blocks=64 * 16,
        page_size=page,
        memory_limit=64 * page * 4,
        reserve_pages=(0, 1),  # no refill; a freed page stays mapped
    )
    with anyio.from_thread.start_blocking_portal(library) as portal:
        kv = portal.call(kvasync.Allocator.open, layout, cfg)
        held = portal.call(kv.alloc, 20)  # pages 0 and 1
        kv.free(held[16:])  # page 1 is mapped and free: what a trim would unmap
        before = dataclasses.replace(kv.stats(), mapper_op_age=0.0)
        assert (before.memory_limit_pages, before.mapped_pages, before.used_blocks) == (64, 2, 16)

        async def from_another_loop() -> list[str]:
            calls = {
                "resize": lambda: kv.resize(memory_limit=2 * page * 4, timeout=1.0),
                "trim": lambda: kv.trim(timeout=1.0),
                "alloc": lambda: kv.alloc(200, timeout=1.0),  # needs maps
                "close": lambda: kv.close(timeout=1.0),
            }
            wrong = []
            for name, call in calls.items():
                try:
                    await call()
                    wrong.append(f"{name}: served")
                except RuntimeError as error:
                    if "event loop that opened it" not in str(error):
                        wrong.append(f"{name}: {error}")
                after = dataclasses.replace(kv.stats(), mapper_op_age=0.0)
                if after != before:
                    wrong.append(f"{name} changed {before} into {after}")
                    break
            return wrong

        assert asyncio.run(from_another_loop()) == []
        kv.free(held[:16])  # the allocator is still whole: its own loop uses and closes it
        portal.call(functools.partial(kv.resize, memory_limit=2 * page * 4))
        assert kv.stats().memory_limit_pages == 2
        portal.call(kv.close)
        assert kv.stats().mapped_pages == 0


def test_layout_and_config_reject_bad_values():
    with pytest.raises(ValueError, match="num_layers"):
        kvasync.KVLayout(num_layers=0, num_kv_heads=1, head_dim=8, block_size=1)
    with pytest.raises(ValueError, match="kv_buffers"):
        kvasync.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=1, kv_buffers=3)
    with pytest.raises(ValueError, match="dtype"):
        kvasync.KVLayout(
            num_layers=1, num_kv_heads=1, head_dim=8, block_size=1, dtype=torch.float64
        )
    with pytest.raises(ValueError, match="backend"):
        kvasync.Config(backend="tpu")
    with pytest.raises(ValueError, match="reserve_pages"):
        kvasync.Config(reserve_pages=(3, 1))
    with pytest.raises(ValueError, match="default_timeout"):
        kvasync.Config(default_timeout=math.inf)
    odd = kvasync.KVLayout(num_layers=1, num_kv_heads=2, head_dim=80, block_size=16)
    with pytest.raises(ValueError, match="page_size"):
        odd.blocks_per_page(2 << 20)


async def test_backend_auto_picks_host_without_a_cuda_driver(small_layout):
    if torch.cuda.is_available():
        pytest.skip("a CUDA driver is present")
    async with kvasync.open_allocator(small_layout, kvasync.Config(backend="auto")) as kv:
        assert kv.backend == "host"
    with pytest.raises(kvasync.KVAsyncError, match="no CUDA driver"):
        await kvasync.Allocator.open(small_layout, kvasync.Config(backend="cuda"))


def test_touching_an_unmapped_block_faults_like_a_gpu():
    # A real reservation: reading a block whose page was never mapped is a segmentation fault.
    script = textwrap.dedent(
        """
        import asyncio, kvasync
        async def main():
            layout = kvasync.KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)
            cfg = kvasync.Config(backend="host", reserve_pages=(0, 0))
            async with kvasync.open_allocator(layout, cfg) as kv:
                k, v = kv.layer(0)
                print("touching", flush=True)
                k[100].sum()
        asyncio.run(main())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert "touching" in result.stdout
    assert result.returncode == -11, result.stderr  # SIGSEGV


# Note [Views outlive close]: a view taken before close, used after it. Run in a child process:
# before the fix the read killed it with SIGSEGV (and would have killed the test run).
_VIEW_AFTER_CLOSE = textwrap.dedent(
    """
    import asyncio, sys, torch, kvasync

    def shmem_kib():
        with open("/proc/self/status") as status:
            return next(int(l.split()[1]) for l in status if l.startswith("RssShmem:"))

    async def main(backend):
        layout = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
        cfg = kvasync.Config(backend=backend, max_blocks=4096, reserve_pages=(0, 0))
        kv = await kvasync.Allocator.open(layout, cfg)
        before = shmem_kib()
        ids = await kv.alloc(2048)  # 4 pages of 512 blocks in each of 4 ranges: 32 MiB
        k, v = kv.layer(1)
        k[ids] = 1.0
        print("mapped", kv.stats().mapped_pages, "grew_kib", shmem_kib() - before, flush=True)
        await kv.close()
        print("closed", kv.stats().mapped_pages, "kept_kib", shmem_kib() - before, flush=True)
        for call in (lambda: kv.layer(0), lambda: kv.gather(ids[:1]), lambda: kv.zero(ids[:1])):
            try:
                call()
                print("served after close", flush=True)
            except kvasync.AllocatorClosed:
                print("refused: AllocatorClosed", flush=True)
        total = float(k[ids].float().sum()) + float(v[ids].float().sum())  # reads every block
        k[ids] = 2.0  # and writes them: a step still running when the engine closed its cache
        v[ids[-1]] = 3.0
        print("used the views after close:", total == total, flush=True)
        if backend == "cuda":
            torch.cuda.synchronize()  # an illegal address would surface here
        del k, v
        print("dropped", flush=True)

    asyncio.run(main(sys.argv[1]))
    """
)


def test_a_view_taken_before_close_stays_valid_after_it(backend_name):
    result = subprocess.run(
        [sys.executable, "-c", _VIEW_AFTER_CLOSE, backend_name],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr[-2000:])
    assert lines[0].startswith("mapped 4 ")
    assert lines[1].startswith("closed 0 ")  # the pages went back, the views still live
    assert lines[2:5] == ["refused: AllocatorClosed"] * 3  # no new view, no kernel after close
    assert lines[5:] == ["used the views after close: True", "dropped"]
    if backend_name == "host":
        grew = int(lines[0].split()[-1])
        kept = int(lines[1].split()[-1])
        assert grew >= 30 * 1024  # the 32 MiB were mapped (RssShmem counts the memfd pages)...
        assert kept < 2 * 1024  # ...and given back at close although the views were alive


def test_a_block_never_mapped_still_faults_after_close():
    # The scratch memory goes only where pages were mapped at close: the rest of the range stays
    # a reservation that faults, as it did before the close (Note [Views outlive close]).
    script = textwrap.dedent(
        """
        import asyncio, kvasync
        async def main():
            layout = kvasync.KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)
            cfg = kvasync.Config(backend="host", reserve_pages=(0, 0))
            kv = await kvasync.Allocator.open(layout, cfg)
            ids = await kv.alloc(1)
            k, v = kv.layer(0)
            await kv.close()
            k[ids].sum()
            print("touching", flush=True)
            k[2000].sum()  # page 1 (1024 blocks of 2 KiB a page): never mapped
        asyncio.run(main())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert "touching" in result.stdout, result.stderr[-2000:]
    assert result.returncode == -11, result.stderr  # SIGSEGV


async def test_layer_after_close_raises_allocator_closed(backend_name, small_layout):
    kv = await kvasync.Allocator.open(small_layout, config(backend_name))
    kv.free(await kv.alloc(1))
    await kv.close()
    with pytest.raises(kvasync.AllocatorClosed, match="closed"):
        kv.layer(0)


def _shmem_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    raise AssertionError("no RssShmem in /proc/self/status")


async def test_host_memory_is_given_back_to_the_os_after_trim(small_layout, bpp):
    cfg = kvasync.Config(backend="host", reserve_pages=(0, 0), max_blocks=64 * bpp)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        before = _shmem_kib()
        blocks = await kv.alloc(16 * bpp)  # 16 pages x 8 ranges x 2 MiB = 256 MiB (pow2)
        grown = _shmem_kib() - before
        assert grown >= 16 * kv.stats().page_bytes // 1024 - 6 * 1024
        kv.free(blocks)
        await wait_until(lambda: kv.stats().mapped_pages == 0 and kv.stats().inflight_pages == 0)
        assert _shmem_kib() - before < 16 * 1024


@pytest.mark.parametrize("contiguous", [False, True])
async def test_block_data_moves_through_the_allocator_in_every_layer(backend_name, contiguous):
    layout = kvasync.KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, contiguous=contiguous
    )
    cfg = kvasync.Config(backend=backend_name, max_blocks=32, page_size=2 << 20)
    async with kvasync.open_allocator(layout, cfg) as kv:
        blocks = await kv.alloc(4)
        device = kv.layer(0)[0].device
        data = torch.randn(3, 2, 2, 4, 2, 16, device=device).to(torch.float16)
        kv.scatter(blocks[:3], data)
        assert torch.equal(kv.gather(blocks[:3]), data)
        assert torch.equal(kv.layer(1)[1][blocks[2]], data[2, 1, 1])  # layer 1's V of block 2
        kv.copy([blocks[0]], [blocks[3]])
        assert torch.equal(kv.gather([blocks[3]])[0], data[0])
        kv.zero(blocks[:2])
        gathered = kv.gather(blocks)
        assert torch.count_nonzero(gathered[:2]).item() == 0
        assert torch.equal(gathered[2], data[2])
        free_block = next(b for b in range(32) if b not in blocks)
        with pytest.raises(ValueError, match="not allocated"):
            kv.gather([blocks[0], free_block])
        kv.free(blocks)


async def test_free_takes_any_sequence_of_ints_and_rejects_other_ids(backend_name, small_layout):
    async with kvasync.open_allocator(small_layout, config(backend_name)) as kv:
        kv.free(tuple(await kv.alloc(3)))
        kv.free(torch.tensor(await kv.alloc(3)))
        blocks = await kv.alloc(2)
        with pytest.raises(TypeError, match="must be ints, got str"):
            kv.free([blocks[0], "1"])
        with pytest.raises(TypeError, match="must be ints, got float"):
            kv.free([float(blocks[0])])
        with pytest.raises(ValueError, match="int64"):
            kv.free([1 << 70])
        with pytest.raises(TypeError, match="got bool"):
            kv.free((True,))  # not block 1
        assert kv.stats().used_blocks == 2  # nothing was freed by the failed calls
        kv.free(blocks)


async def test_concurrent_closes_share_one_close_and_a_cancelled_one_still_completes(
    backend_name, small_layout
):
    faults = FaultInjector()
    kv = await kvasync.Allocator.open(small_layout, config(backend_name, faults=faults))
    faults.delay(0.2)  # the mapper is inside a slow refill when the close comes
    try:
        first = asyncio.create_task(kv.close(timeout=2.0))
        second = asyncio.create_task(kv.close(timeout=2.0))
        await asyncio.sleep(0)  # one loop step: both tasks run up to their first await
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 5.0)  # the close itself went on and finished
        with pytest.raises(kvasync.AllocatorClosed):
            kv.alloc_nowait(1)
    finally:
        faults.release()


async def test_maps_queued_by_many_requests_reach_the_backend_as_one_batch(
    backend_name, small_layout, bpp
):
    faults = FaultInjector()
    cfg = config(backend_name, reserve_pages=(0, 0), faults=faults)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        faults.hang()
        try:
            first = asyncio.create_task(kv.alloc(bpp, timeout=5.0))
            await wait_until(lambda: faults.hung_maps == 1)
            rest = [asyncio.create_task(kv.alloc(bpp, timeout=5.0)) for _ in range(10)]
            await wait_until(lambda: kv.stats().waiters == 11 and kv.stats().queued_jobs == 10)
        finally:
            faults.release()
        results = await asyncio.wait_for(asyncio.gather(first, *rest), 5.0)
        stats = kv.stats()
        assert stats.maps_done == 11
        assert stats.mapper_batches == 2  # the hung map, then the ten queued behind it at once
        for blocks in results:
            kv.free(blocks)


async def test_close_with_a_stuck_mapper_does_not_block_the_event_loop(backend_name, small_layout):
    faults = FaultInjector()
    cfg = config(backend_name, reserve_pages=(0, 0), faults=faults)
    kv = await kvasync.Allocator.open(small_layout, cfg)
    faults.hang()
    waiter = asyncio.create_task(kv.alloc(1, timeout=30.0))
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        await wait_until(lambda: faults.hung_maps == 1)  # the alloc's map is stuck
        before = ticks
        await kv.close(timeout=0.5)
        assert ticks - before >= 10  # other tasks ran all through the half-second close
        with pytest.raises(kvasync.AllocatorClosed):
            await waiter
    finally:
        ticker.cancel()
        faults.release()


@pytest.mark.parametrize("mapper", ["idle", "stuck"])
async def test_close_is_bounded_with_the_default_executor_full(
    backend_name, small_layout, bpp, mapper
):
    # Issue 7: close waited for the mapper through asyncio.to_thread, i.e. behind whatever the
    # application had queued in the loop's default executor.
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    release = threading.Event()
    started = threading.Semaphore(0)

    def application_work() -> bool:
        started.release()
        return release.wait(timeout=10.0)

    jobs = [asyncio.ensure_future(asyncio.to_thread(application_work)) for _ in range(3)]
    faults = FaultInjector()
    kv = await kvasync.Allocator.open(small_layout, config(backend_name, faults=faults))
    try:
        for _ in range(2):  # both executor threads are busy; the third job is queued
            await wait_until(lambda: started.acquire(blocking=False))
        if mapper == "stuck":
            faults.hang()
            waiter = asyncio.ensure_future(kv.alloc(16 * bpp, timeout=30.0))
            await wait_until(lambda: faults.hung_maps == 1)
        started_at = loop.time()
        await kv.close(timeout=1.0)
        assert loop.time() - started_at < 1.0 + 1.5
        assert not any(job.done() for job in jobs)  # the executor was full all along
        if mapper == "stuck":
            with pytest.raises(kvasync.AllocatorClosed):
                await waiter
    finally:
        faults.release()
        release.set()
        assert all(await asyncio.wait_for(asyncio.gather(*jobs), timeout=10.0))


async def test_a_trim_that_times_out_says_what_the_mapper_is_doing(backend_name, small_layout):
    faults = FaultInjector()
    cfg = config(backend_name, reserve_pages=(2, 4), faults=faults)
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        await wait_until(lambda: kv.stats().reserve_pages == 4)
        faults.delay(0.5)
        try:
            with pytest.raises(kvasync.AllocTimeout, match=r"trim timed out .* unmap of 4 page"):
                await kv.trim(timeout=0.1)
        finally:
            faults.release()
        await wait_until(lambda: kv.stats().inflight_pages == 0)
        assert kv.stats().mapped_pages == 0  # the unmap itself went through, late


async def test_free_and_alloc_nowait_work_from_another_thread(backend_name, small_layout, bpp):
    # A synchronous scheduler thread may free blocks and take mapped ones while the loop waits.
    page_bytes = small_layout.page_unit(PAGE) * small_layout.num_ranges
    cfg = config(backend_name, memory_limit=page_bytes, reserve_pages=(0, 0))
    async with kvasync.open_allocator(small_layout, cfg) as kv:
        held = await kv.alloc(bpp)
        waiter = asyncio.create_task(kv.alloc(10, timeout=5.0))
        await wait_until(lambda: kv.stats().waiters == 1)
        taken: list[int] = []

        def scheduler() -> None:
            kv.free(held[:20])  # serves the waiter: its completion wakes the loop
            taken.extend(kv.alloc_nowait(5))  # the 10 left over after the waiter's share

        await asyncio.wait_for(asyncio.to_thread(scheduler), 5.0)
        got = await asyncio.wait_for(waiter, 5.0)
        assert len(got) == 10 and len(taken) == 5
        assert not set(got) & set(taken)
        kv.free(got + taken + held[20:])
        assert kv.stats().used_blocks == 0


async def test_alloc_observers_see_every_alloc_hot_and_cold_until_removed(
    backend_name, small_layout, bpp, caplog
):
    async with kvasync.open_allocator(
        small_layout, config(backend_name, reserve_pages=(0, 0))
    ) as kv:
        seen: list[tuple[str, bool, float]] = []

        def first(waited: bool, seconds: float) -> None:
            seen.append(("first", waited, seconds))

        def broken(waited: bool, seconds: float) -> None:
            raise RuntimeError("an observer's own bug")

        remove_first = kv.add_alloc_observer(first)
        remove_again = kv.add_alloc_observer(first)  # the same callable twice: called twice
        remove_broken = kv.add_alloc_observer(broken)
        cold = await kv.alloc(2)  # waits for a map
        hot = await kv.alloc(1)  # answered from the mapped page
        assert [(who, waited) for who, waited, _ in seen] == [
            ("first", True),
            ("first", True),
            ("first", False),
            ("first", False),
        ]
        assert all(0.0 <= seconds < 5.0 for _, _, seconds in seen)
        # The broken observer was logged twice, and each alloc still got its blocks.
        assert [r.message for r in caplog.records if r.name == "kvasync"].count(
            "an alloc observer raised; the alloc is unaffected"
        ) == 2
        assert len(cold) == 2 and len(hot) == 1
        remove_again()
        remove_again()  # idempotent: removes one entry only
        remove_broken()
        kv.alloc_nowait(1)  # not observed
        await kv.alloc(1)
        assert [who for who, _, _ in seen[4:]] == ["first"]
        remove_first()
        await kv.alloc(1)
        assert len(seen) == 5
        with pytest.raises(TypeError, match="observer must be callable"):
            kv.add_alloc_observer(42)  # type: ignore[arg-type]
        # One duration per successful map job, each taken once.
        durations = kv.take_map_seconds()
        assert len(durations) == 1 and 0.0 < durations[0] < 5.0
        assert kv.take_map_seconds() == []
        await kv.alloc(bpp)  # past the first page: one more map
        assert len(kv.take_map_seconds()) == 1
