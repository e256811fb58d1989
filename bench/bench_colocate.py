#!/usr/bin/env python3
"""Two co-located engines with alternating bursts: one shared budget against two static halves.

Two processes run the same schedule on one device, offset by half a period: each burst allocates
its demand (75% of the budget, more than half) in steps, holds it, then frees it all; the other
process's burst starts before this one's ends, so it must wait for memory the first frees.

* ``shared``: both join one share (``Config(share=..., device_budget=budget)``): each may map up
  to the whole budget as long as the two together stay within it.
* ``static halves`` (the baseline, same run): no share; each has ``memory_limit=budget/2``. An
  alloc beyond the half can never be served.

Per mode: how much of each burst's demand was served, how long a burst took to reach its demand,
the wait of allocs that needed memory the other process was releasing (from the other's free to
this alloc's completion: the cross-process wake-up), and the memory each process held over time
(mean and peak, from the ledger sampled every 5 ms), with the peak of their sum.

Usage: bench/bench_colocate.py [--backend host|cuda] [--budget-mib 64] [--cycles 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from _tables import print_table

import kvasync
from kvasync import share as ledger
from kvasync._stats import percentile

LAYOUT = kvasync.KVLayout(
    num_layers=4, num_kv_heads=8, head_dim=128, block_size=32, contiguous=True
)
PAGE = 2 << 20  # 4 blocks of 512 KiB per page
BLOCKS_PER_PAGE = 4
STEPS = 8  # allocs per burst


# -- one engine (child process) ----------------------------------------------------------------


async def engine(args: argparse.Namespace) -> dict[str, Any]:
    budget = args.budget_mib << 20
    budget_pages = budget // PAGE
    demand_blocks = int(budget_pages * 0.75) * BLOCKS_PER_PAGE
    step = demand_blocks // STEPS
    if args.mode == "shared":
        config = kvasync.Config(
            backend=args.backend,
            max_blocks=budget_pages * BLOCKS_PER_PAGE,
            page_size=PAGE,
            reserve_pages=(1, 2),
            share=args.share,
            device_budget=budget,
            name=args.role,
        )
    else:
        config = kvasync.Config(
            backend=args.backend,
            max_blocks=budget_pages * BLOCKS_PER_PAGE,
            page_size=PAGE,
            reserve_pages=(1, 2),
            memory_limit=budget // 2,
            share=args.share,  # no device_budget: the ledger only watches (the bench samples it)
            name=args.role,
        )
    offset = 0.0 if args.role == "A" else args.period / 2
    report: dict[str, Any] = {"bursts": [], "allocs": [], "frees": []}
    async with kvasync.open_allocator(LAYOUT, config) as kv:
        print(json.dumps({"ready": True}), flush=True)
        loop = asyncio.get_running_loop()
        args.start = float(await loop.run_in_executor(None, sys.stdin.readline))

        for cycle in range(args.cycles):
            begin = args.start + cycle * args.period + offset
            await asyncio.sleep(max(0.0, begin - time.monotonic()))
            held: list[list[int]] = []
            failures = 0
            for _ in range(STEPS):
                asked = time.monotonic()
                # A burst waits at most until its end: then it frees whatever it got.
                remaining = max(0.01, begin + args.burst - asked)
                try:
                    held.append(await kv.alloc(step, timeout=remaining))
                except (kvasync.AllocTimeout, kvasync.OutOfBlocks):
                    failures += 1
                    continue
                report["allocs"].append((asked, time.monotonic()))
            filled = time.monotonic() - begin
            served = sum(len(blocks) for blocks in held)
            report["bursts"].append(
                {"served": served / demand_blocks, "fill_s": filled, "failed": failures}
            )
            await asyncio.sleep(max(0.0, begin + args.burst - time.monotonic()))
            report["frees"].append(time.monotonic())
            for blocks in held:
                kv.free(blocks)
    return report


# -- the parent --------------------------------------------------------------------------------


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    share = f"bench-{uuid.uuid4().hex[:10]}"
    children = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                role,
                "--mode",
                mode,
                "--share",
                share,
                "--backend",
                args.backend,
                "--budget-mib",
                str(args.budget_mib),
                "--cycles",
                str(args.cycles),
                "--period",
                str(args.period),
                "--burst",
                str(args.burst),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for role in ("A", "B")
    ]
    for child in children:  # both are up (kvasync imported, allocator open): start together
        assert child.stdout is not None and json.loads(child.stdout.readline())["ready"]
    start = time.monotonic() + 0.2
    timeout = args.cycles * args.period + 60
    for child in children:  # both before either is waited for
        assert child.stdin is not None
        child.stdin.write(f"{start}\n")
        child.stdin.close()
    # The ledger, sampled from here every 5 ms: each snapshot is taken under its lock, so the
    # two entries of one sample are from the same instant.
    samples: list[tuple[int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                snapshot = ledger.snapshot(share)
            except kvasync.KVAsyncError:  # the file went with the last member: nothing held
                break
            held = {e.name: e.committed_bytes for e in snapshot}
            samples.append((held.get("A", 0), held.get("B", 0)))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    reports = []
    try:
        for child in children:
            assert child.stdout is not None
            reports.append(json.loads(child.stdout.read()))
            child.stdout.close()
            child.wait(timeout=timeout)
    finally:
        done.set()
        sampler.join(timeout=10)
    path = ledger.path(share)
    if os.path.exists(path):
        os.unlink(path)
    return summarize(args, reports, samples)


def summarize(
    args: argparse.Namespace, reports: list[dict[str, Any]], samples: list[tuple[int, int]]
) -> dict[str, Any]:
    budget = args.budget_mib << 20
    bursts = [b for r in reports for b in r["bursts"]]
    # Waits for the other's memory: an alloc that completed after a free of the other process
    # that came after the alloc was asked (it could not be served before that free).
    wake_ms, waits_ms = [], []
    for me, other in ((0, 1), (1, 0)):
        frees = reports[other]["frees"]
        for asked, done in reports[me]["allocs"]:
            waits_ms.append((done - asked) * 1e3)
            released = [t for t in frees if asked < t <= done]
            if released:
                wake_ms.append((done - released[-1]) * 1e3)
    held = [[pair[i] for pair in samples] for i in (0, 1)]
    peak_sum = max(a + b for a, b in samples)
    return {
        "served": statistics.mean(b["served"] for b in bursts),
        "failed": sum(b["failed"] for b in bursts),
        "fill_p50": percentile([b["fill_s"] for b in bursts], 50) * 1e3,
        "fill_p99": percentile([b["fill_s"] for b in bursts], 99) * 1e3,
        "wait_p50": percentile(waits_ms, 50),
        "wait_p99": percentile(waits_ms, 99),
        "wake_n": len(wake_ms),
        "wake_p50": percentile(wake_ms, 50),
        "wake_max": max(wake_ms) if wake_ms else float("nan"),
        "held_mean": [statistics.mean(h) / budget for h in held],
        "held_peak": [max(h) / budget for h in held],
        "peak_sum": peak_sum / budget,
        "samples": len(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="host", choices=("host", "cuda"))
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--period", type=float, default=0.5, help="seconds per cycle")
    parser.add_argument("--burst", type=float, default=0.3, help="seconds a burst holds")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="shared", help=argparse.SUPPRESS)
    parser.add_argument("--share", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.role = args.child
        print(json.dumps(asyncio.run(engine(args))))
        return
    budget_pages = (args.budget_mib << 20) // PAGE
    print(
        f"bench_colocate: backend={args.backend}, budget {args.budget_mib} MiB "
        f"({budget_pages} pages of 2 MiB), 2 processes, {args.cycles} cycles of "
        f"{args.period * 1e3:.0f} ms, bursts of {int(budget_pages * 0.75)} pages held "
        f"{args.burst * 1e3:.0f} ms, offset by half a period"
    )
    results = {mode: run_mode(args, mode) for mode in ("shared", "static")}
    columns = [
        "mode",
        "demand served",
        "allocs failed",
        "burst fill p50 / p99 (ms)",
        "alloc wait p50 / p99 (ms)",
        "waits on the other's free: n, p50 / max (ms)",
        "held mean A / B",
        "held peak A / B",
        "peak A+B",
    ]
    rows = []
    for mode, r in results.items():
        name = "one shared budget" if mode == "shared" else "static halves (baseline)"
        # Static halves never wait for the other's memory: a coincidence in time is no wait.
        wake = (
            f"{r['wake_n']}, {r['wake_p50']:.2f} / {r['wake_max']:.2f}" if mode == "shared" else "-"
        )
        rows.append(
            [
                name,
                f"{r['served']:.0%}",
                f"{r['failed']}",
                f"{r['fill_p50']:.1f} / {r['fill_p99']:.1f}",
                f"{r['wait_p50']:.2f} / {r['wait_p99']:.2f}",
                wake,
                f"{r['held_mean'][0]:.0%} / {r['held_mean'][1]:.0%}",
                f"{r['held_peak'][0]:.0%} / {r['held_peak'][1]:.0%}",
                f"{r['peak_sum']:.0%}",
            ]
        )
    print_table(columns, rows)
    print(
        "held: memory committed (mapping, mapped, unmapping) as a share of the budget, from the "
        f"ledger sampled every 5 ms ({results['shared']['samples']} samples with one budget)"
    )


if __name__ == "__main__":
    main()
