#!/usr/bin/env python3
"""The blocking facade and alloc_nowait against the async allocator they wrap, in one run.

Rows (one op is one alloc plus the free of what it returned; host backend):

* ``async: await alloc(1) + free`` -- the baseline: the asyncio hot path.
* ``facade: alloc(1) + free`` -- the blocking facade's hot path, from a plain thread.
* ``alloc_nowait(1) + free`` -- the synchronous scheduler's call.
* ``cold async`` / ``cold facade`` -- reserve (0, 0): every alloc waits for a map (the facade
  waits on its request's own event, woken by the private loop thread).
* ``grow to the limit`` -- a plain thread retrying alloc_nowait(100) from nothing to a 64-page
  limit: wall time and misses (the pages mapped by the misses).

Hot rows are timed over batches of 200 ops (median of the batch means); cold rows op by op.
Usage: bench/bench_sync.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from _tables import print_table

import kvasync

LAYOUT = kvasync.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)
PAGE_BYTES = (2 << 20) * LAYOUT.num_ranges


def hot_batches(op, batches: int) -> float:
    means = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(200):
            op()
        means.append((time.perf_counter_ns() - start) / 200 / 1000)
    return statistics.median(means)


async def async_rows(batches: int, cold_ops: int) -> dict[str, float]:
    rows = {}
    async with kvasync.open_allocator(LAYOUT, kvasync.Config(backend="host")) as kv:
        kv.free(await kv.alloc(1))
        means = []
        for _ in range(batches):
            start = time.perf_counter_ns()
            for _ in range(200):
                kv.free(await kv.alloc(1))
            means.append((time.perf_counter_ns() - start) / 200 / 1000)
        rows["async: await alloc(1) + free"] = statistics.median(means)
    cfg = kvasync.Config(backend="host", reserve_pages=(0, 0))
    async with kvasync.open_allocator(LAYOUT, cfg) as kv:
        times = []
        for _ in range(cold_ops):
            await wait_unmapped(kv)
            start = time.perf_counter_ns()
            kv.free(await kv.alloc(1))
            times.append((time.perf_counter_ns() - start) / 1000)
        rows["cold async: await alloc(1) + free"] = statistics.median(times)
    return rows


async def wait_unmapped(kv: kvasync.Allocator) -> None:
    deadline = time.monotonic() + 5
    while kv.stats().mapped_pages or kv.stats().inflight_pages:
        if time.monotonic() > deadline:
            raise TimeoutError("the page was not unmapped within 5 s")
        await asyncio.sleep(0.0005)


def sync_rows(batches: int, cold_ops: int) -> dict[str, float]:
    rows = {}
    with kvasync.open_allocator_sync(LAYOUT, kvasync.Config(backend="host")) as kv:
        kv.free(kv.alloc(1))
        rows["facade: alloc(1) + free"] = hot_batches(lambda: kv.free(kv.alloc(1)), batches)
        rows["alloc_nowait(1) + free"] = hot_batches(lambda: kv.free(kv.alloc_nowait(1)), batches)
    cfg = kvasync.Config(backend="host", reserve_pages=(0, 0))
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        times = []
        for _ in range(cold_ops):
            deadline = time.monotonic() + 5
            while kv.stats().mapped_pages or kv.stats().inflight_pages:
                if time.monotonic() > deadline:
                    raise TimeoutError("the page was not unmapped within 5 s")
                time.sleep(0.0005)
            start = time.perf_counter_ns()
            kv.free(kv.alloc(1))
            times.append((time.perf_counter_ns() - start) / 1000)
        rows["cold facade: alloc(1) + free"] = statistics.median(times)
    return rows


def grow() -> tuple[float, int]:
    cfg = kvasync.Config(
        backend="host", max_blocks=128 * 512, memory_limit=64 * PAGE_BYTES, reserve_pages=(0, 0)
    )
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        misses, got = 0, []
        start = time.perf_counter()
        give_up = time.monotonic() + 30
        while kv.available_blocks() >= 100 and time.monotonic() < give_up:
            try:
                got.extend(kv.alloc_nowait(100))
            except kvasync.WouldBlock:
                misses += 1
        elapsed = time.perf_counter() - start
        assert kv.stats().mapped_pages == 64, kv.stats()
        kv.free(got)
    return elapsed, misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches (a smoke run)")
    args = parser.parse_args()
    batches, cold_ops = (10, 20) if args.quick else (50, 200)
    rows = asyncio.run(async_rows(batches, cold_ops))
    rows.update(sync_rows(batches, cold_ops))
    baseline = rows["async: await alloc(1) + free"]
    cold_baseline = rows["cold async: await alloc(1) + free"]
    table = []
    for name, value in rows.items():
        base = cold_baseline if name.startswith("cold") else baseline
        table.append([name, f"{value:.2f}", f"{value / base:.2f}x"])
    print_table(["op", "median µs", "vs baseline"], table)
    elapsed, misses = grow()
    print(
        f"grow to a 64-page limit with alloc_nowait(100) retries: {elapsed * 1e3:.1f} ms, "
        f"{misses} misses"
    )


if __name__ == "__main__":
    main()
