"""The figures and checks of bench/bench_vllm_many.py, from what the engines and the driver
recorded (the same data as OUT/summary.json): requests within SLO, goodput, the regime checks,
cold starts, idle engines' release, the ledger against the budget, the limits' turns.

Every function here takes plain JSON data, so ``bench_vllm_many.py --report OUT`` judges a
finished run again, and the tests feed it hand-built records.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any

from _vllm_many_sim import within_slo

GIB = 2**30
# An idle engine's KV must be back to its null block's page and its reserve within this long
# after its last request ended (the plugin gives back on that free; the mapper unmaps after the
# GPU work that used the pages, polled every ms): what the check holds the run to.
IDLE_BOUND_S = 1.0
IDLE_MIN_S = 1.5  # an idle spell shorter than this is not judged (the next arrival is near)
# summary.json keeps 4 decimals (bench/_vllm_many_runs.compact): a figure read back may be up to
# this much over the exact one (0.1 MiB; a page is 2 MiB or more, so no page hides in it).
ROUNDING_GIB = 1e-4


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def engine_summary(result: dict[str, Any], ttft_s: float, tpot_s: float) -> dict[str, Any]:
    """One engine's requests within SLO, TTFT and TPOT percentiles, preemptions, KV peaks."""
    requests = list(result["requests"].values())
    ttft = [r["first"] - r["at"] for r in requests if r["first"] is not None]
    tpot = [
        (r["finished"] - r["first"]) / (r["output_tokens"] - 1)
        for r in requests
        if r["finished"] is not None and r["first"] is not None and r["output_tokens"] > 1
    ]
    samples = result.get("samples", [])

    def peak(key: str) -> float:
        values = [s.get(key, math.nan) for s in samples]
        return max((v for v in values if not math.isnan(v)), default=math.nan)

    return {
        "requests": len(requests),
        "finished": sum(r["finished"] is not None for r in requests),
        "aborted": sum(r.get("aborted") is not None for r in requests),
        "within_ttft": sum(t <= ttft_s for t in ttft),
        "within_slo": sum(within_slo(r, ttft_s, tpot_s) for r in requests),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "output_tokens": sum(r["output_tokens"] for r in requests),
        "preemptions": result.get("preemptions"),
        "mapped_max_gib": peak("mapped_gib"),
        "kv_used_max_gib": peak("kv_used_gib"),
        "start_s": result.get("start_s"),
        # The trace loop's lateness: how far behind its time a request was handed to the
        # engine (a loop that falls behind adds it to every TTFT).
        "late_max_s": max((r["arrived"] - r["at"] for r in requests), default=math.nan),
    }


def queue_seconds(steps: dict[str, list[Any]], max_seqs: int, max_tokens: int) -> dict[str, float]:
    """Request-seconds waiting, by what held the queue at each step: ``compute`` (the step's
    token budget used up: prefill compute), ``batch`` (``max_num_seqs`` running), ``memory``
    (neither: the head's blocks were not there)."""
    found = {"memory": 0.0, "compute": 0.0, "batch": 0.0}
    t, seconds = steps["t"], steps["seconds"]
    for k in range(len(t)):
        waiting = steps["waiting"][k]
        if not waiting:
            continue
        span = (t[k + 1] - t[k]) if k + 1 < len(t) else seconds[k]
        tokens = steps["tokens"][k]
        if tokens is not None and tokens >= max_tokens:
            found["compute"] += waiting * span
        elif steps["running"][k] >= max_seqs:
            found["batch"] += waiting * span
        else:
            found["memory"] += waiting * span
    return found


def crest(engines: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The busiest second of the run over all engines (scheduled tokens): its tokens a second,
    its steps' median ms, the most requests one engine ran in it."""
    steps = [
        (t, d, n or 0, r)
        for e in engines
        for t, d, n, r in zip(
            e["steps"]["t"],
            e["steps"]["seconds"],
            e["steps"]["tokens"],
            e["steps"]["running"],
            strict=True,
        )
    ]
    best = {"tokens_s": 0.0, "step_ms": math.nan, "running": 0.0}
    if not steps:
        return best
    end = max(s[0] for s in steps)
    window = 0.0
    while window <= end:
        inside = [s for s in steps if window <= s[0] < window + 1.0]
        tokens = float(sum(s[2] for s in inside))
        if tokens > best["tokens_s"]:
            best = {
                "tokens_s": tokens,
                "step_ms": 1e3 * statistics.median(s[1] for s in inside),
                "running": float(max(s[3] for s in inside)),
            }
        window += 0.25
    return best


def busy_spells(requests: dict[str, dict[str, Any]], end: float) -> list[tuple[float, float]]:
    """The spans in which the engine had a request in flight (arrival to finish or give-up)."""
    spans = sorted(
        (r["arrived"], r["finished"] or r.get("aborted") or end) for r in requests.values()
    )
    merged: list[tuple[float, float]] = []
    for begin, finish in spans:
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], finish))
        else:
            merged.append((begin, finish))
    return merged


def idle_release(result: dict[str, Any]) -> list[dict[str, float]]:
    """Each idle spell of a kvasync engine (no request in flight for ``IDLE_MIN_S`` or more):
    the seconds from its start until the engine's mapped KV was at most its null block's page
    and its reserve's high watermark (``release_s``, NaN when it never was within the spell)."""
    geometry = result.get("kv_geometry")
    samples = [
        s for s in result.get("samples", []) if not math.isnan(s.get("mapped_gib", math.nan))
    ]
    if not geometry or not samples:
        return []
    floor = (1 + geometry["reserve_pages"][1]) * geometry["page_bytes"] / GIB
    t0 = result["t0_wall"]
    times = [s["wall"] - t0 for s in samples]
    end = times[-1]
    spells = busy_spells(result["requests"], end)
    gaps = [(a[1], b[0]) for a, b in itertools.pairwise(spells)]
    if spells:
        gaps.append((spells[-1][1], end))
    found = []
    for begin, until in gaps:
        if until - begin < IDLE_MIN_S:
            continue
        reached = next(
            (
                t - begin
                for t, s in zip(times, samples, strict=True)
                if begin <= t <= until and s["mapped_gib"] <= floor + ROUNDING_GIB
            ),
            math.nan,
        )
        found.append(
            {"begin": begin, "length": until - begin, "release_s": reached, "floor_gib": floor}
        )
    return found


def cold_starts(
    plan: Sequence[Sequence[dict[str, Any]]],
    engines: Sequence[dict[str, Any]],
    ttft_s: float,
    ledger: Sequence[dict[str, Any]] | None,
    budget: int,
    names: Sequence[str],
) -> list[dict[str, Any]]:
    """Each engine's first request that arrives after the trace began (its model cold until
    then): its TTFT, whether within the SLO, and the largest share of the budget another
    member held when it arrived (from the share's ledger, where the engines are ``names``; NaN
    without one)."""
    found = []
    for index, (trace, result) in enumerate(zip(plan, engines, strict=True)):
        if not trace or trace[0]["at"] < 1.0:
            continue
        record = result["requests"].get(trace[0]["id"])
        ttft = (
            (record["first"] - record["at"]) if record and record["first"] is not None else math.nan
        )
        held = math.nan
        if ledger:
            wall = result["t0_wall"] + trace[0]["at"]
            sample = min(ledger, key=lambda s: abs(s["wall"] - wall))
            others = [m["committed"] for n, m in sample["members"].items() if n != names[index]]
            held = max(others, default=0) / budget
        found.append(
            {
                "engine": index,
                "at": trace[0]["at"],
                "ttft_s": ttft,
                "within": not math.isnan(ttft) and ttft <= ttft_s,
                "others_max_share": held,
            }
        )
    return found


def ledger_peak(ledger: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The most the share's members had committed and mapped at once (one snapshot each)."""
    return {
        "committed": max(
            (sum(m["committed"] for m in s["members"].values()) for s in ledger), default=0
        ),
        "mapped": max((sum(m["mapped"] for m in s["members"].values()) for s in ledger), default=0),
    }


def limit_turns(ledger: Sequence[dict[str, Any]], budget: int) -> dict[str, dict[str, float]]:
    """Per member, how its limit in force (at most the budget) moved: its changes, its
    fall->rise turns, and the closest two turns (seconds; NaN with fewer than two)."""
    series: dict[str, list[tuple[float, int]]] = {}
    for sample in ledger:
        for name, member in sample["members"].items():
            series.setdefault(name, []).append((sample["wall"], min(member["limit"], budget)))
    found = {}
    for name, points in series.items():
        changes = 0
        turns: list[float] = []
        direction = 0
        for (_, before), (t, after) in itertools.pairwise(points):
            if after == before:
                continue
            changes += 1
            moved = 1 if after > before else -1
            if direction < 0 < moved:
                turns.append(t)
            direction = moved
        gaps = [b - a for a, b in itertools.pairwise(turns)]
        found[name] = {
            "changes": float(changes),
            "turns": float(len(turns)),
            "closest_s": min(gaps) if gaps else math.nan,
        }
    return found


def variant_summary(
    record: dict[str, Any], case: dict[str, Any], plan: Sequence[Sequence[dict[str, Any]]]
) -> dict[str, Any]:
    """A variant's figures and checks (see the module's docstring)."""
    ttft_s, tpot_s = case["slo_ttft_s"], case["slo_tpot_s"]
    engines: list[dict[str, Any]] = record["engines"]
    per_engine = [engine_summary(e, ttft_s, tpot_s) for e in engines]
    arrivals = [r["at"] for trace in plan for r in trace]
    span = max(arrivals, default=0.0) - min(arrivals, default=0.0)
    within = sum(e["within_slo"] for e in per_engine)
    queues = [
        queue_seconds(e["steps"], case["max_num_seqs"], case["max_num_batched_tokens"])
        for e in engines
    ]
    t0 = engines[0]["t0_wall"] if engines else 0.0
    end = max((r["finished"] or 0.0 for e in engines for r in e["requests"].values()), default=0.0)
    busy = [b for w, b in record.get("gpu_busy", []) if t0 <= w <= t0 + end]
    ledger = record.get("ledger") or []
    pre = [e["preemptions"] for e in per_engine]
    summary: dict[str, Any] = {
        "per_engine": per_engine,
        "within_slo": within,
        "requests": sum(e["requests"] for e in per_engine),
        "goodput": within / span if span > 0 else math.nan,
        "preemptions": None if None in pre else sum(pre),
        "queue_memory_s": sum(q["memory"] for q in queues),
        "queue_compute_s": sum(q["compute"] + q["batch"] for q in queues),
        "crest": crest(engines),
        "gpu_busy": statistics.fmean(busy) if busy else math.nan,
        "cold_starts": cold_starts(
            plan, engines, ttft_s, ledger, case["budget"], record.get("names", [])
        ),
        "idle": {str(i): idle_release(e) for i, e in enumerate(engines)},
    }
    if ledger:
        summary["ledger_peak"] = ledger_peak(ledger)
        summary["limit_turns"] = limit_turns(ledger, case["budget"])
    return summary


def memory_bound(
    static: dict[str, Any], shared: dict[str, Any] | None, slo_ttft_s: float | None = None
) -> bool:
    """The memory-bound regime check: under static 1/N the queue waited on memory more than on
    compute, and (when the shared run is there) compute did not bind it: its queue did not wait
    on compute for most of its time, or its requests waited on compute for less than a quarter
    of the TTFT SLO each on average (a shared run that serves every request has almost no queue,
    and what little it has is the step's token budget: no sign that compute binds)."""
    if static["queue_memory_s"] <= static["queue_compute_s"]:
        return False
    if shared is None:
        return True
    compute = float(shared["queue_compute_s"])
    total = float(shared["queue_memory_s"]) + compute
    if total == 0 or compute <= total / 2:
        return True
    requests = int(shared.get("requests") or 0)
    return slo_ttft_s is not None and requests > 0 and compute / requests < slo_ttft_s / 4


def compute_bound(static: dict[str, Any], shared: dict[str, Any]) -> bool:
    """The compute-bound regime check: in both runs the queue waited on compute (the token
    budget or the batch) at least as long as on memory, and it did wait."""
    return all(
        v["queue_compute_s"] > 0 and v["queue_compute_s"] >= v["queue_memory_s"]
        for v in (static, shared)
    )
