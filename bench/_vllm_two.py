"""The ``two`` mode of bench/bench_vllm.py: two engines at once on one budget of KV, bursts
alternating between them (``shared``: one kvasync share; ``static-stock``, ``static-kvasync``:
fixed halves; ``kvcached``: the reference allocator, each engine up to the whole budget). See
bench_vllm.py's docstring for what it measures and why.
"""

from __future__ import annotations

import contextlib
import pathlib
import time
from typing import Any

from _vllm_child import alternating_trace
from _vllm_procs import (
    FAILURES,
    GIB,
    Engine,
    GpuSampler,
    LedgerSampler,
    OutOfTime,
    Run,
    kill_all,
    parse_gib,
    write_atomically,
)

# -- two engines on one budget -----------------------------------------------------------------

TWO_VARIANTS = ("shared", "static-stock", "static-kvasync", "kvcached")


def two_kind(variant: str) -> str:
    return {"static-stock": "stock", "kvcached": "kvcached"}.get(variant, "kvasync")


def mode_two(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.work / "two"
    budget = parse_gib(args.two_budget)
    half = budget // 2
    plan = alternating_trace(
        engines=2,
        bursts=args.bursts,
        period_s=args.period_s,
        requests=args.burst_requests,
        window_s=1.0,
        prompt_len=1536,
        output_len=256,
    )
    trace_end = max(r["at"] for engine in plan for r in engine)
    variants: dict[str, Any] = {}
    data: dict[str, Any] = {
        "budget_gib": budget / GIB,
        "slo_s": args.slo_s,
        "plan": plan,
        "variants": variants,
    }
    folder.mkdir(parents=True, exist_ok=True)

    def spawn(variant: str) -> list[Engine]:
        kind = two_kind(variant)
        share = f"bench-{run.tag}-two-{variant}" if kind == "kvasync" else None
        # kvcached has no budget shared between engines: each may map up to the whole budget
        # (its KV capacity, vLLM's kv_cache_memory_bytes), and nothing caps their sum.
        kv_cache_bytes = {"static-stock": half, "kvcached": budget}.get(variant)
        trace_go = folder / f"{variant}.trace_go"
        trace_go.unlink(missing_ok=True)
        engines = []
        for index, label in enumerate(("A", "B")):
            spec = run.spec(
                kind,
                "trace",
                {
                    "warmup": [96, 1536, 32],  # a burst's shapes, before its trace
                    "trace_go": str(trace_go),
                    "plan": plan[index],
                    "salt": f"trace-{label}",  # the same prompts in every variant
                    "max_s": trace_end + 60,
                },
                utilization=0.3 if kind == "kvasync" else 0.2,
                max_num_seqs=128,
                stats=True,
                kv_cache_bytes=kv_cache_bytes,
            )
            limit = f"{half // 2**20}MiB" if variant == "static-kvasync" else None
            env = run.env(kind, f"two-{label}", share=share, budget=args.two_budget, limit=limit)
            engines.append(Engine(folder, f"{variant}_{label}", spec, env))
        return engines

    upcoming: list[Engine] = []
    try:
        for index, variant in enumerate(args.two_variants):
            record: dict[str, Any] = {}
            variants[variant] = record
            try:
                run.clock.need(trace_end + 35, f"two engines, {variant}")
            except OutOfTime as error:
                record["failure"] = str(error)
                continue
            print(f"== two engines: {variant}", flush=True)
            engines, upcoming = upcoming or spawn(variant), []
            share = engines[0].spec["env"].get("KVASYNC_SHARE")
            sampler = LedgerSampler(share) if share else None
            if sampler:
                sampler.start()
            gpu = GpuSampler()
            gpu.start()
            try:
                for engine in engines:
                    engine.go()
                if index + 1 < len(args.two_variants):
                    # The next pair imports vLLM while this one starts, and is idle (waiting for
                    # its go) before this trace begins: the trace shares the CPU with nothing.
                    upcoming = spawn(args.two_variants[index + 1])
                for engine in engines:
                    up = engine.wait("up", run.clock.by(90))
                    record[f"start_s_{engine.name[-1]}"] = up["start_s"]
                for engine in engines:
                    engine.wait("warm", run.clock.by(60))
                for engine in upcoming:
                    with contextlib.suppress(*FAILURES):  # it is waited for again as current
                        engine.wait("imported", run.clock.by(60))
                trace_go = pathlib.Path(engines[0].spec["args"]["trace_go"])
                write_atomically(trace_go, repr(time.time() + 1.0))
                for engine in engines:
                    engine.wait("result", run.clock.grace(trace_end + 90))
                record["engines"] = {engine.name[-1]: engine.result() for engine in engines}
            except FAILURES as error:
                record["failure"] = str(error)
                print(f"   {error}", flush=True)
            finally:
                kill_all(engines)
                record["gpu_busy"] = gpu.finish()
                if sampler:
                    record["ledger"] = sampler.finish()
    finally:
        kill_all(upcoming)
    return data
