"""The engine's scheduler: which requests are admitted, grow, wait, are preempted or moved.

Note [Engine scheduling]
~~~~~~~~~~~~~~~~~~~~~~~~
One asyncio task runs the engine, step after step:

1. Expire: a request whose deadline passed (waiting or running) fails with DeadlineExceeded and
   its blocks are freed. No request waits past its deadline: while a step runs, the loop waits
   for it no longer than the earliest deadline and expires then (a step can take far longer
   than usual: loaded cores, a slow device), freeing the blocks once the step is done.
2. Admit waiting requests, oldest first, while the batch has room (``max_batch`` requests,
   ``max_batch_tokens`` new tokens): each gets the blocks for its tokens with ``await kv.alloc``.
   First the scheduler reports its demand (``kv.set_demand``: the blocks its running requests
   hold and need for their next step, plus the next-step need of the waiting requests that fit
   the batch, none while compute holds admission below), by which a share divides its budget
   (Note [Fair share under pressure] in csrc/ledger/ledger.h). With others running, a request
   is admitted only when ``kv.available_blocks()`` covers its need: what the allocator can
   count on, which in a share is the headroom the other members leave it or its fair share,
   never the whole budget.
   With other requests running, the alloc waits at most ``alloc_timeout`` (pages being mapped
   arrive in well under that), so that a full cache stalls the running batch at most that long;
   on a timeout admission pauses until blocks are freed. With nothing running it waits up to the
   earliest deadline of the waiting requests (then expires them and tries again): there is
   nothing else to do. Compute counts too (``step_target``, off when None): while the recent
   step time (an average over the last few steps, which the engine reports with ``stepped``) is
   above the target and at least ``compute_min_batch`` requests run, nothing is admitted, memory
   or not. On a GPU shared by several engines, a hot engine given more memory would otherwise
   admit a batch that compute cannot carry, and every running request's TPOT would pass its SLO
   (measured on the H200: shared 42 vs static 74 requests within SLO, N = 2). Held back, a
   request waits for its first token instead (TTFT), and the batch that runs keeps its pace. The
   floor keeps a small batch admitting: its steps are slow because of the other engines on the
   device, and a few more requests add little to them. While held, the demand reported leaves
   the waiting requests out, so that the share gives their memory to engines that would use it.
   Each turn records what the waiting requests wait for (``held_for``: memory, the batch,
   compute, or the step's token budget), so that a benchmark can tell which of them binds.
3. Vacate: when the allocator drains pages (``kv.drain_from()``: a memory limit lowered below
   what is mapped, or in a share the fair share while another engine waits for memory), the
   running requests' blocks in those pages are moved below the drain (new blocks, one
   ``kv.copy`` of every layer's K and V, the old blocks freed), so that the pages go back within
   a step rather than when the requests holding them end. Decode growth lands on the highest
   pages, so nearly every long request holds a block there: preempting the holders would throw
   away most of the batch's work (measured on the H200: 288 preemptions, TTFT p99 20 s), moving
   them costs one copy. Only while the blocks to move do not fit below the drain are the
   youngest holders preempted.
4. Grow: a running request about to cross into a new block asks for it with ``kv.alloc`` in a
   task of its own, with its deadline. Found free, the blocks arrive before the step; otherwise
   the request sits out steps while the others go on, until its blocks arrive (mapped, freed, or
   given back by another engine of the share). When the allocator says it cannot fit
   (``kv.available_blocks()`` is too few, an alloc raises OutOfBlocks, or a grow has waited
   longer than its patience: ``alloc_timeout``, or ``share_wait`` in a share, where memory comes
   back from the other engines), the engine preempts the youngest running request: it frees its
   blocks and puts it back in the queue, to be recomputed from its prompt and the tokens it
   already produced (recompute preemption). While any grow waits, nothing is admitted. A request
   alone that cannot grow waits as an admission does; one that can never fit fails with
   RequestFailed (a request whose prompt + max_tokens can never fit is refused at submission,
   RequestTooLarge; this catches a limit lowered while it runs).
5. Step: one forward pass over the new tokens of every running request that has its blocks
   (prefill and decode in one batch), run in a worker thread so the loop keeps serving HTTP. Each
   request then gets its next token; a request whose sampling fails fails alone (Note [Sampling
   failures] in _runner.py). When every running request waits for blocks, the loop waits
   (bounded by the patience) for the first of them instead.

A request's KV covers ``tokens[:num_computed]``; a step computes ``tokens[num_computed:]`` (the
prompt, or after a preemption prompt + output, or just the last token) and needs
``ceil(len(tokens) / block_size)`` blocks.

This module is that policy, over plain request state and a read-only view of the allocator
(``KVView``): no model, no tensors, no event loop (the engine, _engine.py, is the loop). The
engine asks it what to do, performs the allocs, frees and copies with the allocator, and tells it
what happened. Its answers are plain values (``Admission``, ``GrowthPlan``, ``VacatePlan``), so
that the policy is tested in milliseconds with no model (tests/test_serve_scheduler.py).

The one action it takes itself is a preemption's release: it calls the ``release`` callback it
was given (the engine frees the victim's blocks and drops its pending alloc there and then), and
reads the view again, since a preemption is what makes room.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Generic, Protocol, TypeVar

from ._errors import RequestTooLarge

__all__ = [
    "Admission",
    "GrowthPlan",
    "KVView",
    "Request",
    "Scheduler",
    "VacatePlan",
]


class KVView(Protocol):
    """What the scheduler reads of the allocator (``kvasync.Allocator`` has the first two)."""

    def available_blocks(self) -> int:
        """Blocks an alloc could get now or by mapping within the limit (and share headroom)."""
        ...

    def drain_from(self) -> int | None:
        """The first block id of the pages the allocator wants back, or None."""
        ...

    def capacity_blocks(self) -> int:
        """The most blocks this cache can ever hold at once (capacity, limit, share budget)."""
        ...

    def set_demand(self, blocks: int) -> None:
        """Reports the blocks the engine wants now (a share divides its budget by demand)."""
        ...


@dataclass(eq=False)  # identity: two requests are never the same one
class Request:
    """What the scheduler knows of a request.

    Its KV covers ``tokens[:num_computed]``; its next step computes the rest and needs
    ``ceil(len(tokens) / block_size)`` blocks.
    """

    request_id: int
    prompt: list[int]
    max_tokens: int
    arrival: float  # time.monotonic(): age, for the preemption order
    deadline: float  # the engine's loop clock
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    preemptions: int = 0
    grow_since: float | None = None  # when the alloc of the blocks it grows into was asked for
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


R = TypeVar("R", bound=Request)


@dataclass(frozen=True)
class Admission(Generic[R]):
    """Admit ``request`` with ``need`` new blocks. ``alone``: nothing else runs, so its alloc may
    wait up to ``Scheduler.deadline_for(request)``; otherwise only ``alloc_timeout``."""

    request: R
    need: int
    alone: bool


@dataclass
class GrowthPlan(Generic[R]):
    """One step's growth: the requests preempted to make room (already released), the allocs to
    start (``(request, blocks)``; each request's ``grow_since`` is set), and at most one request
    running alone that waits for its blocks (``alone``) or can never get them (``too_large``)."""

    preempted: list[R] = field(default_factory=list)
    grows: list[tuple[R, int]] = field(default_factory=list)
    alone: tuple[R, int] | None = None
    too_large: tuple[R, int] | None = None


@dataclass
class VacatePlan(Generic[R]):
    """Moving the running requests' blocks at or above ``drain`` below it: ``count`` new blocks
    for the ``holders`` (oldest first); the youngest holders that did not fit were preempted."""

    drain: int
    holders: list[R]
    count: int
    preempted: list[R]

    def assign(self, targets: list[int]) -> tuple[list[int], list[int]]:
        """Rewrites the holders' block tables onto ``targets`` (``count`` blocks).

        Returns:
            ``(sources, destinations)``: the blocks to copy, and where to.
        """
        if len(targets) != self.count:
            raise ValueError(f"a vacate needs {self.count} blocks, got {len(targets)}")
        fresh = iter(targets)
        sources, destinations = [], []
        for request in self.holders:
            for index, block in enumerate(request.blocks):
                if block >= self.drain:
                    request.blocks[index] = next(fresh)
                    sources.append(block)
                    destinations.append(request.blocks[index])
        return sources, destinations


class Scheduler(Generic[R]):
    """The scheduling policy of Note [Engine scheduling].

    Args:
        view: the allocator's view.
        block_size: tokens per KV block.
        max_batch: requests running at once.
        max_batch_tokens: new tokens one step computes at most.
        patience: seconds a grow waits before the youngest request is preempted; also how long
            admission stays paused after an admission alloc timed out.
        release: called with a request being preempted, before its state is reset: it frees the
            request's blocks and drops its pending alloc.
        step_target: seconds a step may take before admission holds (compute); None: no hold.
        compute_min_batch: the compute hold applies only to a batch of at least this many.
    """

    # The weight of the newest step in the recent step time: about the last 3-4 steps count.
    STEP_WEIGHT = 0.3

    def __init__(
        self,
        view: KVView,
        *,
        block_size: int,
        max_batch: int,
        max_batch_tokens: int,
        patience: float,
        release: Callable[[R], None],
        step_target: float | None = None,
        compute_min_batch: int = 4,
    ) -> None:
        if step_target is not None and not (step_target > 0 and math.isfinite(step_target)):
            raise ValueError(f"step_target must be positive seconds or None, got {step_target!r}")
        if compute_min_batch < 1:
            raise ValueError(f"compute_min_batch must be >= 1, got {compute_min_batch!r}")
        self.view = view
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.patience = patience
        self._release = release
        self.waiting: deque[R] = deque()
        self.running: list[R] = []
        self.preemptions = 0
        self._paused = False  # an admission alloc timed out: wait for blocks to be freed
        self._paused_at = 0.0
        self.step_target = step_target
        self.compute_min_batch = compute_min_batch
        self.recent_step: float | None = None  # seconds, a moving average (STEP_WEIGHT)
        self.compute_holds = 0  # admissions held back for compute (a count of loop turns)
        # What the waiting requests wait for, as of the last ``next_admission`` (HELD_FOR).
        self.held_for: str | None = None

    # -- requests ---------------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold the KV of ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request: R) -> int:
        """Blocks ``request`` lacks for its next step (<= 0: none)."""
        return self.blocks_for(len(request.tokens)) - len(request.blocks)

    def demand_blocks(self) -> int:
        """The blocks the engine wants now: what the running requests hold or need for their next
        step, and the next-step need of the waiting requests that fit the batch (none while
        compute holds admission: it would not use that memory, and co-located engines would)."""
        running = sum(max(len(r.blocks), self.blocks_for(len(r.tokens))) for r in self.running)
        room = 0 if self.compute_bound() else max(0, self.max_batch - len(self.running))
        waiting = sum(self.blocks_for(len(r.tokens)) for r in islice(self.waiting, room))
        return running + waiting

    def max_blocks(self, request: R) -> int:
        """The most blocks ``request`` ever holds: the last token it samples is never computed."""
        return self.blocks_for(len(request.prompt) + request.max_tokens - 1)

    def add(self, request: R) -> None:
        """Queues a new request.

        Raises:
            RequestTooLarge: it can never fit the cache (nothing is queued).
        """
        need = self.max_blocks(request)
        capacity = self.view.capacity_blocks()
        if need > capacity:
            raise RequestTooLarge(
                f"request of {len(request.prompt)} prompt tokens + max_tokens "
                f"{request.max_tokens} needs {need} KV blocks of {self.block_size} tokens, more "
                f"KV blocks than the cache can ever hold ({capacity}); shorten it or lower "
                "max_tokens"
            )
        self.waiting.append(request)

    def remove(self, request: R) -> None:
        """Forgets a request that ended (its blocks are the caller's to free)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def expired(self, now: float) -> list[tuple[R, str]]:
        """The requests whose deadline passed, each with where it was (running or waiting)."""
        return [
            (r, "running" if r in self.running else "waiting for admission")
            for r in (*self.waiting, *self.running)
            if r.deadline <= now
        ]

    def deadline_for(self, request: R) -> float:
        """The earliest deadline of ``request`` and the waiting requests: a wait of the loop ends
        by then, so that each request is failed at its deadline."""
        return min([request.deadline, *(r.deadline for r in self.waiting)])

    def ready(self) -> list[R]:
        """The running requests that have the blocks for their next step."""
        return [r for r in self.running if self.blocks_needed(r) <= 0]

    def stall_wait(self, now: float) -> float:
        """How long a loop with nothing ready waits for a grow: the patience, and no later than
        any deadline."""
        deadlines = [r.deadline for r in (*self.running, *self.waiting)]
        return max(0.0, min(self.patience, min(deadlines, default=now + self.patience) - now))

    # -- admission --------------------------------------------------------------------------

    def next_admission(self, now: float) -> Admission[R] | None:
        """The next request to admit, oldest first, or None: the batch is full (requests or
        tokens), a grow is pending (growth first), admission is paused, the recent steps are slower
        than ``step_target`` (compute), or the head's blocks are not available while others run
        (then admission pauses: only an end frees blocks). ``held_for`` says which held it."""
        self.view.set_demand(self.demand_blocks())
        if self._paused and now - self._paused_at > self.patience:
            self._paused = False  # in a share, memory can come back from another engine
        if not self.waiting:
            self.held_for = None
            return None
        self.held_for = self._held_for()
        if self.held_for is not None:
            if self.held_for == "compute":
                self.compute_holds += 1
            return None
        request = self.waiting[0]
        need = self.blocks_needed(request)
        if self.running and self.view.available_blocks() < need:
            self.pause(now)
            self.held_for = "memory"
            return None
        return Admission(request, need, alone=not self.running)

    # Why waiting requests are not admitted (``held_for``), by what would have to change.
    HELD_FOR = ("memory", "batch", "compute", "tokens")

    def _held_for(self) -> str | None:
        """Memory: a running request waits for blocks to grow into, or admission is paused
        (an admission found too few blocks); batch: ``max_batch`` requests run; compute: the
        step target holds admission; tokens: the head's new tokens do not fit the step's
        ``max_batch_tokens`` beside the running requests' (the step's compute); None: the head
        may be admitted if its blocks are available."""
        if any(r.grow_since is not None for r in self.running) or self._paused:
            return "memory"
        if len(self.running) >= self.max_batch:
            return "batch"
        if self.compute_bound():
            return "compute"
        budget = self.max_batch_tokens - sum(len(r.tokens) - r.num_computed for r in self.running)
        request = self.waiting[0]
        if len(request.tokens) - request.num_computed > budget and self.running:
            return "tokens"
        return None

    def stepped(self, seconds: float) -> None:
        """A step of the running batch took ``seconds`` (the recent step time moves to it)."""
        if self.recent_step is None:
            self.recent_step = seconds
        else:
            self.recent_step += self.STEP_WEIGHT * (seconds - self.recent_step)

    def compute_bound(self) -> bool:
        """Whether admission holds for compute: the recent step time is above ``step_target``
        while at least ``compute_min_batch`` requests run."""
        return (
            self.step_target is not None
            and self.recent_step is not None
            and len(self.running) >= self.compute_min_batch
            and self.recent_step > self.step_target
        )

    def admitted(self, request: R, blocks: list[int]) -> bool:
        """Moves the admitted ``request`` to the batch with its ``blocks``.

        Returns:
            False when it is no longer the head of the queue (it ended while its alloc waited):
            nothing changed and the blocks are the caller's to free.
        """
        if request.done or not self.waiting or self.waiting[0] is not request:
            return False
        self.waiting.popleft()
        request.blocks = blocks
        self.running.append(request)
        return True

    def pause(self, now: float) -> None:
        """Pauses admission (an admission alloc timed out) until blocks are freed, or for the
        patience."""
        self._paused = True
        self._paused_at = now

    def unpause(self) -> None:
        """Blocks were freed or arrived: admission may try again."""
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    # -- growth and preemption --------------------------------------------------------------

    def plan_growth(self, now: float) -> GrowthPlan[R]:
        """Gives each running request that crosses into a new block an alloc to wait on, oldest
        first; while the view has too few blocks, preempts the youngest. A request running alone
        waits for its blocks (``alone``) unless it can never hold them (``too_large``)."""
        plan: GrowthPlan[R] = GrowthPlan()
        for request in list(self.running):
            while request in self.running and request.grow_since is None:
                need = self.blocks_needed(request)
                if need <= 0:
                    break
                if len(self.running) == 1:
                    if len(request.blocks) + need > self.view.capacity_blocks():
                        plan.too_large = (request, need)
                    else:
                        plan.alone = (request, need)
                    break
                if self.view.available_blocks() < need:
                    plan.preempted.append(self.preempt(self.youngest()))
                    continue
                request.grow_since = now
                plan.grows.append((request, need))
        # A grow planned for a request preempted later in the plan is dropped with it.
        plan.grows = [(r, n) for r, n in plan.grows if r.grow_since is not None]
        return plan

    def grown(self, request: R, blocks: list[int]) -> None:
        """A grow's alloc delivered ``blocks``."""
        request.grow_since = None
        request.blocks.extend(blocks)
        self._paused = False  # memory arrived

    def overdue(self, request: R, now: float) -> bool:
        """Whether ``request``'s pending grow has waited longer than the patience."""
        return request.grow_since is not None and now - request.grow_since > self.patience

    def make_room(self) -> R | None:
        """Preempts the youngest request when others run (a grow can never fit beside them, or
        one is overdue). Returns the victim, or None when the batch holds one request."""
        if len(self.running) > 1:
            return self.preempt(self.youngest())
        return None

    def youngest(self) -> R:
        """The running request that arrived last."""
        return max(self.running, key=_age_key)

    def preempt(self, victim: R) -> R:
        """Preempts ``victim`` (recompute): releases its blocks and puts it back at the head of
        the queue (it was admitted before anything still waiting), its KV to be recomputed."""
        self.running.remove(victim)
        self._release(victim)
        victim.blocks = []
        victim.num_computed = 0
        victim.grow_since = None
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        self._paused = False
        return victim

    # -- draining (the drain of Note [Limit policy] in kvasync's page pool) -----------------

    def draining(self) -> int | None:
        """The allocator's ``drain_from`` when a running request holds a block there, or None
        (nothing of ours there: the draining pages go back as they empty)."""
        drain = self.view.drain_from()
        if drain is None or not any(r.blocks and max(r.blocks) >= drain for r in self.running):
            return None
        return drain

    def plan_vacate(self, drain: int) -> VacatePlan[R]:
        """Which running requests' blocks move below ``drain``: every holder's, preempting the
        youngest holders while the blocks to move do not fit the view's available blocks. Call
        it with no grow pending (a pending alloc holds back blocks the move needs)."""
        holders = sorted(
            (r for r in self.running if r.blocks and max(r.blocks) >= drain), key=_age_key
        )
        moving = sum(b >= drain for r in holders for b in r.blocks)
        preempted = []
        while holders and moving > self.view.available_blocks():
            victim = holders.pop()  # the youngest
            moving -= sum(b >= drain for b in victim.blocks)
            preempted.append(self.preempt(victim))
        return VacatePlan(drain, holders, moving, preempted)


def _age_key(request: Request) -> tuple[float, int]:
    return (request.arrival, request.request_id)
