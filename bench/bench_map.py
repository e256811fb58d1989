"""The cold path on the cuda backend, beside the bare driver's floor measured in the same run.

1. The driver's floor per handle size (2 .. 512 MiB): create + map + access of one handle (a
   cold map), map + access of an existing one (a pooled map), unmap, release. C++ calls in a
   loop, no allocator (``_core.cuda_driver_floor``).
2. The allocator, through its public API, on the reference geometry (32 layers, K and V, 16
   tokens x 8 heads x 128 x fp16): both layouts, the default page size and explicit ones.
   - hot: awaited alloc + free of 1 block whose page is mapped;
   - fresh: an awaited alloc of 1 block that needs one fresh page (reserve (0, 0), after a trim);
     "idle": the same after 20 ms without work (the mapper asleep); "pooled": its handles pooled
     (``trim(release_handles=False)``);
   - cycle: alloc + free + trim of 128 MiB of blocks, per MiB; "pooled" keeps the handles;
   - burst: an alloc of 16 GiB of blocks from nothing (a new allocator, median of 5).
   Each beside its floor: the bare driver calls for the same handles, on a reservation as large
   as the allocator's, sampled between the allocator's runs (the driver's speed drifts within a
   run) and reduced the same way (medians).
3. Where the time of a fresh alloc goes, from the core's trace points (csrc/common/trace.h).
4. The reference allocator's figures (kvcached e8e6406, from issue 8): measured on the same GPU
   model on 2026-11-30, NOT in this run.

Usage: python bench/bench_map.py [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from _tables import print_table

import kvasync
from kvasync import _core

MIB = 1 << 20
US = 1e6
HANDLE_MIB = (2, 8, 32, 128, 512)
GEOMETRY = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
BLOCK_MIB = 2  # one block across all 64 buffers of the geometry
CYCLE_BLOCKS = 64  # 128 MiB
BURST_BLOCKS = 8192  # 16 GiB
IDLE_S = 0.02
# kvcached e8e6406 (defaults, prealloc and caching off) on an H200, driver 580.159, 2026-11-30,
# from issue 8: NOT measured in this run.
REFERENCE = {"cycle_us": 202.0, "burst_ms": 11.0, "fresh_us": 85.0, "hot_us": 37.3}
# kvasync before this work, same issue and machine (page_size 2 MiB default / 128 MiB).
BEFORE = {
    "contiguous 2 MiB": {"cycle_us": 3502.0, "burst_ms": 569.0, "fresh_us": 106.0, "hot_us": 1.57},
    "contiguous 128 MiB": {"cycle_us": 227.0, "burst_ms": 19.5, "fresh_us": 203.0, "hot_us": 1.48},
}


@dataclass(frozen=True)
class Case:
    name: str
    contiguous: bool
    page_size: int | None  # None: the default

    def layout(self) -> kvasync.KVLayout:
        return kvasync.KVLayout(**GEOMETRY, contiguous=self.contiguous)


CASES = (
    Case("contiguous, default", True, None),
    Case("contiguous 2 MiB", True, 2 * MIB),
    Case("contiguous 512 MiB", True, 512 * MIB),
    Case("per-layer, default", False, None),
    Case("per-layer 8 MiB", False, 8 * MIB),
)


def median(values: list[float]) -> float:
    return statistics.median(values)


def driver_floors(repeats: int) -> dict[int, dict[str, float]]:
    """Seconds per handle of each size: cold_map, pool_map, unmap, release."""
    return {mib: _core.cuda_driver_floor(0, mib * MIB, 1, repeats, True) for mib in HANDLE_MIB}


async def timed_alloc(kv: kvasync.Allocator, n: int) -> tuple[float, list[int], dict[str, int]]:
    start = time.monotonic_ns()
    ids = await kv.alloc(n)
    end = time.monotonic_ns()
    trace = {k: v - start for k, v in _core.trace_points().items()}
    trace["resumed"] = end - start
    return (end - start) / 1e9, ids, trace


def floor_sample(kv: kvasync.Allocator) -> dict[str, float]:
    """One sample of the driver's time for the handles of one page id of ``kv``, in seconds:
    the bare calls on a reservation as large as ``kv``'s, taken between the allocator's runs so
    that both see the driver in the same state."""
    layout = kv.layout
    pages = -(-kv.num_blocks // layout.blocks_per_page(kv.page_size))
    if layout.contiguous:
        f = _core.cuda_driver_floor(0, kv.page_size, 1, 1, True, pages)
        release = f["release"]
    else:
        f = _core.cuda_driver_floor_ranges(0, kv.page_size, layout.num_ranges, 1, 1, True, pages)
        release = f["release"]
    return {
        "fresh": f["cold_map"],
        "fresh_pooled": f["pool_map"],
        "cycle": f["cold_map"] + f["unmap"] + release,
        "cycle_pooled": f["pool_map"] + f["unmap"],
    }


async def allocator_figures(case: Case, repeats: int, spin_s: float | None) -> dict[str, Any]:
    layout = case.layout()
    out: dict[str, Any] = {"case": case.name, "floor": {}, "trace": {}}
    config = kvasync.Config(
        backend="cuda",
        max_blocks=BURST_BLOCKS,
        page_size=case.page_size,
        reserve_pages=(1, 4),
        default_timeout=30,
    )
    async with kvasync.open_allocator(layout, config) as kv:
        if spin_s is not None:
            kv._spin_s = spin_s
        out["page_size"] = kv.page_size
        out["page_mib"] = kv.page_size * layout.num_ranges / MIB
        out["blocks_per_page"] = layout.blocks_per_page(kv.page_size)
        for _ in range(200):
            kv.free(await kv.alloc(1))
        hot = []
        for _ in range(50 * repeats):
            start = time.perf_counter()
            kv.free(await kv.alloc(1))
            hot.append(time.perf_counter() - start)
        out["hot"] = median(hot)
    config = kvasync.Config(
        backend="cuda",
        max_blocks=BURST_BLOCKS,
        page_size=case.page_size,
        reserve_pages=(0, 4),
        default_timeout=30,
    )
    pages_per_cycle = max(1, CYCLE_BLOCKS // out["blocks_per_page"])
    async with kvasync.open_allocator(layout, config) as kv:
        if spin_s is not None:
            kv._spin_s = spin_s
        for name, release, idle in (
            ("fresh", True, 0.0),
            ("fresh_idle", True, IDLE_S),
            ("fresh_pooled", False, 0.0),
        ):
            times, traces, floors = [], [], []
            for _ in range(repeats + 3):
                floors.append(floor_sample(kv)["fresh_pooled" if not release else "fresh"])
                await kv.trim(release_handles=release)
                if idle:
                    await asyncio.sleep(idle)
                seconds, ids, trace = await timed_alloc(kv, 1)
                kv.free(ids)
                times.append(seconds)
                traces.append(trace)
            out[name] = median(times[3:])
            out["floor"][name] = median(floors[3:])
            out["trace"][name] = {k: median([t[k] for t in traces[3:]]) for k in traces[0]}
        for name, release in (("cycle", True), ("cycle_pooled", False)):
            times, floors, traces = [], [], []
            for _ in range(repeats + 3):
                floors.append(pages_per_cycle * floor_sample(kv)[name])
                await kv.trim(release_handles=release)
                start = time.perf_counter()
                ids = await kv.alloc(CYCLE_BLOCKS)
                kv.free(ids)
                trim_start = time.monotonic_ns()
                await kv.trim(release_handles=release)
                times.append(time.perf_counter() - start)
                trace = {k: v - trim_start for k, v in _core.trace_points().items()}
                trace["resumed"] = time.monotonic_ns() - trim_start
                traces.append(trace)
            out[name] = median(times[3:])
            out["floor"][name] = median(floors[3:])
            out["trace"][f"{name} (its trim)"] = {
                k: median([t[k] for t in traces[3:]]) for k in traces[0]
            }
        await kv.trim()
    bursts, floors = [], []
    config = kvasync.Config(
        backend="cuda",
        max_blocks=BURST_BLOCKS,
        page_size=case.page_size,
        reserve_pages=(0, 0),
        default_timeout=30,
    )
    pages = BURST_BLOCKS // out["blocks_per_page"]
    for _ in range(5):
        async with kvasync.open_allocator(layout, config) as kv:
            if spin_s is not None:
                kv._spin_s = spin_s
            start = time.perf_counter()
            ids = await kv.alloc(BURST_BLOCKS)
            bursts.append(time.perf_counter() - start)
            kv.free(ids)
        # The same handles from the bare driver: one run of `pages` per range.
        f = _core.cuda_driver_floor(0, kv.page_size, pages, 1, True)
        floors.append(f["cold_map"] * pages * layout.num_ranges)
    out["burst"] = median(bursts)
    out["floor"]["burst"] = median(floors)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--cases", nargs="+", default=[c.name for c in CASES], help="names of the cases to run"
    )
    parser.add_argument(
        "--loop-spin-us",
        type=float,
        default=None,
        help="override the allocator's spin for a completion (experiments; default: its own)",
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    problem = _core.cuda_problem(0)
    if problem is not None:
        sys.exit(f"bench_map needs a GPU: {problem}")
    results: dict[str, Any] = {"floor": {}, "cases": []}

    print(f"## 1. Driver floor per handle, median of {args.repeats} (us)")
    print()
    floors = driver_floors(args.repeats)
    rows = []
    for mib, f in floors.items():
        cycle = (f["cold_map"] + f["unmap"] + f["release"]) * US / mib
        rows.append(
            [
                f"{mib} MiB",
                f"{f['cold_map'] * US:.1f}",
                f"{f['pool_map'] * US:.1f}",
                f"{f['unmap'] * US:.1f}",
                f"{f['release'] * US:.1f}",
                f"{cycle:.2f}",
            ]
        )
    columns = ["handle", "create+map+access", "map+access", "unmap", "release"]
    print_table([*columns, "cold cycle us/MiB"], rows)
    results["floor"] = floors
    print()
    print("Does the reservation's size matter? create+map+access / map+access of one handle (us):")
    for mib, reserve in ((2, 1), (2, 8192), (128, 1), (128, 128)):
        f = _core.cuda_driver_floor(0, mib * MIB, 1, args.repeats, True, reserve)
        results["floor"][f"{mib}_reserve_{reserve}"] = f
        print(
            f"  {mib} MiB handle in a {mib * reserve} MiB reservation: "
            f"{f['cold_map'] * US:.1f} / {f['pool_map'] * US:.1f}"
        )
    print()
    print("per-layer page id (64 ranges x 2 MiB handles), driver calls (ms): order, reservation,")
    print("threads (the ranges split between them, each making its own calls)")
    for threads, first, reserve in (
        (1, False, 1),
        (1, True, 1),
        (1, True, 128),
        *((t, True, 128) for t in args.threads if t > 1),
    ):
        r = _core.cuda_driver_floor_ranges(0, 2 * MIB, 64, args.repeats, threads, first, reserve)
        results["floor"][f"ranges_{threads}_{first}_{reserve}"] = r
        order = "all creates first" if first else "create+map+access per range"
        print(
            f"  {threads} thread(s), {order}, {2 * reserve} MiB ranges: create+map+access "
            f"{r['cold_map'] * 1e3:.2f}, map+access {r['pool_map'] * 1e3:.2f}, "
            f"unmap {r['unmap'] * 1e3:.2f}, release {r['release'] * 1e3:.2f}"
        )
    print()

    print("## 2. The allocator, reference geometry, awaited public API (kvasync / driver floor)")
    print()
    columns = [
        "case",
        "page id",
        "hot us",
        "fresh us",
        "floor",
        "fresh idle us",
        "fresh pooled us",
        "floor",
        "cycle us/MiB",
        "floor",
        "pooled us/MiB",
        "floor",
        "16 GiB burst ms",
        "floor",
        "x floor",
    ]
    rows = []
    for case in CASES:
        if case.name not in args.cases:
            continue
        spin_s = None if args.loop_spin_us is None else args.loop_spin_us / US
        fig = asyncio.run(allocator_figures(case, args.repeats, spin_s))
        floor = fig["floor"]
        results["cases"].append(fig)
        cyc_mib = CYCLE_BLOCKS * BLOCK_MIB
        rows.append(
            [
                case.name,
                f"{fig['page_mib']:.0f} MiB",
                f"{fig['hot'] * US:.2f}",
                f"{fig['fresh'] * US:.1f}",
                f"{floor['fresh'] * US:.1f}",
                f"{fig['fresh_idle'] * US:.1f}",
                f"{fig['fresh_pooled'] * US:.1f}",
                f"{floor['fresh_pooled'] * US:.1f}",
                f"{fig['cycle'] * US / cyc_mib:.2f}",
                f"{floor['cycle'] * US / cyc_mib:.2f}",
                f"{fig['cycle_pooled'] * US / cyc_mib:.2f}",
                f"{floor['cycle_pooled'] * US / cyc_mib:.2f}",
                f"{fig['burst'] * 1e3:.1f}",
                f"{floor['burst'] * 1e3:.1f}",
                f"{fig['burst'] / floor['burst']:.2f}",
            ]
        )
    ref = REFERENCE
    rows.append(
        [
            "kvcached (reference; same GPU model, 2026-11-30, not in this run)",
            "128 MiB",
            f"{ref['hot_us']:.1f}",
            f"{ref['fresh_us']:.0f}",
            *[""] * 4,
            f"{ref['cycle_us'] / 128:.2f}",
            *[""] * 3,
            f"{ref['burst_ms']:.1f}",
            "",
            "",
        ]
    )
    for name, before in BEFORE.items():
        rows.append(
            [
                f"kvasync before, {name} (issue 8, not in this run)",
                "",
                f"{before['hot_us']:.2f}",
                f"{before['fresh_us']:.0f}",
                *[""] * 4,
                f"{before['cycle_us'] / 128:.2f}",
                *[""] * 3,
                f"{before['burst_ms']:.1f}",
                "",
                "",
            ]
        )
    print_table(columns, rows)
    print()

    print("## 3. Where a fresh alloc's time goes: median us after the alloc call at each point of")
    print("csrc/common/trace.h ('resumed': the awaiting task has its blocks)")
    print()
    for fig in results["cases"]:
        for name, trace in fig["trace"].items():
            steps = " -> ".join(f"{k} {v / 1e3:.1f}" for k, v in trace.items() if v > 0)
            print(f"- {fig['case']}, {name}: {steps}")
    print()
    print_goals(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


def print_goals(results: dict[str, Any]) -> None:
    cases = {c["case"]: c for c in results["cases"]}
    print("## 4. Goals (issue 8, part 2)")
    print()
    rows: list[list[str]] = []

    def row(goal: str, measured: float, bound: float, unit: str, text: str = "") -> None:
        met = "met" if measured <= bound else "not met"
        rows.append([goal, f"{measured:.2f} {unit}", text or f"{bound:.2f} {unit}", met])

    c = cases.get("contiguous, default")
    if c:
        f = c["floor"]
        row(
            "fresh alloc <= floor + 20 us",
            c["fresh"] * US,
            f["fresh"] * US + 20,
            "us",
            f"{f['fresh'] * US:.1f} + 20 us",
        )
        row("16 GiB burst <= 1.2x floor", c["burst"] / f["burst"], 1.2, "x")
        row("128 MiB cycle <= 1.2 us/MiB", c["cycle"] * US / 128, 1.2, "us/MiB")
        row("pooled cycle <= 0.6 us/MiB", c["cycle_pooled"] * US / 128, 0.6, "us/MiB")
    p = cases.get("per-layer, default")
    if p:
        f = p["floor"]
        row("per-layer fresh page id <= 1.2x floor", p["fresh"] / f["fresh"], 1.2, "x")
    print_table(["goal", "measured", "floor / bound", "met"], rows)
    print()


if __name__ == "__main__":
    main()
