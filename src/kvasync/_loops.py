"""Loop plumbing: waits of trio tasks and of threads, and deadlines from cancel scopes.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._allocator import Allocator

__all__ = ["Slot", "SlotTable", "TrioDriver", "current_library", "scope_deadline"]


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
    """The slots of one allocator, keyed by request id (Note [Slots])."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots: dict[int, Slot] = {}


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

    def __init__(self, allocator: Allocator) -> None:
        import trio

        self._allocator = allocator
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

        fd = self._allocator._fd
        try:
            with self._scope:
                while True:
                    # A bounded wait, so the stall check runs on an idle allocator too.
                    with trio.move_on_after(self._allocator._stall_period):
                        await trio.lowlevel.wait_readable(fd)
                    self._allocator._on_completions()
                    self._allocator._check_stall()
        finally:
            self._stopped.set()

    async def wait(self, request: int, due: float, what: str) -> list[int]:
        """Waits for ``request`` until ``due`` (trio clock); see Note [Slots]."""
        import trio

        kv = self._allocator
        event = trio.Event()
        slot = Slot(event.set)
        with kv._slots.lock:
            kv._slots.slots[request] = slot
        started = trio.current_time()
        try:
            with trio.move_on_at(due):
                await event.wait()
        except BaseException:
            kv._abandon_slot(request, slot)
            raise
        if not slot.done:
            kv._on_completions()  # a result already here wins over the deadline
            kv._slot_timed_out(request, slot, what, trio.current_time() - started)
        return kv._slot_result(slot)

    async def close(self, wait: float) -> None:
        """Closes the pool off the trio thread, shielded (a cancelled caller does not leave it
        half done), then stops the drain task. A second caller waits for the first's close."""
        import trio

        if self._closed is not None:
            with trio.move_on_after(wait + 1.0):  # bounded like the close itself
                await self._closed.wait()
            return
        self._closed = trio.Event()
        kv = self._allocator
        try:
            with trio.CancelScope(shield=True):
                kv._on_completions()  # what completed before the close is delivered as usual
                await trio.to_thread.run_sync(kv._pool.close, wait)
                self._scope.cancel()
                with trio.move_on_after(1.0):
                    await self._stopped.wait()
                kv._finish_close()
        finally:
            self._closed.set()
