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
"""

from __future__ import annotations

import asyncio
import math
import operator
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import _core
from ._backends import buffer_views, create_backend, make_fence
from ._config import Config
from ._errors import AllocatorClosed, AllocTimeout, MapError, OutOfBlocks, WouldBlock
from ._layout import KVLayout
from ._share import join_share
from ._stats import AllocatorStats

__all__ = ["Allocator", "open_allocator"]

# Completion statuses (csrc/completion_queue.h).
_OK, _MAP_ERROR, _OUT_OF_BLOCKS, _CLOSED = 0, 1, 2, 3


@dataclass
class _Pending:
    future: asyncio.Future[list[int]]
    timer: asyncio.TimerHandle
    what: str  # "alloc of 8 blocks", "trim", ...
    started: float


def _check_count(n: int) -> int:
    if type(n) is not int:
        n = operator.index(n)
    if n <= 0:
        raise ValueError(f"the number of blocks must be positive, got {n}")
    return n


class Allocator:
    """An elastic paged KV cache over one virtual range per buffer (or one for all).

    Create it with ``open_allocator`` (an async context manager) or ``await Allocator.open``,
    inside a running event loop. ``alloc``, ``trim``, ``resize`` and ``close`` are called from
    that loop; ``free`` and ``alloc_nowait`` never wait and may be called from any thread (the
    C++ pool is locked; a waiter they serve is completed through the loop's eventfd).
    """

    def __init__(
        self,
        layout: KVLayout,
        config: Config,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Prefer ``open_allocator``; this reserves the ranges and starts the mapper thread.

        Raises:
            ValueError: the layout and config do not fit together.
            KVAsyncError: the backend cannot be used here.
        """
        self._layout = layout
        self._config = config
        self._loop = loop
        self._default_timeout = config.default_timeout  # read on the hot path
        self._zero_on_alloc = config.zero_on_alloc
        blocks_per_page = layout.blocks_per_page(config.page_size)
        self._blocks_per_page = blocks_per_page
        num_pages = -(-config.max_blocks // blocks_per_page)
        self._page_bytes = config.page_size * layout.num_ranges
        self._num_pages = num_pages
        self._backend = create_backend(layout, config, num_pages)
        low, high = config.reserve_pages
        self._pool = _core.PagePool(
            self._backend,
            config.max_blocks,
            blocks_per_page,
            self._limit_pages(config.memory_limit),
            low,
            high,
            config.default_timeout,
            join_share(config, self._backend, self._page_bytes),
        )
        self._buffers = buffer_views(layout, self._backend, config.max_blocks)
        self._pending: dict[int, _Pending] = {}
        self._kernel_table: Any = None  # kernels.BlockTable, built on first use
        self._closing: asyncio.Future[None] | None = None
        self._fd = self._pool.completion_fd
        loop.add_reader(self._fd, self._on_completions)

    @classmethod
    async def open(cls, layout: KVLayout, config: Config | None = None) -> Allocator:
        """Opens an allocator on the running loop. Close it with ``await kv.close()``.

        Args:
            layout: the KV cache's geometry.
            config: settings; ``Config()`` when None.

        Returns:
            The allocator. The reserve starts filling in the background; nothing waits for it.

        Raises:
            ValueError: the layout and config do not fit together.
            KVAsyncError: the backend cannot be used here.
        """
        return cls(layout, config or Config(), asyncio.get_running_loop())

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
            ValueError: ``n <= 0``, a negative/NaN/infinite timeout, or both timeout and deadline.
            OutOfBlocks: ``n`` can never fit (capacity or memory limit), raised at once.
            AllocTimeout: the deadline passed; the message says what it waited for.
            MapError: the backend failed to map the pages this request needed.
            AllocatorClosed: the allocator is (or was, while waiting) closed.
        """
        if type(n) is not int or n <= 0:
            n = _check_count(n)
        if timeout is None and deadline is None:
            # The hot path reads no clock: -1 tells the pool "now + default_timeout".
            result = self._pool.alloc(n, -1.0)
            if isinstance(result, int):  # it became a waiter
                due = self._loop.time() + self._default_timeout
                result = await self._wait(result, due, f"alloc of {n} blocks")
        else:
            due = self._deadline(timeout, deadline)
            result = self._pool.alloc(n, due)
            if isinstance(result, int):
                result = await self._wait(result, due, f"alloc of {n} blocks")
        if self._zero_on_alloc:
            self._zero_blocks(result)
        return result

    def alloc_nowait(self, n: int) -> list[int]:
        """Allocates ``n`` blocks that are mapped and free right now, or raises at once.

        Args:
            n: blocks to allocate.

        Returns:
            ``n`` distinct block ids.

        Raises:
            ValueError: ``n <= 0``.
            WouldBlock: the blocks are not mapped and free now (mapping, if any, is started).
            OutOfBlocks: ``n`` can never fit.
            AllocatorClosed: the allocator is closed.
        """
        if type(n) is not int or n <= 0:
            n = _check_count(n)
        result = self._pool.alloc_nowait(n)
        if result is None:
            stats = self._pool.stats()
            limit = min(stats["limit_pages"] * self._blocks_per_page, self.num_blocks)
            if n > limit:
                raise OutOfBlocks(f"alloc of {n} blocks can never fit: the limit is {limit} blocks")
            raise WouldBlock(
                f"{n} mapped free blocks are not available now ({stats['free_blocks']} free, "
                f"{stats['waiters']} request(s) waiting); use await alloc()"
            )
        if self._zero_on_alloc:
            self._zero_blocks(result)
        return result

    def free(self, ids: Sequence[int], *, after: object = None) -> None:
        """Returns blocks to the pool. Synchronous; never blocks.

        Args:
            ids: allocated block ids.
            after: (cuda) a ``torch.cuda.Stream`` or ``torch.cuda.Event``: device work that still
                reads or writes the blocks. Their pages are not unmapped before it completes.

        Raises:
            ValueError: an id is out of range, not allocated, or repeated, or ``after`` is not
                usable here; nothing is freed then.
        """
        if after is None:
            self._pool.free(ids)
        else:
            self._pool.free(ids, make_fence(self._backend, after))

    # -- memory -----------------------------------------------------------------------------

    async def trim(self, *, timeout: float | None = None) -> None:
        """Unmaps every mapped-free page now and waits until the memory is given back.

        Args:
            timeout: seconds to wait for the unmaps; ``default_timeout`` when None.

        Raises:
            AllocTimeout: the unmaps did not finish in time.
            MapError: the backend failed to unmap.
            AllocatorClosed: the allocator is closed.
        """
        due = self._deadline(timeout, None)
        request = self._pool.trim(due)
        if request:
            await self._wait(request, due, "trim")

    async def resize(self, *, memory_limit: int | None, timeout: float | None = None) -> None:
        """Changes the physical memory budget; unmaps free pages above a lowered one.

        Pages in use above the new limit stay until they are freed; no new page is mapped while
        the allocator is over its limit. Waiting requests larger than the new limit fail with
        ``OutOfBlocks``.

        Args:
            memory_limit: bytes of physical KV memory; None = up to capacity.
            timeout: seconds to wait for the unmaps; ``default_timeout`` when None.

        Raises:
            ValueError: the limit is below one page.
            AllocTimeout: the unmaps did not finish in time.
            AllocatorClosed: the allocator is closed.
        """
        if memory_limit is not None and (type(memory_limit) is not int or memory_limit <= 0):
            raise ValueError(f"memory_limit must be a positive int or None, got {memory_limit!r}")
        due = self._deadline(timeout, None)
        request = self._pool.set_limit_pages(self._limit_pages(memory_limit), due)
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
            ValueError: an id not allocated or out of range, or ``out`` of the wrong shape, dtype
                or device. Nothing is launched then.
        """
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
            ValueError: an id not allocated, out of range or repeated, or ``src`` of the wrong
                shape, dtype or device. Nothing is launched then.
        """
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
            ValueError: an id not allocated or out of range. Nothing is launched then.
        """
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
            ValueError: ids not allocated, out of range, of different lengths, or a repeated
                destination. Nothing is launched then.
        """
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
        range. Only allocated blocks may be touched: an unmapped block faults, as on a GPU.

        Raises:
            IndexError: no such layer.
        """
        if not 0 <= index < self._layout.num_layers:
            raise IndexError(f"layer {index} out of range [0, {self._layout.num_layers})")
        per = self._layout.kv_buffers
        return tuple(self._buffers[index * per : (index + 1) * per])

    @property
    def num_blocks(self) -> int:
        """Virtual capacity in blocks; block ids are ``range(num_blocks)``."""
        return self._config.max_blocks

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
        """A consistent snapshot of pages, blocks, waiters and the mapper's current op."""
        return AllocatorStats.from_core(self._pool.stats(), self._page_bytes)

    # -- lifetime ---------------------------------------------------------------------------

    async def close(self, *, timeout: float | None = None) -> None:
        """Fails waiting requests with ``AllocatorClosed``, stops the mapper, unmaps everything.

        Finishes within ``timeout`` even with the mapper stuck in a driver call: the thread is
        then abandoned (it ends by itself when the call returns) and its mappings are left to it.
        Idempotent.

        Args:
            timeout: seconds to wait for the mapper thread; ``default_timeout`` when None.
        """
        wait = self._config.default_timeout if timeout is None else self._check_timeout(timeout)
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(wait))
        # Shielded: a caller cancelled while waiting does not leave the close half done, and a
        # second caller waits for the same close.
        await asyncio.shield(self._closing)

    async def _close(self, wait: float) -> None:
        self._on_completions()  # what completed before the close is delivered as usual
        # pool.close releases the GIL and waits at most `wait` (more only for an idle mapper,
        # which stops at once); run it off the loop thread so other tasks keep running.
        await asyncio.to_thread(self._pool.close, wait)
        self._loop.remove_reader(self._fd)
        # Completed during the close: their pages are gone, so they fail too.
        self._on_completions(closed=True)
        for request in list(self._pending):
            self._settle(request, AllocatorClosed("the allocator was closed"), None)

    async def __aenter__(self) -> Allocator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals --------------------------------------------------------------------------

    def _limit_pages(self, memory_limit: int | None) -> int:
        if memory_limit is None:
            return self._num_pages
        pages = memory_limit // self._page_bytes
        if pages < 1:
            raise ValueError(
                f"memory_limit {memory_limit} is below one page "
                f"({self._page_bytes} bytes across {self._layout.num_ranges} ranges)"
            )
        return min(pages, self._num_pages)

    @staticmethod
    def _check_timeout(timeout: float) -> float:
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout >= 0):
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        return float(timeout)

    def _deadline(self, timeout: float | None, deadline: float | None) -> float:
        if timeout is not None and deadline is not None:
            raise ValueError("give either timeout or deadline, not both")
        if deadline is not None:
            if not (isinstance(deadline, (int, float)) and math.isfinite(deadline)):
                raise ValueError(f"deadline must be a finite loop.time() value, got {deadline!r}")
            return float(deadline)
        wait = self._config.default_timeout if timeout is None else self._check_timeout(timeout)
        return self._loop.time() + wait

    async def _wait(self, request: int, due: float, what: str) -> list[int]:
        loop = self._loop
        if asyncio.get_running_loop() is not loop:
            self._pool.cancel(request, False)
            raise RuntimeError(
                "this allocator belongs to the event loop that opened it; open one allocator per "
                "loop (with pytest-asyncio, give the fixture and the tests the same loop scope)"
            )
        future: asyncio.Future[list[int]] = loop.create_future()
        timer = loop.call_at(due, self._on_deadline, request)
        self._pending[request] = _Pending(future, timer, what, loop.time())
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(request, future)
            raise

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
        waiting_for = self._pool.cancel(request, True)
        waited = self._loop.time() - pending.started
        if waiting_for:
            detail = f"waiting for {waiting_for}"
        else:  # not a waiter for blocks (a trim or resize), or its completion is on its way
            stats = self._pool.stats()
            op, age = stats["mapper_op"], stats["mapper_op_age_s"]
            detail = f"the mapper busy on {op} for {age:.3f} s" if op else "the mapper idle"
        self._settle(
            request, AllocTimeout(f"{pending.what} timed out after {waited:.3f} s, {detail}"), None
        )

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
        for request, status, blocks, message in self._pool.drain():
            pending = request in self._pending
            if blocks and (closed or not pending):
                # Nobody will use them: the request was abandoned (timed out or cancelled), or
                # its pages went with the close.
                self._pool.free(blocks)
                status, message = _CLOSED, "the allocator was closed"
            if not pending:
                continue
            if status == _OK:
                self._settle(request, None, blocks)
            elif status == _MAP_ERROR:
                self._settle(request, MapError(message), None)
            elif status == _OUT_OF_BLOCKS:
                self._settle(request, OutOfBlocks(message), None)
            else:
                self._settle(request, AllocatorClosed(message or "the allocator was closed"), None)

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
        if self._kernel_table is None:
            from . import kernels  # type: ignore[attr-defined]

            self._kernel_table = kernels.block_table(self._buffers)
        return self._kernel_table


def _none_missing(ids: list[int]) -> list[int]:
    return []


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
        ValueError: the layout and config do not fit together.
        KVAsyncError: the backend cannot be used here.
    """
    allocator = await Allocator.open(layout, config)
    try:
        yield allocator
    finally:
        await allocator.close()
