"""The tables and plots of bench/bench_vllm.py, from the data each mode returns (the same data as
OUT/summary.json, so ``bench_vllm.py --report OUT`` prints and plots a finished run again)."""

from __future__ import annotations

import itertools
import math
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

from _tables import print_table
from _vllm_child import AFTER_SNAPSHOT

from kvasync._stats import percentile

GIB = 2**30


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def spread(values: Sequence[float]) -> float:
    """(max - min) / mean, in percent; NaN for fewer than two values."""
    if len(values) < 2:
        return math.nan
    return 100 * (max(values) - min(values)) / statistics.fmean(values)


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return None
    return plt


def save_plot(plt: Any, fig: Any, path: pathlib.Path) -> None:
    """Writes ``fig`` to ``path``, closes it and says where it went."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def heading(text: str) -> None:
    print(f"\n### {text}\n", flush=True)


# -- identity ----------------------------------------------------------------------------------


def digests(result: dict[str, Any]) -> list[str]:
    found = [d for r in result["rounds"] for d in r["digests"]]
    return found + list(result.get("trickle_digests", []))


def report_identity(data: dict[str, Any], out: pathlib.Path) -> None:
    runs = data["runs"]
    done = [r for r in runs if r.get("result")]
    heading("vLLM: outputs, throughput, start (identity mode)")
    reference = next((r for r in done if r["variant"].startswith("stock")), None)
    rows = []
    for r in runs:
        result = r.get("result")
        same = "-"
        if result and reference is not None and r is not reference:
            mine, theirs = digests(result), digests(reference["result"])
            equal = sum(a == b for a, b in zip(mine, theirs, strict=False))
            same = f"{equal}/{max(len(mine), len(theirs))}"
        elif r is reference:
            same = "(reference)"
        tok_s = [x["tok_s"] for x in result["rounds"]] if result else []
        rows.append(
            [
                r["name"],
                same,
                fmt(r.get("start_s")),
                fmt(r.get("import_s")),
                " / ".join(f"{v:.0f}" for v in tok_s) or "-",
                fmt(statistics.fmean(tok_s), 0) if tok_s else "-",
                fmt(spread(tok_s)),
                r.get("failure", r.get("shutdown_error", "")),
            ]
        )
    print_table(
        [
            "run",
            "greedy outputs identical to the first stock run",
            "start s",
            "import s",
            "output tok/s per round",
            "mean",
            "spread %",
            "failure",
        ],
        rows,
        justify=["left", "right", "right", "right", "right", "right", "right", "left"],
    )
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for r in done:
        by_kind.setdefault(r["variant"], []).append(r)
    rows = []
    means: dict[str, float] = {}
    for kind, kind_runs in by_kind.items():
        run_means = [statistics.fmean(x["tok_s"] for x in r["result"]["rounds"]) for r in kind_runs]
        rounds = [x["tok_s"] for r in kind_runs for x in r["result"]["rounds"]]
        means[kind] = statistics.fmean(run_means)
        rows.append(
            [
                kind,
                str(len(kind_runs)),
                " / ".join(f"{v:.0f}" for v in run_means),
                fmt(means[kind], 0),
                fmt(spread(run_means)),
                fmt(spread(rounds)),
                " / ".join(fmt(r.get("start_s")) for r in kind_runs),
            ]
        )
    print()
    print_table(
        [
            "engine",
            "runs",
            "run means tok/s",
            "mean tok/s",
            "spread of run means %",
            "spread of all rounds %",
            "start s",
        ],
        rows,
    )
    stock = means.get("stock")
    print()
    for kind, mean in means.items():
        if stock and kind != "stock":
            print(f"{kind} / stock output tok/s: {mean / stock:.3f}")
    # The call's first engine may have compiled kernels at start: its start is not compared.
    warm = [r for r in done if r["name"] != runs[0]["name"] and r.get("start_s") is not None]
    for kind in by_kind:
        starts = [r["start_s"] for r in warm if r["variant"] == kind]
        if starts:
            median = statistics.median(starts)
            print(f"{kind} start (not the call's first engine): median {median:.1f} s")
    print(
        "(the first engine of the call may compile Triton kernels at start; its rounds come after "
        "a warm-up of every shape they use)"
    )
    rows = []
    for r in done:
        samples = r["result"].get("samples", [])
        if not samples:
            continue
        device = [s.get("device_gib", math.nan) for s in samples]
        mapped = [s.get("mapped_gib", math.nan) for s in samples]
        rows.append(
            [
                r["name"],
                fmt(max(device), 2),
                fmt(max(mapped), 2) if not all(math.isnan(m) for m in mapped) else "-",
                fmt(mapped[-1], 2) if not math.isnan(mapped[-1]) else "-",
            ]
        )
    print()
    print_table(
        ["run", "device used GiB (max)", "mapped KV GiB (max)", "mapped KV GiB at the end"],
        rows,
    )
    plt = pyplot()
    if plt is None or not done:
        return
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for r in done:
        samples = r["result"].get("samples", [])
        if not samples:
            continue
        t0 = samples[0]["wall"]
        xs = [s["wall"] - t0 for s in samples]
        ax.plot(xs, [s.get("device_gib", math.nan) for s in samples], label=f"{r['name']}: device")
        if any(not math.isnan(s.get("mapped_gib", math.nan)) for s in samples):
            ax.plot(
                xs,
                [s.get("mapped_gib", math.nan) for s in samples],
                label=f"{r['name']}: mapped KV",
                ls="--",
            )
    ax.set_xlabel("seconds since the engine was up")
    ax.set_ylabel("GiB")
    ax.set_title("device memory used and the allocator's mapped KV (kvasync, kvcached), each run")
    ax.legend(fontsize=6)
    save_plot(plt, fig, out / "vllm_memory.png")


# -- seed A ------------------------------------------------------------------------------------


def report_seed_a(data: dict[str, Any], out: pathlib.Path) -> None:
    kind = data.get("kind", "kvasync")
    where = f"share {data['budget']}" if kind == "kvasync" else f"each {data['budget']} of KV"
    heading(f"vLLM seed A, {kind}: a second engine started beside a serving one ({where})")
    if "first_start_s" in data:
        print(f"first engine up in {data['first_start_s']:.1f} s")
    batches = data.get("first_batches", [])
    rows = []
    for s in data["starts"]:
        if "hang" in s:
            outcome = f"HANG: no '{s['hang']['what']}' within {s['hang']['elapsed_s']:.1f} s"
        elif "failure" in s:
            outcome = f"failed: {s['failure']}"
        else:
            outcome = "ok"
        during = [
            b
            for b in batches
            if "go_wall" in s and s["go_wall"] <= b["end"] <= s.get("end_wall", 0)
        ]
        rows.append(
            [
                str(s["start"]),
                outcome,
                fmt(s.get("start_s")),
                fmt(s["output_tokens"] / s["served_s"], 0) if s.get("served_s") else "-",
                fmt(s.get("shutdown_s")),
                str(len(during)),
                {True: "yes", False: "no"}.get(s.get("first_alive"), "-"),
            ]
        )
    print_table(
        [
            "start",
            "outcome",
            "start s",
            "second's tok/s",
            "shutdown s",
            "first's batches done meanwhile",
            "first alive",
        ],
        rows,
        justify=["right", "left", "right", "right", "right", "right", "left"],
    )
    ok = [s for s in data["starts"] if "start_s" in s]
    hangs = [s for s in data["starts"] if "hang" in s]
    if ok:
        times = [s["start_s"] for s in ok]
        print(
            f"\nstarts: {len(ok)}/{len(data['starts'])} up, {len(hangs)} hangs; start s min "
            f"{min(times):.1f}, median {statistics.median(times):.1f}, max {max(times):.1f}"
        )
    first = data.get("first") or {}
    if batches:
        ends = [b["end"] for b in batches]
        gaps = [b - a for a, b in itertools.pairwise(ends)]
        print(
            f"first engine: {len(batches)} batches, "
            f"{sum(b['output_tokens'] for b in batches)} output tokens, longest time between two "
            f"batch ends {max(gaps, default=math.nan):.1f} s (median "
            f"{statistics.median(gaps) if gaps else math.nan:.1f} s); its allocator mapped "
            f"{fmt(first.get('maps'), 0)} and unmapped {fmt(first.get('unmaps'), 0)} times"
        )
    mapped = [x.get("mapped_gib", math.nan) for x in first.get("samples", [])]
    seen = [m for m in mapped if not math.isnan(m)]
    if kind == "kvcached" and seen:
        print(
            f"first engine's mapped KV (kvcached's count): max {max(seen):.2f} GiB, at the end "
            f"{seen[-1]:.2f} GiB"
        )
    for key in ("first_failure", "stopped"):
        if key in data:
            print(f"{key}: {data[key]}")
    ledger = data.get("ledger", [])
    plt = pyplot()
    if plt is None or not ledger:
        return
    t0 = ledger[0]["wall"]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    xs = [s["wall"] - t0 for s in ledger]
    first_name = "seedA-first"
    ax.plot(xs, [s["mapped_gib"].get(first_name, 0.0) for s in ledger], label="first engine")
    ax.plot(
        xs,
        [sum(v for k, v in s["mapped_gib"].items() if k != first_name) for s in ledger],
        label="second engine (each start)",
    )
    ax.plot(xs, [s["budget_gib"] for s in ledger], color="grey", ls=":", label="share budget")
    for s in data["starts"]:
        if "go_wall" in s:
            ax.axvspan(s["go_wall"] - t0, s.get("end_wall", s["go_wall"]) - t0, alpha=0.12)
    ax.set_xlabel("seconds")
    ax.set_ylabel("mapped KV GiB (share ledger)")
    ax.set_title(
        f"seed A: the first engine serves while a second starts {len(data['starts'])} times "
        "(shaded)"
    )
    ax.legend(fontsize=7)
    save_plot(plt, fig, out / "vllm_seed_a.png")


# -- a neighbour's release ---------------------------------------------------------------------


def report_release(data: dict[str, Any], out: pathlib.Path) -> None:
    heading("vLLM: a second engine starts while the first releases its memory")
    rows = []
    for a in data["attempts"]:
        rows.append(
            [
                a["variant"],
                str(a["attempt"]),
                fmt(a.get("release_at_s")),
                "log line" if a.get("trigger") in AFTER_SNAPSHOT else "none",
                fmt(a.get("first_gone_at_s")),
                "yes" if a.get("started") else "no",
                fmt(a.get("start_s")),
                (a.get("error") or a.get("failure") or "")[:300],
            ]
        )
    print_table(
        [
            "engines",
            "attempt",
            "first told to leave, s after the second's go",
            "on the second's 'loading the model'",
            "first gone, s",
            "second started",
            "start s",
            "error",
        ],
        rows,
        justify=["left", "right", "right", "left", "right", "left", "right", "left"],
    )
    for variant in dict.fromkeys(a["variant"] for a in data["attempts"]):
        tried = [a for a in data["attempts"] if a["variant"] == variant and "release_at_s" in a]
        started = [a for a in tried if a.get("started")]
        print(f"{variant}: {len(started)}/{len(tried)} second engines started")
    print(
        "(the first is told to leave once the second's log says it is loading the model: its "
        "memory snapshot is taken, the profile that compares free memory against it is next)"
    )


# -- two engines on one budget -----------------------------------------------------------------


def engine_rows(variant: str, label: str, result: dict[str, Any], slo: float) -> list[str]:
    requests = list(result["requests"].values())
    ttft = [r["first"] - r["at"] for r in requests if r["first"] is not None]
    late = max((r["arrived"] - r["at"] for r in requests), default=math.nan)
    finished = [r for r in requests if r["finished"] is not None]
    within = sum(1 for t in ttft if t <= slo)
    tokens = sum(r["output_tokens"] for r in requests)
    end = max((r["finished"] for r in finished), default=math.nan)
    samples = result.get("samples", [])
    mapped = [s.get("mapped_gib", math.nan) for s in samples]
    in_use = [s.get("kv_used_gib", math.nan) for s in samples]
    peak = max((m for m in mapped if not math.isnan(m)), default=math.nan)
    peak_use = max((m for m in in_use if not math.isnan(m)), default=math.nan)
    return [
        variant,
        label,
        str(len(requests)),
        str(len(finished)),
        f"{within}/{len(requests)}",
        fmt(percentile(ttft, 50), 2),
        fmt(percentile(ttft, 90), 2),
        fmt(max(ttft, default=math.nan), 2),
        fmt(tokens / end if end and not math.isnan(end) else math.nan, 0),
        fmt(result.get("preemptions"), 0),
        fmt(peak_use, 2),
        fmt(peak, 2),
        fmt(result.get("start_s")),
        fmt(late, 2),
    ]


def ledger_mapped_peak(record: dict[str, Any]) -> float:
    """The most KV the share's members had mapped at once: each ledger sample is one snapshot
    of every member, so their sum is what was mapped at that moment."""
    samples = record.get("ledger") or []
    return max((sum(s["mapped_gib"].values()) for s in samples), default=math.nan)


def joint_mapped_peak(engines: dict[str, Any]) -> float:
    """At most the KV the engines had mapped at once, from their own samples on the wall clock
    (each engine's latest figure at every sample of either). The engines sample apart, so a
    falling engine's last figure is summed with a rising one's: an upper bound, used only where
    no ledger sees both at once (kvcached)."""
    merged = sorted(
        (s["wall"], label, s["mapped_gib"])
        for label, result in engines.items()
        for s in result.get("samples", [])
        if not math.isnan(s.get("mapped_gib", math.nan))
    )
    latest: dict[str, float] = {}
    peak = math.nan
    for _, label, mapped in merged:
        latest[label] = mapped
        total = sum(latest.values())
        peak = total if math.isnan(peak) else max(peak, total)
    return peak


def joint_mapped_text(record: dict[str, Any]) -> str:
    if record.get("ledger"):
        return fmt(ledger_mapped_peak(record), 2)
    bound = joint_mapped_peak(record["engines"])
    return "-" if math.isnan(bound) else f"<= {fmt(bound, 2)}"


def report_two(data: dict[str, Any], out: pathlib.Path) -> None:
    slo = data["slo_s"]
    heading(
        f"vLLM: two engines, {data['budget_gib']:.1f} GiB of KV between them, alternating bursts "
        f"(TTFT SLO {slo} s)"
    )
    rows = []
    totals = []
    for variant, record in data["variants"].items():
        if "engines" not in record:
            rows.append([variant, record.get("failure", "not run")[:200], *["-"] * 12])
            continue
        all_requests: dict[str, Any] = {}
        for label, result in record["engines"].items():
            rows.append(engine_rows(variant, label, result, slo))
            all_requests.update({f"{label}{k}": v for k, v in result["requests"].items()})
        ttft = [r["first"] - r["at"] for r in all_requests.values() if r["first"] is not None]
        tokens = sum(r["output_tokens"] for r in all_requests.values())
        end = max((r["finished"] or 0.0 for r in all_requests.values()), default=0.0)
        pre = [e.get("preemptions") for e in record["engines"].values()]
        t0 = next(iter(record["engines"].values()))["t0_wall"]
        busy = [b for w, b in record.get("gpu_busy", []) if t0 <= w <= t0 + end]
        totals.append(
            [
                variant,
                f"{sum(1 for t in ttft if t <= slo)}/{len(all_requests)}",
                fmt(percentile(ttft, 50), 2),
                fmt(percentile(ttft, 90), 2),
                fmt(tokens / end if end else math.nan, 0),
                fmt(sum(p for p in pre if p is not None), 0) if None not in pre else "-",
                fmt(statistics.fmean(busy), 0) if busy else "-",
                joint_mapped_text(record),
            ]
        )
    print_table(
        [
            "variant",
            "engine",
            "requests",
            "finished",
            "TTFT within SLO",
            "TTFT p50 s",
            "TTFT p90 s",
            "TTFT max s",
            "output tok/s",
            "preemptions",
            "KV in use GiB (max)",
            "mapped KV GiB (max)",
            "start s",
            "latest arrival, s behind the trace",
        ],
        rows,
    )
    print()
    print_table(
        [
            "variant",
            "TTFT within SLO",
            "p50 s",
            "p90 s",
            "output tok/s (both)",
            "preemptions",
            "GPU busy % (NVML, over the trace)",
            "A + B mapped KV GiB (max)",
        ],
        totals,
    )
    print(
        "A + B mapped: the share's ledger, one snapshot of both engines every 0.1 s; '<=' where "
        "there is no ledger (the engines' own samples, taken apart: an upper bound)."
    )
    if "kvcached" in data["variants"]:
        print(
            "kvcached has no budget shared between engines: each engine's KV capacity is the "
            "whole budget, mapped as used, and nothing caps A + B (the last column)."
        )
    plot_two(data, out)


def plot_two(data: dict[str, Any], out: pathlib.Path) -> None:
    variants = [(v, r) for v, r in data["variants"].items() if "engines" in r]
    plt = pyplot()
    if plt is None or not variants:
        return
    fig, axes = plt.subplots(len(variants), 1, figsize=(9, 2.6 * len(variants)), squeeze=False)
    for ax, (variant, record) in zip(axes[:, 0], variants, strict=True):
        for label, result in record["engines"].items():
            t0 = result["t0_wall"]
            samples = result.get("samples", [])
            xs = [s["wall"] - t0 for s in samples]
            mapped = [s.get("mapped_gib", math.nan) for s in samples]
            if any(not math.isnan(m) for m in mapped):
                ax.plot(xs, mapped, label=f"{label}: mapped KV")
            used = [s.get("kv_used_gib", math.nan) for s in samples]
            ax.plot(xs, used, ls="--", label=f"{label}: KV in use")
            if variant.startswith("static"):  # each engine's half
                ax.axhline(data["budget_gib"] / 2, color="grey", ls=":", lw=0.8)
        for index, engine in enumerate(data["plan"]):
            bursts: dict[str, list[float]] = {}
            for r in engine:
                bursts.setdefault(r["id"].split("-")[0], []).append(r["at"])
            for ats in bursts.values():  # each burst's arrivals, in its engine's colour
                ax.axvspan(min(ats), max(ats) + 0.05, color=f"C{index}", alpha=0.15)
        ledger = record.get("ledger") or []
        if ledger:  # both engines' mapped KV on one clock, as the share's ledger saw it
            t0 = next(iter(record["engines"].values()))["t0_wall"]
            ax.plot(
                [x["wall"] - t0 for x in ledger],
                [sum(x["mapped_gib"].values()) for x in ledger],
                color="black",
                lw=0.8,
                label="A + B mapped (ledger)",
            )
        ax.axhline(data["budget_gib"], color="black", ls=":", lw=0.8, label="budget (both)")
        ax.set_title(variant, fontsize=9)
        ax.set_ylabel("GiB")
        ax.legend(fontsize=6, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the trace started")
    save_plot(plt, fig, out / "vllm_two_engines.png")


# -- colocate ----------------------------------------------------------------------------------


def report_colocate(data: dict[str, Any], out: pathlib.Path) -> None:
    heading("vLLM: a second engine while a stock engine at 0.85 serves")
    rows = [
        [
            s["kind"],
            "yes" if "start_s" in s else "no",
            fmt(s.get("start_s")),
            fmt(s.get("tok_s"), 0),
            s.get("error", "")[:300],
        ]
        for s in data.get("seconds", [])
    ]
    print_table(
        ["second engine", "started", "start s", "output tok/s", "error"],
        rows,
        justify=["left", "left", "right", "right", "left"],
    )


# Student's t, two-sided 95%, by degrees of freedom (1..30); past 30 the normal's 1.96 is within 2%.
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
       2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
       2.052, 2.048, 2.045, 2.042)  # fmt: skip

WARMUP = [[32, 128, 16], [16, 1024, 16], [256, 512, 16]]


def mean_with_ci(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95% confidence interval (NaN with fewer than 2)."""
    mean = statistics.fmean(values) if values else math.nan
    if len(values) < 2:
        return mean, math.nan
    t = T95[len(values) - 2] if len(values) - 1 <= len(T95) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def report_throughput(data: dict[str, Any], out: pathlib.Path) -> None:
    heading("vLLM: throughput, stock and kvasync up at once, rounds in turn (throughput mode)")
    pairs = data.get("pairs", [])
    ratios = [p["ratio"] for p in pairs]
    mean, half = mean_with_ci(ratios)
    stock = [p["stock"]["tok_s"] for p in pairs]
    kvasync = [p["kvasync"]["tok_s"] for p in pairs]
    identical = sum(p["identical"] for p in pairs)
    count, prompt_len, output_len = data.get("round", [0, 0, 0])

    def spread_text(values: list[float]) -> str:
        if not values:
            return "-"
        return f"{(max(values) - min(values)) / statistics.fmean(values) * 100:.0f}%"

    rows = [
        [
            "stock",
            f"{data.get('stock_start_s', math.nan):.1f}",
            f"{statistics.fmean(stock):.0f}" if stock else "-",
            spread_text(stock),
            "(reference)",
        ],
        [
            "kvasync",
            f"{data.get('kvasync_start_s', math.nan):.1f}",
            f"{statistics.fmean(kvasync):.0f}" if kvasync else "-",
            spread_text(kvasync),
            f"{identical}/{len(pairs)} rounds",
        ],
    ]
    print_table(
        ["engine", "start s", "mean output tok/s", "spread of rounds", "greedy outputs identical"],
        rows,
        justify=["left", "right", "right", "right", "right"],
    )
    print(
        f"\n{len(pairs)} pairs of rounds of {count} requests x {prompt_len}+{output_len} tokens; "
        f"kvasync / stock, mean of the pairs' ratios: **{mean:.3f}**, 95% CI "
        f"[{mean - half:.3f}, {mean + half:.3f}] (+-{half * 100:.1f}%)."
        + (f" {data['cut']}." if data.get("cut") else "")
        + (f" Ended early: {data['error']}" if data.get("error") else "")
    )


def report_limit_memory(data: dict[str, Any], out: pathlib.Path) -> None:
    heading(
        f"vLLM: device memory under a KV limit of {data['limit_bytes'] / GIB:.2f} GiB "
        "(limit-memory mode; peaks over the run, first sample after start in brackets)"
    )

    def cell(entry: dict[str, Any], key: str) -> str:
        peak, first = entry.get(f"{key}_peak"), entry.get(f"{key}_first")
        if peak is None:
            return "-"
        return f"{peak:.2f} ({first:.2f})"

    rows = []
    for kind, entry in data["engines"].items():
        rows.append(
            [
                kind,
                cell(entry, "device_gib"),
                cell(entry, "torch_reserved_gib"),
                cell(entry, "torch_allocated_gib"),
                cell(entry, "mapped_gib"),
                cell(entry, "other_gib"),
                str(entry.get("kv_blocks", "-")),
                entry.get("failure", ""),
            ]
        )
    print_table(
        [
            "engine",
            "device used GiB",
            "torch reserved GiB",
            "torch allocated GiB",
            "kvasync mapped GiB",
            "device - torch - mapped GiB",
            "KV blocks",
            "failure",
        ],
        rows,
        justify=["left", "right", "right", "right", "right", "right", "right", "left"],
    )


REPORTS = {
    "throughput": report_throughput,
    "limit-memory": report_limit_memory,
    "identity": report_identity,
    "seed-a": report_seed_a,
    "release": report_release,
    "two": report_two,
    "colocate": report_colocate,
}


def report_mode(mode: str, data: dict[str, Any], out: pathlib.Path) -> None:
    """Prints one mode's tables (and writes its plot); a mode that did not run says why."""
    for key in ("not_run", "failure"):
        if key in data:
            heading(f"vLLM {mode}: {key.replace('_', ' ')}")
            print(data[key])
            return
    try:
        REPORTS[mode](data, out)
    except Exception as error:  # a report's bug must not cost the run: the data is kept
        print(f"(the {mode} report failed: {type(error).__name__}: {error}; data in summary.json)")
    print(f"({mode}: {data.get('wall_s', math.nan):.0f} s)", flush=True)


def report_all(summary: dict[str, Any], out: pathlib.Path) -> None:
    for mode, data in summary["modes"].items():
        report_mode(mode, data, out)
