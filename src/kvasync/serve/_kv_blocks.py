"""The engine's KV blocks: every alloc, free and move of blocks that the scheduler decides.

The scheduler (_scheduler.py) decides who is admitted, grows, is preempted or vacates a drain;
``KVBlocks``, which ``Engine`` (_engine.py) is built on, performs it with the allocator: the
admissions' and the grows' allocs, the blocks of a preempted or finished request given back
(after the running step: Note [Blocks under a running step] in _engine.py), and the moves out of
the pages the allocator drains. The loop that calls these is Note [Engine scheduling].
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field

import torch

from .._allocator import Allocator
from .._errors import AllocTimeout, KVAsyncError, OutOfBlocks
from ._config import EngineConfig
from ._errors import RequestFailed
from ._model import Transformer
from ._records import RequestRecord
from ._runner import SamplingParams
from ._scheduler import Request, Scheduler

__all__ = ["EngineRequest", "KVBlocks"]


@dataclass(eq=False)
class EngineRequest(Request):
    """A request as the engine holds it: the scheduler's state, plus how it samples, where its
    tokens go, and the alloc of the blocks it grows into."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    events: asyncio.Queue[int | BaseException | None] = field(default_factory=asyncio.Queue)
    grow: asyncio.Task[list[int]] | None = None
    first_token: float | None = None
    record: RequestRecord | None = None


class KVBlocks:
    """The allocator's side of the engine's loop; ``Engine`` sets the state it reads."""

    config: EngineConfig
    model: Transformer
    kv: Allocator
    scheduler: Scheduler[EngineRequest]
    _loop: asyncio.AbstractEventLoop
    _counts: dict[str, int]
    _on_cuda: bool
    _step_future: concurrent.futures.Future[list[int | Exception]] | None
    _deferred_frees: list[int]

    def _finish(self, request: EngineRequest, error: BaseException | None) -> None:
        raise NotImplementedError  # the engine's: it ends the request and writes its record

    async def _admit(self) -> None:
        scheduler = self.scheduler
        while (admission := scheduler.next_admission(self._loop.time())) is not None:
            request, need = admission.request, admission.need
            try:
                # Alone, a request may wait up to its deadline: nothing else would run.
                if admission.alone:
                    blocks = await self.kv.alloc(need, deadline=scheduler.deadline_for(request))
                else:
                    blocks = await self.kv.alloc(need, timeout=self.config.alloc_timeout)
            except AllocTimeout:
                if scheduler.running:
                    scheduler.pause(self._loop.time())
                return  # alone: _expire fails whoever's deadline passed, then it retries
            except KVAsyncError as error:  # OutOfBlocks, MapError, AllocatorClosed
                self._finish(request, _failure(request, need, error))
                continue
            if not scheduler.admitted(request, blocks):
                # Aborted by its caller (or the engine closed) while the alloc waited.
                self._free(blocks)

    async def _grow(self) -> None:
        await self._vacate_draining()
        plan = self.scheduler.plan_growth(self._loop.time())
        for request, need in plan.grows:
            request.grow = asyncio.ensure_future(self.kv.alloc(need, deadline=request.deadline))
        if plan.too_large is not None:
            request, need = plan.too_large
            error = OutOfBlocks(f"the cache holds {self.scheduler.view.capacity_blocks()} blocks")
            self._finish(request, _failure(request, need, error))
        elif plan.alone is not None:
            await self._grow_alone(*plan.alone)
        if any(r.grow is not None for r in self.scheduler.running):
            # An alloc that finds its blocks free completes in its task's first step.
            await asyncio.sleep(0)
            self._collect_grows()

    async def _grow_alone(self, request: EngineRequest, need: int) -> None:
        # Nothing else would run: wait here, up to the earliest deadline (then _expire).
        try:
            blocks = await self.kv.alloc(need, deadline=self.scheduler.deadline_for(request))
        except AllocTimeout:
            return  # _expire fails it at its deadline
        except KVAsyncError as error:  # OutOfBlocks: it can never fit; MapError, closed
            self._finish(request, _failure(request, need, error))
            return
        if request in self.scheduler.running:
            request.blocks.extend(blocks)
        else:  # expired or aborted while its alloc waited
            self._free(blocks)

    def _collect_grows(self) -> None:
        """Takes the blocks of the grows that completed; preempts the youngest request when one
        has waited past the patience (Note [Engine scheduling])."""
        scheduler = self.scheduler
        now = self._loop.time()
        overdue = False
        for request in list(scheduler.running):
            task = request.grow
            if task is None:
                continue
            if not task.done():
                overdue = overdue or scheduler.overdue(request, now)
                continue
            request.grow = None
            request.grow_since = None
            error = task.exception()
            if error is None:
                scheduler.grown(request, task.result())
            elif isinstance(error, AllocTimeout):
                pass  # its deadline passed: _expire fails it
            elif isinstance(error, OutOfBlocks) and scheduler.make_room() is not None:
                pass  # it fits alone: the youngest made room
            elif isinstance(error, KVAsyncError):  # can never fit alone, MapError, closed
                need = scheduler.blocks_needed(request)
                self._finish(request, _failure(request, need, error))
            else:  # a bug: fail the request with it rather than ask again forever
                self._finish(
                    request, RequestFailed(f"growing request {request.request_id}: {error!r}")
                )
        if overdue:
            scheduler.make_room()

    async def _vacate_draining(self) -> None:
        """Moves the running requests' blocks out of the pages the allocator drains (the drain of
        Note [Limit policy] in kvasync's page pool), preempting the youngest holders only while the
        blocks to move do not fit below the drain. A request alone whose blocks cannot fit is
        preempted too: requeued, it is readmitted when memory allows, or fails with RequestFailed if
        the lowered limit can never hold it."""
        drain = self.scheduler.draining()
        if drain is None:
            return
        # Grows are asked again after the move: a waiting one holds blocks back from it. Its
        # cancellation reaches the allocator when the task runs, so wait for that first.
        growing = [r.grow for r in self.scheduler.running if r.grow is not None]
        for request in self.scheduler.running:
            self._drop_grow(request)
        if growing:
            await asyncio.wait(growing, timeout=self.scheduler.patience)
        plan = self.scheduler.plan_vacate(drain)
        if not plan.holders:
            return
        try:
            targets = self.kv.alloc_nowait(plan.count)
        except KVAsyncError:  # WouldBlock: pages still on their way; the next step tries again
            return
        sources, destinations = plan.assign(targets)
        self.kv.copy(sources, destinations)  # every layer's K and V, one launch
        if self._on_cuda:
            # NOTE: wait for the copy (no step runs now; it is one launch): the sources may then
            # be unmapped at once, and so may the destinations if their request is preempted
            # or aborted before the next step (a free() without a fence, as everywhere here).
            torch.cuda.current_stream(self.model.device).synchronize()
        self._counts["moved_blocks"] += len(sources)
        self.kv.free(sources)

    def _drop_grow(self, request: EngineRequest) -> None:
        task, request.grow = request.grow, None
        request.grow_since = None
        if task is None:
            return
        if not task.done():
            task.cancel()  # cancelling an alloc leaks nothing (kvasync's contract)
        elif not task.cancelled() and task.exception() is None:
            self._free(task.result())

    def _release(self, request: EngineRequest) -> None:
        """The scheduler preempts ``request``: its pending alloc and its blocks go back."""
        self._drop_grow(request)
        self._free(request.blocks)

    def _free(self, blocks: list[int]) -> None:
        # NOTE: no free(after=stream) on cuda: a step ends by copying its sampled tokens to the
        # host, so the device work that used the blocks is complete when the step is.
        if self._step_future is not None:
            self._deferred_frees.extend(blocks)  # the running step may still write into them
        else:
            self.kv.free(blocks)


def _failure(request: EngineRequest, need: int, error: KVAsyncError) -> RequestFailed:
    if isinstance(error, OutOfBlocks):
        return RequestFailed(
            f"request {request.request_id} needs {need} more KV blocks, more than the cache can "
            f"ever hold ({error}); shorten it or raise the memory limit"
        )
    return RequestFailed(f"request {request.request_id} failed: {type(error).__name__}: {error}")
