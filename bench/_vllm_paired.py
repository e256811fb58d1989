"""The modes of bench/bench_vllm.py that compare kvasync with stock vLLM on the same work, with the
two engines up at once:

``throughput``: a stock and a kvasync engine (the same model, backend and graphs) both up; the
    driver has them run equal rounds in turn (stock, kvasync, kvasync, stock, ...: each pair's
    order alternates, so a drift within a pair falls on both alike) until ``--pairs`` pairs or the
    mode's time is spent. Each pair gives one ratio, kvasync's output tok/s over stock's; the table
    gives the mean ratio and its 95% confidence interval (Student's t over the pairs), and whether
    each pair's greedy outputs were identical. Rounds run one engine at a time, so neither engine
    competes with the other for the GPU; the idle one only holds its memory.
``limit-memory``: stock with ``kv_cache_memory_bytes`` = ``--limit-memory`` and kvasync with
    ``KVASYNC_MEMORY_LIMIT`` of the same, one after the other, on rounds that need more KV than
    that (both preempt). Each engine's peaks, sampled every 50 ms: the device's used memory, what
    PyTorch's caching allocator reserves and has allocated in the engine's process, and the KV
    kvasync has mapped. It answers where a kvasync engine's extra device memory under a KV limit
    sits (issue 25: 7.0 GiB against stock's 5.8 under 1 GiB).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

from _vllm_procs import FAILURES, Engine, Run, kill_all, parse_gib, write_atomically

# Every shape the rounds use, so no round pays a kernel's first compile.
WARMUP = [[32, 128, 16], [16, 1024, 16], [256, 512, 16]]

# -- throughput --------------------------------------------------------------------------------


def mode_throughput(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.work / "throughput"
    folder.mkdir(parents=True, exist_ok=True)
    count, prompt_len, output_len = args.pair_round
    engines: dict[str, Engine] = {}
    for kind in ("stock", "kvasync"):
        turn = folder / f"{kind}.turn"
        task_args = {
            "warmup": WARMUP,
            "round": [count, prompt_len, output_len],
            "turn": str(turn),
            "turn_within_s": 120.0,
        }
        env = run.env(kind, f"bench-pair-{kind}", limit=args.limit)
        engines[kind] = Engine(folder, kind, run.spec(kind, "paired", task_args), env)
    record: dict[str, Any] = {"round": [count, prompt_len, output_len], "pairs": []}
    try:
        # One at a time: stock's start compares free memory before and after its profile, which a
        # neighbour starting meanwhile would upset (the release mode's failure).
        for kind, engine in engines.items():
            engine.go()
            record[f"{kind}_start_s"] = engine.wait("up", run.clock.by(170))["start_s"]
            engine.wait("warm", run.clock.by(120))
        for pair in range(args.pairs):
            if run.clock.left() < 30:
                record["cut"] = f"the mode's time ran out after {pair} pairs"
                break
            order = ["stock", "kvasync"] if pair % 2 == 0 else ["kvasync", "stock"]
            result: dict[str, Any] = {"pair": pair, "first": order[0]}
            for kind in order:
                engine = engines[kind]
                write_atomically(folder / f"{kind}.turn.{pair}", "go")
                deadline = run.clock.by(90)
                while True:  # this pair's round event (Engine.wait finds the first only)
                    found = [e for e in engine.all("round") if e["index"] == pair]
                    if found:
                        break
                    if not engine.alive() or time.monotonic() > deadline:
                        engine.wait(f"round {pair}", deadline)  # raises Died or Stalled
                    time.sleep(0.01)
                result[kind] = {k: found[0][k] for k in ("tok_s", "seconds", "digest")}
            result["ratio"] = result["kvasync"]["tok_s"] / result["stock"]["tok_s"]
            result["identical"] = result["kvasync"]["digest"] == result["stock"]["digest"]
            record["pairs"].append(result)
            print(
                f"   pair {pair:2d} ({order[0]} first): stock {result['stock']['tok_s']:.0f}, "
                f"kvasync {result['kvasync']['tok_s']:.0f} tok/s, ratio {result['ratio']:.3f}, "
                f"identical {result['identical']}",
                flush=True,
            )
    except FAILURES as error:
        record["error"] = str(error)  # the pairs before it stand
        print(f"   {error}", flush=True)
    finally:
        for kind in engines:
            write_atomically(folder / f"{kind}.turn.stop", "stop")
        for engine in engines.values():
            with contextlib.suppress(FAILURES):  # what it did is in its events already
                engine.wait("result", run.clock.grace(30))
        kill_all(engines.values())
    return record


# -- limit-memory ------------------------------------------------------------------------------


def mode_limit_memory(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.work / "limit_memory"
    limit = parse_gib(args.limit_memory)
    task_args = {
        "warmup": [[8, 128, 8]],
        "rounds": 2,
        # 128 requests of 1024 + 256 tokens want 5 GiB of KV: over a 1 GiB limit, both preempt.
        "round": [128, 1024, 256],
        "idle_s": 1.0,
        "trickle": [8, 128, 32],
    }
    record: dict[str, Any] = {"limit_bytes": limit, "engines": {}}
    for kind in ("stock", "kvasync"):
        env = run.env(kind, f"bench-limit-{kind}", limit=args.limit_memory)
        kv_bytes = limit if kind == "stock" else None
        spec = run.spec(kind, "phases", task_args, kv_cache_bytes=kv_bytes, stats=True)
        engine = Engine(folder, kind, spec, env)
        entry: dict[str, Any] = {}
        record["engines"][kind] = entry
        print(f"== limit-memory: {kind}", flush=True)
        try:
            engine.go()
            entry["start_s"] = engine.wait("up", run.clock.by(170))["start_s"]
            engine.wait("result", run.clock.by(150))
            result = engine.result() or {}
            samples = result.get("samples", [])
            for key in (
                "device_gib",
                "torch_reserved_gib",
                "torch_allocated_gib",
                "mapped_gib",
                "kv_used_gib",
            ):
                values = [s[key] for s in samples if key in s and not math.isnan(s[key])]
                entry[f"{key}_peak"] = max(values) if values else None
                entry[f"{key}_first"] = values[0] if values else None
            # Outside torch's allocator and kvasync's mapped KV, at one moment: the CUDA context,
            # NCCL, graphs' pools, and kvasync's pooled (unmapped) handles.
            others = [
                s["device_gib"] - s["torch_reserved_gib"] - (s.get("mapped_gib") or 0.0)
                for s in samples
                if not math.isnan(s.get("device_gib", math.nan) + s.get("torch_reserved_gib", 0))
            ]
            entry["other_gib_peak"] = max(others) if others else None
            entry["other_gib_first"] = others[0] if others else None
            entry["kv_blocks"] = result.get("kv_blocks")
        except FAILURES as error:
            entry["failure"] = str(error)
            print(f"   {error}", flush=True)
        finally:
            engine.kill()
    return record
