"""The engine's scheduling policy (Note [Engine scheduling]), with no model and no event loop.

The scheduler reads the allocator through a view (``KVView``). Most tests here give it a small
ledger of blocks (``Blocks``) that hands out and takes back block ids as the engine does with the
allocator, so each decision is checked in microseconds; one test runs it over a real host-backend
allocator whose limit was lowered, where free blocks and available blocks differ.
"""

from __future__ import annotations

import ast
import itertools
import math
import os
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

import kvasync
from kvasync.serve import EngineConfig, RequestFailed, RequestTooLarge, _scheduler
from kvasync.serve._config import AllocatorView
from kvasync.serve._scheduler import KVView, Request, Scheduler

BLOCK = 16  # tokens per block


@dataclass
class Blocks:
    """A view over a numbered set of blocks: ``available`` of them can be had now (a share's
    headroom can make that fewer than the free ones), ``capacity`` at most, ever."""

    available: int
    capacity: int = 1 << 20
    drain: int | None = None
    next_id: itertools.count[int] = field(default_factory=lambda: itertools.count(0))
    demand: int | None = None  # the last demand the scheduler reported

    def set_demand(self, blocks: int) -> None:
        self.demand = blocks

    def available_blocks(self) -> int:
        return self.available

    def drain_from(self) -> int | None:
        return self.drain

    def capacity_blocks(self) -> int:
        return self.capacity

    def take(self, n: int) -> list[int]:
        assert n <= self.available, f"took {n} blocks, {self.available} available"
        self.available -= n
        return [next(self.next_id) for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self.available += len(blocks)


class Harness:
    """A scheduler over ``Blocks``, with the engine's side of a preemption (free the victim's
    blocks) and of an admission (alloc, then ``admitted``)."""

    def __init__(self, view: KVView, step_target: float | None = None, **limits: int) -> None:
        self.view = view
        self.released: list[int] = []
        self.scheduler: Scheduler[Request] = Scheduler(
            view,
            block_size=BLOCK,
            max_batch=limits.get("max_batch", 64),
            max_batch_tokens=limits.get("max_batch_tokens", 4096),
            patience=0.05,
            release=self.release,
            step_target=step_target,
            compute_min_batch=limits.get("compute_min_batch", 4),
        )
        self.ids = itertools.count()

    def release(self, request: Request) -> None:
        self.released.append(request.request_id)
        if isinstance(self.view, Blocks):
            self.view.give_back(request.blocks)

    def submit(self, prompt_tokens: int, max_tokens: int = 8, arrival: float = 0.0) -> Request:
        request_id = next(self.ids)
        request = Request(
            request_id=request_id,
            prompt=[65] * prompt_tokens,
            max_tokens=max_tokens,
            arrival=arrival or float(request_id),
            deadline=1e9,
        )
        self.scheduler.add(request)
        return request

    def admit_all(self, now: float = 0.0) -> list[Request]:
        admitted = []
        while (admission := self.scheduler.next_admission(now)) is not None:
            assert isinstance(self.view, Blocks)
            blocks = self.view.take(admission.need)
            assert self.scheduler.admitted(admission.request, blocks)
            admitted.append(admission.request)
        return admitted

    def decode(self, request: Request) -> None:
        """One step of ``request``: its KV now covers its tokens, and it samples one more."""
        request.num_computed = len(request.tokens)
        request.output.append(66)


def test_admission_takes_the_oldest_while_the_available_blocks_hold_them() -> None:
    view = Blocks(available=5)
    harness = Harness(view)
    first, second, third = (harness.submit(30), harness.submit(40), harness.submit(20))
    # 2 + 3 blocks fit in 5; the third (2 blocks) does not, and admission pauses.
    assert harness.admit_all() == [first, second]
    assert [len(r.blocks) for r in (first, second)] == [2, 3]
    assert list(harness.scheduler.waiting) == [third]
    assert harness.scheduler.paused
    # Blocks freed (a request ended) unpause it, and the third is admitted.
    harness.scheduler.remove(first)
    view.give_back(first.blocks)
    harness.scheduler.unpause()
    assert harness.admit_all() == [third]


def test_admission_under_a_shares_headroom_waits_though_blocks_are_free() -> None:
    # In a share, available_blocks counts only the budget the share leaves this allocator: free
    # blocks it holds are not enough when the head of the queue needs more than that headroom.
    view = Blocks(available=4)
    harness = Harness(view)
    running = harness.submit(16)
    assert harness.admit_all() == [running]
    view.available = 2  # another member of the share took the rest of the budget
    waiting = harness.submit(40)  # 3 blocks
    assert harness.scheduler.next_admission(now=1.0) is None
    assert harness.scheduler.paused
    # Paused for the patience at most: in a share, memory comes back from the other members.
    view.available = 3
    assert harness.scheduler.next_admission(now=1.01) is None
    admission = harness.scheduler.next_admission(now=1.2)
    assert admission is not None and admission.request is waiting and admission.need == 3
    assert not admission.alone


def test_a_request_alone_is_admitted_to_wait_for_its_blocks_whatever_is_available() -> None:
    harness = Harness(Blocks(available=0))
    request = harness.submit(40)
    admission = harness.scheduler.next_admission(now=0.0)
    # Nothing else runs: its alloc waits up to its deadline rather than pausing admission.
    assert admission is not None and admission.alone and admission.need == 3
    assert harness.scheduler.deadline_for(request) == request.deadline


def test_admission_respects_the_batch_and_its_token_budget() -> None:
    harness = Harness(Blocks(available=100), max_batch=3, max_batch_tokens=64)
    requests = [harness.submit(30) for _ in range(4)]
    # 30 + 30 new tokens fit in 64, a third does not; the batch of 3 is not reached.
    assert harness.admit_all() == requests[:2]
    for request in requests[:2]:
        harness.decode(request)  # one new token each from now on
    assert harness.admit_all() == [requests[2]]  # 3 requests: the batch is full
    assert list(harness.scheduler.waiting) == [requests[3]]


def test_admission_holds_while_recent_steps_are_slower_than_the_step_target() -> None:
    # Memory for all, but compute: 4 running requests whose steps take 80 ms against a target of
    # 50 ms (a TPOT SLO of 100 ms, with room). Nothing more is admitted, memory or not, and
    # admission is not paused (that is memory's); as the steps speed up it resumes.
    view = Blocks(available=1000)
    harness = Harness(view, step_target=0.05)
    running = [harness.submit(16) for _ in range(4)]
    assert harness.admit_all() == running  # no step yet: nothing known of compute
    late = harness.submit(16)
    for _ in range(3):
        harness.scheduler.stepped(0.08)
    assert harness.scheduler.compute_bound()
    assert harness.admit_all() == []
    assert list(harness.scheduler.waiting) == [late] and not harness.scheduler.paused
    assert harness.scheduler.compute_holds == 1
    # The recent step time is an average of the last few: one fast step is not enough...
    harness.scheduler.stepped(0.02)
    assert harness.scheduler.recent_step is not None and harness.scheduler.recent_step > 0.05
    assert harness.admit_all() == []
    # ... a few are.
    for _ in range(3):
        harness.scheduler.stepped(0.02)
    assert not harness.scheduler.compute_bound()
    assert harness.admit_all() == [late]


def test_the_compute_hold_spares_a_small_batch_and_a_request_alone() -> None:
    # Slow steps with 2 running (under compute_min_batch = 3): the steps are slow because of the
    # other engines on the device, and admission goes on up to the floor, then holds.
    view = Blocks(available=1000)
    harness = Harness(view, step_target=0.05, compute_min_batch=3)
    first, second = harness.submit(16), harness.submit(16)
    assert harness.admit_all() == [first, second]
    harness.scheduler.stepped(0.5)
    third, fourth = harness.submit(16), harness.submit(16)
    assert harness.admit_all() == [third]  # 3 now run: the hold applies
    assert list(harness.scheduler.waiting) == [fourth]
    # Everything ended: the one waiting is admitted alone, however slow the last steps were.
    for request in (first, second, third):
        harness.scheduler.remove(request)
    assert harness.admit_all() == [fourth]


def test_without_a_step_target_slow_steps_never_hold_admission() -> None:
    harness = Harness(Blocks(available=1000))
    running = [harness.submit(16) for _ in range(8)]
    assert harness.admit_all() == running
    harness.scheduler.stepped(10.0)
    assert not harness.scheduler.compute_bound()
    late = harness.submit(16)
    assert harness.admit_all() == [late]


@pytest.mark.parametrize("target", [0.0, -1.0, math.inf, math.nan])
def test_a_step_target_that_is_not_positive_seconds_is_refused(target: float) -> None:
    with pytest.raises(ValueError, match="step_target"):
        Harness(Blocks(available=1), step_target=target)
    with pytest.raises(ValueError, match="step_target"):
        EngineConfig(step_target=target)
    with pytest.raises(ValueError, match="compute_min_batch"):
        EngineConfig(compute_min_batch=0)


async def test_an_engine_reports_its_steps_and_holds_admission_for_compute() -> None:
    # A real engine (tiny model, CPU): with a step target no step can meet and a floor of 1, once
    # it has stepped (a first request) it runs one request at a time (each admitted alone, when
    # the one before ended): the hold never starves a queue. Without a target the same requests
    # run together.
    import asyncio

    from kvasync.serve import open_engine

    async def most_running(config: EngineConfig) -> tuple[int, int]:
        async with open_engine(config) as engine:
            await engine.complete("warm", max_tokens=2)
            most = 0

            async def watch() -> None:
                nonlocal most
                while True:
                    most = max(most, len(engine.scheduler.running))
                    await asyncio.sleep(0)

            watcher = asyncio.ensure_future(watch())
            prompts = [engine.complete("z" * (8 + i), max_tokens=6) for i in range(4)]
            results = await asyncio.wait_for(asyncio.gather(*prompts), 60)
            watcher.cancel()
            assert [r.output_tokens for r in results] == [6] * 4
            assert engine.scheduler.recent_step is not None  # the engine reported its steps
            return most, engine.scheduler.compute_holds

    base = {"preset": "tiny", "device": "cpu", "request_timeout": 60.0}
    most, holds = await most_running(EngineConfig(step_target=1e-9, compute_min_batch=1, **base))
    assert most == 1 and holds > 0
    most, holds = await most_running(EngineConfig(**base))
    assert most > 1 and holds == 0


def test_growth_preempts_the_youngest_first_and_requeues_it_at_the_head() -> None:
    view = Blocks(available=6)
    harness = Harness(view)
    old, middle, young = harness.submit(16), harness.submit(16), harness.submit(16)
    late = harness.submit(10)
    assert harness.admit_all() == [old, middle, young, late]
    view.available = 0  # the cache is full
    for request in (old, middle, young):
        harness.decode(request)  # 17 tokens: each crosses into a second block
    for _ in range(16):
        harness.decode(old)  # 33 tokens: old needs 2 blocks (as after a recompute)
    plan = harness.scheduler.plan_growth(now=0.0)
    # Youngest first: `late` (no growth of its own) then `young` make room for the older two
    # (an alloc planned is not yet taken from the view: it is asked for after the plan).
    assert [r.request_id for r in plan.preempted] == [late.request_id, young.request_id]
    assert harness.released == [late.request_id, young.request_id]
    assert [(r, n) for r, n in plan.grows] == [(old, 2), (middle, 1)]
    assert old.grow_since == 0.0 and young.grow_since is None
    # Requeued ahead of anything waiting, in arrival order, to be recomputed from scratch.
    assert list(harness.scheduler.waiting) == [young, late]
    assert (young.blocks, young.num_computed, young.preemptions) == ([], 0, 1)
    assert harness.scheduler.preemptions == 2
    # While a grow is pending nothing is admitted, though blocks came back.
    assert harness.scheduler.next_admission(now=0.0) is None


def test_an_overdue_grow_or_a_refused_one_preempts_the_youngest_but_never_the_last() -> None:
    harness = Harness(Blocks(available=3))
    old, young = harness.submit(16), harness.submit(16)
    harness.admit_all()
    harness.decode(old)
    plan = harness.scheduler.plan_growth(now=10.0)
    assert plan.grows == [(old, 1)]
    assert not harness.scheduler.overdue(old, now=10.04)
    assert harness.scheduler.overdue(old, now=10.06)
    assert harness.scheduler.make_room() is young
    assert harness.scheduler.make_room() is None  # alone now: it waits instead


def test_vacating_a_drain_moves_the_holders_blocks_below_it() -> None:
    view = Blocks(available=100, next_id=itertools.count(10))
    harness = Harness(view)
    a, b = harness.submit(40), harness.submit(40)
    harness.admit_all()  # a: 10 11 12, b: 13 14 15
    view.drain = 14  # the pages from block 14 up drain
    assert harness.scheduler.draining() == 14
    plan = harness.scheduler.plan_vacate(14)
    assert plan.holders == [b] and plan.count == 2 and plan.preempted == []
    sources, destinations = plan.assign([0, 1])  # what the allocator hands out below the drain
    assert (sources, destinations) == ([14, 15], [0, 1])
    assert b.blocks == [13, 0, 1] and a.blocks == [10, 11, 12]
    assert harness.scheduler.draining() is None  # nothing of ours there any more


def test_vacating_preempts_the_youngest_holders_only_while_the_moves_do_not_fit() -> None:
    view = Blocks(available=9)
    harness = Harness(view)
    a, b, c = harness.submit(48), harness.submit(48), harness.submit(48)
    harness.admit_all()  # a: 0-2, b: 3-5, c: 6-8
    view.drain = 2
    view.available = 4  # room below the drain for 4 moved blocks; 7 are at or above it
    plan = harness.scheduler.plan_vacate(2)
    # c (3 blocks there) is preempted: its blocks come back (to the view, as a free does),
    # and then a and b's 4 fit.
    assert plan.preempted == [c] and harness.released == [c.request_id]
    assert plan.holders == [a, b] and plan.count == 4
    with pytest.raises(ValueError, match="needs 4 blocks"):
        plan.assign([20, 21])


def test_a_request_that_can_never_fit_is_refused_at_once_and_nothing_is_queued() -> None:
    harness = Harness(Blocks(available=4, capacity=4))
    # 53 + 200 tokens need 16 blocks of 16, the cache holds 4: refused, not admitted to stall.
    with pytest.raises(RequestTooLarge, match=r"16 KV blocks.*can ever hold \(4\)") as caught:
        harness.submit(53, max_tokens=200)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RequestFailed)
    assert not harness.scheduler.waiting
    # Exactly the capacity fits: the last sampled token is never computed, 53 + 12 - 1 = 64.
    harness.submit(53, max_tokens=12)
    assert len(harness.scheduler.waiting) == 1


def test_a_request_alone_that_outgrows_a_lowered_capacity_is_reported_not_waited_for() -> None:
    view = Blocks(available=4, capacity=4)
    harness = Harness(view)
    request = harness.submit(60, max_tokens=5)  # 64 tokens: 4 blocks
    harness.admit_all()
    view.capacity = 3  # the limit was lowered below what it holds
    request.num_computed = 60
    request.output.append(66)  # 61 tokens: still 4 blocks
    assert harness.scheduler.plan_growth(now=0.0).too_large is None
    request.blocks = request.blocks[:3]  # moved below the drain into 3, it needs a 4th
    plan = harness.scheduler.plan_growth(now=0.0)
    assert plan.too_large == (request, 1) and plan.alone is None


async def test_over_a_real_allocator_a_drain_keeps_free_blocks_from_admission() -> None:
    # A host allocator whose limit was lowered below what is mapped: the free blocks of the
    # draining pages are not available, and the scheduler admits by what is available.
    layout = kvasync.KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=16, block_size=BLOCK, dtype=torch.float32
    )
    page = 16 << 10  # 16 blocks of 1 KiB in each of 2 ranges
    config = kvasync.Config(backend="host", max_blocks=256, page_size=page, reserve_pages=(0, 0))
    async with kvasync.open_allocator(layout, config) as kv:
        held = sorted(await kv.alloc(64, timeout=5))  # pages 0-3
        kept = [*held[:16], held[16], held[32], held[48]]  # page 0, and one block of pages 1-3
        kv.free([b for b in held if b not in kept])
        await kv.resize(memory_limit=2 * 2 * page, timeout=5)  # 2 pages: pages 2 and 3 drain
        view = AllocatorView(kv, EngineConfig(device="cpu"))
        assert view.drain_from() == 32
        # The draining pages' 30 free blocks do not count: page 1's 15 do.
        assert (kv.stats().free_blocks, view.available_blocks()) == (45, 15)
        harness = Harness(view)
        running = Request(0, [65], 8, 0.0, 1e9, blocks=kept)
        harness.scheduler.running.append(running)
        waiting = harness.submit(BLOCK * 16)  # 16 blocks: fewer than free, more than available
        assert harness.scheduler.next_admission(now=0.0) is None
        assert list(harness.scheduler.waiting) == [waiting]
        assert harness.scheduler.draining() == 32  # and the running request is to be moved
        plan = harness.scheduler.plan_vacate(32)
        assert plan.holders == [running] and plan.count == 2
        kv.free(kept)


def test_admission_reports_the_demand_of_the_running_and_the_waiting_that_fit_the_batch() -> None:
    view = Blocks(available=4)
    harness = Harness(view, max_batch=2)
    running = harness.submit(16)  # 1 block
    assert harness.admit_all() == [running]
    harness.decode(running)  # 17 tokens: 2 blocks for its next step
    view.available = 0
    harness.submit(40)  # 3 blocks, fits the batch
    harness.submit(100)  # 7 blocks, beyond max_batch: not wanted now
    assert harness.scheduler.next_admission(now=1.0) is None
    assert view.demand == 2 + 3


def test_while_compute_holds_admission_the_demand_leaves_out_the_waiting_requests() -> None:
    # Held for compute, the engine admits none of its waiting requests, so the memory they would
    # need is not wanted now: reported, it raised this engine's fair share and kept the budget
    # from co-located engines that would use it (a grant never takes what another wants).
    view = Blocks(available=1000)
    harness = Harness(view, step_target=0.05)
    running = [harness.submit(16) for _ in range(4)]  # 1 block each
    assert harness.admit_all() == running
    harness.submit(40)  # 3 blocks, fits the batch
    for _ in range(3):
        harness.scheduler.stepped(0.08)
    assert harness.scheduler.next_admission(now=1.0) is None
    assert harness.scheduler.compute_holds == 1
    assert view.demand == 4  # the running requests' alone
    for _ in range(4):
        harness.scheduler.stepped(0.02)
    assert harness.scheduler.next_admission(now=1.0) is not None  # the hold lifted
    assert view.demand == 4 + 3


async def test_admission_in_a_real_share_counts_only_the_headroom_the_other_member_leaves() -> None:
    # Two host allocators of one share: `other` holds 3 of the 4 pages of the budget. The engine
    # (one request running on the 4th page) may count on its fair share (2 pages, Note [Fair
    # share under pressure]) but no more, though the other holds pages it does not use.
    from conftest import wait_until

    from kvasync import _core
    from kvasync import share as ledger

    layout = kvasync.KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=16, block_size=BLOCK, dtype=torch.float32
    )
    page = 16 << 10  # 16 blocks of 1 KiB in each of 2 ranges
    page_bytes = 2 * page
    share = f"test-{uuid.uuid4().hex[:12]}"
    config = kvasync.Config(
        backend="host",
        max_blocks=256,
        page_size=page,
        reserve_pages=(0, 0),
        share=share,
        device_budget=4 * page_bytes,
    )
    try:
        async with (
            kvasync.open_allocator(layout, replace(config, name="engine")) as engine_kv,
            kvasync.open_allocator(layout, replace(config, name="other")) as other,
        ):
            hogged = await other.alloc(48, timeout=5)  # pages 0-2 of `other`
            view = AllocatorView(
                engine_kv,
                EngineConfig(device="cpu", share=share, device_budget=4 * page_bytes),
            )
            harness = Harness(view)
            running = Request(0, [65] * BLOCK, 8, 0.0, 1e9, blocks=await engine_kv.alloc(16))
            harness.scheduler.running.append(running)
            waiting = harness.submit(BLOCK * 32)  # 32 blocks: more than 1 page of fair share left
            assert harness.scheduler.next_admission(now=0.0) is None
            assert harness.scheduler.paused and list(harness.scheduler.waiting) == [waiting]
            # Its demand is in the ledger: 16 blocks running + 32 waiting = 3 pages.
            await wait_until(
                lambda: any(
                    e["name"] == "engine" and e["demand_bytes"] == 3 * page_bytes
                    for e in _core.ledger_snapshot(ledger.path(share), 1.0)
                )
            )
            assert view.available_blocks() == 16
            # `other` lets go of 2 pages: the engine's headroom covers the waiting request.
            other.free(hogged[16:])
            await wait_until(lambda: view.available_blocks() >= 32)
            admission = harness.scheduler.next_admission(now=1.0)  # past the patience
            assert admission is not None and admission.request is waiting
            blocks = await engine_kv.alloc(admission.need, timeout=5)
            assert harness.scheduler.admitted(waiting, blocks)
            committed = sum(e.committed_bytes for e in ledger.snapshot(share))
            assert committed <= 4 * page_bytes
            engine_kv.free(blocks + running.blocks)
            other.free(hogged[:16])
    finally:
        if os.path.exists(ledger.path(share)):
            os.unlink(ledger.path(share))


def test_the_scheduler_imports_no_model_no_torch_and_no_event_loop() -> None:
    tree = ast.parse(Path(_scheduler.__file__).read_text())
    imported = {
        name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        )
    }
    assert not imported & {"torch", "asyncio", "_model", "_runner", "_engine", "_attention"}


def test_held_for_names_what_the_waiting_requests_wait_for() -> None:
    # One engine through each reason in turn; the admission decisions are the ones pinned above,
    # held_for only names them (a benchmark's regime check reads it).
    view = Blocks(available=6)
    harness = Harness(view, step_target=0.05, max_batch=5, max_batch_tokens=100)
    scheduler = harness.scheduler
    assert scheduler.next_admission(now=0.0) is None and scheduler.held_for is None  # none wait
    running = [harness.submit(16) for _ in range(4)]  # 1 block and 16 new tokens each
    assert harness.admit_all() == running and scheduler.held_for is None
    # 64 new tokens run: 40 more do not fit the step's 100.
    big = harness.submit(40)
    assert harness.admit_all() == [] and scheduler.held_for == "tokens"
    for request in running:
        harness.decode(request)  # one new token each: 4 + 40 fit
    view.available = 2  # big needs 3 blocks
    assert harness.admit_all() == [] and scheduler.held_for == "memory"
    assert scheduler.paused  # and stays memory's while paused
    assert scheduler.next_admission(now=0.01) is None and scheduler.held_for == "memory"
    scheduler.unpause()
    view.available = 100
    for _ in range(3):
        scheduler.stepped(0.08)
    assert harness.admit_all() == [] and scheduler.held_for == "compute"
    for _ in range(4):
        scheduler.stepped(0.02)
    assert harness.admit_all() == [big] and scheduler.held_for is None  # nothing waits now
    harness.submit(16)
    assert harness.admit_all() == [] and scheduler.held_for == "batch"  # 5 of 5 run
    harness.decode(big)
    running[0].output.append(66)  # about to cross into its next block: a grow is pending
    running[0].grow_since = 0.0
    scheduler.remove(big)
    assert harness.admit_all() == [] and scheduler.held_for == "memory"
