"""The serving engine: continuous batching over a paged KV cache that kvasync allocates.

The engine is three parts, after vLLM's: the scheduler decides (_scheduler.py: admit, grow,
preempt, vacate a drain, over plain request state and the allocator's view), the runner computes
(_runner.py: the forward pass and sampling, in a worker thread), and this module's ``Engine`` is
the thin async loop that ties them: it asks the scheduler, performs the allocs, frees and copies
with the allocator (its base, ``KVBlocks`` in _kv_blocks.py), calls the runner and delivers the
tokens.

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

import torch

from .._allocator import Allocator
from .._layout import KVLayout
from ._config import AllocatorView, EngineConfig, kv_config, map_everything
from ._errors import DeadlineExceeded, EngineClosed, RequestFailed
from ._kv_blocks import EngineRequest, KVBlocks
from ._model import Transformer
from ._records import Completion, EngineStats, RequestRecord
from ._runner import ModelRunner, SamplingParams
from ._scheduler import Scheduler

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


class Engine(KVBlocks):
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
        self.scheduler: Scheduler[EngineRequest] = Scheduler(
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

    async def _stream(self, request: EngineRequest) -> AsyncGenerator[str, None]:
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
    ) -> EngineRequest:
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
        request = EngineRequest(
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

    def _finish(self, request: EngineRequest, error: BaseException | None) -> None:
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
