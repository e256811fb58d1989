"""The traces: seeded Poisson arrivals per engine (the memory case's hot and cold engines with
their bursts, the compute case's bumps), the prompts' text, and the KV demand a trace implies."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from _colocate_many.shapes import ComputeShape, Regime


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
