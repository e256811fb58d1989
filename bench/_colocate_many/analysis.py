"""The figures of a run: requests within SLO, queue waits by what held admission, the limits'
oscillation against the policy's bound, the time to take memory back, the busiest second."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from _colocate_many.harness import EngineRun, LedgerSample, VariantRun
from _colocate_many.shapes import HELD_CODES, MIB, Regime


def within_slo(record: Any, ttft: float, tpot: float) -> bool:
    if record.error is not None or record.ttft is None or record.ttft > ttft:
        return False
    return record.tpot is None or record.tpot <= tpot


def integral(samples: list[tuple[float, int]], weight: Callable[[int, int], float]) -> float:
    """sum of weight(value, index) x dt over a sampled step function."""
    total = 0.0
    for k in range(len(samples) - 1):
        total += weight(samples[k][1], k) * (samples[k + 1][0] - samples[k][0])
    return total


def queue_seconds(engine: EngineRun) -> dict[str, float]:
    """Request-seconds waiting ("queue"), and of them by what the scheduler held admission for
    (Scheduler.held_for): "memory" (a grow waiting for blocks, or the head's blocks not
    available), "compute" (the step target, or the step's token budget: prefill compute),
    "batch" (max_batch running); the rest waited while admission went on (the loop's turn)."""
    held = engine.held_for
    codes = {
        "memory": {HELD_CODES["memory"]},
        "compute": {HELD_CODES["compute"], HELD_CODES["tokens"]},
        "batch": {HELD_CODES["batch"]},
    }
    result = {"queue": integral(engine.waiting, lambda n, k: float(n))}
    # The samplers run in one task, in turn: sample k of each is about the same moment.
    for name, wanted in codes.items():

        def weight(n: int, k: int, wanted: set[int] = wanted) -> float:
            return float(n) if held and held[min(k, len(held) - 1)][1] in wanted else 0.0

        result[name] = integral(engine.waiting, weight)
    return result


def step_load(engine: EngineRun, step_target: float) -> tuple[float, float]:
    """(the share of the engine's stepping time in steps over ``step_target``, its mean step
    while it had requests waiting, seconds)."""
    total = sum(d for _, d, _, _ in engine.steps)
    over = sum(d for _, d, _, _ in engine.steps if d > step_target)
    waits = [(t, n) for t, n in engine.waiting]
    times = [t for t, _ in waits]

    def waiting_at(t: float) -> bool:
        k = int(np.searchsorted(times, t, side="right")) - 1
        return k >= 0 and waits[k][1] > 0

    queued = [d for t, d, _, _ in engine.steps if waiting_at(t)]
    return (over / total if total > 0 else 0.0), (float(np.mean(queued)) if queued else 0.0)


def reclaim_times(samples: list[LedgerSample], page_bytes: int) -> tuple[list[float], int]:
    """Episodes of "a member is blocked on the share's budget while another holds at least a page
    it does not use": the seconds until that one's committed bytes dropped. Returns (the times,
    episodes that ended without a drop: the waiter was served otherwise, or the run ended)."""
    times: list[float] = []
    unresolved = 0
    open_since: dict[str, tuple[float, int]] = {}  # idle member -> (since, committed then)
    for t, entries in samples:
        blocked = {name for name, _, _, _, b, _ in entries if b > 0}
        by_name = {name: (committed, used) for name, committed, used, _, _, _ in entries}
        for name, (since, committed_then) in list(open_since.items()):
            committed = by_name.get(name, (0, 0))[0]
            if committed < committed_then:
                times.append(t - since)
                del open_since[name]
            elif not blocked:
                unresolved += 1
                del open_since[name]
        if not blocked:
            continue
        for name, (committed, used) in by_name.items():
            if name in blocked or name in open_since:
                continue
            if committed - used >= page_bytes:
                open_since[name] = (t, committed)
    return times, unresolved + len(open_since)


REGROW_HOLD_S = 0.3  # LimitPolicy::kRegrowHold: Note [Fair share under pressure], no oscillation


def limit_turns(
    samples: list[LedgerSample], budget: int, page_bytes: int
) -> dict[str, dict[str, float]]:
    """Per member, how its limit in force (at most the budget) moved between ledger samples:
    the most direction changes and fall->rise turns in any 1 s window, and the closest two
    fall->rise turns. A turn is seen at the first sample after it, so two turns seen at samples
    j > i were at most t_j - t_(i-1) apart. The bound (Note [Fair share under pressure]): turns
    under kRegrowHold apart only when the later one rises to a new peak of the member's
    guaranteed minimum g = min(demand, budget / members), which the ledger does not show. Such
    a rise lands at most at budget / members, and nothing else lifts the limit within the hold
    of its last step-down (here the fall between the turns: after t_i, so under the hold of the
    rise seen at t_j), so a close pair whose later limit is over budget / members breaks the
    bound for certain (``broken``); one at or under it is allowed only as a new peak of g, which
    this check cannot confirm (``unconfirmed``)."""
    series: dict[str, list[tuple[int, float, int]]] = {}  # member -> (index, time, limit)
    equal: list[int] = []  # per sample: budget / members, in whole pages (at least one)
    for index, (t, entries) in enumerate(samples):
        equal.append(max(1, budget // max(1, len(entries)) // page_bytes) * page_bytes)
        for name, *_, limit in entries:
            series.setdefault(name, []).append((index, t, min(limit, budget)))
    times = [t for t, _ in samples]
    result = {}
    for name, points in series.items():
        changes: list[float] = []  # times of direction changes
        turns: list[tuple[int, int]] = []  # (sample index, limit then) of fall->rise turns
        direction = 0
        for (_, _, before), (index, t, after) in itertools.pairwise(points):
            if after == before:
                continue
            moved = 1 if after > before else -1
            if direction and moved != direction:
                changes.append(t)
                if moved > 0:
                    turns.append((index, after))
            direction = moved

        def most_in_a_second(at: list[float]) -> int:
            return max((sum(1 for u in at if t <= u < t + 1.0) for t in at), default=0)

        spans = [
            times[j] - times[max(0, i - 1)] for (i, _), (j, _) in itertools.pairwise(turns)
        ]  # the most two consecutive turns can have been apart
        close = [
            (j, limit)
            for ((i, _), (j, limit)), span in zip(itertools.pairwise(turns), spans, strict=True)
            if span < REGROW_HOLD_S
        ]
        # Over budget / members (either side of the rise, should the membership change): no g.
        broken = [j for j, limit in close if limit > max(equal[j - 1], equal[j])]
        result[name] = {
            "changes per s max": float(most_in_a_second(changes)),
            "turns per s max": float(most_in_a_second([times[i] for i, _ in turns])),
            "turns": float(len(turns)),
            "closest turns s": min(spans) if spans else float("nan"),
            "close turns": float(len(close)),
            "broken": float(len(broken)),
            "unconfirmed": float(len(close) - len(broken)),
        }
    return result


def blocked_spans(samples: list[LedgerSample]) -> list[float]:
    """How long each member stayed blocked on the share's budget, span by span (seconds)."""
    spans: list[float] = []
    since: dict[str, float] = {}
    for t, entries in samples:
        blocked = {name for name, _, _, _, b, _ in entries if b > 0}
        for name in list(since):
            if name not in blocked:
                spans.append(t - since.pop(name))
        for name in blocked:
            since.setdefault(name, t)
    if samples:
        spans.extend(samples[-1][0] - t for t in since.values())
    return spans


def crest(run: VariantRun) -> tuple[float, float, float]:
    """The busiest second of the run over all engines (decode tokens produced): (its tokens/s,
    its steps' median ms, the largest batch in it)."""
    steps = [s for engine in run.engines for s in engine.steps]
    if not steps:
        return 0.0, float("nan"), 0.0
    end = max(t for t, *_ in steps)
    best = (0.0, float("nan"), 0.0)
    for window in np.arange(0.0, end + 1.0, 0.25):
        inside = [s for s in steps if window <= s[0] < window + 1.0]
        tokens = float(sum(b for _, _, b, _ in inside))
        if tokens > best[0]:
            best = (
                tokens,
                1e3 * float(np.median([s for _, s, _, _ in inside])),
                float(max(b for *_, b, _ in inside)),
            )
    return best


def summarize_variant(
    run: VariantRun,
    regime: Regime,
    page_bytes: int,
    arrivals_s: float,
    budget: int,
) -> dict[str, Any]:
    from kvasync._stats import percentile

    step_target = regime.step_target_frac * regime.slo_tpot_s
    per_engine = []
    for engine in run.engines:
        done = [r for r in engine.records if r.error is None]
        queued = queue_seconds(engine)
        over_target, queued_step = step_load(engine, step_target)
        memory = [b for _, b in engine.memory] or [0]
        times = [t for t, _ in engine.memory] or [0.0]
        span = times[-1] - times[0]
        per_engine.append(
            {
                "requests": len(engine.records) + int(engine.extra.get("refused", 0)),
                "done": len(done),
                "within SLO": sum(
                    within_slo(r, regime.slo_ttft_s, regime.slo_tpot_s) for r in engine.records
                ),
                "gave up": int(engine.extra.get("gave up", 0)),
                "cut": int(engine.extra.get("cut", 0)),
                "refused": int(engine.extra.get("refused", 0)),
                "preemptions": sum(r.preemptions for r in engine.records),
                "moved blocks": int(engine.extra.get("moved blocks", 0)),
                "queue s": queued["queue"],
                "memory queue s": queued["memory"],
                "compute queue s": queued["compute"],
                "batch queue s": queued["batch"],
                "steps over target": over_target,
                "queued step ms": 1e3 * queued_step,
                "TPOT misses": sum(
                    1 for r in done if r.tpot is not None and r.tpot > regime.slo_tpot_s
                ),
                "ttft": [r.ttft for r in done if r.ttft is not None],
                "tpot": [r.tpot for r in done if r.tpot is not None],
                "KV peak MiB": max(memory) / MIB,
                "KV mean MiB": (
                    float(np.trapezoid(memory, times) / span) / MIB if span > 0 else 0.0
                ),
            }
        )
    ttft = [x for e in per_engine for x in e["ttft"]]
    tpot = [x for e in per_engine for x in e["tpot"]]
    reclaim, unresolved = reclaim_times(run.ledger, page_bytes)
    blocked = blocked_spans(run.ledger)
    turns = limit_turns(run.ledger, budget, page_bytes)
    closest = [m["closest turns s"] for m in turns.values() if m["turns"] > 1]
    tokens_s, step_ms, crest_batch = crest(run)
    busy = [b for _, b in run.gpu_busy]
    total_within = sum(e["within SLO"] for e in per_engine)
    return {
        "variant": run.variant,
        "engines": [{k: v for k, v in e.items() if k not in ("ttft", "tpot")} for e in per_engine],
        "within SLO": total_within,
        "requests": sum(e["requests"] for e in per_engine),
        "done": sum(e["done"] for e in per_engine),
        "gave up": sum(e["gave up"] for e in per_engine),
        "cut": sum(e["cut"] for e in per_engine),
        "preemptions": sum(e["preemptions"] for e in per_engine),
        "queue s": sum(e["queue s"] for e in per_engine),
        "memory queue s": sum(e["memory queue s"] for e in per_engine),
        "compute queue s": sum(e["compute queue s"] for e in per_engine),
        "batch queue s": sum(e["batch queue s"] for e in per_engine),
        "TPOT misses": sum(e["TPOT misses"] for e in per_engine),
        "goodput": total_within / arrivals_s,
        "TTFT p50 s": percentile(ttft, 50) if ttft else float("nan"),
        "TTFT p99 s": percentile(ttft, 99) if ttft else float("nan"),
        "TPOT p50 ms": 1e3 * percentile(tpot, 50) if tpot else float("nan"),
        "KV mean MiB": sum(e["KV mean MiB"] for e in per_engine),
        "crest tok/s": tokens_s,
        "crest step ms": step_ms,
        "crest batch": crest_batch,
        "GPU busy max %": max(busy) if busy else float("nan"),
        "reclaim p50 ms": 1e3 * percentile(reclaim, 50) if reclaim else float("nan"),
        "reclaim max ms": 1e3 * max(reclaim) if reclaim else float("nan"),
        "reclaims": len(reclaim),
        "reclaims unresolved": unresolved,
        "blocked spans": len(blocked),
        "blocked p50 s": percentile(blocked, 50) if blocked else float("nan"),
        "blocked max s": max(blocked) if blocked else float("nan"),
        "limit changes/s max": max((m["changes per s max"] for m in turns.values()), default=0),
        "limit turns/s max": max((m["turns per s max"] for m in turns.values()), default=0),
        "limit closest turns ms": 1e3 * min(closest) if closest else float("nan"),
        "limit bound broken by": sorted(name for name, m in turns.items() if m["broken"]),
        "limit bound unconfirmed for": sorted(
            name for name, m in turns.items() if m["unconfirmed"] and not m["broken"]
        ),
        "limit turns": turns,
        "splits MiB": [None if e.limit_bytes is None else e.limit_bytes / MIB for e in run.engines],
    }
