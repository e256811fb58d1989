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
lifetime (scaled to the hot batch by the decode steps) gives the hot rate. The compute
check: the hot engine's step in a run, predicted as the decode step at its batch x the stream's
prefill factor x the contention, must stay within ``--compute-cap`` of the TPOT SLO (by default
the step target, 80%, above which every engine holds admission: EngineConfig.step_target);
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
import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _tables import markdown

MIB = 1 << 20
SAMPLE_S = 0.02  # the workers' sampling interval
# The ledger's: each snapshot takes the share's lock the members' grants take, so the observer
# samples at 50 ms (members publish their used bytes and waiters every 100 ms anyway).
LEDGER_SAMPLE_S = 0.05
READY_TIMEOUT_S = 180.0  # a worker's import, engine open (static: maps its whole limit), warm-up
# Scheduler.held_for as sampled: 0 while it admits or nothing waits.
HELD_CODES = {"memory": 1, "batch": 2, "compute": 3, "tokens": 4}


@dataclass(frozen=True)
class Regime:
    """The memory-bound case of a preset: the budget, the request shapes and the SLOs."""

    budget_mib: int  # the device's KV budget, all engines together
    prompt_median: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    max_batch: int
    max_batch_tokens: int
    slo_ttft_s: float
    slo_tpot_s: float
    hot_fill: float = 0.75  # the hot engine's working set, as a share of the whole budget
    cold_weight: float = 0.05  # a cold engine's arrival rate, as a share of the hot one's
    burst_factor: float = 1.3  # arrivals during a burst, times the rate outside it
    burst_s: float = 1.5
    bursts_per_min: float = 6.0  # per engine, Poisson
    give_up_factor: float = 3.0  # a client leaves after this many TTFT SLOs without a token
    hot_phases: int = 2  # engines hot in turn (0, 1, ...), for 2/3 and 1/3 of the run with 2
    # Admission holds while the engine's recent step time is above this share of the TPOT SLO
    # (EngineConfig.step_target): the rest is room for the steps that carry prefills and for
    # the other engines' kernels between its steps.
    step_target_frac: float = 0.8


REGIMES = {
    # tiny, host backend: 256 KiB page ids of 512 tokens (512 B a token); 8 MiB = 32 page ids
    # = 16k tokens. Decode-heavy like small, scaled to a CPU (which is compute-bound anyway:
    # this preset checks the harness end to end, not the regime).
    "tiny": Regime(8, 64, (32, 128), (48, 128), 64, 1024, 2.0, 0.1),
    # small, cuda: 48 MiB page ids of 4096 tokens (12 KiB a token); 1536 MiB = 32 page ids =
    # 128k tokens. Decode-heavy (the docstring's arithmetic): prompts of 160-640 tokens, outputs
    # of 192-448; TPOT SLO 75 ms (13 tokens/s, faster than anyone reads; the steps of a loaded
    # engine, 30-45 ms on the H200 with prefills in them, leave room), so that the SLO horizon
    # stays short (2 + 448 x 0.075 + 1 = 37 s).
    "small": Regime(1536, 320, (160, 640), (192, 448), 256, 4096, 2.0, 0.075),
}


@dataclass(frozen=True)
class ComputeShape:
    """The compute-bound case of a preset: prefill-heavy requests, so that compute binds at a
    batch far below ``max_batch`` while the KV of a whole batch fits a static half."""

    prompt_median: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    burst_batch: int  # the calibration burst at these shapes (prefill rate, decode step)
    # The crest's arrival rate, times what one engine alone serves at the step target.
    overload: float = 1.75


COMPUTE_SHAPES = {
    # tiny: within the model's 512 positions, prefill-heavy enough that a CPU's compute binds
    # below the batch of 64; checks the harness (and the regime check's "yes") end to end.
    "tiny": ComputeShape(400, (320, 480), (4, 12), 16),
    # small: a request costs the device its prefill (1536 tokens: about 32 ms of an H200 at the
    # 48k tok/s measured) and little decode (64 tokens at <= 60 ms a step: 4 s), so one engine
    # alone serves about 20 req/s at a batch of about 80 (the docstring's arithmetic), and a
    # static half holding a whole batch (256 x 1600 tokens: 4.7 GiB) cannot run out of memory.
    "small": ComputeShape(1536, (1024, 2048), (32, 96), 64),
}


@dataclass(frozen=True)
class Geometry:
    """What a page id of an engine's KV cache holds, on the device the run uses."""

    page_bytes: int  # page_size x ranges: the budget's unit
    tokens_per_page: int
    block_size: int

    @property
    def token_bytes(self) -> float:
        return self.page_bytes / self.tokens_per_page


def geometry(preset: str, device: str) -> Geometry:
    import torch

    import kvasync
    from kvasync.serve._model import preset as model_preset

    model = model_preset(preset)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layout = kvasync.KVLayout(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=model.block_size,
        dtype=dtype,
    )
    page_size = (2 << 20) if device == "cuda" else (64 << 10)  # kv_config's defaults
    blocks = layout.blocks_per_page(page_size)
    return Geometry(page_size * layout.num_ranges, blocks * model.block_size, model.block_size)


# -- traces ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds after the start
    prompt_tokens: int
    max_tokens: int


def hot_schedule(engines: int, duration: float, phases: int = 2) -> list[tuple[float, int]]:
    """(start, hot engine) phases: engines 0..m-1 hot in turn for m, m-1, ..., 1 parts of the run
    (m = min(phases, N), at least 2): popularity shifts, and unevenly, so that a static split
    with hindsight has something to exploit. The other engines are never hot. Few, long phases:
    a phase much shorter than a request's lifetime is over before the static split's queue
    forms (the docstring's arithmetic)."""
    m = max(2, min(phases, engines))
    weights = list(range(m, 0, -1))
    schedule, start = [], 0.0
    for engine, weight in enumerate(weights):
        schedule.append((start, engine))
        start += duration * weight / sum(weights)
    return schedule


def hot_at(phases: list[tuple[float, int]], t: float) -> int:
    return [engine for start, engine in phases if start <= t][-1]


def _lengths(rng: np.random.Generator, shape: Regime | ComputeShape) -> tuple[int, int]:
    low, high = shape.prompt_range
    prompt = int(np.clip(rng.lognormal(math.log(shape.prompt_median), 0.35), low, high))
    output = int(rng.integers(shape.output_range[0], shape.output_range[1] + 1))
    return prompt, output


def mean_lengths(shape: Regime | ComputeShape, seed: int) -> tuple[float, float]:
    """The mean prompt and output of ``shape``'s distribution (sampled)."""
    rng = np.random.default_rng([seed, 1000])
    lengths = [_lengths(rng, shape) for _ in range(20000)]
    return float(np.mean([p for p, _ in lengths])), float(np.mean([o for _, o in lengths]))


def memory_bound_traces(
    regime: Regime, engines: int, duration: float, hot_rate: float, seed: int
) -> list[list[TraceRequest]]:
    """One trace per engine: Poisson arrivals (by thinning) at ``hot_rate`` while the engine is
    hot, ``cold_weight`` of it while cold, times ``burst_factor`` within its bursts."""
    phases = hot_schedule(engines, duration, regime.hot_phases)
    traces = []
    for engine in range(engines):
        rng = np.random.default_rng([seed, engine])
        bursts, t = [], 0.0
        while True:
            t += rng.exponential(60.0 / regime.bursts_per_min)
            if t >= duration:
                break
            bursts.append(t)
        peak = hot_rate * regime.burst_factor
        requests: list[TraceRequest] = []
        t = 0.0
        while True:
            t += rng.exponential(1 / peak)
            if t >= duration:
                break
            rate = hot_rate * (1.0 if hot_at(phases, t) == engine else regime.cold_weight)
            if any(s <= t < s + regime.burst_s for s in bursts):
                rate *= regime.burst_factor
            if rng.random() * peak > rate:
                continue
            requests.append(TraceRequest(t, *_lengths(rng, regime)))
        traces.append(requests)
    return traces


def paper_within_slo(
    regime: Regime, n: int, duration: float, hot_rate: float, lifetime_s: float
) -> tuple[float, float]:
    """(static 1/N, shared): requests within SLO on paper (the docstring's arithmetic)."""
    s = min(1.0, 1.0 / (n * regime.hot_fill))  # the hot working set a 1/N partition holds
    tau = regime.slo_ttft_s
    # Shared: the hot engine and the cold ones fit the budget together (else the share of it).
    served = min(1.0, 1.0 / (regime.hot_fill * (1 + (n - 1) * regime.cold_weight)))
    schedule = hot_schedule(n, duration, regime.hot_phases)
    ends = [start for start, _ in schedule[1:]] + [duration]
    static = shared = 0.0
    for (start, _), end in zip(schedule, ends, strict=True):
        arrivals = hot_rate * (end - start)
        shared += served * arrivals
        if s >= 1.0:
            static += arrivals
        else:
            static += min(arrivals, s * hot_rate * (lifetime_s + tau / (1 - s)))
    cold = (n - 1) * regime.cold_weight * hot_rate * duration
    return static + cold, shared + cold


READY_S = 10.0  # a variant's start: its engines open (a static one maps its split), warm up


def planned_wall(args: argparse.Namespace, regime: Regime, n_max: int) -> str:
    """The wall time each variant may take, up front: its start, its arrivals and its SLO
    horizon (the cut), and what it should take: the tail of a run is the clients' give-up and
    the longest output at the engines' step target."""
    rows = []
    give_up = regime.give_up_factor * regime.slo_ttft_s
    step_target = regime.step_target_frac * regime.slo_tpot_s
    horizon = regime.slo_ttft_s + regime.output_range[1] * regime.slo_tpot_s + 1.0
    # A run ends when its last request does: the last arrivals' longest output, at about half the
    # step target a token (the H200: 25-35 ms against 60), or the clients' give-up.
    tail = max(give_up, regime.output_range[1] * step_target / 2)
    expected = READY_S + args.duration + tail
    bound = READY_S + args.duration + horizon
    # One engine's bursts alone (about 5 s), then the memory case's engines together and its
    # stream; the compute case's burst (about 5 s).
    calibration, calibration_bound = READY_S + 5.0, 2 * READY_S
    if "memory" in args.cases:
        # The engines together, the stream alone, the streams together.
        calibration += 3 * READY_S + 2 * (args.calibration_s + tail)
        calibration_bound += 3 * READY_S + 2 * (args.calibration_s + horizon)
    if "compute" in args.cases:
        calibration += 5.0
        calibration_bound += 10.0
    rows.append(["calibration", "", "", f"{calibration:.0f}", f"{calibration_bound:.0f}"])
    plan: list[tuple[str, int, list[str]]] = []
    if "memory" in args.cases:
        for n in args.engines:
            hindsight = [f"static by {b}" for b in args.best_static] if n == n_max else []
            plan.append(("memory", n, ["static 1/N", "shared", *hindsight]))
    if "compute" in args.cases:
        plan.insert(min(1, len(plan)), ("compute", 2, ["static 1/N", "shared"]))
    total_bound, total_expected = calibration_bound, calibration
    for case, n, variants in plan:
        if case == "compute":
            # Its crests end well before the run (the rate at the end is a third of what an
            # engine serves): the tail is the clients' give-up or the longest output.
            shape = COMPUTE_SHAPES[args.preset]
            duration = args.compute_duration or args.duration
            c_bound = (
                READY_S
                + duration
                + regime.slo_ttft_s
                + shape.output_range[1] * regime.slo_tpot_s
                + 1.0
            )
            c_expected = READY_S + duration + max(give_up, shape.output_range[1] * step_target / 2)
        else:
            c_bound, c_expected = bound, expected
        for variant in variants:
            rows.append([case, str(n), variant, f"{c_expected:.0f}", f"{c_bound:.0f}"])
            total_bound += c_bound
            total_expected += c_expected
    rows.append(["**total**", "", "", f"**{total_expected:.0f}**", f"**{total_bound:.0f}**"])
    return (
        "**Planned wall time** (s; expected: start + arrivals + the longest output at half the "
        "step target a token, or the clients' give-up; at most: start + arrivals + the SLO "
        "horizon, where a run is cut)\n\n"
        + markdown(["case", "N", "variant", "expected s", "at most s"], rows)
        + "\n"
    )


COMPUTE_PHASES = (0.3, 0.7)  # bench_serving.py's co-located crests, as shares of the run


def bump_rate(t: float, duration: float, phase: float, peak: float) -> float:
    """bench_serving.py's arrival rate: a bump cresting at ``phase`` of the run, 10% of the peak
    away from it."""
    x = (t / duration - phase) / 0.18
    return peak * (0.1 + 0.9 * math.exp(-x * x))


def compute_bound_traces(
    shape: ComputeShape, duration: float, peak: float, seed: int
) -> list[list[TraceRequest]]:
    """Two engines, bench_serving.py's bump-shaped arrivals (Poisson by thinning, crests at 30%
    and 70% of the run) cresting at ``peak`` req/s, with ``shape``'s prefill-heavy requests."""
    traces = []
    for index, phase in enumerate(COMPUTE_PHASES):
        rng = np.random.default_rng([seed, 500 + index])
        requests, t = [], 0.0
        while True:
            t += rng.exponential(1 / peak)
            if t >= duration:
                break
            if rng.random() * peak > bump_rate(t, duration, phase, peak):
                continue
            requests.append(TraceRequest(t, *_lengths(rng, shape)))
        traces.append(requests)
    return traces


def engine_capacity(
    prompt: float,
    output: float,
    step_s: float,
    prefill_tok_s: float,
    decode_step: Callable[[float], float],
    max_batch: int,
) -> tuple[float, float]:
    """(requests/s, batch) one engine alone serves with its steps at ``step_s`` (the step
    target): a second of steps spends ``rate x prompt / prefill_tok_s`` on prefills and
    ``decode_step(batch) / step_s`` on the decode part of its steps, where the batch is
    ``rate x output x step_s`` (Little's law: a request rides ``output`` steps). Returns the
    rate where that reaches the second, or the full batch's rate if that comes first."""

    def load(rate: float) -> float:
        return rate * prompt / prefill_tok_s + decode_step(rate * output * step_s) / step_s

    low, high = 0.0, max_batch / (output * step_s)
    if load(high) <= 1.0:
        return high, float(max_batch)  # the batch binds before compute
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if load(middle) <= 1.0 else (low, middle)
    return low, low * output * step_s


def paper_compute(
    duration: float, peak: float, capacity: float, shared_device: bool, tau: float, give_up: float
) -> tuple[float, float, float]:
    """Fluid FIFO queues, one per engine (the compute case's bumps), each served at ``capacity``
    req/s, or with ``shared_device`` both at ``capacity`` in all (split by backlog: the prefills
    share the GPU). Returns (arrivals, served within the TTFT SLO ``tau``, the longest wait);
    a request still waiting after ``give_up`` leaves. Memory plays no part: on paper static and
    shared serve the same."""
    dt = 0.01
    queues: list[list[list[float]]] = [[] for _ in COMPUTE_PHASES]  # [[arrival, mass], ...]
    arrived = within = longest = 0.0
    t = 0.0
    while t < duration + give_up:
        for queue_, phase in zip(queues, COMPUTE_PHASES, strict=True):
            if t < duration:
                mass = bump_rate(t, duration, phase, peak) * dt
                queue_.append([t, mass])
                arrived += mass
            while queue_ and t - queue_[0][0] > give_up:
                queue_.pop(0)  # gave up
        backlog = [sum(m for _, m in q) for q in queues]
        if shared_device:
            total = sum(backlog)
            serve = [capacity * dt * b / total if total > 0 else 0.0 for b in backlog]
        else:
            serve = [capacity * dt] * len(queues)
        for queue_, budget in zip(queues, serve, strict=True):
            while queue_ and budget > 1e-12:
                take = min(budget, queue_[0][1])
                wait = t - queue_[0][0]
                longest = max(longest, wait)
                within += take if wait <= tau else 0.0
                budget -= take
                queue_[0][1] -= take
                if queue_[0][1] <= 1e-12:
                    queue_.pop(0)
        t += dt
    return arrived, within, longest


def prompt_text(seed: int, engine: int, index: int, length: int) -> str:
    chars = np.random.default_rng([seed, engine, index, 7]).integers(32, 127, size=length)
    return bytes(chars.tolist()).decode()


def demand_series(
    trace: list[TraceRequest],
    lifetime: Callable[[TraceRequest], float],
    token_bytes: float,
    duration: float,
) -> np.ndarray:
    """KV bytes an unconstrained engine would hold over time (0.1 s grid), by Little's law: a
    request holds its prompt + half its output (the mean over its decode) from arrival for its
    lifetime."""
    grid = np.arange(0.0, duration + 10.0, 0.1)
    held = np.zeros_like(grid)
    for r in trace:
        end = r.arrival + lifetime(r)
        held[(grid >= r.arrival) & (grid < end)] += (r.prompt_tokens + r.max_tokens / 2) * (
            token_bytes
        )
    return held


# -- one engine (a worker process) -------------------------------------------------------------


def record_to_json(record: Any, start: float) -> dict[str, object]:
    data = dataclasses.asdict(record)
    for key in ("arrival", "first_token", "finish"):
        if data[key] is not None:
            data[key] -= start
    return data


class StepLog:
    """Times every step of an engine: wraps its runner's ``execute`` (the forward pass and the
    sampling, synchronous, run in the engine's step thread) so the measured step is the real one.
    """

    def __init__(self, engine: Any) -> None:
        self.start = time.monotonic()
        self.steps: list[tuple[float, float, int, int]] = []  # (start, seconds, batch, new tok)
        execute = engine.runner.execute

        def timed(tokens: Any, starts: Any, tables: Any, sampling: Any) -> Any:
            begin = time.monotonic()
            result = execute(tokens, starts, tables, sampling)
            new = sum(len(t) - s for t, s in zip(tokens, starts, strict=True))
            self.steps.append((begin - self.start, time.monotonic() - begin, len(tokens), new))
            return result

        engine.runner.execute = timed


def engine_config(spec: dict[str, Any]) -> Any:
    from kvasync.serve import EngineConfig

    return EngineConfig(**spec["config"])


async def _read_command() -> dict[str, Any]:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if not line:
        raise SystemExit(0)  # the parent is gone
    command: dict[str, Any] = json.loads(line)
    return command


def _reply(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def calibrate(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine. Bursts: per (batch, prompt tokens, output tokens), the median decode step time
    (steps that were all decode at that batch) and the prefill rate. With ``together``, the
    engine says ready and starts its bursts at the parent's go, at the same moment as the other
    engines' (the step time co-located). Stream: a trace replayed at its rate on the engine
    alone; its requests' lifetimes and the KV it held once steady (the second half)."""
    from kvasync.serve import Engine
    from kvasync.serve._report import MemorySampler

    engine = await Engine.open(engine_config(spec))
    async with engine:
        await engine.complete("warm up", max_tokens=2)
        if spec.get("together"):
            _reply(ready=True)
            go = await _read_command()
            await asyncio.sleep(max(0.0, go["start_at"] - time.time()))
        log = StepLog(engine)
        results: dict[str, Any] = {"bursts": []}
        for batch, prompt_tokens, output in spec["bursts"]:
            first = len(log.steps)
            prompts = [prompt_text(99, 0, i, prompt_tokens) for i in range(batch)]
            await asyncio.wait_for(
                asyncio.gather(*(engine.complete(p, max_tokens=output) for p in prompts)), 300
            )
            decode = [s for _, s, b, new in log.steps[first:] if b == batch and new == batch]
            # Steps that were mostly prefill (new tokens >= 2x the batch): their tokens/s.
            prefill = [(s, new) for _, s, b, new in log.steps[first:] if new >= 2 * b]
            prefill_s = sum(s for s, _ in prefill)
            results["bursts"].append(
                {
                    "batch": batch,
                    "prompt_tokens": prompt_tokens,
                    "step_s": float(np.median(decode)) if decode else float("nan"),
                    "decode_steps": len(decode),
                    "prefill_tok_s": (
                        sum(n for _, n in prefill) / prefill_s if prefill_s > 0 else float("nan")
                    ),
                }
            )
        if spec.get("stream"):
            trace = [TraceRequest(*r) for r in json.loads(Path(spec["stream"]).read_text())]
            kv = engine.kv
            start = time.monotonic()
            log.start, first_step = start, len(log.steps)

            async def one(index: int, request: TraceRequest) -> tuple[float, float, float]:
                await asyncio.sleep(max(0.0, start + request.arrival - time.monotonic()))
                prompt = prompt_text(98, 0, index, request.prompt_tokens)
                record = (await engine.complete(prompt, max_tokens=request.max_tokens)).record
                assert record is not None and record.first_token is not None
                tpot = record.tpot or 0.0
                # KV is held from admission (about a step before the first token) to the end;
                # the wait in the queue before it holds none.
                return record.ttft or 0.0, record.finish - record.first_token + tpot, tpot

            with MemorySampler(lambda: kv.stats().used_blocks, SAMPLE_S) as used:
                used.start = start
                lives = await asyncio.wait_for(
                    asyncio.gather(*(one(i, r) for i, r in enumerate(trace))), 300
                )
            end = trace[-1].arrival
            steady = [n for t, n in used.samples if end / 2 <= t <= end]
            results["stream"] = {
                "mean_used_blocks": float(np.mean(steady)) if steady else 0.0,
                "mean_ttft_s": float(np.mean([t for t, _, _ in lives])),
                "mean_kv_life_s": float(np.mean([k for _, k, _ in lives])),
                "mean_tpot_s": float(np.mean([p for _, _, p in lives])),
                "most_running": max((b for _, _, b, _ in log.steps[first_step:]), default=0),
                "requests": len(trace),
                # The steps once steady: prefills and decodes mixed, as in the runs.
                "steady_step_s": float(
                    np.mean(
                        [d for t, d, _, _ in log.steps[first_step:] if end / 2 <= t <= end]
                        or [np.nan]
                    )
                ),
            }
        return results


async def replay(spec: dict[str, Any]) -> dict[str, Any]:
    """Opens the engine, says ready, replays the trace from the start time the parent sends."""
    from kvasync.serve import Engine, RequestFailed, RequestTooLarge
    from kvasync.serve._report import MemorySampler

    trace = [TraceRequest(*r) for r in json.loads(Path(spec["trace"]).read_text())]
    engine = await Engine.open(engine_config(spec))
    async with engine:
        await engine.complete("warm up", max_tokens=2)  # first step's lazy inits, off the clock
        prompts = [
            prompt_text(spec["seed"], spec["engine"], i, r.prompt_tokens)
            for i, r in enumerate(trace)
        ]
        _reply(ready=True)
        go = await _read_command()
        await asyncio.sleep(max(0.0, go["start_at"] - time.time()))
        start = time.monotonic()
        log = StepLog(engine)
        log.start = start
        kv, scheduler = engine.kv, engine.scheduler
        give_up = spec["give_up_s"]
        counts = {"refused": 0, "gave up": 0}

        async def one(index: int, request: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, start + request.arrival - time.monotonic()))
            stream = engine.generate(prompts[index], max_tokens=request.max_tokens)
            try:
                async with asyncio.timeout(give_up):
                    await anext(stream, None)
                async for _ in stream:
                    pass
            except RequestTooLarge:  # refused at submit: no record
                counts["refused"] += 1
            except RequestFailed:  # recorded by the engine (its deadline, ...)
                pass
            except TimeoutError:  # no token within give_up: the client leaves (recorded)
                counts["gave up"] += 1
            finally:
                await stream.aclose()

        memory = MemorySampler(lambda: kv.stats().mapped_bytes, SAMPLE_S)
        waiting = MemorySampler(lambda: len(scheduler.waiting), SAMPLE_S)
        running = MemorySampler(lambda: len(scheduler.running), SAMPLE_S)
        # What the waiting requests wait for (Scheduler.held_for), as a code (HELD_CODES).
        held = MemorySampler(lambda: HELD_CODES.get(scheduler.held_for or "", 0), SAMPLE_S)
        for sampler in (memory, waiting, running, held):
            sampler.start = start
        with memory, waiting, running, held:
            tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(trace)]
            # A run ends at its SLO horizon: the last arrival plus the TTFT SLO plus the longest
            # output at the TPOT SLO, the latest any request within both SLOs can finish. What
            # is unfinished then is cut (recorded as abandoned; it had missed the SLO already),
            # so that a slow drain or a stall costs a bounded time.
            _, late = await asyncio.wait(tasks, timeout=spec["duration"] + spec["horizon_s"])
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=30)
        duration = time.monotonic() - start
        stats = engine.stats()
        records = [r for r in engine.records() if r.arrival >= start]
        return {
            "name": spec["name"],
            "duration": duration,
            "memory": memory.samples,
            "waiting": waiting.samples,
            "running": running.samples,
            "held for": held.samples,
            "steps": log.steps,
            "records": [record_to_json(r, start) for r in records],
            "extra": {
                "moved blocks": stats.moved_blocks,
                "refused": counts["refused"],
                "gave up": counts["gave up"],
                "cut": len(late),
            },
        }


def run_worker() -> None:
    """A worker process: one engine at a time, as the parent's JSON lines say (stdin)."""
    import kvasync.serve  # noqa: F401  (imported before saying ready: torch's start-up)

    _reply(ready=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            return
        try:
            if command["op"] == "calibrate":
                result = asyncio.run(calibrate(command))
            else:
                result = asyncio.run(replay(command))
            Path(command["out"]).write_text(json.dumps(result))
            _reply(done=True)
        except Exception as error:  # the parent fails the run with it
            _reply(error=f"{type(error).__name__}: {error}")


# -- the parent: a pool of workers -------------------------------------------------------------


class Worker:
    """One worker process, its replies read by a thread into a queue (read with deadlines)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.started = False  # its first "ready" (imports done) was read
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with contextlib.suppress(json.JSONDecodeError):  # a stray print: not a reply
                self.replies.put(json.loads(line))
        self.replies.put(None)

    def send(self, **command: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def expect(self, key: str, timeout: float) -> dict[str, Any]:
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"worker {self.index}: no {key!r} within {timeout:.0f} s") from None
        if reply is None:
            raise RuntimeError(f"worker {self.index} exited ({self.process.wait(5)})")
        if key not in reply:
            raise RuntimeError(f"worker {self.index}: {reply.get('error', reply)}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send(op="quit")
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


# (seconds since start, [(member, committed, used, waiters, blocked, limit bytes)])
LedgerSample = tuple[float, list[tuple[str, int, int, int, int, int]]]


class LedgerWatch:
    """Samples the share's ledger in a thread (``LedgerSample``s)."""

    def __init__(self, share: str, start_wall: float) -> None:
        self.share = share
        self.start_wall = start_wall
        self.samples: list[LedgerSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kvasync import share as ledger

        while not self._stop.wait(LEDGER_SAMPLE_S):
            try:
                entries = ledger.snapshot(self.share, timeout=1.0)
            except Exception:  # the ledger is gone (the run ended) or its lock was busy
                continue
            self.samples.append(
                (
                    time.time() - self.start_wall,
                    [
                        (
                            e.name,
                            e.committed_bytes,
                            e.used_bytes,
                            e.waiters,
                            e.blocked,
                            e.limit_bytes,
                        )
                        for e in entries
                    ],
                )
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class GpuBusy:
    """Samples the GPU's utilization (NVML: the share of time a kernel ran) in a thread, when
    NVML is there; samples nothing otherwise."""

    def __init__(self, start_wall: float, device: str) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._start = start_wall
        self._thread: threading.Thread | None = None
        if device != "cuda":
            return
        try:
            import pynvml  # type: ignore[import-not-found, unused-ignore]

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            return

        def run() -> None:
            while not self._stop.wait(0.1):
                busy = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                self.samples.append((time.time() - self._start, float(busy)))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@dataclass
class EngineRun:
    """One engine's side of a run, parsed from its worker's result."""

    name: str
    records: list[Any]
    memory: list[tuple[float, int]]
    waiting: list[tuple[float, int]]
    running: list[tuple[float, int]]
    held_for: list[tuple[float, int]]  # what the waiting requests waited for (HELD_CODES)
    steps: list[tuple[float, float, int, int]]
    duration: float
    extra: dict[str, float]
    limit_bytes: int | None  # the static split; None when shared


@dataclass
class VariantRun:
    variant: str
    engines: list[EngineRun]
    ledger: list[LedgerSample]
    gpu_busy: list[tuple[float, float]]


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workers: list[Worker] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-colocate-many-"))
        self.runs = 0

    def pool(self, count: int) -> list[Worker]:
        while len(self.workers) < count:
            self.workers.append(Worker(len(self.workers)))
        for worker in self.workers:
            if not worker.started:
                worker.expect("ready", READY_TIMEOUT_S)
                worker.started = True
        return self.workers[:count]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()

    def base_config(self, max_batch: int, max_batch_tokens: int, **changes: Any) -> dict[str, Any]:
        config: dict[str, Any] = {
            "preset": self.args.preset,
            "device": self.args.device,
            "max_blocks": 1 << 17 if self.args.preset == "small" else 1 << 14,
            "max_batch": max_batch,
            "max_batch_tokens": max_batch_tokens,
            "request_timeout": 600.0,  # the client gives up first (give_up_s)
        }
        config.update(changes)
        return config

    def calibrate(
        self,
        regime: Regime,
        bursts: list[tuple[int, int, int]],
        stream: list[TraceRequest] | None = None,
    ) -> dict[str, Any]:
        (worker, *_) = self.pool(1)
        out = self.tmp / "calibration.json"
        config = self.base_config(regime.max_batch, regime.max_batch_tokens, name="calibration")
        stream_path = None
        if stream is not None:
            stream_path = self.tmp / "calibration_stream.json"
            stream_path.write_text(json.dumps([dataclasses.astuple(r) for r in stream]))
        worker.send(
            op="calibrate",
            config=config,
            bursts=bursts,
            stream=None if stream_path is None else str(stream_path),
            out=str(out),
        )
        worker.expect("done", 600)
        result: dict[str, Any] = json.loads(out.read_text())
        return result

    def calibrate_together(
        self,
        regime: Regime,
        bursts: list[list[tuple[int, int, int]]],
        streams: list[list[TraceRequest]] | None = None,
    ) -> list[dict[str, Any]]:
        """Bursts on several engines at once (one list of bursts per engine), then each engine's
        stream (one per engine, where given), all started at the same moment."""
        workers = self.pool(len(bursts))
        outs = []
        for index, (worker, mine) in enumerate(zip(workers, bursts, strict=True)):
            out = self.tmp / f"calibration_{index}.json"
            outs.append(out)
            config = self.base_config(
                regime.max_batch, regime.max_batch_tokens, name=f"calibration{index}"
            )
            stream_path = None
            if streams is not None:
                stream_path = self.tmp / f"calibration_stream_{index}.json"
                stream_path.write_text(json.dumps([dataclasses.astuple(r) for r in streams[index]]))
            worker.send(
                op="calibrate",
                config=config,
                bursts=mine,
                stream=None if stream_path is None else str(stream_path),
                together=True,
                out=str(out),
            )
        for worker in workers:
            worker.expect("ready", READY_TIMEOUT_S)
        start_at = time.time() + 0.5
        for worker in workers:
            worker.send(op="go", start_at=start_at)
        for worker in workers:
            worker.expect("done", 600)
        return [json.loads(out.read_text()) for out in outs]

    def run(
        self,
        variant: str,
        traces: list[list[TraceRequest]],
        configs: list[dict[str, Any]],
        share: str | None,
        give_up_s: float,
        horizon_s: float,
        duration: float,
    ) -> VariantRun:
        self.runs += 1
        workers = self.pool(len(traces))
        outs = []
        for index, (worker, trace, config) in enumerate(zip(workers, traces, configs, strict=True)):
            trace_path = self.tmp / f"trace_{self.runs}_{index}.json"
            trace_path.write_text(json.dumps([dataclasses.astuple(r) for r in trace]))
            out = self.tmp / f"run_{self.runs}_{index}.json"
            outs.append(out)
            worker.send(
                op="run",
                name=f"{variant} e{index}",
                engine=index,
                seed=self.args.seed,
                config=config,
                trace=str(trace_path),
                give_up_s=give_up_s,
                horizon_s=horizon_s,
                duration=duration,
                out=str(out),
            )
        for worker in workers:
            worker.expect("ready", READY_TIMEOUT_S)
        start_at = time.time() + 0.5
        watch = LedgerWatch(share, start_at) if share is not None else None
        busy = GpuBusy(start_at, self.args.device)
        for worker in workers:
            worker.send(op="go", start_at=start_at)
        try:
            for worker in workers:
                worker.expect("done", duration + horizon_s + 120)
        finally:
            if watch is not None:
                watch.stop()
            busy.stop()
        from kvasync.serve import RequestRecord

        engines = []
        for out, config in zip(outs, configs, strict=True):
            data = json.loads(out.read_text())
            engines.append(
                EngineRun(
                    name=data["name"],
                    records=[RequestRecord(**r) for r in data["records"]],
                    memory=[(float(t), int(b)) for t, b in data["memory"]],
                    waiting=[(float(t), int(n)) for t, n in data["waiting"]],
                    running=[(float(t), int(n)) for t, n in data["running"]],
                    held_for=[(float(t), int(n)) for t, n in data["held for"]],
                    steps=[(float(t), float(d), int(b), int(k)) for t, d, b, k in data["steps"]],
                    duration=data["duration"],
                    extra=data["extra"],
                    limit_bytes=None if share is not None else config.get("memory_limit"),
                )
            )
        return VariantRun(variant, engines, watch.samples if watch else [], busy.samples)


# -- analysis ----------------------------------------------------------------------------------


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


# -- the plot ----------------------------------------------------------------------------------


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


# -- the cases ---------------------------------------------------------------------------------


def split_pages(weights: Sequence[float], total: int, floor: int) -> list[int]:
    """Pages per engine proportional to ``weights``, each at least ``floor``, summing to at most
    ``total`` (the remainder to the heaviest)."""
    n = len(weights)
    spare = total - floor * n
    share = [w / sum(weights) for w in weights]
    pages = [floor + int(spare * s) for s in share]
    order = sorted(range(n), key=lambda i: -share[i])
    k = 0
    while sum(pages) < total:
        pages[order[k % n]] += 1
        k += 1
    return pages


class Case:
    """One case (memory or compute) at one N: its traces, its variants, its tables."""

    def __init__(
        self,
        harness: Harness,
        name: str,
        engines: int,
        traces: list[list[TraceRequest]],
        regime: Regime,
        budget: int,
        geo: Geometry,
        duration: float,
        phases: list[tuple[float, int]] | None,
    ) -> None:
        self.harness = harness
        self.name = name
        self.n = engines
        self.traces = traces
        self.regime = regime
        self.budget = budget
        self.geo = geo
        self.duration = duration
        self.phases = phases
        self.runs: list[VariantRun] = []
        self.summaries: list[dict[str, Any]] = []
        self.verdict = "-"  # the regime check's ("yes" or "NO"), once run
        self.give_up_s = regime.give_up_factor * regime.slo_ttft_s
        longest_output = max(r.max_tokens for t in traces for r in t)
        self.horizon_s = regime.slo_ttft_s + longest_output * regime.slo_tpot_s + 1.0
        self.total_pages = budget // geo.page_bytes
        longest = max(r.prompt_tokens + r.max_tokens for t in traces for r in t)
        # A static partition holds at least the longest request (else it refuses it).
        self.floor_pages = -(-longest // geo.tokens_per_page) + 1

    def config(self, index: int, **changes: Any) -> dict[str, Any]:
        # Every variant's engines hold admission above the step target (compute counts too).
        return self.harness.base_config(
            self.regime.max_batch,
            self.regime.max_batch_tokens,
            name=f"e{index}",
            step_target=self.regime.step_target_frac * self.regime.slo_tpot_s,
            **changes,
        )

    def run_static(self, label: str, pages: list[int]) -> dict[str, Any]:
        configs = [
            self.config(i, memory_limit=p * self.geo.page_bytes, static=True)
            for i, p in enumerate(pages)
        ]
        return self._run(label, configs, None)

    def run_shared(self) -> dict[str, Any]:
        share = f"bench-many-{os.getpid()}-{self.harness.runs + 1}"
        configs = [
            self.config(i, memory_limit=None, share=share, device_budget=self.budget)
            for i in range(self.n)
        ]
        return self._run("shared", configs, share)

    def _run(self, label: str, configs: list[dict[str, Any]], share: str | None) -> dict[str, Any]:
        began = time.monotonic()
        run = self.harness.run(
            label, self.traces, configs, share, self.give_up_s, self.horizon_s, self.duration
        )
        self.runs.append(run)
        summary = summarize_variant(
            run,
            self.regime,
            self.geo.page_bytes,
            self.duration,
            self.budget,
        )
        self.summaries.append(summary)
        print(
            f"  {self.name} N={self.n} {label}: {summary['within SLO']} within SLO of "
            f"{summary['requests']} ({time.monotonic() - began:.0f} s)",
            flush=True,
        )
        return summary

    def best_static_candidates(
        self, lifetime: Callable[[TraceRequest], float], order: list[str]
    ) -> list[tuple[str, list[int]]]:
        demand = [
            demand_series(t, lifetime, self.geo.token_bytes, self.duration) for t in self.traces
        ]
        weights = {
            "peak demand": [float(d.max()) for d in demand],
            "mean demand": [float(d.mean()) for d in demand],
        }
        shared = next((r for r in self.runs if r.variant == "shared"), None)
        if shared is not None:
            weights["shared peaks"] = [float(max(b for _, b in e.memory)) for e in shared.engines]
        uniform = [self.total_pages // self.n] * self.n
        seen = [uniform]
        candidates = []
        for label in order:
            w = weights.get(label)
            if w is None:
                continue
            if min(w) <= 0:
                w = [max(x, 1.0) for x in w]
            pages = split_pages(w, self.total_pages, self.floor_pages)
            if pages in seen:
                continue
            seen.append(pages)
            candidates.append((f"static by {label}", pages))
        return candidates


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
        "--calibration-s", type=float, default=8.0, help="seconds of the calibration stream"
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
            stream = memory_bound_traces(
                dataclasses.replace(regime, cold_weight=1.0, bursts_per_min=1e-9),
                1,
                args.calibration_s,
                stream_rate,
                args.seed + 2000,
            )[0]
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
            def steady_stream(rate: float, seed: int) -> list[TraceRequest]:
                steady = dataclasses.replace(regime, cold_weight=1.0, bursts_per_min=1e-9)
                return memory_bound_traces(steady, 1, args.calibration_s, rate, seed)[0]

            coloc_streams = [steady_stream(first_rate, args.seed + 3000)] + [
                steady_stream(regime.cold_weight * first_rate, args.seed + 3001 + i)
                for i in range(n_max - 1)
            ]
            coloc = harness.calibrate_together(regime, [[]] * n_max, coloc_streams)[0]["stream"]
            coloc_batch = max(1, int(coloc["most_running"]))
            mean_life = float(coloc["mean_kv_life_s"]) * step_alone(batch) / step_alone(coloc_batch)
            hot_rate = batch / mean_life
            working_set = hot_rate * mean_life * held_tokens * geo.token_bytes
            saturated = stream_batch >= regime.max_batch
            full = " (its whole batch: saturated, the lifetime is too long)" if saturated else ""

            def hot_lifetime(r: TraceRequest) -> float:
                return float(
                    mean_life * (prefill_steps + r.max_tokens) / (prefill_steps + mean_output)
                )

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
                f"for {args.calibration_s:.0f} s on one engine alone ran up to {stream_batch} "
                f"requests at once{full}; "
                f"a token took {1e3 * measured['mean_tpot_s']:.1f} ms (x{mixed:.2f} a decode step: "
                f"the prefills), steps {1e3 * measured['steady_step_s']:.1f} ms once steady, "
                f"TTFT {measured['mean_ttft_s']:.2f} s; a request held its KV "
                f"{kv_life_stream:.2f} s (estimated {step_hot * (prefill_steps + mean_output):.2f} "
                f"s from decode steps), {first_life:.2f} s co-located at batch {batch} "
                f"(x{contention:.2f}): {first_rate:.2f} req/s. Measured co-located (that rate on "
                f"the hot engine, {regime.cold_weight:.0%} of it on {n_max - 1} cold ones, "
                f"{args.calibration_s:.0f} s): up to {coloc_batch} requests at once, a token "
                f"{1e3 * coloc['mean_tpot_s']:.1f} ms, KV held {coloc['mean_kv_life_s']:.2f} s, "
                f"so {mean_life:.2f} s at batch {batch}. So the hot "
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
                "lifetime_s": mean_life,
                "hot_rate": hot_rate,
                "paper": paper,
            }
            lifetime = hot_lifetime
        if "compute" in args.cases:
            compute_peak, compute_budget = compute_design(
                emit, args, regime, shape, geo, alone, (compute_prompt, compute_output)
            )
            summary_json["calibration"] |= {
                "compute_peak": compute_peak,
                "compute_budget": compute_budget,
            }
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
