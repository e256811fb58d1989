"""The calibration, before any trace exists: decode steps and the prefill rate of one engine
alone, the contention beside the others, the KV lifetimes measured that set the hot rate (memory
case), and the compute case's design from its burst."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from _colocate_many.harness import Harness
from _colocate_many.paper import engine_capacity, paper_compute, paper_within_slo, planned_wall
from _colocate_many.shapes import COMPUTE_SHAPES, MIB, ComputeShape, Geometry, Regime
from _colocate_many.traces import (
    COMPUTE_PHASES,
    TraceRequest,
    bump_rate,
    mean_lengths,
    memory_bound_traces,
)

# A calibration stream's mean KV lifetime is over its requests, whose outputs vary (uniform over
# the preset's range: a request's lifetime is within about 25% of the mean, one standard
# deviation), so the mean of 10 is within about 8%. A hot stream of fewer is no measurement.
MIN_STREAM_REQUESTS = 10


class CalibrationTooShort(ValueError):
    """``--calibration-s`` gives a hot calibration stream too few requests to measure a KV
    lifetime on (the message names the minimum at the rate measured); the parent turns it into
    an argparse error."""


def steady_stream(regime: Regime, seconds: float, rate: float, seed: int) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` req/s over ``seconds`` on one engine, no bursts."""
    steady = dataclasses.replace(regime, cold_weight=1.0, bursts_per_min=1e-9)
    return memory_bound_traces(steady, 1, seconds, rate, seed)[0]


def hot_stream(
    regime: Regime, seconds: float, rate: float, seed: int, what: str
) -> list[TraceRequest]:
    """``steady_stream`` for the engine whose KV lifetime a calibration measures.

    Raises:
        CalibrationTooShort: it holds fewer than ``MIN_STREAM_REQUESTS`` requests.
    """
    stream = steady_stream(regime, seconds, rate, seed)
    if len(stream) < MIN_STREAM_REQUESTS:
        # Twice the time that holds that many on average: a Poisson stream may hold fewer.
        need = math.ceil(20 * MIN_STREAM_REQUESTS / rate) / 10
        raise CalibrationTooShort(
            f"{seconds:g} s is too short: {what} at the {rate:.2f} req/s calibrated has "
            f"{len(stream)} request{'' if len(stream) == 1 else 's'} in {seconds:g} s, and a KV "
            f"lifetime is measured on at least {MIN_STREAM_REQUESTS}; use --calibration-s "
            f"{need:g} or more at this rate (the default is 8)"
        )
    return stream


def compute_design(
    emit: Callable[[str], None],
    args: argparse.Namespace,
    regime: Regime,
    shape: ComputeShape,
    geo: Geometry,
    alone: list[dict[str, Any]],
    means: tuple[float, float],
) -> tuple[float, int]:
    """The compute case from the calibration (the docstring's arithmetic): what one engine alone
    serves at the step target, the crest's rate ``shape.overload`` times that, and a budget whose
    static half holds a whole batch. Prints it. Returns (the crest's rate, the budget, bytes)."""
    prompt, output = means
    full, _, cold, mine = alone[:4]
    step_target = regime.step_target_frac * regime.slo_tpot_s
    prefill = float(mine["prefill_tok_s"])
    anchor = float(mine["step_s"])
    if not (math.isfinite(prefill) and math.isfinite(anchor)):
        raise SystemExit(f"the compute case's calibration burst measured nothing: {mine}")
    # Decode steps at the compute case's context: the burst's step, and the slope in the batch
    # of the memory shapes' steps (full batch against the cold one).
    slope = max(
        0.0,
        float(full["step_s"] - cold["step_s"]) / max(1, int(full["batch"] - cold["batch"])),
    )

    def decode_step(batch: float) -> float:
        return max(0.5 * anchor, anchor + slope * (batch - float(mine["batch"])))

    rate, batch = engine_capacity(
        prompt, output, step_target, prefill, decode_step, regime.max_batch
    )
    peak = shape.overload * rate
    per_engine = regime.max_batch * (prompt + output) * geo.token_bytes
    pages = max(1, math.ceil(per_engine / geo.page_bytes))
    budget = 2 * pages * geo.page_bytes
    duration = args.compute_duration or args.duration
    tau, give_up = regime.slo_ttft_s, regime.give_up_factor * regime.slo_ttft_s
    arrived, apart, longest_apart = paper_compute(duration, peak, rate, False, tau, give_up)
    _, together, longest_together = paper_compute(duration, peak, rate, True, tau, give_up)
    middle = 2 * bump_rate(0.5, 1.0, COMPUTE_PHASES[0], peak)
    over = 2 * 0.18 * math.sqrt(math.log(0.9 / (1 / shape.overload - 0.1))) * duration
    emit(
        f"**Compute-bound trace, by design** (two engines, bench_serving.py's bumps cresting at "
        f"{COMPUTE_PHASES[0]:.0%} and {COMPUTE_PHASES[1]:.0%} of {duration:.0f} s): prefill-heavy "
        f"requests, prompts of {prompt:.0f} tokens ({shape.prompt_range[0]}-"
        f"{shape.prompt_range[1]}), outputs of {output:.0f} ({shape.output_range[0]}-"
        f"{shape.output_range[1]}). Measured at these shapes (a burst of {mine['batch']}): "
        f"prefill {prefill:.0f} tok/s, decode step {1e3 * anchor:.1f} ms (+{1e6 * slope:.1f} us "
        f"a request, from the full batch against batch {cold['batch']}). One engine alone with "
        f"its steps at the step target ({1e3 * step_target:.0f} ms, where admission holds) "
        f"spends a second on rate x {prompt:.0f} / {prefill:.0f} s of prefills and "
        f"decode_step(batch) / {1e3 * step_target:.0f} ms of decode, batch = rate x "
        f"{output:.0f} x {1e3 * step_target:.0f} ms: it serves **{rate:.1f} req/s** at a batch "
        f"of {batch:.0f}"
        + (
            f" (of {regime.max_batch}: compute binds before the batch).\n\n"
            if batch < regime.max_batch
            else " = max_batch: **the batch binds before compute** (raise max_batch).\n\n"
        )
        + f"The crest is {shape.overload:g}x that, {peak:.1f} req/s an engine: past what one "
        f"engine alone serves for {over:.1f} s of each crest; in the middle of the run both "
        f"engines get {middle:.1f} req/s in all, against {rate:.1f} if their prefills share "
        f"the GPU fully. Memory cannot bind: the budget is two whole batches, {regime.max_batch} "
        f"x {prompt + output:.0f} tokens x {geo.token_bytes:.0f} B = "
        f"{per_engine / MIB:.0f} MiB an engine ({pages} page ids), **{budget / MIB:.0f} MiB**, so "
        f"a static half holds the batch compute allows ({batch:.0f}) "
        f"{regime.max_batch / max(batch, 1.0):.1f}x over; static and shared are limited by "
        f"compute alike.\n\n"
        f"**On paper** (fluid FIFO queues at the compute served, clients leaving after "
        f"{give_up:.0f} s): of {arrived:.0f} arrivals, {apart:.0f} within the TTFT SLO with each "
        f"engine served at {rate:.1f} req/s (longest wait {longest_apart:.1f} s), {together:.0f} "
        f"with both sharing that rate (the prefills contend for the GPU; longest wait "
        f"{longest_together:.1f} s): the same for static 1/N and shared, which is the goal "
        f"(shared >= 97% of static).\n"
    )
    return peak, budget


@dataclass
class Calibration:
    """What the runs take from the calibration (the rest is printed and in summary.json)."""

    shape: ComputeShape  # the compute case's request shapes
    capacity: float  # decode tokens/s of one engine alone at its full batch
    step_full: float  # its decode step at the full batch, seconds
    hot_rate: float  # the memory case's hot arrival rate, req/s (0 without that case)
    lifetime: Callable[[TraceRequest], float]  # a request's KV lifetime on the hot engine
    compute_peak: float  # the compute case's crest, req/s (0 without that case)
    compute_budget: int  # its KV budget, bytes (0 without that case)


def calibrate(
    harness: Harness,
    args: argparse.Namespace,
    regime: Regime,
    geo: Geometry,
    budget: int,
    emit: Callable[[str], None],
    summary_json: dict[str, Any],
) -> Calibration:
    """The calibration, before any trace exists (bench_colocate_many.py's docstring: its
    arithmetic, measured); prints each step with ``emit`` and records it in ``summary_json``."""
    mean_prompt, mean_output = mean_lengths(regime, args.seed)
    shape = COMPUTE_SHAPES[args.preset]
    compute_prompt, compute_output = mean_lengths(shape, args.seed)
    held_tokens = mean_prompt + mean_output / 2  # a request's mean KV over its life
    n_max = max(args.engines)
    hot_batch = max(1, round(regime.hot_fill * budget / (held_tokens * geo.token_bytes)))
    hot_batch = min(hot_batch, regime.max_batch)
    cold_batch = max(1, round(regime.cold_weight * hot_batch))
    step_target = regime.step_target_frac * regime.slo_tpot_s
    harness.pool(max([*args.engines, 2]))  # every worker imports torch meanwhile
    emit(planned_wall(args, regime, n_max))

    def burst(
        batch: int, decode_steps: int = 40, prompt: float = mean_prompt
    ) -> tuple[int, int, int]:
        # Outputs outlast the prefills (max_batch_tokens a step), so that every request of
        # the burst decodes together for decode_steps steps.
        output = decode_steps + math.ceil(batch * prompt / regime.max_batch_tokens)
        return batch, int(prompt), output

    bursts = [burst(regime.max_batch), burst(hot_batch), burst(cold_batch)]
    if "compute" in args.cases:  # the compute case's shapes: its prefill rate, its steps
        bursts.append(burst(shape.burst_batch, prompt=compute_prompt))
    alone = harness.calibrate(regime, bursts)["bursts"]
    step_full, step_hot, step_cold = (b["step_s"] for b in alone[:3])
    capacity = regime.max_batch / step_full  # decode tokens/s of one engine at full batch
    prefill_tps = alone[0]["prefill_tok_s"]
    summary_json["calibration"] = {"alone": alone}
    emit(
        f"**Calibration** (one engine alone): decode step {1e3 * step_full:.1f} ms at full "
        f"batch ({regime.max_batch}, {capacity:.0f} tok/s), {1e3 * step_hot:.1f} ms at "
        f"batch {hot_batch}, {1e3 * step_cold:.1f} ms at batch {cold_batch} (prompts of "
        f"{mean_prompt:.0f} tokens); prefill {prefill_tps:.0f} tok/s.\n"
    )
    hot_rate = mean_life = 0.0
    lifetime: Callable[[TraceRequest], float] = lambda r: 0.0  # noqa: E731
    if "memory" in args.cases:
        # The hot engine's step with N - 1 cold engines stepping beside it on the device: the
        # cold bursts run 3x as many steps, so they outlast the hot one's.
        together = harness.calibrate_together(
            regime, [[burst(hot_batch)]] + [[burst(cold_batch, 120)]] * (n_max - 1)
        )
        step_coloc = together[0]["bursts"][0]["step_s"]
        # (at least 1: a faster step beside other engines is noise; a loaded CPU gives it)
        contention = max(1.0, step_coloc / step_hot)
        prefill_steps = 1 + mean_prompt / regime.max_batch_tokens
        points = sorted((b["batch"], b["step_s"]) for b in alone)

        def step_alone(batch: float) -> float:
            # Decode steps alone, linear between the calibrated batches.
            return float(np.interp(batch, [b for b, _ in points], [s for _, s in points]))

        # Little's law from the decode steps: the rate that keeps hot_batch requests in flight.
        little = hot_batch / (step_coloc * (prefill_steps + mean_output))
        # The lifetime measured: a stream on one engine alone, at a rate that should not fill
        # its batch (steps that carry prefills are slower than decode steps: 1.5x a guess, the
        # H200 gave 1.9x at this shape), replayed; the KV a request holds is from its admission
        # to its end (its wait in the queue holds none).
        stream_rate = little / 1.5
        stream = hot_stream(
            regime, args.calibration_s, stream_rate, args.seed + 2000, "the stream on one engine"
        )
        measured = harness.calibrate(regime, [], stream)["stream"]
        stream_batch = max(1, int(measured["most_running"]))
        # Steps with prefills in them against decode steps alone, at the stream's batch.
        mixed = max(1.0, measured["mean_tpot_s"] / step_alone(stream_batch))

        def step_at(batch: float) -> float:
            # The hot engine's step co-located in a run, at a batch: decode steps alone, times
            # the prefills' share measured in the stream, times the contention measured beside
            # the cold engines.
            return step_alone(batch) * float(mixed * contention)

        # Compute must not bind: the hot engine's step at its batch stays within compute_cap of
        # the TPOT SLO (by default the step target, above which the engines hold admission).
        # Where it does not, the batch (and the working set with it) is lowered until it does.
        cap_s = args.compute_cap * regime.slo_tpot_s
        batch = hot_batch
        while batch > 1 and step_at(batch) > cap_s:
            batch -= 1
        capped = batch < hot_batch
        # The lifetime co-located at that batch (the stream's, at the step's ratio), and the hot
        # rate by Little's law: batch requests in flight.
        kv_life_stream = float(measured["mean_kv_life_s"])
        first_life = kv_life_stream * contention * step_alone(batch) / step_alone(stream_batch)
        first_rate = batch / first_life

        # The estimate above multiplies two factors measured apart: the stream's prefills (at
        # its own rate, here 1.5-2x the hot rate) and the contention of cold engines stepping
        # back to back. Together they overstated the lifetime (an H200 run of 2026-12-01:
        # 16.2 s estimated, while the shared run's hot engine held 770 of the 1152 MiB
        # planned, about 10.9 s), so the working set came out 2x a 1/4 partition, not 3x.
        # So the lifetime is measured where the runs will be: the hot engine replays a stream
        # at that first rate while the N - 1 cold engines replay theirs beside it (cold_weight
        # of it); its KV lifetime, scaled to the batch as above, gives the hot rate.
        cold_rate = regime.cold_weight * first_rate
        coloc_streams = [
            hot_stream(
                regime,
                args.calibration_s,
                first_rate,
                args.seed + 3000,
                "the hot co-located stream",
            ),
            *(
                steady_stream(regime, args.calibration_s, cold_rate, args.seed + 3001 + i)
                for i in range(n_max - 1)
            ),
        ]
        coloc = harness.calibrate_together(regime, [[]] * n_max, coloc_streams)[0]["stream"]
        # A cold stream with no request in the window (a low rate over a short calibration)
        # replays nothing: that engine adds no contention to the hot one's lifetime, and the
        # output says so, rather than invent requests (or a prior) for it.
        idle = [i for i, cold in enumerate(coloc_streams[1:], 1) if not cold]
        without = (
            f" Cold engine{'s' if len(idle) > 1 else ''} "
            f"{', '.join(f'e{i}' for i in idle)} got no request in the {args.calibration_s:g} s "
            f"({cold_rate * args.calibration_s:.2f} expected at {cold_rate:.2f} req/s), so "
            f"{'they' if len(idle) > 1 else 'it'} added no contention to this lifetime (a "
            f"longer --calibration-s gives them requests)."
            if idle
            else ""
        )
        coloc_batch = max(1, int(coloc["most_running"]))
        mean_life = float(coloc["mean_kv_life_s"]) * step_alone(batch) / step_alone(coloc_batch)
        hot_rate = batch / mean_life
        working_set = hot_rate * mean_life * held_tokens * geo.token_bytes
        saturated = stream_batch >= regime.max_batch
        full = " (its whole batch: saturated, the lifetime is too long)" if saturated else ""

        def hot_lifetime(r: TraceRequest) -> float:
            return float(mean_life * (prefill_steps + r.max_tokens) / (prefill_steps + mean_output))

        def prefill_load(rate: float) -> float:
            # The device's share spent on all engines' prefills at that hot rate.
            share = rate * (1 + (n_max - 1) * regime.cold_weight) * mean_prompt
            return float(share / prefill_tps)

        emit(
            f"**Calibration, memory case**: the hot engine's decode step with {n_max - 1} "
            f"engines stepping at batch {cold_batch} beside it: {1e3 * step_coloc:.1f} ms at "
            f"batch {hot_batch} (x{contention:.2f} alone).\n\n"
            f"**Memory-bound trace, from first principles**: a request holds {held_tokens:.0f} "
            f"tokens ({held_tokens * geo.token_bytes / MIB:.1f} MiB) on average; the hot "
            f"engine's working set is to be {regime.hot_fill:.0%} of the budget "
            f"({regime.hot_fill * budget / MIB:.0f} MiB, {hot_batch} requests), "
            f"{regime.hot_fill * n_max:.1f}x a 1/{n_max} partition. Little's law with the "
            f"co-located decode step: {little:.2f} req/s. A stream of {stream_rate:.2f} req/s "
            f"for {args.calibration_s:g} s on one engine alone ran up to {stream_batch} "
            f"requests at once{full}; "
            f"a token took {1e3 * measured['mean_tpot_s']:.1f} ms (x{mixed:.2f} a decode step: "
            f"the prefills), steps {1e3 * measured['steady_step_s']:.1f} ms once steady, "
            f"TTFT {measured['mean_ttft_s']:.2f} s; a request held its KV "
            f"{kv_life_stream:.2f} s (estimated {step_hot * (prefill_steps + mean_output):.2f} "
            f"s from decode steps), {first_life:.2f} s co-located at batch {batch} "
            f"(x{contention:.2f}): {first_rate:.2f} req/s. Measured co-located (that rate on "
            f"the hot engine, {regime.cold_weight:.0%} of it on {n_max - 1} cold ones, "
            f"{args.calibration_s:g} s): up to {coloc_batch} requests at once, a token "
            f"{1e3 * coloc['mean_tpot_s']:.1f} ms, KV held {coloc['mean_kv_life_s']:.2f} s, "
            f"so {mean_life:.2f} s at batch {batch}.{without} So the hot "
            f"rate is {batch} / {mean_life:.2f} s = {hot_rate:.2f} req/s (a working set of "
            f"{working_set / MIB:.0f} MiB); cold engines get {regime.cold_weight:.0%} of it; "
            f"bursts x{regime.burst_factor} for {regime.burst_s} s, "
            f"{regime.bursts_per_min:g}/min per engine.\n\n"
            f"**Compute check**: the hot engine's step co-located at batch {batch} (decode "
            f"{1e3 * step_alone(batch):.1f} ms x{mixed:.2f} prefills x{contention:.2f} "
            f"contention; prefills {prefill_load(hot_rate):.1%} of the device) is "
            f"{1e3 * step_at(batch):.1f} ms against a cap of {1e3 * cap_s:.0f} ms "
            f"({args.compute_cap:.0%} of the TPOT SLO; the engines hold admission above "
            f"{1e3 * step_target:.0f} ms)"
            + (
                f". **Capped by compute**: at batch {batch} (not {hot_batch}) the hot working "
                f"set is below its target, so these request shapes cannot make memory bind on "
                f"this device (shorter steps or more KV per request would).\n"
                if capped
                else ": compute does not bind at the hot working set.\n"
            )
        )
        paper = [
            (n, *paper_within_slo(regime, n, args.duration, hot_rate, mean_life))
            for n in args.engines
        ]
        emit(
            "**On paper** (the docstring's arithmetic with these figures; bursts left out): "
            + "; ".join(
                f"N={n}: static 1/N {static:.0f}, shared {shared:.0f} requests within SLO "
                f"({shared / max(1.0, static):.2f}x)"
                for n, static, shared in paper
            )
            + ".\n"
        )
        summary_json["calibration"] |= {
            "together": together,
            "hot_batch": hot_batch,
            "cold_batch": cold_batch,
            "capped_batch": batch,
            "little_rate": little,
            "stream_rate": stream_rate,
            "mixed": mixed,
            "contention": contention,
            "prefill_tok_s": prefill_tps,
            "stream": measured,
            "first_lifetime_s": first_life,
            "first_rate": first_rate,
            "coloc_stream": coloc,
            "coloc_cold_requests": [len(cold) for cold in coloc_streams[1:]],
            "lifetime_s": mean_life,
            "hot_rate": hot_rate,
            "paper": paper,
        }
        lifetime = hot_lifetime
    compute_peak, compute_budget = 0.0, 0
    if "compute" in args.cases:
        compute_peak, compute_budget = compute_design(
            emit, args, regime, shape, geo, alone, (compute_prompt, compute_output)
        )
        summary_json["calibration"] |= {
            "compute_peak": compute_peak,
            "compute_budget": compute_budget,
        }
    return Calibration(shape, capacity, step_full, hot_rate, lifetime, compute_peak, compute_budget)
