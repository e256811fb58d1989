"""A simulation of one vLLM engine's scheduler on a trace, for the best static split with
hindsight (bench/bench_vllm_many.py) and for the dry mode's engines.

What it keeps of vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py): blocks of
``BLOCK_TOKENS`` tokens from a pool of fixed size; each step, running requests first, in order,
each one token (decode) or a chunk of its prompt within the step's token budget; a running
request that finds no block preempts the newest running one (itself when it is the newest),
which frees all its blocks and computes its prompt and output so far again later (recompute),
first in the waiting queue; then waiting requests first come first served while the token
budget, ``max_num_seqs`` and the free blocks allow (the head blocks the rest), and none in a
step that preempted. A step's time is ``StepModel``: a fixed cost, a cost per running sequence
and a cost per prefill token, fitted to the steps the real engines logged (``fit_step_model``),
or the priors in bench/_vllm_many.py before any ran.

``best_split`` searches the static splits of a budget: each engine's requests within SLO as a
function of its own capacity (its pool alone decides its schedule; the other engines reach it
only through the step times, which the fitted model carries), then the split that maximises
their sum on a grid of the budget (dynamic programming over the engines: exact on the grid).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

BLOCK_TOKENS = 16


@dataclass(frozen=True)
class StepModel:
    """A step's seconds: ``base_s + per_seq_s x running + per_token_s x prefill tokens``."""

    base_s: float
    per_seq_s: float
    per_token_s: float

    def step_s(self, seqs: int, prefill_tokens: int) -> float:
        return self.base_s + self.per_seq_s * seqs + self.per_token_s * prefill_tokens


class BlockSource(Protocol):
    """Where a simulated engine's blocks come from (a fixed pool, or a real allocator)."""

    def take(self, n: int) -> list[int] | None:
        """``n`` block ids, or None when there are not that many now."""

    def give(self, ids: list[int]) -> None: ...

    def free_count(self) -> int: ...


class FixedPool:
    """``blocks`` block ids, as a static KV cache of vLLM's (block 0 is the null block)."""

    def __init__(self, blocks: int) -> None:
        if blocks < 2:
            raise ValueError(f"a pool needs the null block and one more, got {blocks} blocks")
        self._free = list(range(blocks - 1, 0, -1))

    def take(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def give(self, ids: list[int]) -> None:
        self._free.extend(ids)

    def free_count(self) -> int:
        return len(self._free)


@dataclass
class SimRequest:
    id: str
    at: float
    prompt: int
    output: int
    computed: int = 0  # tokens whose KV is in its blocks
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    first: float | None = None
    finished: float | None = None
    aborted: float | None = None  # its client gave up (no token by then)
    preempted: int = 0

    def wanted(self) -> int:
        """Tokens to compute before its next token comes out."""
        return self.prompt + self.generated - self.computed


@dataclass
class StepRecord:
    """What one step did (the child's step log has the same fields)."""

    t: float  # its start, seconds since the trace's start
    seconds: float
    tokens: int  # scheduled tokens (decode + prefill)
    running: int
    waiting: int


class Scheduler:
    """One engine's scheduler over a ``BlockSource`` (see the module's docstring)."""

    def __init__(
        self,
        pool: BlockSource,
        *,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 8192,
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.preemptions = 0

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, request: SimRequest, tokens: int) -> bool:
        need = math.ceil((request.computed + tokens) / BLOCK_TOKENS) - len(request.blocks)
        if need <= 0:
            return True
        got = self.pool.take(need)
        if got is None:
            return False
        request.blocks.extend(got)
        return True

    def _preempt(self, request: SimRequest) -> None:
        self.running.remove(request)
        self.pool.give(request.blocks)
        request.blocks = []
        request.computed = 0
        request.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> tuple[list[tuple[SimRequest, int]], int]:
        """One step's plan: (request, tokens) pairs and the prefill tokens among them."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[SimRequest, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            tokens = min(request.wanted(), budget)
            while not self._grow(request, tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                plan.append((request, tokens))
                budget -= tokens
                index += 1
                continue
            # The request itself was preempted: the ones after it were already (newest first).
            break
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            tokens = min(request.wanted(), budget)
            if not self._grow(request, tokens):
                break  # first come, first served: the head blocks the queue
            self.waiting.popleft()
            self.running.append(request)
            plan.append((request, tokens))
            budget -= tokens
        prefill = sum(t for r, t in plan if t > 1 or r.computed < r.prompt)
        return plan, prefill

    def give_up(self, now: float, after_s: float) -> list[SimRequest]:
        """Aborts the requests with no token ``after_s`` after their arrival (their clients
        leave: they can be within no SLO any more); returns them."""
        gone = [
            r for r in [*self.waiting, *self.running] if r.first is None and now >= r.at + after_s
        ]
        for request in gone:
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self.pool.give(request.blocks)
            request.blocks = []
            request.aborted = now
        return gone

    def finish_step(self, plan: list[tuple[SimRequest, int]], now: float) -> list[SimRequest]:
        """Applies a step's plan ending at ``now``; returns the requests that emitted a token."""
        emitted = []
        for request, tokens in plan:
            request.computed += tokens
            if request.wanted() > 0:
                continue  # a chunk of its prompt: no token yet
            request.generated += 1
            emitted.append(request)
            if request.first is None:
                request.first = now
            if request.generated >= request.output:
                request.finished = now
                self.running.remove(request)
                self.pool.give(request.blocks)
                request.blocks = []
        return emitted


def simulate(
    trace: Sequence[dict[str, Any]],
    blocks: int,
    model: StepModel,
    *,
    horizon_s: float,
    give_up_s: float,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 8192,
    steps: list[StepRecord] | None = None,
) -> list[SimRequest]:
    """The engine on ``trace`` with a static pool of ``blocks`` blocks until ``horizon_s``, its
    clients giving up on a request with no token ``give_up_s`` after its arrival; each
    request's first and finish times (None where it had none by the horizon)."""
    scheduler = Scheduler(
        FixedPool(blocks), max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    requests = [SimRequest(r["id"], r["at"], r["prompt_len"], r["output_len"]) for r in trace]
    arrivals = deque(sorted(requests, key=lambda r: r.at))
    t = 0.0
    while t < horizon_s and (arrivals or scheduler.busy()):
        while arrivals and arrivals[0].at <= t:
            scheduler.add(arrivals.popleft())
        scheduler.give_up(t, give_up_s)
        if not scheduler.busy():
            t = arrivals[0].at
            continue
        plan, prefill = scheduler.schedule()
        if not plan:  # nothing fits now: wait for an arrival or the head's give-up
            due = [r.at + give_up_s for r in scheduler.waiting if r.first is None]
            if arrivals:
                due.append(arrivals[0].at)
            if not due:
                break
            t = max(t, min(due))
            continue
        seconds = model.step_s(len(plan), prefill)
        if steps is not None:
            tokens = sum(n for _, n in plan)
            steps.append(
                StepRecord(t, seconds, tokens, len(scheduler.running), len(scheduler.waiting))
            )
        t += seconds
        scheduler.finish_step(plan, t)
    return requests


def within_slo(request: SimRequest | dict[str, Any], ttft_s: float, tpot_s: float) -> bool:
    """Its first token within ``ttft_s`` of its arrival, and it finished with at most ``tpot_s``
    a token after the first (a simulated request, or the child's record: at, first, finished,
    output_tokens)."""
    if isinstance(request, SimRequest):
        at, first, finished, output = request.at, request.first, request.finished, request.output
    else:
        at, first, finished = request["at"], request["first"], request["finished"]
        output = request["output_tokens"]
    if first is None or finished is None or first - at > ttft_s:
        return False
    return output <= 1 or (finished - first) / (output - 1) <= tpot_s


def count_within(
    trace: Sequence[dict[str, Any]],
    blocks: int,
    model: StepModel,
    *,
    horizon_s: float,
    give_up_s: float,
    ttft_s: float,
    tpot_s: float,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 8192,
) -> int:
    """Requests within both SLOs, simulated with a pool of ``blocks``."""
    done = simulate(
        trace,
        blocks,
        model,
        horizon_s=horizon_s,
        give_up_s=give_up_s,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return sum(within_slo(r, ttft_s, tpot_s) for r in done)


def fit_step_model(steps: Sequence[dict[str, Any]], prior: StepModel) -> StepModel:
    """Least squares of the logged steps' seconds on (1, running, prefill tokens), each step's
    prefill tokens being its scheduled tokens less its running sequences (one decode token each).

    A coefficient the steps cannot show (its column all zero: no prefill logged) or that the
    fit makes negative is the prior's, and the others are fitted again around it; with fewer
    than 20 steps the prior is the answer.
    """
    import numpy as np

    rows = [
        (1.0, float(s["running"]), float(max(0, s["tokens"] - s["running"])), float(s["seconds"]))
        for s in steps
        if s.get("tokens") is not None and s["seconds"] > 0
    ]
    if len(rows) < 20:
        return prior
    data = np.array(rows)
    x, y = data[:, :3], data[:, 3]
    coefficients = [prior.base_s, prior.per_seq_s, prior.per_token_s]
    free = [k for k in range(3) if np.any(x[:, k] != 0)]
    while free:
        fixed = [k for k in range(3) if k not in free]
        target = y - x[:, fixed] @ np.array([coefficients[k] for k in fixed])
        solved, *_ = np.linalg.lstsq(x[:, free], target, rcond=None)
        negative = [k for k, value in zip(free, solved, strict=True) if value < 0]
        if not negative:
            for k, value in zip(free, solved, strict=True):
                coefficients[k] = float(value)
            break
        free = [k for k in free if k not in negative]
    return StepModel(*coefficients)


@dataclass(frozen=True)
class SplitSearch:
    """The search's answer: the best split (bytes per engine), its simulated requests within
    SLO in all and per engine, and every engine's curve (requests within SLO at each grid
    point: ``curves[e][k]`` at k grid steps of the budget above its minimum)."""

    split: list[int]
    within: int
    per_engine: list[int]
    curves: list[list[int]]
    grid_bytes: int


def best_split(
    budget: int,
    minima: Sequence[int],
    score: Callable[[int, int], int],
    *,
    grid: int = 48,
) -> SplitSearch:
    """The static split of ``budget`` that maximises the sum of ``score(engine, bytes)`` over
    the engines, on a grid of ``budget / grid`` bytes above each engine's minimum (``minima``).

    ``score`` is evaluated once per engine and grid point, and no further along an engine's
    curve once it has stayed flat for a quarter of the grid (its demand is met: more capacity
    changes nothing).

    Raises:
        ValueError: the minima alone exceed the budget.
    """
    n = len(minima)
    free = budget - sum(minima)
    if free < 0:
        raise ValueError(f"the minima ({sum(minima)} bytes) exceed the budget ({budget} bytes)")
    step = max(1, budget // grid)
    points = free // step
    curves: list[list[int]] = []
    for engine in range(n):
        curve: list[int] = []
        flat = 0
        for k in range(points + 1):
            if flat >= max(2, grid // 4):
                curve.append(curve[-1])
                continue
            value = score(engine, minima[engine] + k * step)
            flat = flat + 1 if curve and value == curve[-1] else 0
            curve.append(value)
        curves.append(curve)
    # best[k]: the most within SLO of the engines so far with k grid steps between them. Among
    # equal sums, the split nearest an even one (a flat curve gains nothing from more, and a
    # static engine loses nothing by it), and all of the budget used.
    best = list(curves[0])
    choice: list[list[int]] = [list(range(points + 1))]
    for engine in range(1, n):
        merged, picks = [], []
        for k in range(points + 1):
            even = k / (engine + 1)
            j = max(range(k + 1), key=lambda j: (best[k - j] + curves[engine][j], -abs(j - even)))
            merged.append(best[k - j] + curves[engine][j])
            picks.append(j)
        best, choice = merged, [*choice, picks]
    k = max(range(points + 1), key=lambda k: (best[k], k))
    steps_per_engine = [0] * n
    for engine in range(n - 1, 0, -1):
        j = choice[engine][k]
        steps_per_engine[engine] = j
        k -= j
    steps_per_engine[0] = k
    split = [minima[e] + steps_per_engine[e] * step for e in range(n)]
    per_engine = [curves[e][steps_per_engine[e]] for e in range(n)]
    return SplitSearch(split, sum(per_engine), per_engine, curves, step)
