"""The linger (Config.linger; csrc/pool/limit_policy.h, Note [Limit policy]): the pages in use at
a recent peak stay mapped for the linger after use falls, and go back when it lapses; nothing
lingers under a share's pressure, over a lowered limit, or through trim().

Real allocators on the host backend (memfd + mmap), a real ledger file for the share.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from conftest import wait_until

import kvasync

PAGE = 2 << 20  # 4 blocks of 512 KiB a page
BLOCKS_PER_PAGE = 4
LAYOUT = kvasync.KVLayout(
    num_layers=4, num_kv_heads=8, head_dim=128, block_size=32, contiguous=True
)
LONG = 600.0  # a linger no test outlives: what it keeps is kept for the whole test


def config(linger: float, **overrides: object) -> kvasync.Config:
    settings: dict[str, object] = {
        "backend": "host",
        "max_blocks": 64,
        "page_size": PAGE,
        "reserve_pages": (0, 0),
        "linger": linger,
    }
    settings.update(overrides)
    return kvasync.Config(**settings)  # type: ignore[arg-type]


async def test_without_a_linger_emptied_pages_leave_at_once() -> None:
    # The baseline the linger changes: the unmap is decided inside free(), synchronously.
    async with kvasync.open_allocator(LAYOUT, config(0.0)) as kv:
        blocks = await kv.alloc(3 * BLOCKS_PER_PAGE)
        kv.free(blocks)
        stats = kv.stats()
        assert stats.mapped_pages + stats.inflight_pages == 3
        assert stats.inflight_pages > 0 or stats.unmaps_done == 3  # on their way out already
        await wait_until(lambda: kv.stats().mapped_pages == 0 and kv.stats().inflight_pages == 0)


async def test_pages_of_the_peak_stay_mapped_and_serve_the_next_burst_without_a_map() -> None:
    async with kvasync.open_allocator(LAYOUT, config(LONG)) as kv:
        blocks = await kv.alloc(3 * BLOCKS_PER_PAGE)
        maps = kv.stats().maps_done
        kv.free(blocks)
        stats = kv.stats()
        assert (stats.mapped_pages, stats.inflight_pages, stats.unmaps_done) == (3, 0, 0)
        again = kv.alloc_nowait(3 * BLOCKS_PER_PAGE)  # no WouldBlock: all three still mapped
        assert kv.stats().maps_done == maps
        kv.free(again)


async def test_a_peak_reached_again_starts_its_linger_again() -> None:
    # Bursts that each reach the same peak, with gaps far shorter than the linger, for longer
    # than one linger: every burst finds its pages mapped (a linger counted from the first peak
    # alone would lapse halfway and the next burst would miss).
    linger = 2.0
    async with kvasync.open_allocator(LAYOUT, config(linger)) as kv:
        kv.free(await kv.alloc(3 * BLOCKS_PER_PAGE))
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.5 * linger
        bursts = 0
        while loop.time() < end:
            kv.free(kv.alloc_nowait(3 * BLOCKS_PER_PAGE))  # WouldBlock: the linger lapsed
            bursts += 1
            await asyncio.sleep(0.02)  # the gap between bursts (the scenario, not a settle)
        assert bursts > 10
        assert kv.stats().unmaps_done == 0


async def test_the_linger_keeps_the_peak_only_less_what_is_in_use() -> None:
    async with kvasync.open_allocator(LAYOUT, config(LONG)) as kv:
        blocks = await kv.alloc(4 * BLOCKS_PER_PAGE)
        kv.free(blocks[BLOCKS_PER_PAGE:])  # one page stays in use, three linger
        stats = kv.stats()
        assert (stats.mapped_pages, stats.reserve_pages, stats.unmaps_done) == (4, 3, 0)
        kv.free(blocks[:BLOCKS_PER_PAGE])
        assert kv.stats().reserve_pages == 4


async def test_what_lingered_goes_back_once_the_linger_lapses() -> None:
    # The idle mapper re-checks (every 100 ms): no call on the allocator is needed.
    async with kvasync.open_allocator(LAYOUT, config(0.2)) as kv:
        kv.free(await kv.alloc(3 * BLOCKS_PER_PAGE))
        assert kv.stats().mapped_pages == 3
        await wait_until(
            lambda: kv.stats().mapped_pages == 0 and kv.stats().inflight_pages == 0, timeout=10.0
        )
        assert kv.stats().unmaps_done == 3


async def test_trim_gives_back_what_lingers() -> None:
    async with kvasync.open_allocator(LAYOUT, config(LONG)) as kv:
        kv.free(await kv.alloc(3 * BLOCKS_PER_PAGE))
        assert kv.stats().mapped_pages == 3
        await kv.trim(timeout=5.0)
        assert kv.stats().mapped_pages == 0


async def test_a_lowered_limit_unmaps_what_lingers_over_it() -> None:
    async with kvasync.open_allocator(LAYOUT, config(LONG)) as kv:
        kv.free(await kv.alloc(4 * BLOCKS_PER_PAGE))
        assert kv.stats().mapped_pages == 4
        await kv.resize(memory_limit=2 * PAGE * LAYOUT.num_ranges, timeout=5.0)
        await wait_until(lambda: kv.stats().mapped_pages + kv.stats().inflight_pages <= 2)


async def test_a_neighbour_short_of_budget_gets_what_lingers(share: str) -> None:
    # A share of 4 pages: A's peak of 4 lingers; B asks for 2, the share is under pressure,
    # and A's lingering pages go back so B's alloc completes within its deadline.
    budget = {"share": share, "device_budget": 4 * PAGE * LAYOUT.num_ranges}
    async with (
        kvasync.open_allocator(LAYOUT, config(LONG, name="a", **budget)) as a,
        kvasync.open_allocator(LAYOUT, config(0.0, name="b", **budget)) as b,
    ):
        a.free(await a.alloc(4 * BLOCKS_PER_PAGE))
        assert a.stats().mapped_pages == 4
        held = await b.alloc(2 * BLOCKS_PER_PAGE, timeout=10.0)
        assert len(held) == 2 * BLOCKS_PER_PAGE
        assert a.stats().mapped_pages <= 2
        b.free(held)


@pytest.mark.parametrize(
    ("linger", "error"),
    [
        (-1.0, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (86401.0, ValueError),
        (True, TypeError),
        ("1s", TypeError),
    ],
)
def test_config_refuses_a_linger_out_of_range(linger: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"Config\.linger"):
        config(linger)  # type: ignore[arg-type]
