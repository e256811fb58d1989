"""What the run prints: the variants' table, the plot of KV memory per engine over time, each
case's regime check and the goals' table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from _tables import markdown

from _colocate_many.analysis import REGROW_HOLD_S
from _colocate_many.harness import VariantRun
from _colocate_many.runs import Case
from _colocate_many.shapes import LEDGER_SAMPLE_S, MIB


def fmt(value: float, digits: int = 3) -> str:
    if value != value:  # NaN
        return "-"
    if value == int(value) and abs(value) >= 1:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def ms_text(ms: float) -> str:
    return "-" if ms != ms else f"{ms:.0f}"


def variant_table(summaries: list[dict[str, Any]], baseline: dict[str, Any]) -> str:
    columns = [
        "variant",
        "within SLO",
        "per engine",
        "x static 1/N",
        "goodput req/s",
        "done / requests",
        "gave up (cut)",
        "preempt.",
        "queued s (memory / compute / batch)",
        "TTFT p50 / p99 s",
        "TPOT p50 ms",
        "KV mean MiB",
        "crest step ms (batch)",
        "reclaim p50 / max ms (n)",
        "limit turns/s max (closest ms)",
        "split MiB",
    ]
    rows = []
    for s in summaries:
        ratio = s["within SLO"] / baseline["within SLO"] if baseline["within SLO"] else math.inf
        splits = s["splits MiB"]
        rows.append(
            [
                s["variant"],
                f"**{s['within SLO']}**",
                " / ".join(str(e["within SLO"]) for e in s["engines"]),
                f"{ratio:.2f}",
                fmt(s["goodput"]),
                f"{s['done']} / {s['requests']}",
                f"{s['gave up']} ({s['cut']})" if s["cut"] else str(s["gave up"]),
                str(s["preemptions"]),
                (
                    f"{s['queue s']:.0f} ({s['memory queue s']:.0f} / "
                    f"{s['compute queue s']:.0f} / {s['batch queue s']:.0f})"
                ),
                f"{fmt(s['TTFT p50 s'])} / {fmt(s['TTFT p99 s'])}",
                fmt(s["TPOT p50 ms"]),
                f"{s['KV mean MiB']:.0f}",
                f"{fmt(s['crest step ms'])} ({s['crest batch']:.0f})",
                (
                    f"{fmt(s['reclaim p50 ms'])} / {fmt(s['reclaim max ms'])} ({s['reclaims']})"
                    if s["reclaims"] or s["reclaims unresolved"]
                    else "-"
                ),
                (
                    f"{s['limit turns/s max']:.0f} ({ms_text(s['limit closest turns ms'])})"
                    if s["splits MiB"][0] is None
                    else "-"
                ),
                "shared" if splits[0] is None else " / ".join(f"{m:.4g}" for m in splits),
            ]
        )
    return markdown(columns, rows)


def plot_case(
    runs: list[VariantRun],
    path: Path,
    title: str,
    budget: int,
    slo_ttft: float,
    phases: list[tuple[float, int]] | None,
) -> Path:
    """One row per variant: KV memory held per engine (left, with the budget; dotted, a static
    engine's partition or a shared member's limit in force from the ledger), TTFT per request per
    engine (right, with the SLO)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(runs), 2, figsize=(14, 2.8 * len(runs)), sharex=True, squeeze=False
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, run in zip(axes, runs, strict=True):
        memory_ax, ttft_ax = row
        for index, engine in enumerate(run.engines):
            color = colors[index % len(colors)]
            label = engine.name.rsplit(" ", 1)[-1]
            memory_ax.step(
                [t for t, _ in engine.memory],
                [b / MIB for _, b in engine.memory],
                where="post",
                color=color,
                label=label,
            )
            if engine.limit_bytes is not None:
                memory_ax.axhline(engine.limit_bytes / MIB, color=color, ls=":", lw=0.8)
            done = [r for r in engine.records if r.ttft is not None]
            ttft_ax.plot(
                [r.first_token for r in done],
                [r.ttft for r in done],
                ".",
                ms=3,
                color=color,
                label=label,
            )
            missed = [r for r in engine.records if r.first_token is None]
            ttft_ax.plot(
                [r.arrival for r in missed],
                [slo_ttft * 3.2] * len(missed),
                "x",
                ms=3,
                color=color,
            )
        if run.ledger:
            # The limit in force per member (the share's cap under pressure), where below the
            # budget: the policy's step-downs and regrowth, beside what each one mapped.
            for index, engine in enumerate(run.engines):
                member = engine.name.rsplit(" ", 1)[-1]
                cap = [
                    (t, next((e[5] for e in entries if e[0] == member), budget))
                    for t, entries in run.ledger
                ]
                memory_ax.step(
                    [t for t, _ in cap],
                    [min(c, budget) / MIB for _, c in cap],
                    where="post",
                    color=colors[index % len(colors)],
                    ls=":",
                    lw=0.8,
                )
        memory_ax.axhline(budget / MIB, color="k", ls="--", lw=0.8, label="budget")
        if phases:
            for start, hot in phases:
                memory_ax.axvline(start, color="grey", lw=0.6)
                memory_ax.annotate(
                    f"e{hot} hot", (start, budget / MIB), fontsize="x-small", va="bottom"
                )
        ttft_ax.axhline(slo_ttft, color="k", ls="--", lw=0.8)
        ttft_ax.set_yscale("log")
        memory_ax.set_ylabel(f"{run.variant}\nKV mapped (MiB)")
        ttft_ax.set_ylabel("TTFT s (x: no token)")
        memory_ax.grid(alpha=0.3)
        ttft_ax.grid(alpha=0.3)
        memory_ax.legend(loc="upper right", fontsize="x-small", ncol=5)
    axes[-1][0].set_xlabel("seconds since start")
    axes[-1][1].set_xlabel("seconds since start (at the first token; x at arrival)")
    axes[0][0].set_title(title, loc="left", fontsize="medium")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def regime_text(case: Case, capacity: float | None, step_full: float | None) -> str:
    """The regime check of one case, from its static 1/N and shared runs: whether memory bound
    (static queued for memory) while compute did not (shared met the TPOT SLO and did not hold
    admission for compute); and the limits' oscillation against the policy's bound."""
    static, shared = case.summaries[0], case.summaries[1]
    slo_ms = 1e3 * case.regime.slo_tpot_s
    hot_memory = max(e["memory queue s"] for e in static["engines"])
    memory_binds = hot_memory >= case.duration  # one request or more waited all along
    tpot_misses = shared["TPOT misses"] / max(1, shared["done"])
    compute_held = shared["compute queue s"] >= max(case.duration, 0.5 * shared["queue s"])
    compute_binds = tpot_misses > 0.1 or compute_held or shared["crest step ms"] > slo_ms
    verdict = "yes" if memory_binds and not compute_binds else "NO"
    case.verdict = verdict
    crest = ""
    if capacity is not None and step_full is not None:
        crest = (
            f" At the crest (busiest second, all engines) the shared run produced "
            f"{shared['crest tok/s']:.0f} decode tok/s ({shared['crest tok/s'] / capacity:.0%} "
            f"of one engine alone at full batch, {1e3 * step_full:.1f} ms a step)."
        )
    text = (
        f"**Regime: memory-bound: {verdict}.** Memory "
        f"{'binds' if memory_binds else 'does not bind'}: static 1/N's busiest engine waited "
        f"{hot_memory:.0f} request-s for memory (admission held for blocks: a grow waiting, or "
        f"the head's blocks not available; Scheduler.held_for) ({static['preemptions']} "
        f"preemptions, {static['gave up']} clients gave up; "
        f"binding: at least one request waiting all along, {case.duration:.0f}). Compute "
        f"{'binds' if compute_binds else 'does not bind'}: in the shared run "
        f"{tpot_misses:.0%} of the finished requests missed the TPOT SLO (binding: over 10%), "
        f"admission was held for compute (the step target or the step's tokens) "
        f"{shared['compute queue s']:.0f} request-s of "
        f"{shared['queue s']:.0f} queued, the crest's steps took {fmt(shared['crest step ms'])} ms "
        f"(batch {shared['crest batch']:.0f}; SLO {slo_ms:.0f} ms). GPU busy (NVML) max "
        f"{fmt(shared['GPU busy max %'])}% shared, {fmt(static['GPU busy max %'])}% static (a "
        f"kernel running, not the device full).{crest} Shared: members blocked on the share's "
        f"budget {shared['blocked spans']} times, p50 {fmt(shared['blocked p50 s'])} s, max "
        f"{fmt(shared['blocked max s'])} s.\n"
    )
    text += limit_bound_text(shared)
    return text


def limit_bound_text(shared: dict[str, Any]) -> str:
    """The oscillation paragraph of a shared run: what the ledger showed against the bound of
    Note [Fair share under pressure], with what the check cannot see (limit_turns)."""
    hold_ms = 1e3 * REGROW_HOLD_S
    broken = shared["limit bound broken by"]
    unconfirmed = shared.get("limit bound unconfirmed for", [])
    turns = shared["limit turns"]
    if broken:
        verdict = (
            f"**broken** by {', '.join(broken)}: turns under {hold_ms:.0f} ms apart whose later "
            f"limit was over budget / members, which no guaranteed minimum reaches."
        )
    elif unconfirmed:
        pairs = "; ".join(
            f"{name} {m['close turns']:.0f}, closest {1e3 * m['closest turns s']:.0f} ms"
            for name, m in ((name, turns[name]) for name in unconfirmed)
        )
        verdict = (
            f"**kept only if** each turn under {hold_ms:.0f} ms after the one before rose to a "
            f"new peak of the member's guaranteed minimum, which the ledger does not show (such "
            f"pairs: {pairs}; each later limit at most budget / members, as such a rise is)."
        )
    else:
        verdict = "kept."
    return (
        f"\n**Limit oscillation** (shared; each member's limit in force, from the ledger every "
        f"{1e3 * LEDGER_SAMPLE_S:.0f} ms): at most {shared['limit changes/s max']:.0f} direction "
        f"changes and {shared['limit turns/s max']:.0f} fall->rise turns in any second; the "
        f"closest two turns at most {ms_text(shared['limit closest turns ms'])} ms apart. The "
        f"policy's bound (Note [Fair share under pressure]: fall->rise turns at least "
        f"{hold_ms:.0f} ms apart, so at most {math.ceil(1 / REGROW_HOLD_S)} in a second, unless "
        f"the later one rises to a new peak of the member's guaranteed minimum "
        f"min(demand, budget / members): its demand growing): {verdict}\n"
    )


def compute_regime_text(case: Case) -> str:
    """The regime check of the compute case: compute binds (in both variants, most of the queue
    waited while admission was held for compute: the step target or the step's token budget,
    and a request or more waited so all along) while memory and the batch do not (each held at
    most 10% of the queue). Sets ``case.verdict``."""
    target_ms = 1e3 * case.regime.step_target_frac * case.regime.slo_tpot_s
    parts, verdicts = [], []
    for s in case.summaries[:2]:
        queue = max(s["queue s"], 1e-9)
        compute = s["compute queue s"] >= max(case.duration, 0.5 * queue)
        memory = s["memory queue s"] > 0.1 * queue
        batch = s["batch queue s"] > 0.1 * queue
        verdicts.append(compute and not memory and not batch)
        engines = s["engines"]
        parts.append(
            f"{s['variant']}: {s['queue s']:.0f} request-s queued, held for compute "
            f"{s['compute queue s']:.0f} ({s['compute queue s'] / queue:.0%}; binding: half the "
            f"queue and at least {case.duration:.0f}), for memory {s['memory queue s']:.0f} "
            f"({s['memory queue s'] / queue:.0%}), the batch full {s['batch queue s']:.0f} "
            f"({s['batch queue s'] / queue:.0%}; binding: over 10% each); steps over the step "
            f"target ({target_ms:.0f} ms): "
            + " / ".join(f"{e['steps over target']:.0%}" for e in engines)
            + " of each engine's stepping time, mean step while requests waited "
            + " / ".join(f"{e['queued step ms']:.0f}" for e in engines)
            + f" ms; {s['preemptions']} preemptions, {s['TPOT misses']} TPOT misses, "
            f"{s['gave up']} clients gave up"
        )
    case.verdict = "yes" if all(verdicts) else "NO"
    return (
        f"**Regime: compute-bound: {case.verdict}.** "
        + "; ".join(parts)
        + ". Memory cannot bind by design (a static half holds a whole batch); where it did "
        "queue, the verdict says NO.\n"
    )


def goal_rows(memory4: Case | None, compute: Case | None) -> list[list[str]]:
    rows = []

    def get(case: Case, variant: str) -> dict[str, Any] | None:
        return next((s for s in case.summaries if s["variant"] == variant), None)

    if memory4 is not None:
        shared = get(memory4, "shared")
        static = get(memory4, "static 1/N")
        statics = [
            s for s in memory4.summaries if s["variant"].startswith("static") and s is not None
        ]
        if shared and static:
            ratio = shared["within SLO"] / max(1, static["within SLO"])
            rows.append(
                [
                    f"shared >= 2x static 1/N, memory-bound, N={memory4.n}",
                    str(shared["within SLO"]),
                    f"{static['within SLO']} (static 1/N)",
                    f"{ratio:.2f}x",
                    "met" if ratio >= 2.0 else "not met",
                ]
            )
            best = max(statics, key=lambda s: s["within SLO"])
            ratio = shared["within SLO"] / max(1, best["within SLO"])
            rows.append(
                [
                    f"shared within 10% of the best static, N={memory4.n}",
                    str(shared["within SLO"]),
                    f"{best['within SLO']} ({best['variant']})",
                    f"{ratio:.2f}x",
                    "met" if ratio >= 0.9 else "not met",
                ]
            )
    if compute is not None:
        shared = get(compute, "shared")
        static = get(compute, "static 1/N")
        if shared and static:
            ratio = shared["within SLO"] / max(1, static["within SLO"])
            rows.append(
                [
                    f"shared >= 97% of static, compute-bound (regime check: {compute.verdict}), "
                    f"N={compute.n}",
                    str(shared["within SLO"]),
                    f"{static['within SLO']} (static 1/N)",
                    f"{ratio:.2f}x",
                    (
                        "not shown (the trace did not bind compute)"
                        if compute.verdict != "yes"
                        else "met"
                        if ratio >= 0.97
                        else "not met"
                    ),
                ]
            )
    return rows
