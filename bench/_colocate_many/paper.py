"""The arithmetic on paper, before any run: requests within SLO per variant (memory case), the
planned wall time, and the compute case's capacity of one engine and its fluid queues."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from _tables import markdown

from _colocate_many.shapes import COMPUTE_SHAPES, Regime
from _colocate_many.traces import COMPUTE_PHASES, bump_rate, hot_schedule


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
