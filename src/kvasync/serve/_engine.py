"""The serving engine: continuous batching over a paged KV cache that kvasync allocates.

The engine is three parts, after vLLM's: the scheduler decides (_scheduler.py: admit, grow,
preempt, vacate a drain, over plain request state and the allocator's view), the runner computes
(_runner.py: the forward pass and sampling, in a worker thread), and this module's ``Engine`` is
the thin async loop that ties them: it asks the scheduler, performs the allocs, frees and copies
with the allocator, calls the runner and delivers the tokens.

The loop and its policy are Note [Engine scheduling], in _scheduler.py.

Note [Blocks under a running step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A request can end while a step that writes into its blocks runs in the worker thread (its caller
went away, its deadline passed, or the engine closes). Its blocks are then freed only when the
step is done, and close waits for the step before it closes the allocator: freed pages may be
unmapped at once, and a write into an unmapped page faults.

Aborting: a request ends when its caller stops waiting for it. Closing ``generate``'s iterator,
or cancelling the task that awaits ``generate`` or ``complete``, fails the request with
EngineClosed ("abandoned") and frees its blocks at once (after the running step, if it is in
it): an HTTP server cancels a non-streaming request's ``complete`` when its client disconnects.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import contextlib
import itertools
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch

from .._allocator import Allocator
from .._errors import AllocTimeout, KVAsyncError, OutOfBlocks
from .._layout import KVLayout
from ._config import AllocatorView, EngineConfig, kv_config, map_everything
from ._errors import DeadlineExceeded, EngineClosed, RequestFailed
from ._model import Transformer
from ._records import Completion, EngineStats, RequestRecord
from ._runner import ModelRunner, SamplingParams
from ._scheduler import Request, Scheduler

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "ModelRunner",
    "RequestRecord",
    "open_engine",
]

_IDLE_WAIT_S = 0.05  # how long an idle engine sleeps between deadline checks
_STREAM_GRACE_S = 5.0  # past its deadline, a reader stops waiting for the loop to fail it


@dataclass(eq=False)
class _Request(Request):
    """A request as the engine holds it: the scheduler's state, plus how it samples, where its
    tokens go, and the alloc of the blocks it grows into."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    events: asyncio.Queue[int | BaseException | None] = field(default_factory=asyncio.Queue)
    grow: asyncio.Task[list[int]] | None = None
    first_token: float | None = None
    record: RequestRecord | None = None


class Engine:
    """A continuous-batching engine over kvasync (see Note [Engine scheduling]).

    Open it with ``open_engine(config)`` (an async context manager) or ``await Engine.open``,
    inside a running loop; submit with ``generate`` (streams text) or ``complete``.
    """

    def __init__(self, config: EngineConfig, model: Transformer, kv: Allocator) -> None:
        self.config = config
        self.model = model
        self.kv = kv
        use_kernel = config.attention == "triton" or (
            config.attention == "auto" and model.device.type == "cuda"
        )
        self.runner = ModelRunner(model, kv, use_kernel)
        self._loop = asyncio.get_running_loop()
        self.scheduler: Scheduler[_Request] = Scheduler(
            AllocatorView(kv, config),
            block_size=model.config.block_size,
            max_batch=config.max_batch,
            max_batch_tokens=config.max_batch_tokens,
            # How long a grow waits before the youngest is preempted (Note [Engine scheduling]).
            patience=config.share_wait if config.share is not None else config.alloc_timeout,
            release=self._release,
            step_target=config.step_target,
            compute_min_batch=config.compute_min_batch,
        )
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._closed = False
        self.error: Exception | None = None  # what stopped the engine's loop, if anything
        self._records: list[RequestRecord] = []
        self._counts = {"finished": 0, "failed": 0, "steps": 0, "moved_blocks": 0}
        self._on_cuda = model.device.type == "cuda"
        self._token_counts = {"prompt": 0, "output": 0}
        # One worker thread runs the steps in order; the loop stays free for HTTP meanwhile.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvasync-step")
        self._step_future: concurrent.futures.Future[list[int | Exception]] | None = None
        self._deferred_frees: list[int] = []
        self._task = asyncio.ensure_future(self._run())

    @classmethod
    async def open(cls, config: EngineConfig | None = None) -> Engine:
        """Builds the model, opens its KV cache and starts the engine's task.

        Args:
            config: settings; ``EngineConfig()`` when None.

        Returns:
            The running engine; ``await engine.close()`` stops it.

        Raises:
            ValueError: settings that do not fit together.
            KVAsyncError: the KV cache cannot be opened here.
            AllocTimeout: a static engine's cache was not mapped within its timeout.
        """
        config = config or EngineConfig()
        device = config.resolved_device()
        dtype = config.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model = Transformer(config.model, device, dtype)
        layout = KVLayout(
            num_layers=config.model.num_layers,
            num_kv_heads=config.model.num_kv_heads,
            head_dim=config.model.head_dim,
            block_size=config.model.block_size,
            dtype=dtype,
        )
        kv = await Allocator.open(layout, kv_config(config, layout, device))
        try:
            if config.static:
                await map_everything(kv)
            return cls(config, model, kv)  # refused (no Triton for the kernel): kv closes
        except BaseException:
            await kv.close()
            raise

    # -- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str,
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerator[str, None]:
        """Submits a request and yields its output text as it is produced.

        Closing the iterator early (or cancelling the consumer) aborts the request.

        Args:
            prompt: the prompt; its UTF-8 bytes are the tokens.
            max_tokens: tokens to generate (the output length).
            temperature: 0 = greedy; otherwise sampling (within ``TEMPERATURE_RANGE``, 1e-3 to
                100), seeded by ``seed``.
            seed: the sampler's seed, an int in [0, 2**63).
            timeout: seconds until the request's deadline; ``request_timeout`` when None.

        Yields:
            Pieces of the output text.

        Raises:
            ValueError: an empty prompt, one too long for the model, or bad numbers.
            RequestTooLarge: prompt + max_tokens can never fit the KV cache (a ValueError too).
            DeadlineExceeded: the deadline passed first.
            RequestFailed: the request cannot be served (its KV can never fit, ...).
            EngineClosed: the engine closed first.
        """
        request = self._submit(prompt, max_tokens, temperature, seed, timeout)
        async for piece in self._stream(request):
            yield piece

    async def complete(
        self,
        prompt: str,
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        timeout: float | None = None,
    ) -> Completion:
        """Submits a request and waits for all of its output (``generate``'s arguments).

        Cancelling the task that awaits it aborts the request: its blocks are freed and no
        further token is computed for it (an HTTP server does so when the client has left).

        Raises:
            ValueError: an empty prompt, one too long for the model, or bad numbers.
            RequestTooLarge: prompt + max_tokens can never fit the KV cache (a ValueError too).
            DeadlineExceeded: the deadline passed first.
            RequestFailed: the request cannot be served (its KV can never fit, ...).
            EngineClosed: the engine closed first.
        """
        request = self._submit(prompt, max_tokens, temperature, seed, timeout)
        text = "".join([piece async for piece in self._stream(request)])
        record = request.record
        assert record is not None, "bug: a request's stream ended before its record was written"
        return Completion(text, record.prompt_tokens, record.output_tokens, "length", record)

    def records(self) -> list[RequestRecord]:
        """Every request that ended so far, in the order they ended."""
        return list(self._records)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters and its KV cache."""
        kv = self.kv.stats()
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            finished=self._counts["finished"],
            failed=self._counts["failed"],
            preemptions=self.scheduler.preemptions,
            moved_blocks=self._counts["moved_blocks"],
            steps=self._counts["steps"],
            prompt_tokens=self._token_counts["prompt"],
            output_tokens=self._token_counts["output"],
            kv_used_blocks=kv.used_blocks,
            kv_mapped_bytes=kv.mapped_bytes,
        )

    # -- lifetime ---------------------------------------------------------------------------

    async def close(self, *, timeout: float = 10.0) -> None:
        """Fails every unfinished request with EngineClosed and closes the KV cache.

        Args:
            timeout: seconds to wait for the running step and for the allocator's close.
        """
        if self._closed:
            return
        self._closed = True
        self._task.cancel()
        await asyncio.wait([self._task], timeout=timeout)
        step = self._step_future
        if step is not None and not step.done():
            # NOTE: the step's thread still writes into blocks: the pages stay mapped until it
            # is done (Note [Blocks under a running step]).
            await asyncio.to_thread(concurrent.futures.wait, [step], timeout)
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self._finish(request, EngineClosed("the engine was closed"))
        self._executor.shutdown(wait=False, cancel_futures=True)
        await self.kv.close(timeout=timeout)

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the loop (Note [Engine scheduling]) ------------------------------------------------

    async def _stream(self, request: _Request) -> AsyncGenerator[str, None]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            while True:
                # The engine's loop fails a request at its deadline; this bound holds even if
                # the loop is gone.
                # NOTE: asyncio.timeout, not wait_for: before Python 3.12, wait_for returns the
                # event that arrives as its task is cancelled and drops the cancellation, so a
                # request whose caller left would run on to its end (issue 18, defect 8).
                remaining = request.deadline - self._loop.time() + _STREAM_GRACE_S
                try:
                    async with asyncio.timeout(max(0.0, remaining)):
                        event = await request.events.get()
                except TimeoutError:
                    raise DeadlineExceeded(
                        f"request {request.request_id} got no output by its deadline"
                    ) from None
                if event is None:
                    tail = decoder.decode(b"", final=True)
                    if tail:
                        yield tail
                    return
                if isinstance(event, BaseException):
                    raise event
                text = decoder.decode(bytes((event,)))
                if text:
                    yield text
        finally:
            # Closed early or cancelled: the request's blocks go back now.
            self._finish(request, EngineClosed("the request was abandoned by its caller"))

    def _submit(
        self,
        prompt: str,
        max_tokens: int,
        temperature: float,
        seed: int | None,
        timeout: float | None,
    ) -> _Request:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt must be a non-empty str, got {prompt!r:.40}")
        tokens = list(prompt.encode())
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        limit = self.model.config.max_seq_len
        if len(tokens) + max_tokens > limit:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"max_seq_len of {limit}"
            )
        sampling = SamplingParams.of(temperature, seed, self.model.device)  # ValueError
        wait = self.config.request_timeout if timeout is None else timeout
        if not (isinstance(wait, (int, float)) and math.isfinite(wait) and wait > 0):
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if self._closed:
            raise EngineClosed("the engine is closed")
        request = _Request(
            request_id=next(self._ids),
            prompt=tokens,
            max_tokens=max_tokens,
            arrival=time.monotonic(),
            deadline=self._loop.time() + wait,
            sampling=sampling,
        )
        self.scheduler.add(request)  # RequestTooLarge: nothing queued
        self._wake.set()
        return request

    async def _run(self) -> None:
        try:
            await self._serve()
        except Exception as error:
            # A bug or a device error: every request ends with it rather than waiting, and the
            # engine stops taking requests (``error`` says why; /health reports it).
            self._closed = True
            for request in [*self.scheduler.running, *self.scheduler.waiting]:
                self._finish(request, RequestFailed(f"the engine stopped: {error!r}"))
            self.error = error

    async def _serve(self) -> None:
        while True:
            self._expire()
            await self._admit()
            if not self.scheduler.running:
                self._wake.clear()
                # A bounded sleep, then expire (asyncio.timeout keeps close()'s cancellation).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_IDLE_WAIT_S):
                        await self._wake.wait()
                continue
            await self._grow()
            if self.scheduler.running:
                await self._step()

    def _expire(self) -> None:
        for request, where in self.scheduler.expired(self._loop.time()):
            waited = time.monotonic() - request.arrival
            self._finish(
                request,
                DeadlineExceeded(
                    f"request {request.request_id} passed its deadline after {waited:.3f} s "
                    f"({where}, {len(request.output)}/{request.max_tokens} tokens done)"
                ),
            )

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

    async def _grow_alone(self, request: _Request, need: int) -> None:
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

    def _drop_grow(self, request: _Request) -> None:
        task, request.grow = request.grow, None
        request.grow_since = None
        if task is None:
            return
        if not task.done():
            task.cancel()  # cancelling an alloc leaks nothing (kvasync's contract)
        elif not task.cancelled() and task.exception() is None:
            self._free(task.result())

    def _release(self, request: _Request) -> None:
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

    async def _step(self) -> None:
        batch = self.scheduler.ready()
        if not batch:
            # Every running request waits for blocks: wait for the first (bounded by the
            # patience, after which _collect_grows preempts the youngest).
            growing = [r.grow for r in self.scheduler.running if r.grow is not None]
            if growing:
                # Not past any deadline either: _expire must fail that request on time.
                wait = self.scheduler.stall_wait(self._loop.time())
                await asyncio.wait(growing, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                self._collect_grows()
            return
        tokens = [r.tokens for r in batch]
        starts = [r.num_computed for r in batch]
        tables = [list(r.blocks) for r in batch]
        sampling = [r.sampling for r in batch]
        began = time.monotonic()
        step = self._executor.submit(self.runner.execute, tokens, starts, tables, sampling)
        self._step_future = step
        try:
            sampled = await self._step_result(step)
        finally:
            if step.done():
                self._step_future = None
                deferred, self._deferred_frees = self._deferred_frees, []
                if deferred:
                    self.kv.free(deferred)
        self._counts["steps"] += 1
        now = time.monotonic()
        self.scheduler.stepped(now - began)  # admission counts compute (step_target)
        for request, token, seq_tokens in zip(batch, sampled, tokens, strict=True):
            if request.done or request not in self.scheduler.running:
                continue  # expired, aborted or preempted during the step
            if isinstance(token, Exception):  # Note [Sampling failures]: this request alone
                self._finish(
                    request,
                    RequestFailed(
                        f"request {request.request_id}: sampling its next token failed: "
                        f"{type(token).__name__}: {token}"
                    ),
                )
                continue
            request.num_computed = len(seq_tokens)
            request.output.append(token)
            self._token_counts["output"] += 1
            if request.first_token is None:
                request.first_token = now
                self._token_counts["prompt"] += len(request.prompt)
            request.events.put_nowait(token)
            if len(request.output) >= request.max_tokens:
                self._finish(request, None)

    async def _step_result(
        self, step: concurrent.futures.Future[list[int | Exception]]
    ) -> list[int | Exception]:
        """Waits for ``step`` and fails each request whose deadline passes meanwhile, at its
        deadline (Note [Engine scheduling], 1): a step can take far longer than usual (loaded
        cores, a slow device), and a request ends by its deadline all the same. Its blocks are
        freed when the step is done (Note [Blocks under a running step])."""
        result = asyncio.wrap_future(step)
        try:
            while not result.done():
                waiting = (*self.scheduler.running, *self.scheduler.waiting)
                due = min((r.deadline for r in waiting), default=None)
                wait = None if due is None else max(0.0, due - self._loop.time())
                # NOTE: asyncio.wait, not wait_for: a timeout leaves the step's future alone.
                if not (await asyncio.wait([result], timeout=wait))[0]:
                    self._expire()
        finally:
            result.cancel()  # only when cancelled itself (close): as awaiting it would
        return result.result()

    def _finish(self, request: _Request, error: BaseException | None) -> None:
        if request.done:
            return
        request.done = True
        self.scheduler.remove(request)
        self._drop_grow(request)
        if request.blocks:
            self._free(request.blocks)
            self.scheduler.unpause()
        request.blocks = []
        self._counts["failed" if error else "finished"] += 1
        request.record = RequestRecord(
            request_id=request.request_id,
            arrival=request.arrival,
            first_token=request.first_token,
            finish=time.monotonic(),
            prompt_tokens=len(request.prompt),
            output_tokens=len(request.output),
            preemptions=request.preemptions,
            error=None if error is None else f"{type(error).__name__}: {error}",
        )
        self._records.append(request.record)
        request.events.put_nowait(error)


def _failure(request: _Request, need: int, error: KVAsyncError) -> RequestFailed:
    if isinstance(error, OutOfBlocks):
        return RequestFailed(
            f"request {request.request_id} needs {need} more KV blocks, more than the cache can "
            f"ever hold ({error}); shorten it or raise the memory limit"
        )
    return RequestFailed(f"request {request.request_id} failed: {type(error).__name__}: {error}")


@asynccontextmanager
async def open_engine(config: EngineConfig | None = None) -> AsyncIterator[Engine]:
    """Opens an engine for an ``async with`` block, then closes it.

    Args:
        config: settings; ``EngineConfig()`` when None.

    Yields:
        The running engine.
    """
    engine = await Engine.open(config)
    try:
        yield engine
    finally:
        await engine.close()
