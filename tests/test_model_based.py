"""A hypothesis state machine drives the public async API against a plain Python model.

Note [Model-based test]
~~~~~~~~~~~~~~~~~~~~~~~
Each example opens an allocator on the host backend on an event loop of its own, then runs random
steps: allocs of random sizes and timeouts (some cancelled part way), alloc_nowait, frees (some from
a second thread, some while an alloc waits for them), trims, resizes, and faults switched on and
off (map delays, failures, a hung map). The model is what a user can know: the blocks each alloc
returned and the data written into them, the memory limit, whether failures were injected. After
every step:

* no block id is held twice, and the pool's allocated ids are exactly the model's;
* the pool's counters agree with the model (used blocks, no waiter left behind, mapped blocks add
  up: used + free = mapped pages * blocks per page);
* every held block is still mapped and keeps its data (on host, reading an unmapped block faults);
* every awaited call returned within its deadline plus ``SLACK_S``, with an outcome its inputs
  allow (OutOfBlocks only for a request larger than the limit, MapError only with failures
  injected).

``KVASYNC_MODEL_EXAMPLES`` raises the number of examples (``make soak`` does).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import kvasync
from kvasync.testing import FaultInjector

LAYOUT = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
PAGE_SIZE = 64 << 10
BLOCKS_PER_PAGE = PAGE_SIZE // LAYOUT.block_bytes  # 16
NUM_PAGES = 12
NUM_BLOCKS = NUM_PAGES * BLOCKS_PER_PAGE
PAGE_BYTES = PAGE_SIZE * LAYOUT.num_ranges
SLACK_S = 1.0  # beyond a deadline, for a loaded 2-core CI machine; a hang overshoots by far more
THREAD_JOIN_S = 5.0
EXAMPLES = int(os.environ.get("KVASYNC_MODEL_EXAMPLES", "60"))

counts = st.integers(min_value=1, max_value=3 * BLOCKS_PER_PAGE)
timeouts = st.sampled_from([0.0, 0.005, 0.05, 0.2])


# Which allocation a free takes: an index into those held, modulo their number. Not a hypothesis
# Bundle: whether an alloc succeeds depends on timing, and what hypothesis draws must not.
picks = st.integers(min_value=0, max_value=1 << 16)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.faults = FaultInjector()
        cfg = kvasync.Config(
            backend="host",
            max_blocks=NUM_BLOCKS,
            page_size=PAGE_SIZE,
            reserve_pages=(1, 2),
            default_timeout=2.0,
            faults=self.faults,
        )
        self.kv = self.run(kvasync.Allocator.open(LAYOUT, cfg), 5.0)
        self.held: dict[int, float] = {}  # block id -> the value written into it
        self.allocations: list[list[int]] = []  # as the allocs returned them
        self.limit_pages = NUM_PAGES
        self.failures_injected = False
        self.next_value = 1.0

    # -- running on the machine's loop, with a deadline --------------------------------------

    def run(self, coroutine: Coroutine[Any, Any, Any], deadline_s: float) -> Any:
        """Runs ``coroutine`` to its end; fails if it takes longer than ``deadline_s + SLACK_S``."""
        task = self.loop.create_task(coroutine)
        started = self.loop.time()
        self.loop.run_until_complete(asyncio.wait({task}, timeout=deadline_s + SLACK_S))
        if not task.done():
            task.cancel()
            self.loop.run_until_complete(asyncio.wait({task}, timeout=THREAD_JOIN_S))
            raise AssertionError(f"a call ran past its {deadline_s} s deadline")
        assert self.loop.time() - started <= deadline_s + SLACK_S
        return task.result()

    def outcome(self, coroutine: Coroutine[Any, Any, Any], deadline_s: float) -> Any:
        """The call's result, or the kvasync error it raised (anything else propagates)."""
        try:
            return self.run(coroutine, deadline_s)
        except kvasync.KVAsyncError as error:
            return error

    # -- the model -----------------------------------------------------------------------------

    def limit_blocks(self) -> int:
        return min(self.limit_pages * BLOCKS_PER_PAGE, NUM_BLOCKS)

    def check_alloc_result(self, n: int, result: object) -> list[int]:
        """Blocks to add to the model (none unless the alloc succeeded)."""
        event(f"alloc outcome: {type(result).__name__}")
        if isinstance(result, list):
            assert len(result) == n, result
            assert not set(result) & self.held.keys(), "a held block was handed out again"
            self.write(result)
            self.allocations.append(result)
            return result
        if isinstance(result, kvasync.OutOfBlocks):
            assert n > self.limit_blocks(), (
                f"OutOfBlocks for {n} <= {self.limit_blocks()}: {result}"
            )
        elif isinstance(result, kvasync.MapError):
            assert self.failures_injected, f"MapError without injected failures: {result}"
        else:
            assert isinstance(result, kvasync.AllocTimeout | kvasync.WouldBlock), repr(result)
        return []

    def write(self, blocks: list[int]) -> None:
        for block in blocks:
            value = self.next_value
            self.next_value = self.next_value % 1000 + 1  # exact in fp16
            for buffer in self.buffers():
                buffer[block].fill_(value)
            self.held[block] = value

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for i in range(LAYOUT.num_layers) for t in self.kv.layer(i))

    def forget(self, blocks: list[int]) -> None:
        for block in blocks:
            del self.held[block]

    # -- rules -----------------------------------------------------------------------------------

    @rule(n=counts, timeout=timeouts)
    def alloc(self, n: int, timeout: float) -> None:
        result = self.outcome(self.kv.alloc(n, timeout=timeout), timeout)
        self.check_alloc_result(n, result)

    @rule(n=counts)
    def alloc_nowait(self, n: int) -> None:
        try:
            result: object = self.kv.alloc_nowait(n)
        except kvasync.KVAsyncError as error:
            result = error
        self.check_alloc_result(n, result)

    @rule(n=counts, timeout=timeouts, steps=st.integers(0, 3))
    def alloc_cancelled(self, n: int, timeout: float, steps: int) -> None:
        """An alloc whose task is cancelled after a few loop iterations: it leaks nothing."""

        async def cancel_after() -> object:
            task = asyncio.ensure_future(self.kv.alloc(n, timeout=timeout))
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            try:
                return await task
            except asyncio.CancelledError:
                return None
            except kvasync.KVAsyncError as error:
                return error

        result = self.run(cancel_after(), timeout)
        if result is not None:  # it completed before the cancellation reached it
            self.check_alloc_result(n, result)

    @rule(n=counts)
    def alloc_cancelled_with_its_completion_queued(self, n: int) -> None:
        """The mapper answered, the loop has not drained the answer yet, the task is cancelled.

        The loop thread waits (without yielding, bounded) for the pool to have no waiter left:
        the completion record is then queued but undelivered. The blocks in it must go back.
        """

        async def cancel_when_queued() -> object:
            task = asyncio.ensure_future(self.kv.alloc(n, timeout=0.3))
            await asyncio.sleep(0)  # the alloc runs: answered at once or waiting
            give_up = time.monotonic() + 0.3
            while self.kv.stats().waiters and time.monotonic() < give_up:
                time.sleep(0.001)  # NOTE: blocks the loop on purpose, so nothing is drained
            task.cancel()
            try:
                return await task
            except asyncio.CancelledError:
                return None
            except kvasync.KVAsyncError as error:
                return error

        result = self.run(cancel_when_queued(), 0.6)
        if result is not None:
            self.check_alloc_result(n, result)

    def take(self, pick: int) -> list[int]:
        if not self.allocations:
            return []
        blocks = self.allocations.pop(pick % len(self.allocations))
        self.forget(blocks)
        return blocks

    @rule(pick=picks, from_thread=st.booleans())
    def free(self, pick: int, from_thread: bool) -> None:
        blocks = self.take(pick)
        if from_thread:
            thread = threading.Thread(target=self.kv.free, args=(blocks,))
            thread.start()
            thread.join(THREAD_JOIN_S)
            assert not thread.is_alive(), "free() blocked in another thread"
        else:
            self.kv.free(blocks)

    @rule(pick=picks, n=counts, timeout=timeouts)
    def alloc_while_another_thread_frees(self, pick: int, n: int, timeout: float) -> None:
        """An alloc waits; a free from another thread may serve it (through the eventfd)."""
        blocks = self.take(pick)

        async def alloc_and_free() -> object:
            task = asyncio.ensure_future(self.kv.alloc(n, timeout=timeout))
            await asyncio.sleep(0)  # the alloc is answered or waiting now
            thread = threading.Thread(target=self.kv.free, args=(blocks,))
            thread.start()
            await asyncio.to_thread(thread.join, THREAD_JOIN_S)
            assert not thread.is_alive(), "free() blocked in another thread"
            try:
                return await task
            except kvasync.KVAsyncError as error:
                return error

        result = self.run(alloc_and_free(), timeout + THREAD_JOIN_S)
        self.check_alloc_result(n, result)

    @rule(timeout=timeouts)
    def trim(self, timeout: float) -> None:
        result = self.outcome(self.kv.trim(timeout=timeout), timeout)
        assert result is None or isinstance(result, kvasync.AllocTimeout | kvasync.MapError), result

    @rule(pages=st.one_of(st.none(), st.integers(1, NUM_PAGES + 2)), timeout=timeouts)
    def resize(self, pages: int | None, timeout: float) -> None:
        limit = None if pages is None else pages * PAGE_BYTES
        result = self.outcome(self.kv.resize(memory_limit=limit, timeout=timeout), timeout)
        # The limit changes even if the unmaps it asks for time out.
        self.limit_pages = NUM_PAGES if pages is None else min(pages, NUM_PAGES)
        assert result is None or isinstance(result, kvasync.AllocTimeout | kvasync.MapError), result

    @rule(seconds=st.sampled_from([0.0, 0.001, 0.02]))
    def delay_maps(self, seconds: float) -> None:
        self.faults.delay(seconds)

    @rule(count=st.integers(1, 3))
    def fail_maps(self, count: int) -> None:
        self.faults.fail(count)
        self.failures_injected = True

    @rule()
    def hang_maps(self) -> None:
        self.faults.hang()

    @rule()
    def release_faults(self) -> None:
        self.faults.release()
        # A failure already injected can still surface in a completion drained later.

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def no_block_is_held_twice_and_the_pool_agrees(self) -> None:
        held = list(self.held)
        assert len(held) == len(set(held))
        assert not self.kv._pool.unallocated(held), "a held block is not allocated in the pool"
        stats = self.kv.stats()
        assert stats.used_blocks == len(held), (stats.used_blocks, len(held))
        assert stats.waiters == 0, "a finished call left a waiter behind"

    @invariant()
    def mapped_blocks_add_up(self) -> None:
        stats = self.kv.stats()
        assert stats.used_blocks + stats.free_blocks == stats.mapped_pages * BLOCKS_PER_PAGE, stats

    @invariant()
    def held_blocks_stay_mapped_and_keep_their_data(self) -> None:
        if not self.held:
            return
        ids = torch.tensor(list(self.held))
        expected = torch.tensor(list(self.held.values()), dtype=LAYOUT.dtype)
        for buffer in self.buffers():  # an unmapped block would fault here
            assert torch.equal(buffer[ids, 0, 0, 0], expected)
            assert torch.equal(buffer[ids, -1, -1, -1], expected)

    def teardown(self) -> None:
        try:
            self.faults.release()  # a hung mapper would otherwise be abandoned at close
            self.run(self.kv.close(timeout=2.0), 2.0)
            assert self.kv.stats().mapped_pages == 0
        finally:
            self.loop.close()


AllocatorMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    deadline=None,  # each call checks its own deadline; hypothesis' would be per example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_allocator_against_the_model = AllocatorMachine.TestCase
