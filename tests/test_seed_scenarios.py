"""The hangs of the shared seeds, replayed against kvasync: each must end, within a deadline.

* Two engines start at the same moment with the reserve on and maps stalling (seed 001, repro A):
  both must come up and serve allocations within their deadlines, round after round.
* Saturation (seed 001, repro B): demand far above the memory limit; every request gets its
  blocks or times out at its deadline, and allocations keep completing throughout.
* The main thread holds the GIL inside extension code (seed 000): the mapper fills the reserve
  anyway, because it never needs the GIL.
* Random cancellations and timeouts, under stalling, hanging and failing maps, leak no block;
  the "future resolved, task cancelled" race is replayed step by step.

No test sleeps to let things settle: each waits for the event it expects, with a deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import select
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from conftest import wait_until

import kvasync
from kvasync import _core
from kvasync.testing import FaultInjector

# 4 layers x K/V x 32 tokens x 8 heads x 128 x fp16 in one block-major range: 512 KiB per block
# there, so a 2 MiB page (the cuda granularity too) holds 4 blocks and one page id is 2 MiB.
LAYOUT = kvasync.KVLayout(
    num_layers=4, num_kv_heads=8, head_dim=128, block_size=32, contiguous=True
)
PAGE_SIZE = 2 << 20
BLOCKS_PER_PAGE = 4
# A correctness bound, not a performance claim: no request may wait this long past its deadline.
MAX_LATENESS_S = 0.5


def config(backend: str, **overrides: Any) -> kvasync.Config:
    settings: dict[str, Any] = {"backend": backend, "page_size": PAGE_SIZE, "default_timeout": 2.0}
    settings.update(overrides)
    return kvasync.Config(**settings)


def no_map_in_flight(kv: kvasync.Allocator) -> bool:
    stats = kv.stats()
    return stats.inflight_pages == 0 and stats.queued_jobs == 0 and stats.mapper_op is None


def assert_nothing_leaked(kv: kvasync.Allocator) -> None:
    stats = kv.stats()
    assert stats.used_blocks == 0, stats
    assert stats.waiters == 0, stats
    assert stats.free_blocks == stats.mapped_pages * BLOCKS_PER_PAGE, stats
    every_block = list(range(kv.num_blocks))
    assert kv._pool.unallocated(every_block) == every_block


# -- (A) two engines starting at the same moment ---------------------------------------------

WORKER_SCRIPT = Path(__file__).with_name("two_engine_worker.py")
WORKER_START_TIMEOUT_S = 60.0  # importing torch in two processes at once on a 2-core machine
ROUND_TIMEOUT_S = 15.0  # a round takes ~0.1 s; allocs time out after 1 s, close after 2 s
ROUNDS = 20


class WorkerHung(AssertionError):
    pass


class EngineWorker:
    """A two_engine_worker.py child process; every read from it has a deadline."""

    def __init__(self, name: str, backend: str) -> None:
        self.name = name
        # A file, not a pipe: a worker writing much to stderr can never block on it.
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin = self.process.stdin
        self._stdout_fd = self.process.stdout.fileno()
        os.set_blocking(self._stdout_fd, False)
        self._buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        # A few bytes into an empty pipe: never blocks.
        self._stdin.write(json.dumps(message).encode() + b"\n")
        self._stdin.flush()

    def receive(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        """The next line the worker prints, or a failure naming what it was waiting for."""
        with selectors.DefaultSelector() as selector:
            selector.register(self._stdout_fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerHung(f"{self.name} hung: no answer {waiting_for}{self.stderr()}")
                if not selector.select(left):
                    continue
                chunk = os.read(self._stdout_fd, 65536)
                if not chunk:
                    code = self.process.wait(timeout=5)
                    raise AssertionError(
                        f"{self.name} exited with {code} {waiting_for}{self.stderr()}"
                    )
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def stderr(self) -> str:
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace")[-4000:]
        return f"; its stderr:\n{text}" if text else ""

    def stop(self) -> None:
        """Asks the worker to quit; kills it if it has not within 10 s."""
        if self.process.poll() is None:
            try:
                self.send({"quit": True})
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=10)
        self._stdin.close()
        assert self.process.stdout is not None
        self.process.stdout.close()
        self._stderr.close()


@pytest.fixture
def two_engines(backend_name: str) -> Iterator[tuple[EngineWorker, EngineWorker]]:
    workers = (EngineWorker("engine 1", backend_name), EngineWorker("engine 2", backend_name))
    try:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        for worker in workers:
            assert worker.receive(deadline, "to start (import kvasync)") == {"ready": True}
        yield workers
    finally:
        for worker in workers:
            worker.stop()


def test_two_engines_started_together_with_stalling_maps_both_serve_allocs(
    two_engines: tuple[EngineWorker, EngineWorker],
) -> None:
    engines_saw_refill_in_flight = {worker.name: 0 for worker in two_engines}
    for index in range(ROUNDS):
        for worker in two_engines:  # released back to back: both open their allocator at once
            worker.send({"round": index})
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        for worker in two_engines:
            report = worker.receive(deadline, f"in round {index} of {ROUNDS}")
            assert report["ok"], f"{worker.name}, round {index}: {report['error']}"
            assert report["round"] == index
            assert [a["got"] for a in report["allocs"]] == [6, 10, 12, 8], report
            for alloc in report["allocs"]:
                assert alloc["took_s"] < alloc["timeout_s"], (worker.name, index, report)
            assert report["used_blocks_after_free"] == 0, report
            engines_saw_refill_in_flight[worker.name] += report["refill_in_flight_at_first_alloc"]
    # The scenario is only the seed's if the first alloc met a reserve refill still mapping.
    assert all(engines_saw_refill_in_flight.values()), engines_saw_refill_in_flight


# -- (B) saturation ----------------------------------------------------------------------------

SATURATION_TASKS = 150
SATURATION_RUN_S = 2.4
SATURATION_WINDOWS = 8  # successes must appear in each of these consecutive windows


# (1, 2): a small reserve; (4, 4): the refill wants the whole budget, as in seed 001's repro B.
@pytest.mark.parametrize("reserve_pages", [(1, 2), (4, 4)], ids=["reserve-1-2", "reserve-4-4"])
@pytest.mark.asyncio
async def test_saturated_allocs_either_succeed_or_time_out_at_deadline_and_keep_progressing(
    backend_name: str, reserve_pages: tuple[int, int]
) -> None:
    limit_pages = 4  # 16 blocks for ~150 tasks asking for 1-6 blocks each
    rng = random.Random(1)
    faults = FaultInjector()
    faults.delay(0.002)
    kv = await kvasync.Allocator.open(
        LAYOUT,
        config(
            backend_name,
            max_blocks=64,
            memory_limit=limit_pages * PAGE_SIZE,
            reserve_pages=reserve_pages,
            faults=faults,
        ),
    )
    loop = asyncio.get_running_loop()
    start = loop.time()
    stop_at = start + SATURATION_RUN_S
    held: set[int] = set()
    successes: list[float] = []  # loop.time() of each successful alloc
    timeouts = 0
    lateness: list[float] = []  # completion time - deadline, for every request

    async def client() -> None:
        nonlocal timeouts
        while loop.time() < stop_at:
            n = rng.randint(1, 6)
            deadline = loop.time() + rng.uniform(0.02, 0.2)
            try:
                blocks = await kv.alloc(n, deadline=deadline)
            except kvasync.AllocTimeout as error:
                now = loop.time()
                assert now >= deadline, f"timed out {deadline - now:.6f} s before its deadline"
                assert f"alloc of {n} blocks timed out after" in str(error)
                lateness.append(now - deadline)
                timeouts += 1
                continue
            now = loop.time()
            lateness.append(now - deadline)
            successes.append(now)
            assert len(blocks) == n and held.isdisjoint(blocks), (blocks, held)
            held.update(blocks)
            await asyncio.sleep(rng.uniform(0, 0.005))  # the request's work on its blocks
            held.difference_update(blocks)
            kv.free(blocks)

    try:
        tasks = [asyncio.create_task(client()) for _ in range(SATURATION_TASKS)]
        done, pending = await asyncio.wait(tasks, timeout=SATURATION_RUN_S + 10)
        assert not pending, f"{len(pending)} clients still running 10 s after the run ended"
        for task in done:
            task.result()  # re-raises a client's failed assertion or unexpected error
        await wait_until(lambda: no_map_in_flight(kv))
        assert_nothing_leaked(kv)
    finally:
        faults.release()
        await kv.close(timeout=2.0)

    assert max(lateness) < MAX_LATENESS_S, f"a request waited {max(lateness):.3f} s past deadline"
    assert timeouts > 0, "demand never exceeded capacity: the test is not saturating"
    window = SATURATION_RUN_S / SATURATION_WINDOWS
    per_window = [0] * SATURATION_WINDOWS
    for when in successes:
        index = int((when - start) / window)
        if index < SATURATION_WINDOWS:
            per_window[index] += 1
    assert all(per_window), f"a window without a completed alloc: {per_window}"


# -- (C) the GIL held by the main thread -------------------------------------------------------


@pytest.mark.asyncio
async def test_mapper_fills_reserve_while_main_thread_holds_gil(backend_name: str) -> None:
    faults = FaultInjector()
    faults.delay(0.01)
    kv = await kvasync.Allocator.open(
        LAYOUT, config(backend_name, max_blocks=64, reserve_pages=(4, 8), faults=faults)
    )
    try:
        # Straight after open, with the refill queued and its map stalling: the main thread
        # does not let go of the GIL until the reserve holds 4 pages (or 5 s pass).
        assert _core.spin_holding_gil(kv._pool, 4, 5.0) is True
        assert kv.stats().reserve_pages >= 4
    finally:
        faults.release()
        await kv.close(timeout=2.0)


@pytest.mark.asyncio
async def test_spin_holding_gil_fails_when_reserve_never_fills_and_blocks_python_threads(
    backend_name: str,
) -> None:
    """The control: the spin can fail, and it really keeps every other Python thread out."""
    kv = await kvasync.Allocator.open(
        LAYOUT, config(backend_name, max_blocks=64, reserve_pages=(0, 0))
    )
    samples: list[float] = []
    stop = threading.Event()

    def sample_clock() -> None:
        while not stop.is_set():
            samples.append(time.monotonic())  # only ever runs with the GIL held
            time.sleep(0.001)

    sampler = threading.Thread(target=sample_clock)
    sampler.start()
    try:
        await wait_until(lambda: len(samples) > 0)
        spin_s = 0.3
        before = time.monotonic()
        filled = _core.spin_holding_gil(kv._pool, 1, spin_s)
        after = time.monotonic()
        assert filled is False
        assert spin_s <= after - before < spin_s + 1.0
        await wait_until(lambda: samples[-1] > after)
        # No sample can be taken while the spin holds the GIL: two consecutive samples bracket it.
        longest_gap = max(later - earlier for earlier, later in itertools.pairwise(samples))
        assert longest_gap >= spin_s, f"a Python thread ran during the spin ({longest_gap=:.3f})"
    finally:
        stop.set()
        sampler.join(timeout=5)
        assert not sampler.is_alive()
        await kv.close(timeout=2.0)


@pytest.mark.asyncio
async def test_spin_holding_gil_fails_when_the_mapper_is_stuck(backend_name: str) -> None:
    """The control for a mapper that makes no progress: a hung map never fills the reserve."""
    faults = FaultInjector()
    faults.hang()
    kv = await kvasync.Allocator.open(
        LAYOUT, config(backend_name, max_blocks=64, reserve_pages=(4, 8), faults=faults)
    )
    try:
        assert _core.spin_holding_gil(kv._pool, 4, 0.2) is False
        assert kv.stats().reserve_pages == 0
    finally:
        faults.release()
        await kv.close(timeout=2.0)


# -- (D) cancellations and timeouts leak nothing -----------------------------------------------

STRESS_WAVES = 20
STRESS_TASKS_PER_WAVE = 200


async def stress_wave(
    kv: kvasync.Allocator,
    faults: FaultInjector,
    rng: random.Random,
    mode: str,
    held: set[int],
    outcomes: dict[str, int],
) -> None:
    loop = asyncio.get_running_loop()
    release_timer = None
    if mode == "delay":
        faults.delay(rng.uniform(0.001, 0.004))
    elif mode == "hang":
        faults.hang()
        release_timer = loop.call_later(rng.uniform(0.005, 0.03), faults.release)
    elif mode == "fail":
        faults.fail(rng.randint(2, 4))

    async def request(n: int, timeout: float, hold: float) -> None:
        blocks = await kv.alloc(n, timeout=timeout)
        assert len(blocks) == n and held.isdisjoint(blocks), (blocks, held)
        held.update(blocks)
        try:
            await asyncio.sleep(hold)  # cancelled here too, now and then
        finally:
            held.difference_update(blocks)
            kv.free(blocks)

    tasks = []
    for _ in range(STRESS_TASKS_PER_WAVE):
        coroutine = request(rng.randint(1, 12), rng.uniform(0.001, 0.04), rng.uniform(0, 0.003))
        task = asyncio.create_task(coroutine)
        roll = rng.random()
        if roll < 0.05:
            task.cancel()  # before its first step
        elif roll < 0.35:
            loop.call_later(rng.uniform(0, 0.03), task.cancel)
        tasks.append(task)
        if rng.random() < 0.2:
            await asyncio.sleep(0)  # let some start before the rest are created
    done, pending = await asyncio.wait(tasks, timeout=10)
    assert not pending, f"{len(pending)} of {len(tasks)} allocs still running after 10 s ({mode})"
    if release_timer is not None:
        release_timer.cancel()
    faults.release()
    for task in done:
        if task.cancelled():
            outcomes["cancelled"] += 1
        elif isinstance(task.exception(), kvasync.AllocTimeout):
            outcomes["timed out"] += 1
        elif isinstance(task.exception(), kvasync.MapError):
            outcomes["map error"] += 1
        else:
            task.result()  # re-raises anything else
            outcomes["succeeded"] += 1


@pytest.mark.asyncio
async def test_random_cancels_and_timeouts_leak_no_blocks(backend_name: str) -> None:
    rng = random.Random(2)
    faults = FaultInjector()
    kv = await kvasync.Allocator.open(
        LAYOUT,
        config(
            backend_name,
            max_blocks=128,
            memory_limit=12 * PAGE_SIZE,
            reserve_pages=(1, 3),
            faults=faults,
        ),
    )
    held: set[int] = set()
    outcomes = {"succeeded": 0, "timed out": 0, "cancelled": 0, "map error": 0}
    modes = ["none", "delay", "hang", "fail"]
    try:
        for wave in range(STRESS_WAVES):
            await stress_wave(kv, faults, rng, modes[wave % len(modes)], held, outcomes)
        assert held == set()
        await wait_until(lambda: no_map_in_flight(kv))
        assert_nothing_leaked(kv)
    finally:
        faults.release()
        await kv.close(timeout=2.0)
    assert sum(outcomes.values()) == STRESS_WAVES * STRESS_TASKS_PER_WAVE
    # Every path was taken, or the test proves less than it claims.
    assert all(outcomes.values()), outcomes


async def start_waiting_alloc(
    kv: kvasync.Allocator, faults: FaultInjector
) -> asyncio.Task[list[int]]:
    """An alloc parked behind a hung map, then the map released and its completion queued."""
    task = asyncio.create_task(kv.alloc(4, timeout=5.0))
    await wait_until(lambda: kv.stats().waiters == 1 and faults.hung_maps == 1)
    faults.release()
    readable, _, _ = select.select([kv._pool.completion_fd], [], [], 5.0)
    assert readable == [kv._pool.completion_fd], "no completion 5 s after releasing the map"
    return task


@pytest.mark.asyncio
async def test_alloc_resolved_then_cancelled_raises_cancelled_and_frees_blocks(
    backend_name: str,
) -> None:
    faults = FaultInjector()
    faults.hang()
    kv = await kvasync.Allocator.open(
        LAYOUT, config(backend_name, max_blocks=64, reserve_pages=(0, 0), faults=faults)
    )
    try:
        task = await start_waiting_alloc(kv, faults)
        kv._on_completions()  # what the loop's reader does: the future now holds the blocks
        assert kv.stats().used_blocks == 4
        assert not task.done()  # the task has not run since: the race's window
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert kv.stats().used_blocks == 0
        assert kv.stats().waiters == 0
    finally:
        faults.release()
        await kv.close(timeout=2.0)


@pytest.mark.asyncio
async def test_alloc_cancelled_with_completion_queued_frees_blocks_on_drain(
    backend_name: str,
) -> None:
    faults = FaultInjector()
    faults.hang()
    kv = await kvasync.Allocator.open(
        LAYOUT, config(backend_name, max_blocks=64, reserve_pages=(0, 0), faults=faults)
    )
    try:
        task = await start_waiting_alloc(kv, faults)
        assert kv.stats().used_blocks == 4  # taken for the request, the record not yet drained
        task.cancel()  # pending -> abandoned, while its record waits in the queue
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: kv.stats().used_blocks == 0)  # the reader drains, then frees
        assert kv.stats().waiters == 0
    finally:
        faults.release()
        await kv.close(timeout=2.0)
