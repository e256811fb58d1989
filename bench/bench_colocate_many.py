#!/usr/bin/env python3
"""Many models on one device, where KV memory binds: N engines sharing one KV budget through
kvasync against static partitions of it (issue 16).

Each engine is its own process (our serving engine, kvasync.serve) with its own model and its own
seeded trace, all on one device; they start their traces at the same moment. Variants, on the
same traces:

  static 1/N   each engine maps budget/N at start and keeps it (``static=True``): what co-located
               engines with preallocated pools do.
  shared       one budget through kvasync (``Config(share=..., device_budget=budget)``): each
               engine maps what it needs, the share keeps their sum within the budget.
  best static  the static split chosen with hindsight: splits proportional to each engine's peak
               and mean KV demand (estimated from the trace by Little's law) and to the peaks the
               shared run measured; the best of them and 1/N is the upper bound of any static
               policy (on these traces).

Cases:

  memory   the regime co-location exists for, built from first principles: KV memory binds
           while compute does not. Popularity is skewed: one engine is hot, the others get
           ``cold_weight`` of its arrival rate; the hot one changes once (engine 0 for 2/3 of
           the run, then engine 1; with N = 4 engines 2 and 3 stay cold); every engine has
           seeded bursts. Requests are decode-heavy: short prompts (small: 160-640 tokens) and
           long outputs (192-448), so that each holds KV for seconds at little compute a second
           (a decode step of a batch of 200 costs about what one of 10 does: 24 against 16 ms on
           the H200). The hot rate is set before any variant runs (the calibration, below) so
           that the hot engine's working set (Little's law: rate x lifetime x KV per request)
           is ``hot_fill`` of the whole budget, 3x a 1/4 partition, while the hot engine and the
           cold ones fit the budget together (0.75 x (1 + 3 x 0.05) = 0.86).

  compute  the regime where compute binds and memory cannot, by design (static halves against
           shared; no memory policy can win here, the goal is not to lose). Two engines with
           bench_serving.py's bump-shaped arrivals (cresting at 30% and 70% of the run, 10% of
           the crest away from it), but prefill-heavy requests (small: prompts of 1024-2048
           tokens, outputs of 32-96), so that a request costs the device its prefill and little
           decode time: compute binds at a batch far below max_batch. The crest is
           ``overload`` (1.75) times what one engine alone serves with its steps at the step
           target (below), and the budget is two whole batches (max_batch requests of mean
           size each), so a static half holds every batch the engine may run: memory cannot
           bind before the batch does, and the batch not before compute. (bench_serving's own
           shapes, outputs of 64-512 at 22 ms decode steps, fill the batch of 256 before the
           steps reach the target on the H200; with its 3072 MiB budget the static halves
           queued for memory: the H200 run of 2026-12-01 said memory-bound.)

Calibration (memory case), each figure measured: decode steps alone at the full batch, the hot
batch and the cold one, and the prefill rate; the hot engine's decode step with N - 1 engines
stepping at the cold batch beside it (the contention); a stream on one engine alone, whose
requests' KV lifetime (admission to end) and time per token (prefills and decodes mixed) give
a first lifetime at the hot batch (x the contention) and a first hot rate, the hot batch over it.
That product of factors measured apart overstated the lifetime on the H200 (16.2 s against about
10.9 s in the run), so it is measured again where the runs will be: the hot engine replays a
stream at the first rate while the cold engines replay theirs beside it, and its requests' KV
lifetime (scaled to the hot batch by the decode steps) gives the hot rate. The hot engine's
streams need at least 10 requests each (a mean lifetime within about 8%): a --calibration-s too
short for that at the rate calibrated stops with an argparse error naming the seconds needed. A
cold engine's stream with no request in the window (a low rate over a short one) replays
nothing, and the output says the lifetime was measured without that engine's contention. The
compute check: the hot engine's step in a run, predicted as the decode step at its batch x the
stream's prefill factor x the contention, must stay within ``--compute-cap`` of the TPOT SLO (by
default the step target, 80%, above which every engine holds admission: EngineConfig.step_target);
where it does not, the hot batch is lowered until it does and the output says so ("capped by
compute": these shapes cannot make memory bind). After the runs, the regime check says whether
memory bound: static 1/N's busiest engine queued for memory (waiting with its batch not full
and compute not holding admission) for at least one request-second a second, while in the
shared run at most 10% of the requests missed the TPOT SLO, admission was not held for compute
for most of its queue, and the crest's steps stayed within the TPOT SLO. (NVML's "GPU busy" is
printed but is no evidence: it counts a kernel running, 99% even at a quarter of the device.)

The compute case's arithmetic, before its runs (printed: "Compute-bound trace, by design"), from
a calibration burst at its shapes (one engine alone, ``burst_batch`` requests: its prefill tok/s
P and its decode step D at that batch, with the slope in the batch of the memory bursts' steps).
An engine whose steps average the step target S (admission holds above it) spends each second
on rate x prompt / P of prefills and D(batch) / S of decode, with batch = rate x output x S
(Little's law: a request rides ``output`` steps); the rate where that reaches 1 is what one
engine alone serves, mu. With the H200 run's figures of 2026-12-01 (P = 47.9k tok/s, measured
at 337-token prompts; D = 18 ms at batch 64, between the 16.1 and 22.1 ms measured at 10 and
256, + 0.024 ms a request; S = 60 ms; prompts of 1549, outputs of 64): mu = 21 req/s at a batch
of 82 (of 256), so the crest is 37 req/s an engine, past mu for 7 s of each crest of a 24 s
run; in the middle both engines get 27 req/s together, against mu if their prefills share the
GPU fully. The budget: 2 x 256 x 1613 tokens x 12 KiB, rounded up to page ids, = 9.5 GiB
(static halves of 4.7 GiB, 3x the batch compute allows). Within the TTFT SLO on paper (fluid
FIFO queues, clients leaving after 6 s): of 691 arrivals, 429 with each engine served at mu,
168 with both sharing mu: where the device lies between is for the run to say; static and
shared alike either way. The regime
check (compute-bound: yes/NO) wants, in both variants, most of the queue (and at least one
request all along) held for compute (Scheduler.held_for: the step target, or the step's token
budget: prefill compute), and at most 10% held for memory and 10% with the batch full; it
prints each engine's share of stepping time in steps over the step target and its mean step
while requests waited. The goal's row reads "not shown" unless the check says yes.

The step target in the compute case: both variants hold admission by the same rule, each
engine on its own steps (the other engine's kernels make them slower in both alike), and the
share is never under pressure (its budget holds both whole batches), so its fair shares never
lower a limit; what differs is the allocator's mechanics (a static engine maps its half at
start; a shared one maps as it grows, 1-4 page ids ready), which the run measures (a grow
waiting for a page counts as held for memory). Where memory binds as well (the old trace), a
held engine reports only its running requests' demand, so the share may give its memory to the
other engine and its next admission waits for a reclaim (about 300 ms on the H200): memory the
other engine uses, not a loss of the device's compute.

The arithmetic of the goal (shared >= 2x static 1/N at N = 4), before the run. With hot rate
L, KV lifetime T, hot fill f, TTFT SLO tau and N engines, a 1/N partition holds s = 1/(N f) of
the hot working set (1/3 at f = 0.75, N = 4), so it serves s L a second while L arrive. In a hot
phase of P seconds it admits s L T requests at once (filling its partition), then a FIFO queue
forms whose head has waited (1 - s) t after t seconds: it passes the TTFT SLO after
tau / (1 - s) s, and every request admitted later waited longer (or gave up after
``give_up_factor`` tau). So static 1/N serves within SLO min(L P, s L (T + tau / (1 - s)))
of the phase's L P hot requests, shared all of them (memory fits); the cold engines'
(N - 1) c L D requests are within SLO in both. On the H200 (small, a pilot of this harness):
T = 14.6 s at a hot batch of 198, L = 13.6 req/s, D = 36 s (phases of 24 and 12 s), tau = 2,
s = 1/3, c = 0.05: static 1/N per phase s L (T + 3) = 5.9 L (capped at the phase's L P), in
all 11.7 L + 5.4 L (cold) = 17.1 L = 233 requests; shared 36 L + 5.4 L = 41.4 L = 562: 2.4x.
That pilot measured 216 against 618 (2.86x; shared met every SLO, the bursts included). A
rehearsal of the whole command below on another H200 (faster steps: T = 10.0 s, L = 19.9
req/s) gave 2.95x on paper and 870 against 281 measured (3.10x); at N = 2, 1.64x on paper and
808 against 630 (1.28x). The ratio grows with the phases' length against T (P / T), which is
why the hot phases are few and long and the outputs not longer.
The harness prints this arithmetic with its own calibration before the runs ("On paper").

Run length: a run ends when its last request ends, or at its SLO horizon (below): about start
(10 s) + D + the clients' give-up (6 s) + the longest output at the step time, 55 s at D = 36 on
the H200; the TPOT SLO (75 ms: 13 tokens/s, faster than anyone reads, and room over the 30-45
ms a loaded engine's steps take with prefills in them) keeps the horizon at 2 + 448 x 0.075 + 1
= 37 s. The plan, per variant, is printed up front.

Metrics: requests within both SLOs (TTFT and TPOT) per engine and in total; goodput (requests
within SLO per second of arrivals); preemptions; queue waits (request-seconds waiting; of them,
by what the scheduler held admission for, Scheduler.held_for: memory, compute (the step target
or the step's token budget), the batch full); the limits' oscillation in shared runs (each
member's limit in force from the ledger: the most direction changes and fall->rise turns in any
second, and the closest two turns, against the policy's bound: turns at least the 300 ms regrow
hold apart, unless the later one rises to a new peak of the member's guaranteed minimum, which
the ledger does not show: a close pair is a certain break only when its later limit is over
budget / members, where no such minimum reaches); the time to
take memory back from an idle engine (shared runs, from the share's ledger sampled every 50 ms:
from a sample where a member is blocked on the share's budget while another holds a page or more
mapped beyond what it uses, to the first sample where that one's committed bytes dropped); KV
memory held over time per engine (a plot, one panel per variant). A client gives up on a request
with no token after ``give_up_factor`` TTFT SLOs (it would miss the SLO anyway); a run ends at
its SLO horizon (the last arrival + the TTFT SLO + the longest output at the TPOT SLO: no
request within both SLOs finishes later), and what is unfinished then is counted as cut.

Engines: kvasync.serve's. Two vLLM engines with kvasync's plugin on one budget against static
halves are bench_vllm.py's ``--mode two`` (a memory-bound trace of alternating bursts); N = 4 vLLM
engines are not benchmarked yet.

Usage: python bench/bench_colocate_many.py --preset tiny --device cpu --engines 2 --duration 10
(``--cases compute`` runs the compute case alone, with its calibration only.)
On the H200, one call (planned 437 s expected with the runs' tails, 594 s at most if every run
were cut at its SLO horizon, plus the build; the plan is printed first; the goal's cases run
first: memory N=4, compute, then memory N=2). The previous command (compute case on
bench_serving's shapes, 20 s) took 6 min 43 s with the build at cb4a3e1: N=4 shared 715 within
SLO vs static 1/N 226 (3.16x), static by shared peaks 523; N=2 662 vs 590; its compute case
(604 vs 371) bound memory, not compute:
  python bench/bench_colocate_many.py --preset small --device cuda --engines 4 2 --duration 36 \
    --compute-duration 24 --calibration-s 6 --best-static "shared peaks"
Writes the tables (results_<preset>.md), the plots (PNG), summary.json and the shared runs'
ledger samples (ledger_<preset>_<case>_N<n>.json: variant -> [time, entries], each entry
(name, committed, used, waiters, blocked, limit in force), for limit_turns() offline) to
--out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any

from _colocate_many.calibration import MIN_STREAM_REQUESTS, CalibrationTooShort, calibrate
from _colocate_many.harness import Harness
from _colocate_many.report import (
    compute_regime_text,
    goal_rows,
    plot_case,
    regime_text,
    variant_table,
)
from _colocate_many.runs import Case
from _colocate_many.shapes import COMPUTE_SHAPES, MIB, REGIMES, geometry
from _colocate_many.traces import compute_bound_traces, hot_schedule, memory_bound_traces
from _colocate_many.worker import run_worker
from _tables import markdown


def calibration_seconds(text: str) -> float:
    """``--calibration-s``: a stream of no time (or none at all) has no request to measure."""
    seconds = float(text)
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds > 0 (a stream long enough for {MIN_STREAM_REQUESTS} "
            f"requests at the hot rate calibrated; the default is 8), got {text}"
        )
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny", choices=sorted(REGIMES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--engines", type=int, nargs="+", default=[4, 2], help="N, in order")
    parser.add_argument("--cases", nargs="+", default=["memory", "compute"])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--compute-duration", type=float, default=None)
    parser.add_argument(
        "--compute-overload",
        type=float,
        default=None,
        help="the compute case's crest rate, times what one engine alone serves (1..10)",
    )
    parser.add_argument("--budget-mib", type=int, default=None, help="KV budget, all engines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--calibration-s",
        type=calibration_seconds,
        default=8.0,
        help=f"seconds of the calibration streams (> 0; long enough for {MIN_STREAM_REQUESTS} "
        "requests at the hot rate calibrated, or the calibration stops and says how long)",
    )
    parser.add_argument(
        "--compute-cap",
        type=float,
        default=None,
        help="the hot engine's co-located step may reach this share of the TPOT SLO (0..1); "
        "the hot batch is lowered until it does (default: the engines' step target)",
    )
    parser.add_argument("--tpot-slo-ms", type=float, default=None, help="the preset's TPOT SLO")
    parser.add_argument(
        "--output-range", type=int, nargs=2, default=None, help="output tokens, low high"
    )
    parser.add_argument("--hot-fill", type=float, default=None, help="0..1 of the budget")
    parser.add_argument("--cold-weight", type=float, default=None, help="of the hot rate")
    parser.add_argument(
        "--best-static",
        nargs="*",
        default=["shared peaks", "peak demand", "mean demand"],
        help="the hindsight splits to run, in order (none: skip), for the largest N only",
    )
    parser.add_argument("--out", default="bench/colocate_many")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker()
        return
    regime = REGIMES[args.preset]
    changes: dict[str, Any] = {}
    if args.tpot_slo_ms is not None:
        changes["slo_tpot_s"] = args.tpot_slo_ms / 1e3
    if args.output_range is not None:
        changes["output_range"] = tuple(args.output_range)
    if args.hot_fill is not None:
        changes["hot_fill"] = args.hot_fill
    if args.cold_weight is not None:
        changes["cold_weight"] = args.cold_weight
    regime = dataclasses.replace(regime, **changes)
    if args.compute_cap is None:
        args.compute_cap = regime.step_target_frac
    if args.compute_overload is not None:
        if not 1.0 < args.compute_overload < 10.0:
            raise SystemExit(f"--compute-overload must be in (1, 10), got {args.compute_overload}")
        COMPUTE_SHAPES[args.preset] = dataclasses.replace(
            COMPUTE_SHAPES[args.preset], overload=args.compute_overload
        )
    unknown = set(args.cases) - {"memory", "compute"}
    if unknown or not args.cases:
        raise SystemExit(f"--cases takes memory and/or compute, got {args.cases}")
    budget_mib = args.budget_mib or regime.budget_mib
    geo = geometry(args.preset, args.device)
    budget = (budget_mib * MIB // geo.page_bytes) * geo.page_bytes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    harness = Harness(args)
    report: list[str] = []
    summary_json: dict[str, Any] = {"args": vars(args), "cases": {}}

    def emit(text: str) -> None:
        print(text, flush=True)
        report.append(text)
        (out / f"results_{args.preset}.md").write_text("\n".join(report) + "\n")

    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    emit(
        f"preset {args.preset}, device {args.device}, {started}; KV budget {budget / MIB:.0f} "
        f"MiB ({budget // geo.page_bytes} page ids of {geo.page_bytes / MIB:.3g} MiB, "
        f"{geo.tokens_per_page} tokens each); SLO TTFT <= {regime.slo_ttft_s} s, TPOT <= "
        f"{1e3 * regime.slo_tpot_s:.0f} ms; a client gives up after "
        f"{regime.give_up_factor * regime.slo_ttft_s:.0f} s without a token\n"
    )
    try:
        # 1. Calibration, before any trace exists (the docstring's arithmetic, measured).
        try:
            calibrated = calibrate(harness, args, regime, geo, budget, emit, summary_json)
        except CalibrationTooShort as error:
            parser.error(f"argument --calibration-s: {error}")
        shape, capacity, step_full = (
            calibrated.shape,
            calibrated.capacity,
            calibrated.step_full,
        )
        hot_rate, lifetime = calibrated.hot_rate, calibrated.lifetime
        compute_peak, compute_budget = calibrated.compute_peak, calibrated.compute_budget
        memory4: Case | None = None
        compute: Case | None = None
        # The goal's cases first (device time may run out): the largest N, then the compute-
        # bound one, then the other Ns.
        plan: list[tuple[str, int]] = []
        if "memory" in args.cases:
            plan = [("memory", n) for n in args.engines]
        if "compute" in args.cases:
            plan.insert(min(1, len(plan)), ("compute", 2))
        for case_name, n in plan:
            if case_name == "memory":
                traces = memory_bound_traces(regime, n, args.duration, hot_rate, args.seed)
                phases: list[tuple[float, int]] | None = hot_schedule(
                    n, args.duration, regime.hot_phases
                )
                case = Case(
                    harness, "memory", n, traces, regime, budget, geo, args.duration, phases
                )
            else:
                duration = args.compute_duration or args.duration
                # The memory case's SLOs and engines (step target included), the compute
                # case's request shapes.
                compute_regime = dataclasses.replace(
                    regime,
                    prompt_median=shape.prompt_median,
                    prompt_range=shape.prompt_range,
                    output_range=shape.output_range,
                )
                traces = compute_bound_traces(shape, duration, compute_peak, args.seed)
                phases = None
                case = Case(
                    harness,
                    "compute",
                    2,
                    traces,
                    compute_regime,
                    compute_budget,
                    geo,
                    duration,
                    None,
                )
            requests = [len(t) for t in traces]
            emit(
                f"### {case_name}-bound, {n} engines\n\n{sum(requests)} requests "
                f"({' / '.join(map(str, requests))} per engine) over {case.duration:.0f} s"
                + (
                    "; hot: " + ", ".join(f"e{e} from {s:.1f} s" for s, e in phases)
                    if phases
                    else ""
                )
                + f"; budget {case.budget / MIB:.0f} MiB.\n"
            )
            uniform = [case.total_pages // n] * n
            case.run_static("static 1/N", uniform)
            case.run_shared()
            if case_name == "memory":
                # Device time: the hindsight splits for the largest N only (the goal's).
                order = args.best_static if n == max(args.engines) else []
                for label, pages in case.best_static_candidates(lifetime, order):
                    case.run_static(label, pages)
            baseline = case.summaries[0]
            emit(variant_table(case.summaries, baseline) + "\n")
            if case_name == "memory":
                emit(regime_text(case, capacity, step_full) + "\n")
            else:
                emit(compute_regime_text(case) + "\n")
            plot = plot_case(
                case.runs,
                out / f"colocate_many_{args.preset}_{case_name}_N{n}.png",
                f"{case_name}-bound, {n} engines, {args.preset}, {args.device}",
                case.budget,
                case.regime.slo_ttft_s,
                phases,
            )
            emit(f"plot: `{plot}`\n")
            ledgers = {run.variant: run.ledger for run in case.runs if run.ledger}
            if ledgers:
                path = out / f"ledger_{args.preset}_{case_name}_N{n}.json"
                path.write_text(json.dumps(ledgers))
            summary_json["cases"][f"{case_name} N={n}"] = case.summaries
            (out / "summary.json").write_text(json.dumps(summary_json, indent=1, default=str))
            if case_name == "memory" and (memory4 is None or n > memory4.n):
                memory4 = case
            if case_name == "compute":
                compute = case
        rows = goal_rows(memory4, compute)
        if rows:
            emit(
                "**Goals** (issue 16, part 3)\n\n"
                + markdown(["goal", "shared", "baseline", "ratio", "result"], rows)
                + "\n"
            )
    finally:
        harness.close()


if __name__ == "__main__":
    main()
