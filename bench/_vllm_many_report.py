"""The tables, goals and plots of bench/bench_vllm_many.py, from OUT/summary.json's data (so
``bench_vllm_many.py --report OUT`` prints and plots a finished run again)."""

from __future__ import annotations

import math
import pathlib
from typing import Any

import _vllm_many_checks as checks
from _tables import print_table
from _vllm_report import fmt, heading, pyplot, save_plot

GIB = 2**30


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else math.nan


def summaries(case: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each variant that ran: its summary (bench/_vllm_many_checks.py)."""
    found = {}
    for name, record in case["variants"].items():
        if record.get("engines"):
            found[name] = checks.variant_summary(record, case["spec"], case["plan"])
    return found


def print_paper(case: dict[str, Any]) -> None:
    spec = case["spec"]
    heading(
        f"{spec['name']}: {len(spec['models'])} vLLM engines, {spec['budget'] / GIB:.1f} GiB of KV "
        f"between them ({spec['kind']}-bound trace, {spec['duration_s']:.0f} s of arrivals; SLO "
        f"TTFT {spec['slo_ttft_s']} s, TPOT {spec['slo_tpot_s'] * 1e3:.0f} ms)"
    )
    print_table(case["paper"]["columns"], case["paper"]["rows"])
    load = case["paper"].get("prefill_load")
    if load is not None:
        print(
            f"\nThe prompts ask {100 * load:.0f}% of the GPU's time over the arrivals (prefill "
            "rates per model: priors in bench/_vllm_many.py, PREFILL_TOK_S)"
        )
    sims = case["paper"].get("simulated", {})
    if sims:
        print(
            f"\nOn paper (bench/_vllm_many_sim.py, step model priors): of "
            f"{case['paper'].get('requests', '?')} requests, within SLO "
            + ", ".join(f"{k} {v}" for k, v in sims.items())
            + " ('alone': each engine with the whole budget, an upper bound for shared)"
        )


def print_variants(case: dict[str, Any], found: dict[str, dict[str, Any]]) -> None:
    spec = case["spec"]
    rows = []
    for name, record in case["variants"].items():
        if name not in found:
            rows.append([name, record.get("failure", "not run")[:160], *["-"] * 11])
            continue
        s = found[name]
        split = record.get("split")
        rows.append(
            [
                name,
                f"{s['within_slo']}/{s['requests']}",
                " / ".join(str(e["within_slo"]) for e in s["per_engine"]),
                fmt(s["goodput"], 2),
                fmt(s["preemptions"], 0),
                f"{s['queue_memory_s']:.0f} / {s['queue_compute_s']:.0f}",
                fmt(s["crest"]["step_ms"], 1),
                fmt(s["gpu_busy"], 0),
                fmt(s.get("ledger_peak", {}).get("committed", math.nan) / GIB, 2),
                " / ".join(f"{b / GIB:.2f}" for b in split) if split else "shared",
                fmt(record.get("simulated"), 0),
                " / ".join(fmt(e["start_s"]) for e in s["per_engine"]),
                fmt(record.get("start_wall_s")),
            ]
        )
    print()
    print_table(
        [
            "variant",
            "within SLO (TTFT and TPOT)",
            "per engine",
            "goodput req/s",
            "preemptions",
            "queued s (memory / compute)",
            "crest step ms",
            "GPU busy % (NVML)",
            "ledger max GiB",
            "split GiB",
            "simulated within SLO",
            "engine start s",
            "variant up s",
        ],
        rows,
    )
    rows = []
    for name, s in found.items():
        for e, engine in enumerate(s["per_engine"]):
            rows.append(
                [
                    name,
                    f"e{e} {spec['models'][e]}",
                    str(engine["requests"]),
                    str(engine["within_slo"]),
                    str(engine["within_ttft"]),
                    str(engine["aborted"]),
                    fmt(engine["ttft_p50"], 2),
                    fmt(engine["ttft_p99"], 2),
                    fmt(engine["tpot_p50"] * 1e3, 0),
                    fmt(engine["preemptions"], 0),
                    fmt(engine["kv_used_max_gib"], 2),
                    fmt(engine["mapped_max_gib"], 2),
                    fmt(engine["late_max_s"], 3),
                ]
            )
    print()
    print_table(
        [
            "variant",
            "engine",
            "requests",
            "within SLO",
            "within TTFT",
            "gave up",
            "TTFT p50 s",
            "TTFT p99 s",
            "TPOT p50 ms",
            "preemptions",
            "KV in use GiB (max)",
            "mapped GiB (max)",
            "latest arrival, s behind the trace",
        ],
        rows,
    )


def print_checks(case: dict[str, Any], found: dict[str, dict[str, Any]]) -> None:
    spec = case["spec"]
    for name, s in found.items():
        if not s.get("ledger_peak"):
            continue
        peak = s["ledger_peak"]["committed"]
        verdict = "kept" if peak <= spec["budget"] else "BROKEN"
        print(
            f"\n{name}: ledger max {peak / GIB:.3f} GiB committed "
            f"(mapped {s['ledger_peak']['mapped'] / GIB:.3f}) "
            f"against the budget {spec['budget'] / GIB:.3f} GiB: {verdict}"
        )
        cold = s["cold_starts"]
        if cold:
            inside = sum(c["within"] for c in cold)
            print(
                f"  cold starts: {inside}/{len(cold)} first requests within the TTFT SLO "
                + "; ".join(
                    f"e{c['engine']} at {c['at']:.1f} s: TTFT {fmt(c['ttft_s'], 2)} s, another "
                    f"member held {fmt(100 * c['others_max_share'], 0)}% of the budget"
                    for c in cold
                )
            )
        spells = [(e, x) for e, xs in s["idle"].items() for x in xs]
        if spells:
            times = [x["release_s"] for _, x in spells]
            worst = math.nan if any(math.isnan(t) for t in times) else max(times)
            late = [
                (e, x)
                for e, x in spells
                if math.isnan(x["release_s"]) or x["release_s"] > checks.IDLE_BOUND_S
            ]
            print(
                f"  idle release: {len(spells) - len(late)}/{len(spells)} idle spells back to the "
                "null "
                f"block's page + reserve within {checks.IDLE_BOUND_S} s (slowest {fmt(worst, 2)} s)"
                + "".join(
                    f"; e{e} at {x['begin']:.1f} s ({x['length']:.1f} s idle): "
                    f"{fmt(x['release_s'], 2)} s to {x['floor_gib']:.2f} GiB"
                    for e, x in late
                )
            )
        turns = s.get("limit_turns", {})
        if turns:
            print(
                "  limit turns (changes / fall->rise turns / closest turns s): "
                + "; ".join(
                    f"{m} {t['changes']:.0f} / {t['turns']:.0f} / {fmt(t['closest_s'], 2)}"
                    for m, t in turns.items()
                )
            )
    static, shared = found.get("stock-1N"), found.get("shared")
    if static is not None:
        if spec["kind"] == "memory":
            verdict = "yes" if checks.memory_bound(static, shared, spec["slo_ttft_s"]) else "NO"
            print(f"\nregime check, memory-bound: {verdict}", end="")
        elif shared is not None:
            verdict = "yes" if checks.compute_bound(static, shared) else "NO"
            print(f"\nregime check, compute-bound: {verdict}", end="")
        print(
            " (queued request-s, memory / compute: "
            + "; ".join(
                f"{n} {s['queue_memory_s']:.0f} / {s['queue_compute_s']:.0f}"
                for n, s in found.items()
            )
            + ")"
        )
    crest = {n: s["crest"] for n, s in found.items()}
    if crest:
        print(
            "\nregime: crest (busiest second, all engines): "
            + "; ".join(
                f"{n} {c['tokens_s']:.0f} tok/s, step {fmt(c['step_ms'], 1)} ms, "
                f"batch {c['running']:.0f}"
                for n, c in crest.items()
            )
        )


def goal_rows(
    cases: dict[str, dict[str, Any]], found: dict[str, dict[str, dict[str, Any]]]
) -> list[list[str]]:
    """The issue's goals, each beside its baseline from the same run."""
    rows = []

    def within(case: str, variant: str) -> float | None:
        s = found.get(case, {}).get(variant)
        return float(s["within_slo"]) if s else None

    for case, bound in (("memory4", 2.0), ("memory8", 2.0)):
        shared, static = within(case, "shared"), within(case, "stock-1N")
        if case in cases:
            ratio = _ratio(shared, static)
            regime = (
                case in found
                and "stock-1N" in found[case]
                and checks.memory_bound(
                    found[case]["stock-1N"],
                    found[case].get("shared"),
                    cases[case].get("spec", {}).get("slo_ttft_s"),
                )
            )
            rows.append(
                [
                    f"{case}: shared >= {bound:.0f}x stock static 1/N",
                    fmt(shared, 0),
                    f"{fmt(static, 0)} (stock 1/N)",
                    fmt(ratio, 2),
                    ("met" if ratio >= bound else "NOT met")
                    + ("" if regime else " (regime check: not memory-bound)"),
                ]
            )
    if "memory4" in cases:
        statics = {
            v: within("memory4", v) for v in found.get("memory4", {}) if v.startswith("hindsight")
        }
        statics = {v: w for v, w in statics.items() if w is not None}
        shared = within("memory4", "shared")
        if statics:
            best = max(statics, key=lambda v: statics[v] or 0)
            ratio = _ratio(shared, statics[best])
            rows.append(
                [
                    "memory4: shared >= best static split with hindsight (or within 5%)",
                    fmt(shared, 0),
                    f"{fmt(statics[best], 0)} ({best})",
                    fmt(ratio, 2),
                    "met" if ratio >= 0.95 else "NOT met",
                ]
            )
    if "compute4" in cases:
        shared, static = within("compute4", "shared"), within("compute4", "stock-1N")
        ratio = _ratio(shared, static)
        regime = (
            "compute4" in found
            and {"shared", "stock-1N"} <= set(found["compute4"])
            and checks.compute_bound(found["compute4"]["stock-1N"], found["compute4"]["shared"])
        )
        rows.append(
            [
                "compute4: shared >= 97% of stock static 1/N",
                fmt(shared, 0),
                f"{fmt(static, 0)} (stock 1/N)",
                fmt(ratio, 3),
                ("met" if ratio >= 0.97 else "NOT met")
                + ("" if regime else " (regime check: not compute-bound)"),
            ]
        )
    for case, summaries_ in found.items():
        shared_run = summaries_.get("shared")
        if shared_run is None:
            continue
        peak = shared_run.get("ledger_peak", {}).get("committed")
        budget = cases[case]["spec"]["budget"] if "spec" in cases[case] else None
        if peak is not None and budget:
            rows.append(
                [
                    f"{case}: the ledger never over the budget (shared run)",
                    f"{peak / GIB:.3f} GiB",
                    f"{budget / GIB:.3f} GiB",
                    fmt(peak / budget, 3),
                    "met" if peak <= budget else "NOT met",
                ]
            )
        spells = [x for xs in shared_run.get("idle", {}).values() for x in xs]
        if spells:
            times = [x["release_s"] for x in spells]
            ok = all(t <= checks.IDLE_BOUND_S for t in times)  # False for a NaN: never back
            slowest = math.nan if any(math.isnan(t) for t in times) else max(times)
            rows.append(
                [
                    f"{case}: an idle engine back to its null block's page + reserve within "
                    f"{checks.IDLE_BOUND_S:.0f} s (shared run)",
                    "one never back" if math.isnan(slowest) else f"{slowest:.2f} s (slowest)",
                    f"{len(spells)} idle spells",
                    "-",
                    "met" if ok else "NOT met",
                ]
            )
    cold = [
        c
        for case in ("memory4", "memory8")
        for c in found.get(case, {}).get("shared", {}).get("cold_starts", [])
    ]
    if cold:
        inside = sum(c["within"] for c in cold)
        pressed = sum(c.get("others_max_share", 0.0) > 0.5 for c in cold)
        rows.append(
            [
                "cold starts: every cold model's first request within TTFT SLO (shared runs)",
                str(inside),
                f"{len(cold)} cold starts ({pressed} while another engine held over half the "
                "budget)",
                fmt(inside / len(cold), 2),
                "met" if inside == len(cold) else "NOT met",
            ]
        )
    return rows


def plot_case(case: dict[str, Any], out: pathlib.Path) -> None:
    """One panel a variant: each engine's mapped KV (kvasync: the share's ledger) or KV in use
    (stock) over the trace, its partition where static, the budget; each burst shaded."""
    variants = [(n, r) for n, r in case["variants"].items() if r.get("engines")]
    plt = pyplot()
    if plt is None or not variants:
        return
    spec = case["spec"]
    fig, axes = plt.subplots(len(variants), 1, figsize=(10, 2.4 * len(variants)), squeeze=False)
    for ax, (name, record) in zip(axes[:, 0], variants, strict=True):
        t0 = record["engines"][0]["t0_wall"]
        ledger = record.get("ledger") or []
        for e, result in enumerate(record["engines"]):
            label = f"e{e} {spec['models'][e]}"
            member = record["names"][e] if record.get("names") else None
            if ledger and member:
                xs = [s["wall"] - t0 for s in ledger]
                ys = [s["members"].get(member, {}).get("mapped", 0) / GIB for s in ledger]
                ax.plot(xs, ys, color=f"C{e}", label=f"{label}: mapped")
            else:
                samples = result.get("samples", [])
                xs = [s["wall"] - t0 for s in samples]
                ax.plot(
                    xs,
                    [s.get("kv_used_gib", math.nan) for s in samples],
                    color=f"C{e}",
                    ls="--",
                    label=f"{label}: in use",
                )
            if record.get("split"):
                ax.axhline(record["split"][e] / GIB, color=f"C{e}", ls=":", lw=0.7)
            bursts = (
                {r["id"].split("-")[1] for r in case["plan"][e]}
                if spec["kind"] == "memory"
                else set()
            )
            for burst in sorted(b for b in bursts if b.startswith("b")):
                ats = [r["at"] for r in case["plan"][e] if r["id"].split("-")[1] == burst]
                ax.axvspan(min(ats), max(ats) + 0.05, color=f"C{e}", alpha=0.1)
        if ledger:
            ax.plot(
                [s["wall"] - t0 for s in ledger],
                [sum(m["mapped"] for m in s["members"].values()) / GIB for s in ledger],
                color="black",
                lw=0.8,
                label="all mapped (ledger)",
            )
        ax.axhline(spec["budget"] / GIB, color="black", ls=":", lw=0.8, label="budget")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("GiB")
        ax.legend(fontsize=6, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel("seconds since the trace started")
    save_plot(plt, fig, out / f"vllm_many_{spec['name']}.png")


def report_case(case: dict[str, Any], out: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Prints a case's tables and checks and writes its plot; returns its summaries."""
    print_paper(case)
    found = summaries(case)
    print_variants(case, found)
    print_checks(case, found)
    plot_case(case, out)
    return found


def report_all(summary: dict[str, Any], out: pathlib.Path) -> None:
    found = {}
    for name, case in summary["cases"].items():
        if "variants" not in case:
            heading(f"{name}: {case.get('failure', 'not run')}")
            continue
        found[name] = report_case(case, out)
    heading("Goals (issue 28), each beside its baseline from the same run")
    print_table(
        ["goal", "shared", "baseline", "ratio", "result"],
        goal_rows(summary["cases"], found),
        justify=["left", "right", "right", "right", "left"],
    )
