"""A fresh allocator joining a busy share: its first block is block 0 (vLLM's null block).

Seen on the H200 (seed A, 2 of 10 starts): a second vLLM engine starting beside a busy one in an
8 GiB share got its first blocks from another page than page 0. A CPU stress of the same shape
(a first allocator churning at the share's budget, fresh allocators with a vLLM-like reserve
opening beside it and asking for one block; map delays of 1-5 ms) gave a first block off page 0
in about 1 start in 20, always by one of the two sequences pinned here. Both are the drain
(Note [Limit policy] in csrc/pool/limit_policy.h) under a fair share that fell while the fresh
pool's first maps were in flight: it counted only the pages already mapped, so the page 0 that
landed first was drained in place of a higher page still mapping, unmapped at once while the
alloc waited for it, and the alloc was served from the higher page landing next.

One start in that stress (with the ledger's lock taken now and then) went another way: the
alloc's map of page 0 was queued uncharged while the lock was busy, a refill planned once the
lock was free took the budget first, and page 0 was refused (Note [Budget off the caller's
thread] in csrc/pool/page_pool.h). The last test pins that.

Real ledger file, real host backend, and a real process holding the ledger's lock; the faults hold
or slow a map in the mapper to order the landings.
"""

from __future__ import annotations

import asyncio
import select
import subprocess
from collections.abc import Callable

import torch
from conftest import ledger_lock_taken, wait_until

import kvasync
from kvasync.testing import FaultInjector

DEADLINE = 10.0
LAYOUT = kvasync.KVLayout(1, 1, 256, 16, dtype=torch.int8, kv_buffers=1)  # 4 KiB blocks
PAGE = 64 << 10
BLOCKS_PER_PAGE = 16
BUDGET_PAGES = 8


def member_config(
    share: str, reserve: tuple[int, int], faults: FaultInjector | None = None
) -> kvasync.Config:
    return kvasync.Config(
        backend="host",
        max_blocks=BUDGET_PAGES * BLOCKS_PER_PAGE,
        page_size=PAGE,
        reserve_pages=reserve,
        share=share,
        device_budget=BUDGET_PAGES * PAGE,
        default_timeout=DEADLINE,
        faults=faults,
    )


async def squeeze_to_one_page(busy: kvasync.Allocator, fresh: kvasync.Allocator) -> None:
    """The busy member wants the whole budget: the fresh one, wanting one block, is held to a
    fair share of one page (Note [Fair share under pressure] in csrc/ledger/ledger.h)."""
    busy.set_demand(BUDGET_PAGES * BLOCKS_PER_PAGE)
    await wait_until(lambda: fresh.stats().memory_limit_pages == 1, DEADLINE)


async def test_the_first_block_is_0_when_the_fair_share_falls_as_the_reserve_lands(
    share: str,
) -> None:
    # The reserve's refill (pages 0 and 1) is in flight when the first alloc comes, which maps a
    # page of its own (page 2; a refill is never counted on). The fair share then falls to one
    # page, and the refill lands over it. The drain took pages 0 and 1 (the only pages mapped),
    # unmapped them, and served the alloc from page 2: block 32.
    faults = FaultInjector()
    async with kvasync.open_allocator(LAYOUT, member_config(share, (0, 0))) as busy:
        faults.hang()
        async with kvasync.open_allocator(LAYOUT, member_config(share, (2, 2), faults)) as fresh:
            await wait_until(lambda: fresh.stats().mapper_op == "refill of 2 page(s)", DEADLINE)
            first = asyncio.create_task(fresh.alloc(1, timeout=DEADLINE))
            await wait_until(
                lambda: fresh.stats().waiters == 1 and fresh.stats().queued_jobs == 1, DEADLINE
            )
            assert fresh.stats().mapping_pages == 3  # pages 0 and 1, and page 2 for the alloc
            await squeeze_to_one_page(busy, fresh)
            faults.release()  # the refill lands, then page 2
            assert await first == [0]
            # Page 2 landed too (the race was run), over the limit: it goes back.
            await wait_until(lambda: fresh.stats().maps_done == 3, DEADLINE)
            await wait_until(lambda: fresh.stats().mapped_pages == 1, DEADLINE)
            fresh.free([0])


async def test_the_first_block_is_0_when_the_fair_share_falls_as_its_own_page_lands(
    share: str,
) -> None:
    # The busy member holds the whole budget when the fresh one opens: its refill is refused and
    # its first alloc waits. Once the busy one lets go, one tick maps page 0 for the alloc and
    # refills pages 1 and 2. The fair share falls to one page while page 0 maps; it lands over
    # the limit, the only page mapped: the drain took it, unmapped it at once with the alloc
    # waiting for it, and the refill's page 1 served the alloc: block 16.
    faults = FaultInjector()
    async with kvasync.open_allocator(LAYOUT, member_config(share, (0, 0))) as busy:
        held = await busy.alloc(BUDGET_PAGES * BLOCKS_PER_PAGE, timeout=DEADLINE)
        async with kvasync.open_allocator(LAYOUT, member_config(share, (2, 2), faults)) as fresh:
            assert fresh.stats().mapping_pages == 0  # no budget for a refill
            first = asyncio.create_task(fresh.alloc(1, timeout=DEADLINE))
            await wait_until(lambda: fresh.stats().waiters == 1, DEADLINE)
            faults.hang()
            busy.free(held)
            await busy.trim(timeout=DEADLINE)
            await wait_until(
                lambda: (
                    faults.hung_maps == 1
                    and fresh.stats().mapper_op == "map of 1 page(s)"
                    and fresh.stats().mapping_pages == 3
                ),
                DEADLINE,
            )
            await squeeze_to_one_page(busy, fresh)
            faults.release()  # page 0 lands, then the refill
            assert await first == [0]
            await wait_until(lambda: fresh.stats().maps_done == 3, DEADLINE)
            await wait_until(lambda: fresh.stats().mapped_pages == 1, DEADLINE)
            fresh.free([0])


def page_blocks(blocks: list[int], page: int) -> list[int]:
    return [b for b in blocks if b // BLOCKS_PER_PAGE == page]


async def test_a_refill_never_takes_the_budget_a_map_queued_uncharged_waits_for(
    share: str, lock_holder: Callable[[], subprocess.Popen[str]]
) -> None:
    faults = FaultInjector()
    async with kvasync.open_allocator(LAYOUT, member_config(share, (0, 0))) as busy:
        held = await busy.alloc(BUDGET_PAGES * BLOCKS_PER_PAGE, timeout=DEADLINE)
        faults.delay(600.0)  # every map of the fresh pool stays in the mapper until released
        async with kvasync.open_allocator(LAYOUT, member_config(share, (1, 2), faults)) as fresh:
            assert fresh.stats().mapping_pages == 0  # the whole budget is the busy one's
            first = asyncio.create_task(fresh.alloc(BLOCKS_PER_PAGE, timeout=DEADLINE))
            await wait_until(lambda: fresh.stats().waiters == 1, DEADLINE)
            # One page comes back: page 0 is charged for the first alloc, its map held.
            busy.free(page_blocks(held, 0))
            await wait_until(lambda: fresh.stats().mapper_op == "map of 1 page(s)", DEADLINE)

            holder = lock_holder()
            assert holder.stdout is not None
            ready, _, _ = select.select([holder.stdout], [], [], DEADLINE)
            assert ready and holder.stdout.readline().strip() == "taking"
            await wait_until(lambda: ledger_lock_taken(share), DEADLINE)
            # Two pages more come back while the lock is held; nothing can be charged.
            busy.free(page_blocks(held, 1) + page_blocks(held, 2))
            await wait_until(lambda: busy.stats().mapped_pages == 5, DEADLINE)
            await wait_until(lambda: busy.stats().inflight_pages == 0, DEADLINE)
            # The second alloc needs page 1: its map is queued uncharged, behind page 0's.
            second = asyncio.create_task(fresh.alloc(1, timeout=DEADLINE))
            await wait_until(
                lambda: fresh.stats().waiters == 2 and fresh.stats().queued_jobs == 1, DEADLINE
            )
            holder.kill()
            holder.wait(timeout=DEADLINE)
            await wait_until(lambda: not ledger_lock_taken(share), DEADLINE)
            # The lock is free: this alloc plans a refill on this thread (its own blocks are on
            # their way). It took the two pages left, and page 1 was refused: the second alloc
            # came from the refill's page 2 (block 32).
            third = asyncio.create_task(fresh.alloc(1, timeout=DEADLINE))
            await wait_until(lambda: fresh.stats().waiters == 3, DEADLINE)
            faults.release()
            assert sorted(await first) == list(range(BLOCKS_PER_PAGE))
            assert await second == [BLOCKS_PER_PAGE]
            assert await third == [BLOCKS_PER_PAGE + 1]
