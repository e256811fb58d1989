"""Loop plumbing: waits of trio tasks and of threads, and deadlines from cancel scopes.

Note [Drivers]
~~~~~~~~~~~~~~
A driver -- the trio drain task here, the blocking facade in ``_sync`` -- is handed what it needs
of an allocator as a ``CompletionSource`` (below): the eventfd to watch, the drain, the stall
check, the slot table, the close. The allocator builds it (``_allocator._DriverPort``); a driver
imports no allocator and calls none of its private methods, so the arrows between these modules
point one way: ``_allocator`` -> ``_loops``.

Note [Slots]
~~~~~~~~~~~~
The asyncio path of ``Allocator`` keeps its futures, timers and ``add_reader`` (Note [Futures and
ownership]). Every other waiter -- a trio task, or a thread of a blocking facade -- waits on a
``Slot``: a record the completion drain fills in, plus a wake-up callback (``trio.Event.set`` on
the trio thread, ``threading.Event.set`` for a thread). The slots live in a ``SlotTable`` whose
lock covers both the pool call that creates a request *and* the slot's registration, and the
drain: so a completion can never be drained before its slot exists, from any thread.
lock order: SlotTable.lock -> GIL (a blocked acquire releases it) -> PagePool::mutex_.

Ownership is settled under that lock, as on the loop: pending -> delivered (the drain pops the
slot and fills it) or pending -> abandoned (the waiter pops it first, at its deadline or on
cancellation, and cancels the request in the pool; a record already queued then finds no slot and
its blocks go back to the pool). A waiter that finds its slot already popped owns the result, and
frees the blocks if it will not return them.

Note [Clocks]
~~~~~~~~~~~~~
The C++ pool's deadlines are CLOCK_MONOTONIC seconds: ``time.monotonic()``, which is also asyncio's
``loop.time()``. trio's clock is offset from it, so a trio deadline is converted by the difference
of the two clocks read together. An enclosing cancel scope's deadline (``anyio.fail_after``,
``move_on_after``, trio's own) is read with ``current_effective_deadline`` and also bounds the
mapper's job; when it is the earlier one, the scope's own cancellation ends the wait, so
``move_on_after`` and ``fail_after`` behave as their users expect.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ._errors import AllocatorClosed, AllocTimeout, MapError, OutOfBlocks

__all__ = [
    "CLOSED",
    "MAP_ERROR",
    "OK",
    "OUT_OF_BLOCKS",
    "CompletionSource",
    "Slot",
    "SlotTable",
    "TrioDriver",
    "completion_error",
    "current_library",
    "scope_deadline",
]

# The status of a completion record (csrc/pool/completion_queue.h).
OK, MAP_ERROR, OUT_OF_BLOCKS, CLOSED = 0, 1, 2, 3


def completion_error(status: int, message: str) -> Exception | None:
    """The error a completion record's status stands for; None for ``OK``."""
    if status == OK:
        return None
    if status == MAP_ERROR:
        return MapError(message)
    if status == OUT_OF_BLOCKS:
        return OutOfBlocks(message)
    return AllocatorClosed(message or "the allocator was closed")


class Slot:
    """One waiting request of a trio task or a thread; filled by the completion drain."""

    __slots__ = ("blocks", "done", "message", "status", "wake")

    def __init__(self, wake: Callable[[], object]) -> None:
        self.wake = wake
        self.done = False
        self.status = 0
        self.blocks: list[int] = []
        self.message = ""

    def deliver(self, status: int, blocks: list[int], message: str) -> None:
        self.status, self.blocks, self.message, self.done = status, blocks, message, True
        self.wake()


class SlotTable:
    """The slots of one allocator, keyed by request id (Note [Slots]).

    Built by the allocator with what settling a request needs of its pool: ``cancel`` makes the
    pool forget a waiter (a record already queued then frees its blocks in the drain), ``free``
    gives blocks back, and ``timeout_error`` cancels a request at its deadline and returns the
    ``AllocTimeout`` that says what it waited for.
    """

    def __init__(
        self,
        *,
        cancel: Callable[[int], object],
        free: Callable[[list[int]], object],
        timeout_error: Callable[[int, str, float], AllocTimeout],
    ) -> None:
        self.lock = threading.Lock()
        self.slots: dict[int, Slot] = {}
        self._cancel = cancel
        self._free = free
        self._timeout_error = timeout_error

    def abandon(self, request: int, slot: Slot) -> None:
        """The waiter gives up (cancelled, interrupted): pending -> abandoned, or it frees the
        blocks already delivered to it, which it will never return."""
        with self.lock:
            if self.slots.get(request) is slot:
                del self.slots[request]
                self._cancel(request)
                return
        if slot.status == OK and slot.blocks:
            self._free(slot.blocks)  # delivered, then abandoned: give them back

    def time_out(self, request: int, slot: Slot, what: str, waited: float) -> None:
        """At the waiter's deadline: raises its ``AllocTimeout``, unless the result came first.

        The caller drains the completions first, so a result already queued wins.
        """
        with self.lock:
            if self.slots.get(request) is not slot:
                return  # delivered meanwhile: the result wins
            del self.slots[request]
            error = self._timeout_error(request, what, waited)
        raise error

    def close(self) -> None:
        """Fails every slot still waiting: requests the close left without a record (a trim's
        barrier)."""
        with self.lock:
            slots, self.slots = self.slots, {}
        for slot in slots.values():
            slot.deliver(CLOSED, [], "the allocator was closed")

    @staticmethod
    def result(slot: Slot) -> list[int]:
        """The blocks a filled slot holds, or the error its status stands for, raised."""
        error = completion_error(slot.status, slot.message)
        if error is not None:
            raise error
        return slot.blocks


class CompletionSource(Protocol):
    """What a driver gets of an allocator (Note [Drivers])."""

    @property
    def fd(self) -> int:
        """The eventfd that turns readable when completion records are queued."""

    @property
    def stall_period(self) -> float:
        """Seconds between stall checks, and the longest a drain waits on an idle fd."""

    @property
    def slots(self) -> SlotTable:
        """Where trio tasks and threads wait (Note [Slots])."""

    @property
    def close_pool(self) -> Callable[[float], object]:
        """The pool's blocking close, for a worker thread: it holds the pool, never the
        allocator (whose torch views must not be freed on that thread)."""

    def drain(self) -> None:
        """Delivers every queued completion record to its future or slot (on this thread)."""

    def check_stall(self) -> None:
        """Warns when the mapper has been inside one op too long (``_log.StallWatch``)."""

    def finish_close(self) -> None:
        """After ``close_pool``: fails what completed during the close, and every slot left."""


def current_library() -> str:
    """The async library of the running task: "asyncio" or "trio".

    Raises:
        RuntimeError: no async library is running in this thread.
    """
    trio = sys.modules.get("trio")  # not imported: no trio run can be going on
    if trio is not None:
        try:
            trio.lowlevel.current_task()
            return "trio"
        except RuntimeError:
            pass
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "no running event loop: open the allocator inside asyncio or trio (or anyio on "
            "either), or use kvasync.open_allocator_sync from plain threads"
        ) from None
    return "asyncio"


def scope_deadline(library: str) -> float:
    """The deadline of the enclosing cancel scopes, in the library's clock; inf when none."""
    if library == "trio":
        import trio

        return float(trio.current_effective_deadline())
    anyio = sys.modules.get("anyio")  # no anyio imported: no anyio scope can be open
    if anyio is None:
        return math.inf
    try:
        return float(anyio.current_effective_deadline())
    except Exception:  # not inside a task anyio can see (a bare callback): no scope
        return math.inf


class TrioDriver:
    """An allocator's trio side: one system task drains the eventfd; waits use slots."""

    def __init__(self, source: CompletionSource) -> None:
        import trio

        self._source = source
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.get_ident()
        self._scope = trio.CancelScope()
        self._stopped = trio.Event()
        self._closed: trio.Event | None = None
        trio.lowlevel.spawn_system_task(self._drain, name="kvasync completion drain")

    @property
    def thread(self) -> int:
        """The thread trio runs on."""
        return self._thread

    @staticmethod
    def time() -> float:
        import trio

        return float(trio.current_time())

    @staticmethod
    def to_pool_time(due: float) -> float:
        """A trio deadline as CLOCK_MONOTONIC seconds (Note [Clocks])."""
        import trio

        return time.monotonic() + (due - trio.current_time())

    async def _drain(self) -> None:
        import trio

        source = self._source
        try:
            with self._scope:
                while True:
                    # A bounded wait, so the stall check runs on an idle allocator too.
                    with trio.move_on_after(source.stall_period):
                        await trio.lowlevel.wait_readable(source.fd)
                    source.drain()
                    source.check_stall()
        finally:
            self._stopped.set()

    async def wait(self, request: int, due: float, what: str) -> list[int]:
        """Waits for ``request`` until ``due`` (trio clock); see Note [Slots]."""
        import trio

        source, slots = self._source, self._source.slots
        event = trio.Event()
        slot = Slot(event.set)
        with slots.lock:
            slots.slots[request] = slot
        started = trio.current_time()
        try:
            with trio.move_on_at(due):
                await event.wait()
        except BaseException:
            slots.abandon(request, slot)
            raise
        if not slot.done:
            source.drain()  # a result already here wins over the deadline
            slots.time_out(request, slot, what, trio.current_time() - started)
        return slots.result(slot)

    async def close(self, wait: float) -> None:
        """Closes the pool off the trio thread, shielded (a cancelled caller does not leave it
        half done), then stops the drain task. A second caller waits for the first's close."""
        import trio

        if self._closed is not None:
            with trio.move_on_after(wait + 1.0):  # bounded like the close itself
                await self._closed.wait()
            return
        self._closed = trio.Event()
        source = self._source
        try:
            with trio.CancelScope(shield=True):
                source.drain()  # what completed before the close is delivered as usual
                await trio.to_thread.run_sync(source.close_pool, wait)
                self._scope.cancel()
                with trio.move_on_after(1.0):
                    await self._stopped.wait()
                source.finish_close()
        finally:
            self._closed.set()
