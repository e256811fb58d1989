"""Serving benchmark: one seeded arrival trace against kvasync elastic and a static pool.

Variants, all in one run, on the same trace (Poisson arrivals whose rate rises to a peak and
falls again; prompt and output lengths from a fixed seeded distribution):

  (a) elastic  kvasync maps KV pages as requests need them and unmaps them as load falls
               (reserve watermarks (1, 4) pages).
  (b) static   the same engine, but kvasync maps the whole KV budget at start and never gives any
               back (reserve watermarks = the whole budget): what an engine without an elastic
               allocator does with a preallocated pool. Same engine, model, kernel, scheduler and
               block allocator hot path: the only difference is the mapping policy, so the gap
               between (a) and (b) is the cost (or not) of elasticity.
  (c) colocated  two engines, two processes, on one device, each with its own trace (A's load
               peaks in the first half, B's in the second): sharing one budget through kvasync
               (Config(share=..., device_budget=...)) against the same two engines each given a
               static half. Reports requests served within the SLO.

Usage: python bench/bench_serving.py --preset tiny --device cpu --duration 20
Writes PNG plots and a markdown table to --out (default bench/serving/).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _tables import markdown

import kvasync
from kvasync.serve import Engine, EngineConfig, RequestFailed, RequestRecord, RequestTooLarge
from kvasync.serve._report import MemorySampler, RunResult, plot_runs, summarize

MIB = 1 << 20


@dataclass(frozen=True)
class Workload:
    """Per-preset defaults: the KV budget, peak arrival rate and length distributions."""

    kv_mib: int
    peak_rate: float  # requests / s at the crest
    prompt_median: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    max_batch: int
    slo_ttft_s: float
    slo_tpot_s: float


WORKLOADS = {
    # KV: 64 KiB pages x 4 buffers = 32 blocks (512 tokens) per page id; 6 MiB = 24 page ids.
    "tiny": Workload(6, 24.0, 96, (8, 320), (16, 128), 64, 2.0, 0.1),
    # KV: 2 MiB pages x 24 buffers = 256 blocks (4096 tokens) per 48 MiB page id.
    "small": Workload(3072, 40.0, 512, (32, 2048), (64, 512), 256, 2.0, 0.05),
}


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds after the start
    prompt: str
    max_tokens: int


def make_trace(
    workload: Workload, duration: float, seed: int, phase: float = 0.5
) -> list[TraceRequest]:
    """Poisson arrivals (by thinning) whose rate is a bump centred at ``phase`` of the run.

    The rate is 10% of the peak away from the bump, so memory demand rises and falls.
    """
    rng = np.random.default_rng(seed)
    peak = workload.peak_rate
    t = 0.0
    requests: list[TraceRequest] = []
    while True:
        t += rng.exponential(1 / peak)
        if t >= duration:
            return requests
        x = (t / duration - phase) / 0.18
        rate = peak * (0.1 + 0.9 * math.exp(-x * x))
        if rng.random() * peak > rate:
            continue
        low, high = workload.prompt_range
        length = int(np.clip(rng.lognormal(math.log(workload.prompt_median), 0.6), low, high))
        chars = rng.integers(32, 127, size=length)
        output = int(rng.integers(workload.output_range[0], workload.output_range[1] + 1))
        requests.append(TraceRequest(t, bytes(chars.tolist()).decode(), output))


async def replay(
    name: str, config: EngineConfig, trace: list[TraceRequest], start_at: float | None = None
) -> RunResult:
    """Opens an engine, replays ``trace`` in real time, waits for every request, closes it."""
    engine = await Engine.open(config)
    async with engine:
        # NOTE: warm-up (first step's allocations, lazy inits) outside the measured run.
        await engine.complete("warm up", max_tokens=2)
        if start_at is not None:  # co-located processes start their traces together
            await asyncio.sleep(max(0.0, start_at - time.time()))
        start = time.monotonic()
        kv = engine.kv
        with MemorySampler(lambda: kv.stats().mapped_bytes, 0.02) as sampler:
            sampler.start = start

            refused = 0

            async def one(request: TraceRequest) -> None:
                nonlocal refused
                await asyncio.sleep(max(0.0, start + request.arrival - time.monotonic()))
                try:
                    await engine.complete(request.prompt, max_tokens=request.max_tokens)
                except RequestTooLarge:  # refused at submit: the engine keeps no record of it
                    refused += 1
                except RequestFailed:  # recorded by the engine
                    pass

            await asyncio.wait_for(asyncio.gather(*(one(r) for r in trace)), 600)
        duration = time.monotonic() - start
        records = [r for r in engine.records() if r.arrival >= start]
        extra = {
            # Blocks moved out of pages the allocator drained (co-location: Note [Limit policy]).
            "moved blocks": float(engine.stats().moved_blocks),
            # Requests larger than the KV budget could ever hold (a budget set too small).
            "requests refused": float(refused),
        }
        return RunResult(name, records, sampler.samples, start, duration, extra)


def engine_config(args: argparse.Namespace, workload: Workload, **changes: object) -> EngineConfig:
    budget = args.kv_mib * MIB
    fields: dict[str, object] = {
        "preset": args.preset,
        "device": args.device,
        "memory_limit": budget,
        "max_blocks": 1 << 17 if args.preset == "small" else 1 << 14,
        "max_batch": workload.max_batch,
        "request_timeout": 120.0,
        "max_batch_tokens": 8192,
    }
    fields.update(changes)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def run_single(
    args: argparse.Namespace, workload: Workload
) -> tuple[list[RunResult], list[RunResult]]:
    """(a) and (b) on the same trace, alternating (b a, a b, ...) so that a machine whose speed
    drifts (a shared CPU) favours neither; each variant's records are pooled over its repeats."""
    trace = make_trace(workload, args.duration, args.seed)
    print(f"trace: {len(trace)} requests over {args.duration} s (seed {args.seed})", flush=True)
    variants = [("(b) static", True), ("(a) elastic", False)]
    runs: dict[str, list[RunResult]] = {name: [] for name, _ in variants}
    for repeat in range(args.repeats):
        for name, static in variants if repeat % 2 == 0 else variants[::-1]:
            config = engine_config(args, workload, static=static, name=name)
            result = asyncio.run(replay(name, config, trace))
            runs[name].append(result)
            print(f"{name} #{repeat}: {len(result.records)} requests in {result.duration:.1f} s")
    pooled, firsts = [], []
    for name, results in runs.items():
        firsts.append(results[0])
        first = results[0]
        pooled.append(
            RunResult(
                name,
                [r for result in results for r in result.records],
                first.samples,  # memory is plotted and averaged from the first repeat
                first.start,
                sum(r.duration for r in results),
            )
        )
    return pooled, firsts


# -- (c) co-location: two processes ----------------------------------------------------------


def record_to_json(record: RequestRecord, start: float) -> dict[str, object]:
    data = dataclasses.asdict(record)
    for key in ("arrival", "first_token", "finish"):
        if data[key] is not None:
            data[key] -= start
    return data


def run_worker(spec_path: str) -> None:
    """One co-located engine (a child process): replays its trace, writes its records."""
    spec = json.loads(Path(spec_path).read_text())
    args = argparse.Namespace(**spec["args"])
    workload = WORKLOADS[args.preset]
    config = engine_config(args, workload, **spec["changes"])
    trace = make_trace(workload, args.duration, spec["seed"], spec["phase"])
    result = asyncio.run(replay(spec["name"], config, trace, spec["start_at"]))
    out = {
        "name": result.name,
        "duration": result.duration,
        "samples": [(t, b) for t, b in result.samples],
        "records": [record_to_json(r, result.start) for r in result.records],
        "extra": result.extra,
    }
    Path(spec["out"]).write_text(json.dumps(out))


def run_pair(
    args: argparse.Namespace, label: str, changes: list[dict[str, object]]
) -> list[RunResult]:
    out_dir = Path(tempfile.mkdtemp(prefix="bench-serving-"))  # the workers' specs and records
    start_at = time.time() + 15.0  # both processes import torch and open their engine first
    workers = []
    for index, (engine_changes, phase) in enumerate(zip(changes, (0.3, 0.7), strict=True)):
        name = f"{label} {'AB'[index]}"
        spec = {
            "args": vars(args),
            "changes": engine_changes,
            "seed": args.seed + 1 + index,
            "phase": phase,
            "name": name,
            "start_at": start_at,
            "out": str(out_dir / f"worker_{label.replace(' ', '_')}_{index}.json"),
        }
        spec_path = out_dir / f"worker_{label.replace(' ', '_')}_{index}.spec.json"
        spec_path.write_text(json.dumps(spec))
        workers.append(
            (subprocess.Popen([sys.executable, __file__, "--worker", str(spec_path)]), spec)
        )
    results = []
    for process, spec in workers:
        if process.wait(timeout=args.duration + 300) != 0:
            raise RuntimeError(f"co-located worker {spec['name']} exited {process.returncode}")
        data = json.loads(Path(str(spec["out"])).read_text())
        records = [RequestRecord(**r) for r in data["records"]]
        samples = [(float(t), int(b)) for t, b in data["samples"]]
        results.append(
            RunResult(data["name"], records, samples, 0.0, data["duration"], data["extra"])
        )
    return results


def run_colocated(args: argparse.Namespace, workload: Workload) -> list[RunResult] | None:
    fields = {f.name for f in dataclasses.fields(kvasync.Config)}
    if "share" not in fields or "device_budget" not in fields:
        print("(c) co-location skipped: this kvasync has no Config(share=..., device_budget=...)")
        return None
    budget = args.kv_mib * MIB
    share = f"bench-serving-{os.getpid()}"
    shared = [
        {"memory_limit": None, "share": share, "device_budget": budget, "name": f"shared-{i}"}
        for i in range(2)
    ]
    halves = [{"memory_limit": budget // 2, "static": True, "name": f"half-{i}"} for i in range(2)]
    return run_pair(args, "(c) shared", shared) + run_pair(args, "(c) static half", halves)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny", choices=sorted(WORKLOADS))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument(
        "--kv-mib", type=int, default=None, help="KV budget (per engine, or shared)"
    )
    parser.add_argument("--peak-rate", type=float, default=None, help="requests/s at the crest")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs of (a) and (b), alternating")
    parser.add_argument("--out", default="bench/serving")
    parser.add_argument("--skip-colocated", action="store_true", help="only (a) and (b)")
    parser.add_argument("--colocated-only", action="store_true", help="only (c)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker)
        return
    workload = WORKLOADS[args.preset]
    if args.peak_rate is not None:
        workload = dataclasses.replace(workload, peak_rate=args.peak_rate)
    args.kv_mib = args.kv_mib or workload.kv_mib
    args.peak_rate = workload.peak_rate
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, float]] = {}
    if not args.colocated_only:
        pooled, firsts = run_single(args, workload)
        rows.update({r.name: summarize(r, workload.slo_ttft_s) for r in pooled})
        title = f"one engine, {args.preset}, the same trace (first repeat of each)"
        plot = plot_runs(firsts, out / f"serving_{args.preset}.png", title)
        print(f"\nplot: {plot}")
    colocated = None if args.skip_colocated else run_colocated(args, workload)
    if colocated:
        for r in colocated:
            rows[r.name] = summarize(r, workload.slo_ttft_s)
        plot = plot_runs(
            colocated, out / f"colocated_{args.preset}.png", f"two engines, {args.preset}"
        )
        print(f"plot: {plot}")
        for label in ("(c) shared", "(c) static half"):
            pair = [r for r in colocated if r.name.startswith(label)]
            total = sum(int(rows[r.name]["within SLO"]) for r in pair)
            print(
                f"{label}: {total} requests served within the SLO (TTFT <= {workload.slo_ttft_s} s)"
            )
    header = (
        f"preset {args.preset}, device {args.device}, {args.duration} s of arrivals, peak "
        f"{workload.peak_rate} req/s, KV budget {args.kv_mib} MiB, "
        f"SLO TTFT <= {workload.slo_ttft_s} s"
    )
    if not rows:
        return
    table = _table(rows)
    print(f"\n{header}\n\n{table}")
    part = "_colocated" if args.colocated_only else ""
    (out / f"results_{args.preset}{part}.md").write_text(f"{header}\n\n{table}\n")


def _table(rows: dict[str, dict[str, float]]) -> str:
    """One row per variant, one column per figure (rich's Markdown box, bench/_tables)."""
    columns = list(next(iter(rows.values())))
    cells = [
        [name, *(_cell(row.get(column, float("nan"))) for column in columns)]
        for name, row in rows.items()
    ]
    return markdown(["variant", *columns], cells)


def _cell(value: float) -> str:
    if value != value:  # NaN
        return "-"
    return f"{value:.0f}" if value == int(value) and abs(value) >= 1 else f"{value:.3g}"


if __name__ == "__main__":
    main()
