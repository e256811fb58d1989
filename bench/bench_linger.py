#!/usr/bin/env python3
"""The linger (``Config.linger``) against none, on a load in rounds with short idle gaps.

An engine's scheduler grows its KV use step by step through a round (``alloc_nowait`` of a
step's blocks, as vLLM's scheduler does: a ``WouldBlock`` is a miss, and the step passes with
fewer blocks), frees everything at the round's end, stays idle for ``--gap-ms``, and starts the
next round. Without a linger the pages emptied at the gap beyond the reserve's high watermark are
unmapped at once, so every round maps them again while admitting; with one they stay mapped.
Both allocators are open at once and measured in turn, round by round, by the same loop.

Per variant: the pages mapped when a round starts, the maps and unmaps a round makes, the
steps a round takes to reach its peak (the floor is peak / step blocks: an allocator with
everything mapped), the misses a round, and the round's wall time. On the host backend a map is
a memfd page (microseconds), so misses are few and the maps a round is the figure that carries
to a GPU, where a map of a 16-layer model's page costs milliseconds (bench/results/2026-12-03.md:
vLLM's 1.4 s rounds grew mapped KV from 2 to 6 GiB each round).

Usage: bench/bench_linger.py [--backend host|cuda] [--rounds 20] [--gap-ms 50] [--linger 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field

import _tables as tables

import kvasync

PAGE = 2 << 20
LAYOUT = kvasync.KVLayout(
    num_layers=4, num_kv_heads=8, head_dim=128, block_size=32, contiguous=True
)


@dataclass
class Variant:
    name: str
    kv: kvasync.Allocator
    mapped_at_start: list[int] = field(default_factory=list)
    maps: list[int] = field(default_factory=list)
    unmaps: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    peak_pages: int = 0


async def one_round(variant: Variant, args: argparse.Namespace) -> None:
    kv = variant.kv
    before = kv.stats()
    variant.mapped_at_start.append(before.mapped_pages)
    held: list[int] = []
    steps = misses = 0
    started = time.perf_counter()
    deadline = started + 10.0  # a round that cannot reach its peak is a failure, not a hang
    while len(held) < args.peak_blocks:
        steps += 1
        want = min(args.step_blocks, args.peak_blocks - len(held))
        try:
            held += kv.alloc_nowait(want)
        except kvasync.WouldBlock:
            misses += 1
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{variant.name}: a round did not reach its peak within 10 s")
        await asyncio.sleep(args.step_ms / 1000)  # the step's forward pass
    for _ in range(args.hold_steps):  # decode at the peak
        await asyncio.sleep(args.step_ms / 1000)
    variant.seconds.append(time.perf_counter() - started)
    variant.peak_pages = max(variant.peak_pages, kv.stats().mapped_pages)
    kv.free(held)
    after = kv.stats()
    variant.maps.append(after.maps_done - before.maps_done)
    variant.steps.append(steps)
    variant.misses.append(misses)
    await asyncio.sleep(args.gap_ms / 1000)  # idle: nothing in use
    variant.unmaps.append(kv.stats().unmaps_done - after.unmaps_done)


async def main(args: argparse.Namespace) -> None:
    def config(linger: float) -> kvasync.Config:
        return kvasync.Config(
            backend=args.backend,
            max_blocks=args.peak_blocks + 64,
            page_size=PAGE,
            reserve_pages=(1, 2),
            linger=linger,
        )

    async with (
        kvasync.open_allocator(LAYOUT, config(0.0)) as none,
        kvasync.open_allocator(LAYOUT, config(args.linger)) as lingering,
    ):
        variants = [Variant("no linger", none), Variant(f"linger {args.linger:g} s", lingering)]
        for index in range(args.rounds):
            order = variants if index % 2 == 0 else variants[::-1]
            for variant in order:
                await one_round(variant, args)
    floor = -(-args.peak_blocks // args.step_blocks)
    rows = []
    for v in variants:
        later = slice(1, None)  # the first round maps from nothing in both
        rows.append(
            [
                v.name,
                f"{statistics.median(v.mapped_at_start[later]):.0f}",
                f"{statistics.fmean(v.maps[later]):.1f}",
                f"{statistics.fmean(v.unmaps[later]):.1f}",
                f"{statistics.fmean(v.steps[later]):.1f}",
                f"{statistics.fmean(v.misses[later]):.2f}",
                f"{statistics.median(v.seconds[later]) * 1000:.1f}",
            ]
        )
    print(
        f"\n{args.rounds} rounds each, {args.backend} backend, a peak of {args.peak_blocks} blocks "
        f"(up to {max(v.peak_pages for v in variants)} pages mapped, "
        f"{PAGE >> 20} MiB each) grown by {args.step_blocks} a {args.step_ms:g} ms step, held "
        f"{args.hold_steps} steps, {args.gap_ms:g} ms idle between rounds (rounds after the "
        f"first; the floor of steps to the peak: {floor})\n"
    )
    tables.print_table(
        [
            "allocator",
            "pages mapped at a round's start (median)",
            "maps a round",
            "unmaps a round",
            "steps to the peak",
            "misses a round",
            "round ms (median)",
        ],
        rows,
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="host", choices=("host", "cuda"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--peak-blocks", type=int, default=256, help="blocks in use at the peak")
    parser.add_argument("--step-blocks", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--hold-steps", type=int, default=20)
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--linger", type=float, default=2.0)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
