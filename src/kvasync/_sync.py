"""SyncAllocator: the blocking face of an allocator, for synchronous schedulers in threads.

A waiting call registers a slot for its own request (Note [Slots] in _loops) and waits on that
request's own ``threading.Event`` with its deadline: no loop of the caller's, no shared condition
variable, and any number of threads at once. The completions are drained by the loop that owns
the allocator: a private loop thread for ``open_allocator_sync``, or the caller's own asyncio or
trio loop for ``SyncAllocator(kv)`` (one allocator shared between a loop and threads).

The facade starts and settles requests through a ``RequestSource`` that the allocator builds
(Note [Drivers] in _loops), never through the allocator's private methods.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from . import _loops, _validate
from ._allocator import Allocator, driver_port
from ._config import Config
from ._errors import AllocatorClosed, AllocTimeout
from ._layout import KVLayout
from ._stats import AllocatorStats

__all__ = ["SyncAllocator", "open_allocator_sync"]


class RequestSource(Protocol):
    """What the blocking facade gets of an allocator (Note [Drivers] in _loops)."""

    @property
    def slots(self) -> _loops.SlotTable:
        """Where threads wait (Note [Slots])."""

    @property
    def loop_thread(self) -> int:
        """The thread that drains the completions: a blocking call there would wait for itself."""

    @property
    def forked(self) -> bool:
        """Whether this is a forked child of the process that opened the allocator, where its
        threads do not exist (Note [Fork] in _allocator)."""

    def check_open(self) -> None:
        """Raises ``AllocatorClosed`` in such a forked child, or once the allocator's close
        has begun."""

    def check_count(self, n: object) -> int:
        """``n`` as a number of blocks, checked as ``Allocator.alloc`` checks it."""

    def limit_pages(self, memory_limit: int | None) -> int:
        """A memory limit in pages, checked as ``Allocator.resize`` checks it."""

    def start_alloc(self, n: int, due: float) -> list[int] | int:
        """Blocks now, or the id of a request that waits until ``due`` (monotonic)."""

    def start_trim(self, due: float, release_handles: bool) -> list[int] | int:
        """``[]`` when nothing is left to unmap, else the id of the request to wait for."""

    def start_resize(self, pages: int, due: float) -> list[int] | int:
        """``[]`` when the new limit is in force, else the id of the request to wait for."""

    def finish_alloc(self, blocks: list[int], waited: bool, started: float) -> None:
        """What follows a successful alloc: zeroing (``zero_on_alloc``) and the metrics' hook,
        given whether it waited and its ``time.perf_counter()`` start."""


class _LoopThread:
    """A private asyncio loop in a daemon thread: it drains the completions of the allocator."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="kvasync-loop", daemon=True
        )
        self.thread.start()

    def run(self, coroutine: Any, timeout: float, what: str) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise AllocTimeout(f"{what} did not finish within {timeout:.3f} s") from None

    def stop(self, timeout: float) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.loop.close()


class SyncAllocator:
    """The methods of ``Allocator`` without ``await``, callable from any thread.

    Make one with ``open_allocator_sync`` (it owns a private loop thread), or wrap an allocator
    already open on an asyncio or trio loop with ``SyncAllocator(kv)``, so that threads share it
    with that loop. Blocking calls must not run on the owning loop's own thread (they would wait
    for the loop they block): they raise ``RuntimeError`` there.

    Once the allocator's close has begun (this facade's ``close()`` or the loop's), every method
    raises ``AllocatorClosed`` but ``close()`` (idempotent), ``stats()`` and
    ``take_map_seconds()``, as on ``Allocator``; the properties still describe it.
    """

    def __init__(self, allocator: Allocator, *, _owner: _LoopThread | None = None) -> None:
        """Wraps ``allocator``; it stays owned (and closed) by its loop.

        Raises:
            TypeError: ``allocator`` is not a ``kvasync.Allocator``.
        """
        if not isinstance(allocator, Allocator):
            raise TypeError(f"allocator must be a kvasync.Allocator, got {type(allocator)!r}")
        self._kv = allocator
        self._source: RequestSource = driver_port(allocator)
        self._owner = _owner
        self._closed = False

    # -- allocation -------------------------------------------------------------------------

    def alloc(
        self, n: int, *, timeout: float | None = None, deadline: float | None = None
    ) -> list[int]:
        """Allocates ``n`` blocks, blocking this thread at most until the deadline.

        Args:
            n: blocks to allocate.
            timeout: seconds to wait; ``default_timeout`` when neither this nor deadline is given.
            deadline: a ``time.monotonic()`` value to wait until, instead of ``timeout``.

        Returns:
            ``n`` distinct block ids.

        Raises:
            TypeError: ``n`` is not an int, or ``timeout``/``deadline`` not a number (a bool is
                neither).
            ValueError: ``n <= 0``, a negative, NaN or infinite timeout or deadline, or both
                given.
            OutOfBlocks, AllocTimeout, MapError, AllocatorClosed: as ``Allocator.alloc``.
            RuntimeError: called on the thread of the loop that owns the allocator.
        """
        source = self._source
        source.check_open()  # closed, or Note [Fork]: the loop thread that would answer is gone
        n = source.check_count(n)
        due = self._due(timeout, deadline)
        self._check_thread()
        started = time.perf_counter()
        result, waited = self._call(lambda: source.start_alloc(n, due), due, f"alloc of {n} blocks")
        source.finish_alloc(result, waited, started)
        return result

    def alloc_nowait(self, n: int) -> list[int]:
        """As ``Allocator.alloc_nowait``: never waits; a miss starts mapping what it lacks."""
        return self._kv.alloc_nowait(n)

    def available_blocks(self) -> int:
        """As ``Allocator.available_blocks``."""
        return self._kv.available_blocks()

    def set_demand(self, blocks: int) -> None:
        """As ``Allocator.set_demand``: the blocks wanted now, for a share's fair share."""
        self._kv.set_demand(blocks)

    def drain_from(self) -> int | None:
        """As ``Allocator.drain_from``: the first block id of the pages to give back, or None."""
        return self._kv.drain_from()

    def free_block_ids(self, limit: int | None = None) -> list[int]:
        """As ``Allocator.free_block_ids``: a snapshot of the free blocks on mapped pages, in
        the order alloc hands them out."""
        return self._kv.free_block_ids(limit)

    def free(self, ids: Sequence[int], *, after: object = None) -> None:
        """As ``Allocator.free``: never blocks; from any thread."""
        self._kv.free(ids, after=after)

    # -- memory -----------------------------------------------------------------------------

    def trim(self, *, timeout: float | None = None, release_handles: bool = True) -> None:
        """As ``Allocator.trim``, blocking this thread at most ``timeout``.

        Raises:
            TypeError: ``release_handles`` is not a bool.
        """
        _validate.flag(release_handles, "release_handles")  # as Allocator.trim checks it
        source = self._source
        source.check_open()
        due = self._due(timeout, None)
        self._check_thread()
        self._call(lambda: source.start_trim(due, release_handles), due, "trim")

    def resize(self, *, memory_limit: int | None, timeout: float | None = None) -> None:
        """As ``Allocator.resize``, blocking this thread at most ``timeout``."""
        source = self._source
        source.check_open()
        if memory_limit is not None:  # the same errors as Allocator.resize
            _validate.integer(memory_limit, "memory_limit", minimum=1)
        pages = source.limit_pages(memory_limit)
        due = self._due(timeout, None)
        self._check_thread()
        self._call(lambda: source.start_resize(pages, due), due, "resize")

    # -- block data, views and state: no waits, passed through -----------------------------

    def gather(
        self, ids: Sequence[int] | torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As ``Allocator.gather``."""
        return self._kv.gather(ids, out)

    def scatter(self, ids: Sequence[int] | torch.Tensor, src: torch.Tensor) -> None:
        """As ``Allocator.scatter``."""
        self._kv.scatter(ids, src)

    def zero(self, ids: Sequence[int] | torch.Tensor) -> None:
        """As ``Allocator.zero``."""
        self._kv.zero(ids)

    def copy(
        self, src_ids: Sequence[int] | torch.Tensor, dst_ids: Sequence[int] | torch.Tensor
    ) -> None:
        """As ``Allocator.copy``."""
        self._kv.copy(src_ids, dst_ids)

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """As ``Allocator.layer``."""
        return self._kv.layer(index)

    def stats(self) -> AllocatorStats:
        """As ``Allocator.stats``."""
        return self._kv.stats()

    @property
    def num_blocks(self) -> int:
        """Virtual capacity in blocks."""
        return self._kv.num_blocks

    @property
    def page_size(self) -> int:
        """As ``Allocator.page_size``: the unit of mapping in use, in bytes of each range."""
        return self._kv.page_size

    @property
    def layout(self) -> KVLayout:
        """The KV cache's geometry."""
        return self._kv.layout

    @property
    def config(self) -> Config:
        """The settings the allocator was opened with."""
        return self._kv.config

    @property
    def backend(self) -> str:
        """The backend in use: "host" or "cuda"."""
        return self._kv.backend

    @property
    def allocator(self) -> Allocator:
        """The async allocator underneath (bound to its loop)."""
        return self._kv

    # -- observers --------------------------------------------------------------------------

    def add_alloc_observer(self, observer: Callable[[bool, float], object]) -> Callable[[], None]:
        """As ``Allocator.add_alloc_observer``: called after every successful ``alloc`` of the
        allocator underneath, from this facade's threads and from its loop alike."""
        return self._kv.add_alloc_observer(observer)

    def take_map_seconds(self) -> list[float]:
        """As ``Allocator.take_map_seconds``."""
        return self._kv.take_map_seconds()

    # -- lifetime ---------------------------------------------------------------------------

    def close(self, *, timeout: float | None = None) -> None:
        """Closes the allocator and stops the private loop thread, within ``timeout`` (plus a
        second for the thread to end). Idempotent. In a forked child it returns at once and
        touches nothing: the allocator, its loop thread and its pages are the parent's
        (Note [Fork] in _allocator).

        Raises:
            RuntimeError: this facade wraps an allocator of another loop: close it there; or it
                is called on its own loop's thread. Nothing is closed then.
        """
        if self._owner is None:
            raise RuntimeError(
                "this SyncAllocator wraps an allocator opened on an event loop: close it there "
                "(await kv.close())"
            )
        wait = (
            self._kv.config.default_timeout
            if timeout is None
            else _validate.seconds(timeout, "timeout")
        )
        if self._closed:
            return
        if self._source.forked:
            self._closed = True
            return
        self._check_thread()  # before anything changes: it would wait for its own thread
        self._closed = True
        try:
            self._owner.run(self._kv.close(timeout=wait), wait + 1.0, "close")
        finally:
            self._owner.stop(1.0)

    def __enter__(self) -> SyncAllocator:
        self._source.check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _due(self, timeout: float | None, deadline: float | None) -> float:
        if timeout is not None and deadline is not None:
            raise ValueError("give either timeout or deadline, not both")
        if deadline is not None:  # as Allocator.alloc checks it, on the clock of threads
            return _validate.deadline(deadline, "deadline", "time.monotonic()")
        wait = (
            self._kv.config.default_timeout
            if timeout is None
            else _validate.seconds(timeout, "timeout")
        )
        return time.monotonic() + wait

    def _check_thread(self) -> None:
        if threading.get_ident() == self._source.loop_thread:
            raise RuntimeError(
                "a blocking call on the thread of the loop that drains the allocator's "
                "completions would wait for itself: use await kv.alloc() there"
            )

    def _call(
        self, start: Callable[[], list[int] | int], due: float, what: str
    ) -> tuple[list[int], bool]:
        """Starts a request under the slot lock; waits on its own event until ``due``.

        Returns the blocks and whether it had to wait.
        """
        slots = self._source.slots
        with slots.lock:
            result = start()
            if isinstance(result, list):
                return result, False
            event = threading.Event()  # only a waiter pays for one
            slot = _loops.Slot(event.set)
            slots.slots[result] = slot
        started = time.monotonic()
        try:
            delivered = event.wait(max(0.0, due - started))
        except BaseException:  # KeyboardInterrupt in the wait: leak nothing
            slots.abandon(result, slot)
            raise
        if not delivered:
            slots.time_out(result, slot, what, time.monotonic() - started)
        return slots.result(slot), True


def open_allocator_sync(layout: KVLayout, config: Config | None = None) -> SyncAllocator:
    """Opens an allocator for threads, with no event loop of the caller's.

    It runs a private asyncio loop in a daemon thread that drains the completions. Close it with
    ``close()`` or use it as a context manager (``with kvasync.open_allocator_sync(...) as kv``).

    Args:
        layout: the KV cache's geometry.
        config: settings; ``Config()`` when None.

    Returns:
        The blocking allocator.

    Raises:
        ValueError: the layout and config do not fit together.
        KVAsyncError: the backend cannot be used here.
    """
    owner = _LoopThread()
    timeout = (config or Config()).default_timeout
    try:
        allocator = owner.run(Allocator.open(layout, config), timeout, "open")
    except BaseException:
        owner.stop(1.0)
        raise
    if not isinstance(allocator, Allocator):
        raise AllocatorClosed("the allocator did not open")  # unreachable: a bug otherwise
    return SyncAllocator(allocator, _owner=owner)
