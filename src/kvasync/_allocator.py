"""Allocator: the asyncio face of the page pool.

Note [Futures and ownership]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An alloc that fits in mapped free blocks is answered by the C++ pool on the caller's thread and
returns without suspending. Otherwise the pool returns a request id and the alloc awaits a future
keyed by it. The mapper thread completes requests by pushing plain records and writing an eventfd;
the loop (``add_reader``) drains the records and resolves the futures, on the loop thread. So the
ownership of a result is settled here, on one thread:

* pending  -> delivered: a record arrives while the future is pending.
* pending  -> abandoned: the deadline timer or a cancellation removes the request first. The pool
  forgets the waiter; a record that was already queued finds no future and its blocks are freed.
* delivered, then cancelled: asyncio can resolve the future and still raise CancelledError in the
  task on its next step. The alloc then frees the blocks it will never return.

Every wait has a deadline: a timer at the deadline settles the request even if the mapper never
answers (a hung driver call), and close() waits for the mapper thread at most its timeout.

Note [Fork]
~~~~~~~~~~~
An allocator belongs to the process that opened it. A forked child inherits the Python object and
a copy of the pool's memory, but none of its threads: no mapper, no loop thread of a blocking
facade, no ledger watcher, and a lock that one of them held at the fork stays held for good. A call
there would wait for a thread that does not exist (``SyncAllocator.alloc`` of blocks that needed a
map never returned). So every method first checks that it runs in the process that opened the
allocator and otherwise raises ``AllocatorClosed`` saying so; the properties (``layout``,
``config``, ...) still describe it. The check compares two ints: the opener's pid, stored at open,
and ``_Process.pid``, which an ``os.register_at_fork`` hook refreshes in every child (a fork made
by C code without Python's hooks is not seen).

``close()`` in the child closes nothing: the mappings, the memory (the host backend's pages are
shared memory), the share's ledger entry and the event loop's epoll set (shared across fork: a
removed reader would vanish from the parent's loop too) are all the parent's. The C++ pool is
never destroyed there either: the mapper thread's reference to it was copied with the memory, and
no thread is left in the child to drop it. A child opens an allocator of its own, which joins a
share anew under its own pid.

Note [Views outlive close]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The torch views (``layer()``) are tensors over the reserved ranges; each holds the C++ backend, so
the address space lives as long as any view does. ``close()`` gives the memory back (the pages, the
share's budget) but does not leave a view pointing at unmapped memory: the pool's close *retires*
the pages mapped at close, putting scratch memory under their addresses until the allocator and
the last view are gone (the full rule, and what the scratch memory costs on each backend, in
csrc/backends/backend.h). So a view taken before close stays valid until it is dropped: it reads
garbage (zeros on host) and its writes are lost, but it never kills the process (SIGSEGV on host)
or poisons the CUDA context (an illegal address). Once ``close()`` has begun, ``layer()`` and the
block operations (``gather``, ``scatter``, ``zero``, ``copy``) raise ``AllocatorClosed``: no new
view or kernel launch reaches the ranges through the allocator.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import _core, _log, _loops, _share_names, _validate
from ._backends import buffer_views, create_backend, make_fence, page_size_for
from ._config import Config
from ._errors import AllocatorClosed, AllocTimeout, OutOfBlocks, WouldBlock
from ._group import scheduler_group
from ._layout import KVLayout
from ._sizes import format_bytes
from ._stats import AllocatorStats

__all__ = ["Allocator", "driver_port", "open_allocator"]

# What close() allows, beyond its timeout, for the unmaps that follow the mapper's join.
_CLOSE_GRACE_S = 5.0
# An awaited request whose map (or trim) the mapper expects to finish within this many seconds is
# awaited by spinning for its completion, the GIL released, instead of sleeping until the loop is
# woken: on a VM that wake-up costs 20-40 us, a third of a cold map (Note [Spinning wake-up] in
# csrc/common/wakeup.h; bench/bench_map.py). The loop is held that long at most; longer work is
# awaited.
_SPIN_S = 250e-6


class _Process:
    """This process's id, refreshed in a forked child (Note [Fork]): read on every call, where
    ``os.getpid()`` would be a system call."""

    pid = os.getpid()

    @classmethod
    def after_fork_in_child(cls) -> None:
        cls.pid = os.getpid()


os.register_at_fork(after_in_child=_Process.after_fork_in_child)


def _forked_error(opened_in: int) -> AllocatorClosed:
    return AllocatorClosed(
        f"this allocator was opened in process {opened_in}; this is process {_Process.pid}, a "
        "forked child, where its mapper and loop threads do not exist: a forked child must open "
        "its own allocator (kvasync.open_allocator or open_allocator_sync)"
    )


@dataclass(eq=False)
class _AllocObserver:
    """One ``add_alloc_observer`` registration: compared by identity, so that the same callable
    added twice is two entries."""

    callback: Callable[[bool, float], object]


@dataclass
class _Pending:
    future: asyncio.Future[list[int]]
    timer: asyncio.TimerHandle
    what: str  # "alloc of 8 blocks", "trim", ...
    started: float


def _check_count(n: object, capacity: int) -> int:
    count = _validate.count(n, "n (the number of blocks)")
    if count > capacity:
        # Before the pool: a count past int64 would otherwise reach pybind11 (issue 7).
        raise OutOfBlocks(
            f"alloc of n={count} blocks can never fit: capacity is {capacity} blocks (max_blocks)"
        )
    return count


class Allocator:
    """An elastic paged KV cache over one virtual range per buffer (or one for all).

    Create it with ``open_allocator`` (an async context manager) or ``await Allocator.open``,
    inside a running event loop. ``alloc``, ``trim``, ``resize`` and ``close`` are called from
    that loop; ``free`` and ``alloc_nowait`` never wait and may be called from any thread (the
    C++ pool is locked; a waiter they serve is completed through the loop's eventfd).

    It belongs to the process that opened it: in a forked child every method raises
    ``AllocatorClosed`` and ``close()`` touches nothing (Note [Fork]); open another there.

    Once ``close()`` has begun, every method raises ``AllocatorClosed`` but three: ``close()``
    itself (idempotent), and the read-only ``stats()`` (the final counters: what close gave back)
    and ``take_map_seconds()`` (the last maps' durations, for a final metrics scrape). The
    properties (``num_blocks``, ``page_size``, ``layout``, ``config``, ``backend``) still
    describe it. Views taken before the close stay valid (Note [Views outlive close]).
    """

    def __init__(
        self,
        layout: KVLayout,
        config: Config,
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        """Prefer ``open_allocator``; this reserves the ranges and starts the mapper thread.

        Raises:
            ValueError: the layout and config do not fit together.
            KVAsyncError: the backend cannot be used here.
        """
        _validate.instance(layout, "layout", KVLayout)
        _validate.instance(config, "config", Config)
        # None only for an allocator opened under trio (open() passes it; _loops drives it).
        trio = loop is None and _loops.current_library() == "trio"
        _validate.instance(loop, "loop", asyncio.AbstractEventLoop, optional=trio)
        self._opened_in = _Process.pid  # Note [Fork]
        # The process where calls are served: the opener's until close() begins, then 0, so that
        # one comparison checks both (Note [Fork], Note [Views outlive close]).
        self._usable_in = self._opened_in
        self._layout = layout
        self._config = config
        self._loop = loop
        self._default_timeout = config.default_timeout  # read on the hot path
        self._zero_on_alloc = config.zero_on_alloc
        self._spin_s = _SPIN_S
        # Note [Blocks across page boundaries] (_layout.py): the unit may be a multiple of the
        # configured (or default) page size, and its blocks need not fill it.
        page_size = layout.page_unit(page_size_for(layout, config))
        self._page_size = page_size
        num_pages = -(-config.max_blocks * layout.range_block_bytes // page_size)
        self._page_bytes = page_size * layout.num_ranges
        self._num_pages = num_pages
        self._backend = create_backend(layout, config, num_pages, page_size)
        self._group = scheduler_group(self._backend)  # Config.tensor_parallel's; closed with us
        low, high = config.reserve_pages
        self._pool = _core.PagePool(
            self._backend,
            config.max_blocks,
            0,
            self._limit_pages(config.memory_limit),
            low,
            high,
            config.default_timeout,
            block_bytes=layout.range_block_bytes,
            page_bytes=page_size,
            share=self._join_share(),
            linger_s=config.linger,
        )
        self._buffers = buffer_views(layout, self._backend, config.max_blocks)
        self._pending: dict[int, _Pending] = {}
        self._kernel_table: Any = None  # kernels.BlockTable, built on first use (_block_ops)
        self._closing: asyncio.Future[None] | None = None
        self._fd = self._pool.completion_fd
        # Trio tasks and threads wait on slots (Note [Slots] in _loops); `loop` is None on trio.
        pool = self._pool
        self._slots = _loops.SlotTable(
            cancel=lambda request: pool.cancel(request, False),
            free=pool.free,
            timeout_error=self._timeout_error,
        )
        self._loop_thread = threading.get_ident()  # where completions drain (opened there)
        self._trio: _loops.TrioDriver | None = None
        self._library = "asyncio"
        # add_alloc_observer: _observe is None while there is none, so that alloc reads no clock.
        self._observers: tuple[_AllocObserver, ...] = ()
        self._observe: Callable[[bool, float], None] | None = None
        self._stall = _log.StallWatch(config.stall_warning)
        self._stall_period = min(max(config.stall_warning / 2, 0.05), 1.0)
        self._stall_timer: asyncio.TimerHandle | None = None
        if loop is not None:
            loop.add_reader(self._fd, self._on_completions)
            self._stall_timer = loop.call_later(self._stall_period, self._stall_tick)
        # What the drivers (_loops, _sync) get of this allocator (Note [Drivers] in _loops).
        self._port = _DriverPort(self)
        _log.log_open(self)

    @classmethod
    async def open(cls, layout: KVLayout, config: Config | None = None) -> Allocator:
        """Opens an allocator on the running loop. Close it with ``await kv.close()``.

        Args:
            layout: the KV cache's geometry.
            config: settings; ``Config()`` when None.

        Returns:
            The allocator. The reserve starts filling in the background; nothing waits for it.

        Raises:
            TypeError: ``layout`` is not a KVLayout, or ``config`` not a Config or None.
            ValueError: the layout and config do not fit together.
            KVAsyncError: the backend cannot be used here.
        """
        # Not `config or Config()`: an empty dict would pass as "no config".
        config = Config() if config is None else config
        if _loops.current_library() == "trio":
            allocator = cls(layout, config, None)
            allocator._library = "trio"
            allocator._trio = _loops.TrioDriver(allocator._port)
            return allocator
        return cls(layout, config, asyncio.get_running_loop())

    # -- allocation -------------------------------------------------------------------------

    async def alloc(
        self, n: int, *, timeout: float | None = None, deadline: float | None = None
    ) -> list[int]:
        """Allocates ``n`` blocks, waiting for mapping or for frees at most until the deadline.

        Completes without suspending when ``n`` mapped blocks are free. Waiting requests are
        served first come, first served. Cancelling the awaiting task leaks nothing.

        Args:
            n: blocks to allocate.
            timeout: seconds to wait; ``default_timeout`` when neither this nor deadline is given.
            deadline: a ``loop.time()`` value to wait until, instead of ``timeout``.

        Returns:
            ``n`` distinct block ids in ``range(num_blocks)``.

        Raises:
            TypeError: ``n`` is not an int, or ``timeout``/``deadline`` not a number (a bool is
                neither).
            ValueError: ``n <= 0``, a negative/NaN/infinite timeout or deadline, or both timeout
                and deadline. A deadline already past is valid: as with ``timeout=0``, the alloc
                succeeds if the blocks are mapped and free now, else times out at once.
            OutOfBlocks: ``n`` can never fit (capacity or memory limit), raised at once.
            AllocTimeout: the deadline passed; the message says what it waited for.
            MapError: the backend failed to map the pages this request needed.
            AllocatorClosed: the allocator is (or was, while waiting) closed, or this is a forked
                child of the process that opened it (Note [Fork]).
            RuntimeError: the blocks are not there at once and this is not the event loop (or
                trio thread) that opened the allocator; nothing was queued.
        """
        if self._usable_in != _Process.pid:  # Note [Fork], closed; inline: the hot path
            raise self._unusable_error()
        if type(n) is not int or not 0 < n <= self._config.max_blocks:
            n = _check_count(n, self._config.max_blocks)
        observe = self._observe
        started = time.perf_counter() if observe is not None else 0.0
        waited = False
        due = None
        if timeout is not None or deadline is not None:
            due = self._deadline(timeout, deadline)  # checked even when the blocks are there
        # The hot path reads no cancel scope: a try that changes nothing on a miss.
        result = self._pool.alloc_nowait(n, False)
        if result is None:
            if due is None:
                due = self._time() + self._default_timeout
            self._check_loop()  # before the pool queues anything (issue 27)
            request = self._pool.alloc(n, self._pool_deadline(due))
            if isinstance(request, int):  # it became a waiter
                waited = True
                result = await self._wait(request, due, f"alloc of {n} blocks")
            else:
                result = request
        if self._zero_on_alloc:
            self._zero_blocks(result)
        if observe is not None:
            observe(waited, time.perf_counter() - started)
        return result

    def alloc_nowait(self, n: int) -> list[int]:
        """Allocates ``n`` blocks that are mapped and free right now, or raises at once.

        Args:
            n: blocks to allocate.

        Returns:
            ``n`` distinct block ids.

        Raises:
            TypeError: ``n`` is not an int (or is a bool).
            ValueError: ``n <= 0``.
            WouldBlock: the blocks are not mapped and free now. Mapping what the request lacks
                is started (within the memory limit), so the same call retried succeeds once
                the pages are mapped; the pages go to the reserve, held for nobody.
            OutOfBlocks: ``n`` can never fit.
            AllocatorClosed: the allocator is closed.
        """
        if self._usable_in != _Process.pid:  # Note [Fork], closed; inline: the hot path
            raise self._unusable_error()
        if type(n) is not int or not 0 < n <= self._config.max_blocks:
            n = _check_count(n, self._config.max_blocks)
        result = self._pool.alloc_nowait(n)
        if result is None:
            stats = self._pool.stats()
            limit = stats["limit_blocks"]
            if n > limit:
                raise OutOfBlocks(f"alloc of {n} blocks can never fit: the limit is {limit} blocks")
            raise WouldBlock(
                f"{n} mapped free blocks are not available now ({stats['free_blocks']} free, "
                f"{stats['waiters']} request(s) waiting); use await alloc()"
            )
        if self._zero_on_alloc:
            self._zero_blocks(result)
        return result

    def available_blocks(self) -> int:
        """Blocks an alloc could get now or by mapping within the memory limit.

        Mapped free blocks, blocks being mapped, and the blocks of the pages the memory limit
        still allows, less what waiting requests need: what a scheduler checks before admitting
        a request. In a share (``Config.share``), mapping counts only on the budget the share
        leaves this allocator, or on what is left of its fair share when that is more (the
        others are held to theirs while it waits). Free blocks of draining pages do not count
        (see ``drain_from``).

        Raises:
            AllocatorClosed: the allocator is closed, or this is a forked child (Note [Fork]).
        """
        if self._usable_in != _Process.pid:  # Note [Fork], closed; inline: every scheduler step
            raise self._unusable_error()
        available: int = self._pool.available_blocks()
        return available

    def set_demand(self, blocks: int) -> None:
        """Reports the blocks this allocator's user wants now: those it holds plus those it is
        about to ask for (an engine's running and admissible requests).

        In a share, the budget is divided by demand (Note [Fair share under pressure] in
        csrc/ledger/ledger.h): the report counts for 5 s, or until the next one, beside what the
        pool sees itself (blocks held and waited for); what it claims beyond those counts only
        while requests follow it (1 s after the claim or the last request that needed pages:
        Note [Demand claims] in csrc/pool/limit_policy.h). Without a share it changes nothing.

        Args:
            blocks: the number of blocks wanted now, >= 0 (more than ``num_blocks`` counts as
                ``num_blocks``).

        Raises:
            TypeError: ``blocks`` is not an int (a bool, a float or a str is not).
            ValueError: ``blocks`` is negative or beyond int64.
            AllocatorClosed: the allocator is closed, or this is a forked child (Note [Fork]).
        """
        self._check_open()
        blocks = _validate.integer(blocks, "blocks", minimum=0)
        self._pool.set_demand(min(blocks, self.num_blocks))

    def drain_from(self) -> int | None:
        """The first block id of the pages this allocator wants back, or None.

        When the memory limit in force is lower than what is mapped (``resize``,
        ``kvasync limit``, or in a share the fair share while another allocator waits for
        budget), the highest pages over it drain: no block is handed out from them any more,
        and each is unmapped as soon as its last block is freed. A scheduler that frees the
        blocks ``>= drain_from()`` (preempting the requests holding them) gives the memory back
        at once rather than when those requests end. None when nothing drains.

        Raises:
            AllocatorClosed: the allocator is closed, or this is a forked child (Note [Fork]).
        """
        self._check_open()
        block = int(self._pool.drain_from_block())
        return None if block < 0 else block

    def free_block_ids(self, limit: int | None = None) -> list[int]:
        """A snapshot: the free blocks on mapped pages, in the order alloc hands them out.

        The first ``n`` ids are those an ``alloc(n)`` (or ``try_alloc(n)``) made right after
        would return, when nothing else changes the pool in between and no waiter holds the
        blocks back. Blocks of draining pages (``drain_from``) are not listed: no allocation
        takes them. Nothing is taken or reserved; the listing is stale as soon as another call
        allocates, frees, maps or unmaps.

        Args:
            limit: list at most this many (``None``: all of them). A scheduler that only needs
                the next few pays for those alone.

        Raises:
            TypeError: ``limit`` is not an int or None (a bool, a float or a str is not).
            ValueError: ``limit`` is negative or beyond int64.
            AllocatorClosed: the allocator is closed, or this is a forked child (Note [Fork]).
        """
        self._check_open()
        wanted = self.num_blocks if limit is None else _validate.integer(limit, "limit", minimum=0)
        ids: list[int] = self._pool.free_blocks_in_order(min(wanted, self.num_blocks))
        return ids

    def free(self, ids: Sequence[int], *, after: object = None) -> None:
        """Returns blocks to the pool. Synchronous; never blocks.

        Args:
            ids: allocated block ids: a sequence of ints, or a 1-D integer tensor or array.
            after: (cuda) a ``torch.cuda.Stream`` or ``torch.cuda.Event``: device work that still
                reads or writes the blocks. Their pages are not unmapped before it completes.

        Raises:
            TypeError: ``ids`` is not such a sequence (a set or dict is not), or holds a non-int;
                or (cuda) ``after`` is neither a stream nor an event.
            ValueError: an id is out of range, not allocated, or repeated, or ``after`` is not
                usable here; nothing is freed then.
            AllocatorClosed: the allocator is closed (its pages went with it: there is nothing
                to give back), or this is a forked child (Note [Fork]).
        """
        if self._usable_in != _Process.pid:  # Note [Fork], closed; inline: the hot path
            raise self._unusable_error()
        if type(ids) is not list:  # a list goes straight to the pool, which checks its items
            ids = _validate.block_ids(ids, "ids")
        if after is None:
            self._pool.free(ids)
        else:
            self._pool.free(ids, make_fence(self._backend, after))

    # -- memory -----------------------------------------------------------------------------

    async def trim(self, *, timeout: float | None = None, release_handles: bool = True) -> None:
        """Unmaps every mapped-free page now and waits until the memory is given back.

        When it returns, no page is mapped and free unless a request mapped it since (or a
        waiting request counts on it): maps already under way when it was called (the reserve's
        refill, a map for a request that a free served first) are waited for and unmapped too.
        The reserve then stays empty until the next ``alloc`` or ``alloc_nowait``: demand again.

        Args:
            timeout: seconds to wait for the unmaps; ``default_timeout`` when None.
            release_handles: (cuda) also release the pooled physical handles. False keeps up to
                the reserve's high watermark of them, still allocated on the device, so that the
                next map skips cuMemCreate (and this trim skips cuMemRelease).

        Raises:
            TypeError: ``timeout`` is not a number (or is a bool), or ``release_handles`` is not
                a bool.
            ValueError: ``timeout`` is negative, NaN or infinite.
            AllocTimeout: the unmaps did not finish in time.
            MapError: the backend failed to unmap.
            AllocatorClosed: the allocator is closed.
            RuntimeError: not called on the event loop that opened it; nothing was unmapped.
        """
        self._check_open()
        _validate.flag(release_handles, "release_handles")
        due = self._deadline(timeout, None)
        self._check_loop()
        request = self._pool.trim(self._pool_deadline(due), release_handles)
        if request:
            await self._wait(request, due, "trim")

    async def resize(self, *, memory_limit: int | None, timeout: float | None = None) -> None:
        """Changes the physical memory budget; unmaps free pages above a lowered one.

        Pages in use above the new limit stay until they are freed, but they drain: no block is
        handed out from them any more, and each is unmapped once its last block is freed (see
        ``drain_from``). No new page is mapped while the allocator is over its limit. Waiting
        requests larger than the new limit fail with ``OutOfBlocks``.

        Args:
            memory_limit: bytes of physical KV memory; None = up to capacity.
            timeout: seconds to wait for the unmaps; ``default_timeout`` when None.

        Raises:
            TypeError: ``memory_limit`` is not an int or None, or ``timeout`` not a number (a bool
                is neither).
            ValueError: the limit is below one page, or a bad timeout.
            AllocTimeout: the unmaps did not finish in time.
            AllocatorClosed: the allocator is closed.
            RuntimeError: not called on the event loop that opened it; the limit is unchanged.
        """
        self._check_open()
        if memory_limit is not None:
            _validate.integer(memory_limit, "memory_limit", minimum=1)
        due = self._deadline(timeout, None)
        self._check_loop()  # a failed call changes nothing: the limit neither (issue 27)
        request = self._pool.set_limit_pages(
            self._limit_pages(memory_limit), self._pool_deadline(due)
        )
        if request:
            await self._wait(request, due, "resize")

    # -- block data (Triton kernels: one launch for every layer and buffer) ------------------

    def gather(
        self, ids: Sequence[int] | torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copies blocks ``ids`` of every layer and buffer into one contiguous tensor.

        Args:
            ids: allocated block ids (repeats allowed): ints or a 1-D integer tensor.
            out: where to write: contiguous, the layout's dtype, on the allocator's device, shape
                ``[len(ids), num_layers, kv_buffers, block_size, num_kv_heads, head_dim]``.

        Returns:
            ``out`` or a new tensor of that shape.

        Raises:
            TypeError: ``ids`` are not ints or an integer tensor, or ``out`` is not a tensor of
                the layout's dtype.
            ValueError: an id not allocated or out of range, or ``out`` of the wrong shape or
                device. Nothing is launched then.
            AllocatorClosed: ``close()`` has begun (Note [Views outlive close]).
        """
        self._check_open()  # Note [Views outlive close]
        from . import _block_ops

        return _block_ops.gather(
            self._buffers,
            ids,
            out,
            kv_buffers=self._layout.kv_buffers,
            is_allocated=self._pool.unallocated,
            table=self._block_table(),
        )

    def scatter(self, ids: Sequence[int] | torch.Tensor, src: torch.Tensor) -> None:
        """Writes ``src`` (shaped as ``gather``'s result) into blocks ``ids`` of every layer.

        Raises:
            TypeError: ``ids`` are not ints or an integer tensor, or ``src`` is not a tensor of
                the layout's dtype.
            ValueError: an id not allocated, out of range or repeated, or ``src`` of the wrong
                shape or device. Nothing is launched then.
            AllocatorClosed: ``close()`` has begun.
        """
        self._check_open()  # Note [Views outlive close]
        from . import _block_ops

        _block_ops.scatter(
            self._buffers,
            ids,
            src,
            kv_buffers=self._layout.kv_buffers,
            is_allocated=self._pool.unallocated,
            table=self._block_table(),
        )

    def zero(self, ids: Sequence[int] | torch.Tensor) -> None:
        """Zeroes blocks ``ids`` in every layer and buffer.

        Raises:
            TypeError: ``ids`` are not ints or an integer tensor.
            ValueError: an id not allocated or out of range. Nothing is launched then.
            AllocatorClosed: ``close()`` has begun.
        """
        self._check_open()  # Note [Views outlive close]
        from . import _block_ops

        _block_ops.zero(
            self._buffers,
            ids,
            kv_buffers=self._layout.kv_buffers,
            is_allocated=self._pool.unallocated,
            table=self._block_table(),
        )

    def copy(
        self, src_ids: Sequence[int] | torch.Tensor, dst_ids: Sequence[int] | torch.Tensor
    ) -> None:
        """Copies block ``src_ids[i]`` to block ``dst_ids[i]`` in every layer (copy-on-write).

        Raises:
            TypeError: ids that are not ints or integer tensors.
            ValueError: ids not allocated, out of range, of different lengths, or a repeated
                destination. Nothing is launched then.
            AllocatorClosed: ``close()`` has begun.
        """
        self._check_open()  # Note [Views outlive close]
        from . import _block_ops

        _block_ops.copy(
            self._buffers,
            src_ids,
            dst_ids,
            kv_buffers=self._layout.kv_buffers,
            is_allocated=self._pool.unallocated,
            table=self._block_table(),
        )

    # -- views and state --------------------------------------------------------------------

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """The KV buffers of one layer: ``(k, v)``, or ``(kv,)`` when ``kv_buffers == 1``.

        Each is a view ``[num_blocks, block_size, num_kv_heads, head_dim]`` over the virtual
        range, one fixed block stride whatever the geometry. Only allocated blocks may be
        touched: an unmapped block faults, as on a GPU (and an id across a page boundary is never
        allocated: Note [Blocks across page boundaries]).

        A view stays valid after ``close()`` until it is dropped (Note [Views outlive close]):
        the blocks that were mapped at close read garbage and take writes that are lost, and
        nothing faults that did not fault before; the memory itself went back at close.

        Raises:
            TypeError: ``index`` is not an int (or is a bool).
            IndexError: no such layer.
            AllocatorClosed: ``close()`` has begun: no new view of a closed allocator.
        """
        self._check_open()  # Note [Views outlive close]
        index = _validate.index(index, "layer index", self._layout.num_layers)
        per = self._layout.kv_buffers
        return tuple(self._buffers[index * per : (index + 1) * per])

    @property
    def num_blocks(self) -> int:
        """Virtual capacity in blocks; block ids are ``range(num_blocks)``."""
        return self._config.max_blocks

    @property
    def page_size(self) -> int:
        """The unit of mapping in use: bytes of each virtual range that one page id maps."""
        return self._page_size

    @property
    def layout(self) -> KVLayout:
        """The KV cache's geometry."""
        return self._layout

    @property
    def config(self) -> Config:
        """The settings this allocator was opened with."""
        return self._config

    @property
    def backend(self) -> str:
        """The backend in use: "host" or "cuda"."""
        return str(self._backend.name)

    def stats(self) -> AllocatorStats:
        """A consistent snapshot of pages, blocks, waiters and the mapper's current op.

        Also after ``close()``: the final counters (no page is mapped then, unless a mapper stuck
        in the driver was abandoned).

        Raises:
            AllocatorClosed: called in a forked child (Note [Fork]).
        """
        self._check_process()
        return AllocatorStats.from_core(
            self._pool.stats(),
            self._page_bytes,
            self._layout.block_bytes * self._layout.num_buffers,
        )

    # -- observers --------------------------------------------------------------------------

    def add_alloc_observer(self, observer: Callable[[bool, float], object]) -> Callable[[], None]:
        """Calls ``observer(waited, seconds)`` after every successful ``alloc``.

        ``waited`` is False for an alloc answered at once from mapped free blocks (hot), True for
        one that waited for a map or a free (cold); ``seconds`` runs from the call to its blocks.
        It is called on the thread that made the alloc (a thread of a ``SyncAllocator`` too), so
        it must be quick and thread-safe: a Prometheus histogram's ``observe`` is. An exception
        it raises is logged (the ``kvasync`` logger) and does not fail the alloc. ``alloc_nowait``
        is not observed. With no observer, ``alloc`` does not read the clock.

        Args:
            observer: a callable taking ``(waited: bool, seconds: float)``.

        Returns:
            A callable that removes this observer (idempotent). The same callable added twice is
            called twice, and each handle removes one.

        Raises:
            TypeError: ``observer`` is not callable.
            AllocatorClosed: the allocator is closed, or this is a forked child (Note [Fork]).
        """
        self._check_open()
        if not callable(observer):
            raise TypeError(f"observer must be callable, got {observer!r}")
        entry = _AllocObserver(observer)
        self._observers = (*self._observers, entry)
        self._observe = self._notify_observers

        def remove() -> None:
            self._observers = tuple(o for o in self._observers if o is not entry)
            if not self._observers:
                self._observe = None

        return remove

    def take_map_seconds(self) -> list[float]:
        """The seconds each successful map job took since the last call; forgets them.

        Each duration is returned once (a batch's jobs share theirs), so one consumer should read
        them: ``kvasync.integrations.metrics`` does at each scrape. At most 4096 are kept between
        two calls; later ones are dropped until the next call. Also after ``close()``: the
        durations recorded before it are still taken once.

        Returns:
            The durations, oldest first; ``[]`` when no map finished since the last call.

        Raises:
            AllocatorClosed: called in a forked child (Note [Fork]).
        """
        self._check_process()
        return list(self._pool.take_map_seconds())

    # -- lifetime ---------------------------------------------------------------------------

    async def close(self, *, timeout: float | None = None) -> None:
        """Fails waiting requests with ``AllocatorClosed``, stops the mapper, unmaps everything.

        Finishes within ``timeout`` even with the mapper stuck in a driver call: the thread is
        then abandoned (it ends by itself when the call returns) and its mappings are left to it.
        The memory goes back, but views taken before (``layer()``) stay valid until dropped:
        their addresses are left on scratch memory, never unmapped under them (Note [Views
        outlive close]).
        With ``Config.tensor_parallel`` every rank unmaps too, then the group is closed: its ranks
        leave and its file is removed (``TensorParallel``).
        The wait runs on a thread of its own, so a default executor the application keeps busy
        does not delay it. Idempotent. In a forked child it returns at once and touches nothing:
        the pages and the share's ledger entry are the parent's (Note [Fork]).

        Args:
            timeout: seconds to wait for the mapper thread; ``default_timeout`` when None.

        Raises:
            TypeError: ``timeout`` is not a number (or is a bool).
            ValueError: ``timeout`` is negative, NaN or infinite.
            RuntimeError: not called on the event loop (or trio thread) that opened it; nothing
                is closed then.
        """
        wait = self._config.default_timeout if timeout is None else self._check_timeout(timeout)
        if self._opened_in != _Process.pid:
            return  # Note [Fork]: nothing here is this process's to close
        self._check_loop()  # before anything changes: a close half done on another loop hung
        self._usable_in = 0  # from now on the other calls raise AllocatorClosed
        if self._trio is not None:
            await self._trio.close(wait)
            return
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(wait))
        # Shielded: a caller cancelled while waiting does not leave the close half done, and a
        # second caller waits for the same close.
        await asyncio.shield(self._closing)

    async def _close(self, wait: float) -> None:
        self._on_completions()  # what completed before the close is delivered as usual
        await self._close_pool(wait)
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        if self._loop is not None:  # always, on this (asyncio) path
            self._loop.remove_reader(self._fd)
        # Completed during the close: their pages are gone, so they fail too.
        self._on_completions(closed=True)
        for request in list(self._pending):
            self._settle(request, AllocatorClosed("the allocator was closed"), None)
        self._slots.close()

    async def _close_pool(self, wait: float) -> None:
        # pool.close releases the GIL and waits for the mapper at most `wait` (at least 1 s for
        # an idle mapper, which stops at once), then unmaps. It runs off the loop thread so other
        # tasks keep running, on a thread of its own: not asyncio.to_thread, whose executor the
        # application shares and may have filled with its own work, which would make the close
        # wait for that work (issue 7). One short-lived thread per close costs nothing that
        # matters. The loop waits for it with a deadline too; past it the thread is left to end
        # by itself (it holds the pool alive) and the close goes on.
        loop = self._loop
        assert loop is not None  # the asyncio path; trio closes in its driver
        done: asyncio.Future[None] = loop.create_future()

        # NOTE: the thread holds the pool, never the allocator: if it dropped the last reference
        # to the allocator, its torch views would be freed on this thread, and one freed while the
        # interpreter finalizes aborts the process (torch takes the GIL in C++, and CPython then
        # ends the thread by a forced unwind through code that may not unwind).
        pool, group = self._pool, self._group

        def close_pool() -> None:
            error: BaseException | None = None
            try:
                _close_pool_and_group(pool, group, wait)
            except BaseException as exc:  # delivered to the awaiting close, not lost here
                error = exc
            # RuntimeError: the loop is closed, nobody waits for this close any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, done, error)

        threading.Thread(target=close_pool, name="kvasync-close", daemon=True).start()
        # A timeout here: the unmaps after the join are stuck in the backend; left to the thread.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), max(wait, 1.0) + _CLOSE_GRACE_S)

    async def __aenter__(self) -> Allocator:
        self._check_open()  # entering a closed allocator is a mistake too
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals --------------------------------------------------------------------------

    def _join_share(self) -> _core.ShareMember | None:
        # The membership of config.share (Note [Share ledger] in csrc/ledger/ledger.h), or None.
        config = self._config
        if config.share is None:
            return None
        budget = config.device_budget
        if budget is None and self._backend.name == "cuda":
            total = torch.cuda.get_device_properties(config.device).total_memory
            budget = int(total * config.gpu_utilization)
        name = config.name or _share_names.default_name()
        return _share_names.join(config.share, name, budget or 0, self._page_bytes)

    def _limit_pages(self, memory_limit: int | None) -> int:
        if memory_limit is None:
            return self._num_pages
        pages = memory_limit // self._page_bytes
        if pages < 1:
            raise ValueError(self._below_one_page(memory_limit))
        return min(pages, self._num_pages)

    def _below_one_page(self, memory_limit: int) -> str:
        # The unit of the limit is a page id, and a page id maps page_size of every range at
        # once (a block id sits at the same offset of each): say so, with what it costs.
        layout = self._layout
        if layout.contiguous:
            spans = "the layout's one range (contiguous=True: every layer's K/V of a block)"
        else:
            spans = (
                f"each of the layout's {layout.num_ranges} ranges (one per layer and K/V "
                f"buffer: {layout.num_layers} x {layout.kv_buffers}), since a block id's data "
                "sits at the same offset of every range"
            )
        return (
            f"memory_limit {memory_limit} bytes ({format_bytes(memory_limit)}) is below one page, "
            f"which costs {self._page_bytes} bytes ({format_bytes(self._page_bytes)}): a page id "
            f"maps page_size ({format_bytes(self._page_size)}) in {spans}. Raise memory_limit "
            "to at least that, or lower Config.page_size where the backend allows it"
        )

    def _check_process(self) -> None:
        if self._opened_in != _Process.pid:
            raise _forked_error(self._opened_in)

    def _check_open(self) -> None:
        # Note [Fork] and Note [Views outlive close]: one comparison for both.
        if self._usable_in != _Process.pid:
            raise self._unusable_error()

    def _unusable_error(self) -> AllocatorClosed:
        if self._opened_in != _Process.pid:
            return _forked_error(self._opened_in)
        return AllocatorClosed("the allocator is closed (close() was called); open another one")

    def _check_loop(self) -> None:
        # Before any state changes (issue 27: resize from another loop had lowered the limit
        # before it raised): the calls that wait run on the loop, or trio thread, that opened it.
        if self._trio is not None:
            if threading.get_ident() == self._trio.thread:
                return
        else:
            try:
                running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:  # no asyncio loop here (trio, or none at all)
                running = None
            if running is self._loop:
                return
        raise RuntimeError(
            f"this allocator belongs to the {self._library} event loop that opened it (on "
            f"thread {self._loop_thread}; this is thread {threading.get_ident()}): alloc, "
            "trim, resize and close are called there, and nothing was changed. Open one "
            "allocator per loop (with pytest-asyncio, give the fixture and the tests the same "
            "loop scope), or wrap it in kvasync.SyncAllocator for threads"
        )

    def _notify_observers(self, waited: bool, seconds: float) -> None:
        for entry in self._observers:
            try:
                entry.callback(waited, seconds)
            except Exception:  # the blocks are allocated: an observer's bug must not lose them
                _log.logger.exception("an alloc observer raised; the alloc is unaffected")

    @staticmethod
    def _check_timeout(timeout: float) -> float:
        return _validate.seconds(timeout, "timeout")

    def _deadline(self, timeout: float | None, deadline: float | None) -> float:
        if timeout is not None and deadline is not None:
            raise ValueError("give either timeout or deadline, not both")
        if deadline is not None:
            # >= 0: a negative value would reach the pool as its "no deadline given" mark.
            return _validate.deadline(deadline, "deadline")
        wait = self._config.default_timeout if timeout is None else self._check_timeout(timeout)
        return self._time() + wait

    def _time(self) -> float:
        # The clock of `deadline=`: loop.time() on asyncio, trio.current_time() on trio.
        if self._loop is not None:
            return self._loop.time()
        try:
            return _loops.TrioDriver.time()
        except RuntimeError:  # trio's "must be called from async context": say whose it is
            self._check_loop()
            raise

    def _pool_deadline(self, due: float) -> float:
        # Note [Clocks] in _loops: an enclosing cancel scope's deadline bounds the mapper too.
        due = min(due, _loops.scope_deadline(self._library))
        return due if self._trio is None else self._trio.to_pool_time(due)

    async def _wait(self, request: int, due: float, what: str) -> list[int]:
        if self._trio is not None:
            return await self._trio.wait(request, due, what)
        loop = self._loop
        assert loop is not None, "an asyncio allocator has a loop (a bug otherwise)"
        if self._spin_s > 0.0:  # see _SPIN_S
            spin = min(self._spin_s, due - loop.time())
            record = self._pool.take_completion(request, spin) if spin > 0 else None
            if record is not None:
                return self._result_of(*record)
        future: asyncio.Future[list[int]] = loop.create_future()
        timer = loop.call_at(due, self._on_deadline, request)
        self._pending[request] = _Pending(future, timer, what, loop.time())
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(request, future)
            raise

    @staticmethod
    def _result_of(status: int, blocks: list[int], message: str) -> list[int]:
        error = _loops.completion_error(status, message)
        if error is not None:
            raise error
        return blocks

    def _abandon(self, request: int, future: asyncio.Future[list[int]]) -> None:
        # See Note [Futures and ownership].
        if future.done() and not future.cancelled():
            if future.exception() is None:
                self._pool.free(future.result())  # delivered, then cancelled: give them back
            return
        pending = self._pending.pop(request, None)
        if pending is not None:
            pending.timer.cancel()
            self._pool.cancel(request, False)  # None: its record is queued; drain frees it

    def _on_deadline(self, request: int) -> None:
        self._on_completions()  # a result that is already here wins over the timer
        pending = self._pending.get(request)
        if pending is None:
            return
        waited = self._time() - pending.started
        self._settle(request, self._timeout_error(request, pending.what, waited), None)

    def _timeout_error(self, request: int, what: str, waited: float) -> AllocTimeout:
        waiting_for = self._pool.cancel(request, True)
        if waiting_for:
            detail = f"waiting for {waiting_for}"
        else:  # not a waiter for blocks (a trim or resize), or its completion is on its way
            stats = self._pool.stats()
            op, age = stats["mapper_op"], stats["mapper_op_age_s"]
            detail = f"the mapper busy on {op} for {age:.3f} s" if op else "the mapper idle"
        return AllocTimeout(f"{what} timed out after {waited:.3f} s, {detail}")

    def _settle(self, request: int, error: Exception | None, blocks: list[int] | None) -> None:
        pending = self._pending.pop(request)
        pending.timer.cancel()
        if pending.future.done():  # cancelled meanwhile: nobody will take the blocks
            if blocks:
                self._pool.free(blocks)
        elif error is not None:
            pending.future.set_exception(error)
        else:
            pending.future.set_result(blocks or [])

    def _on_completions(self, closed: bool = False) -> None:
        with self._slots.lock:  # Note [Slots]: a slot is registered before its record drains
            for request, status, blocks, message in self._pool.drain():
                self._complete(request, status, blocks, message, closed)

    def _complete(
        self, request: int, status: int, blocks: list[int], message: str, closed: bool
    ) -> None:
        pending = request in self._pending
        slot = None if pending else self._slots.slots.pop(request, None)
        if blocks and (closed or (not pending and slot is None)):
            # Nobody will use them: the request was abandoned (timed out or cancelled), or its
            # pages went with the close.
            self._pool.free(blocks)
            status, message, blocks = _loops.CLOSED, "the allocator was closed", []
        if slot is not None:
            slot.deliver(status, blocks, message)
        elif pending:
            self._settle(request, _loops.completion_error(status, message), blocks)

    def _finish_close(self) -> None:
        # After pool.close: what completed during the close fails (its pages are gone).
        self._on_completions(closed=True)
        self._slots.close()

    def _stall_tick(self) -> None:
        if self._closing is not None or self._loop is None:
            return
        self._check_stall()
        self._stall_timer = self._loop.call_later(self._stall_period, self._stall_tick)

    def _check_stall(self) -> None:
        self._stall.check(self._pool.stats())

    def _zero_blocks(self, ids: list[int]) -> None:
        from . import _block_ops

        # The blocks were just handed out by the pool: no need to ask it again.
        _block_ops.zero(
            self._buffers,
            ids,
            kv_buffers=self._layout.kv_buffers,
            is_allocated=_none_missing,
            table=self._block_table(),
        )

    def _block_table(self) -> Any:
        # The buffers never move (a fixed virtual range), so their pointer table is built once:
        # building it copies it to the device, a host synchronization per call otherwise.
        # None where the kernels do not run (CPU without Triton's interpreter): torch does it.
        if self._kernel_table is None:
            from . import _block_ops

            self._kernel_table = _block_ops.block_table(self._buffers)
        return self._kernel_table


def _close_pool_and_group(
    pool: _core.PagePool, group: _core.SchedulerGroup | None, wait: float
) -> bool:
    """Closes the pool (``PagePool.close``), then the tensor-parallel group it maps through.

    The group is closed here, not when the backend is released: the allocator (freed only by the
    cycle collector) and views taken from it may live until exit, and so did the group, holding
    its ranks and its name, and at exit leaving its file in /dev/shm. After the pool: its unmaps
    go through the group. Closed even when the pool's mapper was abandoned in a backend call:
    the ranks then unmap everything and leave, as when the scheduler dies, and the map the
    mapper is in fails (Note [Tensor parallel group]).
    """
    try:
        return pool.close(wait)
    finally:
        if group is not None:
            group.close()


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _none_missing(ids: list[int]) -> list[int]:
    return []


class _DriverPort:
    """The allocator as its drivers see it (Note [Drivers] in _loops): ``_loops.CompletionSource``
    for the trio drain, ``_sync.RequestSource`` for the blocking facade. Public methods over the
    allocator's internals, so that no other module calls those."""

    def __init__(self, allocator: Allocator) -> None:
        self._kv = allocator
        self._pool = allocator._pool
        self.fd: int = allocator._fd
        self.stall_period: float = allocator._stall_period
        self.slots: _loops.SlotTable = allocator._slots
        self.loop_thread: int = allocator._loop_thread
        # A worker thread running it holds the pool and the group, never the allocator.
        self.close_pool: Callable[[float], object] = functools.partial(
            _close_pool_and_group, allocator._pool, allocator._group
        )

    def check_open(self) -> None:
        self._kv._check_open()

    @property
    def forked(self) -> bool:
        return self._kv._opened_in != _Process.pid

    def drain(self) -> None:
        self._kv._on_completions()

    def check_stall(self) -> None:
        self._kv._check_stall()

    def finish_close(self) -> None:
        self._kv._finish_close()

    def check_count(self, n: object) -> int:
        return _check_count(n, self._kv.config.max_blocks)

    def limit_pages(self, memory_limit: int | None) -> int:
        return self._kv._limit_pages(memory_limit)

    def start_alloc(self, n: int, due: float) -> list[int] | int:
        return self._pool.alloc(n, due)

    def start_trim(self, due: float, release_handles: bool) -> list[int] | int:
        return self._pool.trim(due, release_handles) or []

    def start_resize(self, pages: int, due: float) -> list[int] | int:
        return self._pool.set_limit_pages(pages, due) or []

    def finish_alloc(self, blocks: list[int], waited: bool, started: float) -> None:
        kv = self._kv
        if kv._zero_on_alloc:
            kv._zero_blocks(blocks)
        if kv._observe is not None:
            kv._observe(waited, time.perf_counter() - started)


def driver_port(allocator: Allocator) -> _DriverPort:
    """What a driver of ``allocator`` calls (Note [Drivers] in _loops); see ``_DriverPort``."""
    return allocator._port


@asynccontextmanager
async def open_allocator(
    layout: KVLayout, config: Config | None = None
) -> AsyncIterator[Allocator]:
    """Opens an allocator for the duration of an ``async with`` block, then closes it.

    Args:
        layout: the KV cache's geometry.
        config: settings; ``Config()`` when None.

    Yields:
        The open allocator.

    Raises:
        TypeError: ``layout`` is not a KVLayout, or ``config`` not a Config or None.
        ValueError: the layout and config do not fit together.
        KVAsyncError: the backend cannot be used here.
    """
    allocator = await Allocator.open(layout, config)
    try:
        yield allocator
    finally:
        await allocator.close()
