#!/usr/bin/env python3
"""Allocator hot path: kvasync against a pure-Python free-list allocator, in one run.

Rows (one "op" is one alloc plus the free of what it returned):

* ``await alloc(1) + free``: the hot path, enough mapped free blocks, nothing suspends.
* ``await alloc(16) + free``: the same with 16 blocks.
* ``alloc_nowait(1) + free``: the synchronous variant.
* ``cold await alloc(1) + free``: reserve (0, 0), so each alloc waits for the mapper to map a page
  and each free queues its unmap (kvasync only: a free list has no memory to map).

Latency is timed with ``time.perf_counter_ns`` around batches of ops (hot rows: 100 ops a batch,
so the timer's own cost is amortised) and divided by the batch; p50/p99 are over those per-batch
means. The cold rows time each op on its own (an op is tens of µs; the timer is ~0.05 µs).
kvasync and the baseline are measured alternately, in rounds, by the same loop.

Usage: bench/bench_alloc.py [--backend host|cuda|auto] [--layout small|kvcached] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import platform
import statistics
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import _tables as tables
import torch

import kvasync
from kvasync._stats import percentile

MIB = 1 << 20
GRANULARITY = 2 * MIB  # the CUDA driver's mapping granularity on current GPUs; a multiple of 4 KiB

LAYOUTS = {
    # The tests' small layout: 4 KiB blocks per buffer, 512 blocks per 2 MiB page.
    "small": kvasync.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16),
    # kvcached's geometry: 32 layers, K and V, 16 tokens x 8 heads x 128 x fp16, block-major.
    "kvcached": kvasync.KVLayout(
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.float16,
        contiguous=True,
    ),
}


# -- the baseline ------------------------------------------------------------------------------


class FreeListAllocator:
    """A pure-Python block allocator with kvasync's API shape: the baseline.

    A stack of free block ids (lowest on top), a bytearray of allocation flags so that ``free``
    validates ids as kvasync does (in range, allocated, not repeated; nothing freed on error), and
    first-come-first-served waiters on futures with a deadline timer. No memory behind the ids.
    """

    def __init__(self, num_blocks: int, default_timeout: float = 5.0) -> None:
        self._loop = asyncio.get_running_loop()
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used = bytearray(num_blocks)
        self._waiters: deque[tuple[int, asyncio.Future[list[int]]]] = deque()
        self._default_timeout = default_timeout

    async def alloc(self, n: int, *, timeout: float | None = None) -> list[int]:
        if type(n) is not int or n <= 0:
            raise ValueError(f"the number of blocks must be positive, got {n!r}")
        due = self._loop.time() + (self._default_timeout if timeout is None else timeout)
        free = self._free
        if n <= len(free) and not self._waiters:
            return self._take(n)
        if n > len(self._used):
            raise kvasync.OutOfBlocks(f"alloc of {n} blocks can never fit")
        return await self._wait(n, due)

    def alloc_nowait(self, n: int) -> list[int]:
        if type(n) is not int or n <= 0:
            raise ValueError(f"the number of blocks must be positive, got {n!r}")
        if n <= len(self._free) and not self._waiters:
            return self._take(n)
        raise kvasync.WouldBlock(f"{n} free blocks are not available now")

    def free(self, ids: Sequence[int]) -> None:
        used = self._used
        for k, block in enumerate(ids):
            if not 0 <= block < len(used) or used[block] != 1:
                for earlier in ids[:k]:
                    used[earlier] = 1
                raise ValueError(f"free: block {block} is not allocated; nothing was freed")
            used[block] = 2  # "seen": catches an id repeated in ids
        for block in ids:
            used[block] = 0
        self._free.extend(ids)
        if self._waiters:
            self._serve_waiters()

    def _take(self, n: int) -> list[int]:
        free = self._free
        ids = free[-n:]
        del free[-n:]
        used = self._used
        for block in ids:
            used[block] = 1
        return ids

    async def _wait(self, n: int, due: float) -> list[int]:
        future: asyncio.Future[list[int]] = self._loop.create_future()
        entry = (n, future)
        self._waiters.append(entry)
        timer = self._loop.call_at(due, self._expire, entry)
        try:
            return await future
        finally:
            timer.cancel()

    def _expire(self, entry: tuple[int, asyncio.Future[list[int]]]) -> None:
        if not entry[1].done():
            self._waiters.remove(entry)
            entry[1].set_exception(kvasync.AllocTimeout(f"alloc of {entry[0]} blocks timed out"))
            self._serve_waiters()

    def _serve_waiters(self) -> None:
        while self._waiters and self._waiters[0][0] <= len(self._free):
            n, future = self._waiters.popleft()
            if not future.done():
                future.set_result(self._take(n))


# -- measuring ---------------------------------------------------------------------------------


AllocFn = Callable[[int], Awaitable[list[int]]]
FreeFn = Callable[[Sequence[int]], None]


async def time_awaited(alloc: AllocFn, free: FreeFn, n: int, batch: int, batches: int) -> list[int]:
    """Per-op nanoseconds of ``free(await alloc(n))``, one mean per batch."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(batches):
        start = clock()
        for _ in range(batch):
            free(await alloc(n))
        out.append((clock() - start) // batch)
    return out


async def time_nowait(
    alloc_nowait: Callable[[int], list[int]], free: FreeFn, n: int, batch: int, batches: int
) -> list[int]:
    """Per-op nanoseconds of ``free(alloc_nowait(n))``, one mean per batch."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(batches):
        start = clock()
        for _ in range(batch):
            free(alloc_nowait(n))
        out.append((clock() - start) // batch)
    return out


@dataclass
class Figures:
    samples: list[int]
    batch: int

    @property
    def ops(self) -> int:
        return len(self.samples) * self.batch

    def p(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the per-op samples, in µs."""
        return percentile(self.samples, q) / 1000

    @property
    def ops_per_s(self) -> float:
        return 1e9 / statistics.fmean(self.samples)


Measure = Callable[[int], Awaitable[list[int]]]  # batches -> per-op ns samples


async def measure_alternately(
    measures: Sequence[Measure], batches: int, warmup: int, rounds: int
) -> list[list[int]]:
    """Runs each measure for ``batches`` in ``rounds`` turns, alternating, after a warm-up."""
    for measure in measures:
        await measure(warmup)
    samples: list[list[int]] = [[] for _ in measures]
    per_round = max(1, batches // rounds)
    for _ in range(rounds):
        for measure, out in zip(measures, samples, strict=True):
            gc.collect()
            out.extend(await measure(per_round))
    return samples


# -- the run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    batch: int  # ops per timed batch on the hot rows
    batches: int  # timed batches per hot row and implementation
    cold_ops: int
    warmup: int  # batches
    rounds: int


def hot_config(backend: str, layout: kvasync.KVLayout, page_size: int) -> kvasync.Config:
    """Enough capacity for 16 blocks, and a reserve high enough that freed pages stay mapped."""
    per_page = layout.blocks_per_page(page_size)
    pages_for_16 = -(-16 // per_page)
    return kvasync.Config(
        backend=backend,
        max_blocks=max(64, 4 * per_page),
        page_size=page_size,
        reserve_pages=(1, pages_for_16 + 1),
    )


async def run(args: argparse.Namespace) -> list[tuple[str, Figures, Figures | None]]:
    layout = LAYOUTS[args.layout]
    page_size = math.lcm(layout.range_block_bytes, GRANULARITY)
    plan = (
        Plan(batch=100, batches=500, cold_ops=300, warmup=50, rounds=2)
        if args.quick
        else Plan(batch=100, batches=5000, cold_ops=3000, warmup=500, rounds=5)
    )
    config = hot_config(args.backend, layout, page_size)
    rows: list[tuple[str, Figures, Figures | None]] = []
    async with kvasync.open_allocator(layout, config) as kv:
        baseline = FreeListAllocator(config.max_blocks)
        print_header(args, kv, plan)
        for n in (1, 16):
            kv.free(await kv.alloc(n, timeout=10.0))  # map the pages once; they stay mapped

            def awaited(impl: kvasync.Allocator | FreeListAllocator, n: int = n) -> Measure:
                return lambda k: time_awaited(impl.alloc, impl.free, n, plan.batch, k)

            ours, theirs = await measure_alternately(
                [awaited(kv), awaited(baseline)], plan.batches, plan.warmup, plan.rounds
            )
            rows.append(
                (f"await alloc({n}) + free", Figures(ours, plan.batch), Figures(theirs, plan.batch))
            )

        def nowait(impl: kvasync.Allocator | FreeListAllocator) -> Measure:
            return lambda k: time_nowait(impl.alloc_nowait, impl.free, 1, plan.batch, k)

        ours, theirs = await measure_alternately(
            [nowait(kv), nowait(baseline)], plan.batches, plan.warmup, plan.rounds
        )
        rows.append(
            ("alloc_nowait(1) + free", Figures(ours, plan.batch), Figures(theirs, plan.batch))
        )
        assert kv.stats().used_blocks == 0, "bench bug: blocks left allocated"

    cold = kvasync.Config(
        backend=args.backend,
        max_blocks=config.max_blocks,
        page_size=page_size,
        reserve_pages=(0, 0),
        default_timeout=10.0,
    )
    async with kvasync.open_allocator(layout, cold) as kv:
        await time_awaited(kv.alloc, kv.free, 1, 1, plan.cold_ops // 10)  # warm-up
        before = kv.stats()
        samples = await time_awaited(kv.alloc, kv.free, 1, 1, plan.cold_ops)
        after = kv.stats()
    maps = (after.maps_done - before.maps_done) / plan.cold_ops
    unmaps = (after.unmaps_done - before.unmaps_done) / plan.cold_ops
    rows.append(
        (
            f"cold await alloc(1) + free [{maps:.2f} map, {unmaps:.2f} unmap /op]",
            Figures(samples, 1),
            None,
        )
    )
    return rows


def print_header(args: argparse.Namespace, kv: kvasync.Allocator, plan: Plan) -> None:
    layout = kv.layout
    print("kvasync allocator hot path vs a pure-Python free-list allocator (same run)")
    print(
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(f"backend: {kv.backend} (asked: {args.backend})")
    print(
        f"layout:  {args.layout}: {layout.num_layers} layers x {layout.kv_buffers} buffers, "
        f"block {layout.block_size} tokens x {layout.num_kv_heads} heads x {layout.head_dim} "
        f"x {layout.dtype}, {'contiguous' if layout.contiguous else 'per-layer'}; "
        f"page_size {kv.page_size // 1024} KiB -> "
        f"{layout.blocks_per_page(kv.page_size)} block(s)/page"
    )
    print(
        f"timing:  perf_counter_ns around batches of {plan.batch} ops (hot rows), per-op mean of "
        f"each batch; {plan.batches} batches per row and implementation after {plan.warmup} "
        f"warm-up batches, alternating in {plan.rounds} rounds; cold row: each op timed alone, "
        f"{plan.cold_ops} ops, reserve (0, 0)"
    )
    print()


def print_table(rows: list[tuple[str, Figures, Figures | None]]) -> None:
    def fmt(f: Figures | None) -> list[str]:
        if f is None:
            return ["-", "-", "-"]
        return [f"{f.p(50):.2f}", f"{f.p(99):.2f}", f"{f.ops_per_s:,.0f}"]

    head = [
        "op (alloc + free)",
        "kvasync p50 µs",
        "p99 µs",
        "ops/s",
        "baseline p50 µs",
        "p99 µs",
        "ops/s",
        "p50 speed-up",
    ]
    body = []
    for name, ours, theirs in rows:
        ratio = f"{theirs.p(50) / ours.p(50):.2f}x" if theirs else "-"
        body.append([name, *fmt(ours), *fmt(theirs), ratio])
    tables.print_table(head, body)
    hot = rows[0][1].p(50)
    verdict = "met" if hot <= 2.0 else "NOT met"
    print(f"\ngoal: kvasync await alloc(1) + free p50 <= 2 µs: {verdict} ({hot:.2f} µs)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("host", "cuda", "auto"), default="host")
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default="small")
    parser.add_argument("--quick", action="store_true", help="a short run (a tenth of the ops)")
    args = parser.parse_args(argv)
    try:
        rows = asyncio.run(run(args))
    except kvasync.KVAsyncError as error:
        print(f"bench_alloc: {error}", file=sys.stderr)
        return 2
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
