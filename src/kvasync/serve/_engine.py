"""The serving engine: continuous batching over a paged KV cache that kvasync allocates.

Note [Engine scheduling]
~~~~~~~~~~~~~~~~~~~~~~~~
One asyncio task runs the engine, step after step:

1. Expire: a request whose deadline passed (waiting or running) fails with DeadlineExceeded and
   its blocks are freed. No request waits past its deadline.
2. Admit waiting requests, oldest first, while the batch has room (``max_batch`` requests,
   ``max_batch_tokens`` new tokens): each gets the blocks for its tokens with ``await kv.alloc``.
   With other requests running, the alloc waits at most ``alloc_timeout`` (pages being mapped
   arrive in well under that), so that a full cache stalls the running batch at most that long;
   on a timeout admission pauses until blocks are freed. With nothing running it waits up to the
   earliest deadline of the waiting requests (then expires them and tries again): there is
   nothing else to do.
3. Vacate: when the allocator drains pages (``kv.drain_from()``: a memory limit lowered below
   what is mapped, or in a share the fair share while another engine waits for memory), the
   running requests' blocks in those pages are moved below the drain (new blocks, one
   ``kv.copy`` of every layer's K and V, the old blocks freed), so that the pages go back within
   a step rather than when the requests holding them end. Decode growth lands on the highest
   pages, so nearly every long request holds a block there: preempting the holders would throw
   away most of the batch's work (measured on the H200: 288 preemptions, TTFT p99 20 s), moving
   them costs one copy. Only while the blocks to move do not fit below the drain are the
   youngest holders preempted.
4. Grow: a running request about to cross into a new block asks for it with ``kv.alloc`` in a
   task of its own, with its deadline. Found free, the blocks arrive before the step; otherwise
   the request sits out steps while the others go on, until its blocks arrive (mapped, freed, or
   given back by another engine of the share). When the allocator says it cannot fit
   (``kv.available_blocks()`` is too few, an alloc raises OutOfBlocks, or a grow has waited
   longer than its patience: ``alloc_timeout``, or ``share_wait`` in a share, where memory comes
   back from the other engines), the engine preempts the youngest running request: it frees its
   blocks and puts it back in the queue, to be recomputed from its prompt and the tokens it
   already produced (recompute preemption). While any grow waits, nothing is admitted. A request
   alone that cannot grow waits as an admission does; one that can never fit fails with
   RequestFailed.
5. Step: one forward pass over the new tokens of every running request that has its blocks
   (prefill and decode in one batch), run in a worker thread so the loop keeps serving HTTP. Each
   request then gets its next token. When every running request waits for blocks, the loop
   waits (bounded by the patience) for the first of them instead.

Blocks under a running step: a request can end while a step that writes into its blocks runs in
the worker thread (its caller went away, or the engine closes). Its blocks are then freed only
when the step is done, and close waits for the step before it closes the allocator: freed pages
may be unmapped at once, and a write into an unmapped page faults.

A request's KV covers ``tokens[:num_computed]``; a step computes ``tokens[num_computed:]`` (the
prompt, or after a preemption prompt + output, or just the last token) and needs
``ceil(len(tokens) / block_size)`` blocks.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .._allocator import Allocator
from .._config import Config
from .._errors import AllocTimeout, KVAsyncError, OutOfBlocks
from .._layout import KVLayout
from ._attention import PagedBatch, attend_paged
from ._errors import DeadlineExceeded, EngineClosed, RequestFailed
from ._model import ModelConfig, Transformer, preset

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "ModelRunner",
    "RequestRecord",
    "open_engine",
]

# Sampled tokens are printable ASCII and newline, so that outputs read as text; the logits (and
# the correctness test) cover all 256 byte values.
_SAMPLEABLE = [10, *range(32, 127)]
_IDLE_WAIT_S = 0.05  # how long an idle engine sleeps between deadline checks
_STREAM_GRACE_S = 5.0  # past its deadline, a reader stops waiting for the loop to fail it


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine.

    Args:
        preset: the model (``"tiny"`` or ``"small"``).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda when available).
        dtype: the model's and the cache's dtype; fp32 on a CPU, bf16 on a GPU when None.
        backend: the kvasync backend (``"auto"``, ``"host"``, ``"cuda"``).
        max_blocks: the KV cache's virtual capacity in blocks.
        memory_limit: bytes of KV memory it may map; None = the whole capacity.
        page_size: kvasync's unit of mapping; 64 KiB on host, 2 MiB on cuda when None.
        reserve_pages: kvasync's reserve watermarks (mapped-free pages kept ready).
        static: map the whole capacity (or memory_limit) at start and never give it back: the
            baseline of an engine without an elastic allocator.
        max_batch: requests running at once.
        max_batch_tokens: new tokens one step computes at most (prefill budget).
        alloc_timeout: how long an admission's alloc may stall the running batch, and how long a
            request waits for a block to grow into before the youngest is preempted (see Note
            [Engine scheduling]).
        share_wait: in a share, how long a request waits for a block to grow into (memory the
            other engines give back) before the youngest is preempted.
        request_timeout: a request's deadline, in seconds after submission, when it gives none.
        attention: ``"triton"``, ``"torch"`` or ``"auto"`` (triton on a GPU).
        share: kvasync device share to join (co-located engines); None = none.
        device_budget: bytes the share's allocators may map together.
        name: this engine's name (in the share's ledger and in metrics).

    Raises:
        ValueError: a value out of range.
    """

    preset: str = "tiny"
    device: str = "auto"
    dtype: torch.dtype | None = None
    backend: str = "auto"
    max_blocks: int = 2048
    memory_limit: int | None = None
    page_size: int | None = None
    reserve_pages: tuple[int, int] = (1, 4)
    static: bool = False
    max_batch: int = 64
    max_batch_tokens: int = 4096
    alloc_timeout: float = 0.05
    share_wait: float = 0.5
    request_timeout: float = 60.0
    attention: str = "auto"
    share: str | None = None
    device_budget: int | None = None
    name: str = "kvasync-engine"

    def __post_init__(self) -> None:
        preset(self.preset)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"EngineConfig.device must be auto, cpu or cuda, got {self.device!r}")
        if self.attention not in ("auto", "triton", "torch"):
            raise ValueError(
                f"EngineConfig.attention must be auto, triton or torch, got {self.attention!r}"
            )
        for name in ("max_blocks", "max_batch", "max_batch_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        for name in ("alloc_timeout", "share_wait", "request_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"EngineConfig.{name} must be positive seconds, got {value!r}")

    @property
    def model(self) -> ModelConfig:
        """The model's shape."""
        return preset(self.preset)

    def resolved_device(self) -> torch.device:
        """The torch device the model runs on."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass(frozen=True)
class RequestRecord:
    """One finished (or failed) request, for benchmarks: times are ``time.monotonic()``."""

    request_id: int
    arrival: float
    first_token: float | None
    finish: float
    prompt_tokens: int
    output_tokens: int
    preemptions: int
    error: str | None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Completion:
    """The result of ``Engine.complete``."""

    text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    record: RequestRecord


@dataclass(frozen=True)
class EngineStats:
    """Counters and gauges of an engine (``kv`` is the allocator's snapshot)."""

    running: int
    waiting: int
    finished: int
    failed: int
    preemptions: int
    moved_blocks: int  # blocks moved out of pages the allocator drained (Note [Drain])
    steps: int
    prompt_tokens: int
    output_tokens: int
    kv_used_blocks: int
    kv_mapped_bytes: int


@dataclass
class _Request:
    request_id: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    generator: torch.Generator | None
    arrival: float  # time.monotonic()
    deadline: float  # loop.time()
    events: asyncio.Queue[int | BaseException | None]
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    first_token: float | None = None
    preemptions: int = 0
    grow: asyncio.Task[list[int]] | None = None  # the alloc of the blocks it grows into
    grow_since: float = 0.0  # loop.time() when that alloc was asked for
    done: bool = False
    record: RequestRecord | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class ModelRunner:
    """Runs the model over requests' paged KV: the piece the correctness test drives directly.

    Args:
        model: the transformer.
        kv: the allocator whose blocks hold the K/V.
        use_kernel: attend with the Triton kernel (else the torch reference).
    """

    def __init__(self, model: Transformer, kv: Allocator, use_kernel: bool) -> None:
        self.model = model
        self.kv = kv
        self.use_kernel = use_kernel
        self._layers = [kv.layer(i) for i in range(model.config.num_layers)]

    def step(
        self, tokens: list[list[int]], starts: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """Computes positions ``starts[s]..`` of each sequence, writing their K/V into blocks.

        Args:
            tokens: each sequence's tokens so far (its KV covers ``tokens[s][:starts[s]]``).
            starts: tokens of each sequence already in the cache.
            tables: each sequence's block ids, in order, enough for all its tokens.

        Returns:
            ``[T, 256]`` logits of every computed position, sequence after sequence.
        """
        device = self.model.device
        ends = [len(t) for t in tokens]
        batch = PagedBatch.build(tables, starts, ends, self.model.config.block_size, device)
        new = [t for seq, start in zip(tokens, starts, strict=True) for t in seq[start:]]
        token_tensor = torch.tensor(new, dtype=torch.int64).to(device, non_blocking=True)
        positions = batch.query_positions.long()

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attend_paged(q, k, v, self._layers[layer], batch, self.use_kernel)

        return self.model.forward(token_tensor, positions, attend)


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
        self._block_size = model.config.block_size
        self._loop = asyncio.get_running_loop()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._admit_paused = False  # an admission alloc timed out: wait for blocks to be freed
        self._admit_paused_at = 0.0
        # How long a grow waits before the youngest is preempted (Note [Engine scheduling]).
        self._patience = config.share_wait if config.share is not None else config.alloc_timeout
        self._closed = False
        self.error: Exception | None = None  # what stopped the engine's loop, if anything
        self._records: list[RequestRecord] = []
        self._counts = {
            "finished": 0,
            "failed": 0,
            "preemptions": 0,
            "steps": 0,
            "moved_blocks": 0,
        }
        self._on_cuda = model.device.type == "cuda"
        self._token_counts = {"prompt": 0, "output": 0}
        mask = torch.full((256,), float("-inf"))
        mask[_SAMPLEABLE] = 0.0
        self._sample_mask = mask.to(model.device)
        # One worker thread runs the steps in order; the loop stays free for HTTP meanwhile.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvasync-step")
        self._step_future: concurrent.futures.Future[list[int]] | None = None
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
        kv = await Allocator.open(layout, _kv_config(config, layout, device))
        try:
            if config.static:
                await _map_everything(kv)
        except BaseException:
            await kv.close()
            raise
        return cls(config, model, kv)

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
            temperature: 0 = greedy; otherwise sampling, seeded by ``seed``.
            seed: the sampler's seed.
            timeout: seconds until the request's deadline; ``request_timeout`` when None.

        Yields:
            Pieces of the output text.

        Raises:
            ValueError: an empty prompt, one too long for the model, or bad numbers.
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

        Raises:
            The same as ``generate``.
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
            running=len(self._running),
            waiting=len(self._waiting),
            finished=self._counts["finished"],
            failed=self._counts["failed"],
            preemptions=self._counts["preemptions"],
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
            # is done (Note [Engine scheduling], "Blocks under a running step").
            await asyncio.to_thread(concurrent.futures.wait, [step], timeout)
        for request in [*self._running, *self._waiting]:
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
                remaining = request.deadline - self._loop.time() + _STREAM_GRACE_S
                try:
                    event = await asyncio.wait_for(request.events.get(), max(0.0, remaining))
                except asyncio.TimeoutError:
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
        if not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        wait = self.config.request_timeout if timeout is None else timeout
        if not (isinstance(wait, (int, float)) and math.isfinite(wait) and wait > 0):
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if self._closed:
            raise EngineClosed("the engine is closed")
        generator = None
        if temperature > 0:
            generator = torch.Generator(self.model.device)
            generator.manual_seed(seed if seed is not None else 0)
        request = _Request(
            request_id=next(self._ids),
            prompt=tokens,
            max_tokens=max_tokens,
            temperature=float(temperature),
            generator=generator,
            arrival=time.monotonic(),
            deadline=self._loop.time() + wait,
            events=asyncio.Queue(),
        )
        self._waiting.append(request)
        self._wake.set()
        return request

    async def _run(self) -> None:
        try:
            await self._serve()
        except Exception as error:
            # A bug or a device error: every request ends with it rather than waiting, and the
            # engine stops taking requests (``error`` says why; /health reports it).
            self._closed = True
            for request in [*self._running, *self._waiting]:
                self._finish(request, RequestFailed(f"the engine stopped: {error!r}"))
            self.error = error

    async def _serve(self) -> None:
        while True:
            self._expire()
            await self._admit()
            if not self._running:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):  # a bounded sleep, then expire
                    await asyncio.wait_for(self._wake.wait(), _IDLE_WAIT_S)
                continue
            await self._grow()
            if self._running:
                await self._step()

    def _expire(self) -> None:
        now = self._loop.time()
        for request in [r for r in (*self._waiting, *self._running) if r.deadline <= now]:
            where = "running" if request in self._running else "waiting for admission"
            waited = time.monotonic() - request.arrival
            self._finish(
                request,
                DeadlineExceeded(
                    f"request {request.request_id} passed its deadline after {waited:.3f} s "
                    f"({where}, {len(request.output)}/{request.max_tokens} tokens done)"
                ),
            )

    def _blocks_needed(self, request: _Request) -> int:
        return -(-len(request.tokens) // self._block_size) - len(request.blocks)

    async def _admit(self) -> None:
        budget = self.config.max_batch_tokens - sum(
            len(r.tokens) - r.num_computed for r in self._running
        )
        if self._admit_paused and self._loop.time() - self._admit_paused_at > self._patience:
            self._admit_paused = False  # in a share, memory can come back from another engine
        if any(r.grow is not None for r in self._running):
            return  # the running requests' growth first (Note [Engine scheduling])
        while (
            self._waiting and not self._admit_paused and len(self._running) < self.config.max_batch
        ):
            request = self._waiting[0]
            new_tokens = len(request.tokens) - request.num_computed
            if new_tokens > budget and self._running:
                return
            need = self._blocks_needed(request)
            if self._running and not self._fits(need):
                self._pause_admission()  # nothing frees blocks until a request ends
                return
            try:
                # Alone, a request may wait up to its deadline: nothing else would run.
                if self._running:
                    blocks = await self.kv.alloc(need, timeout=self.config.alloc_timeout)
                else:
                    blocks = await self.kv.alloc(need, deadline=self._next_deadline(request))
            except AllocTimeout:
                if self._running:
                    self._pause_admission()
                return  # alone: _expire fails whoever's deadline passed, then it retries
            except KVAsyncError as error:  # OutOfBlocks, MapError, AllocatorClosed
                self._finish(request, _failure(request, need, error))
                continue
            if request.done or not self._waiting or self._waiting[0] is not request:
                # Aborted by its caller (or the engine closed) while the alloc waited.
                self._free(blocks)
                continue
            self._waiting.popleft()
            request.blocks = blocks
            self._running.append(request)
            budget -= new_tokens

    def _pause_admission(self) -> None:
        self._admit_paused = True
        self._admit_paused_at = self._loop.time()

    def _next_deadline(self, request: _Request) -> float:
        """The earliest deadline of ``request`` and the waiting requests: a wait of the loop
        ends by then, so that _expire fails each request on time."""
        return min([request.deadline, *(r.deadline for r in self._waiting)])

    def _fits(self, need: int) -> bool:
        """Whether ``need`` blocks are free or could be mapped under the memory limit now."""
        return self.kv.available_blocks() >= need

    async def _grow(self) -> None:
        await self._vacate_draining()
        for request in list(self._running):  # oldest first: the youngest are preempted first
            while request in self._running and request.grow is None:
                need = self._blocks_needed(request)
                if need <= 0:
                    break
                if len(self._running) == 1:
                    await self._grow_alone(request, need)
                    break
                if not self._fits(need):
                    self._preempt(self._youngest())
                    continue
                request.grow = asyncio.ensure_future(self.kv.alloc(need, deadline=request.deadline))
                request.grow_since = self._loop.time()
        if any(r.grow is not None for r in self._running):
            # An alloc that finds its blocks free completes in its task's first step.
            await asyncio.sleep(0)
            self._collect_grows()

    async def _grow_alone(self, request: _Request, need: int) -> None:
        # Nothing else would run: wait here, up to the earliest deadline (then _expire).
        try:
            blocks = await self.kv.alloc(need, deadline=self._next_deadline(request))
        except AllocTimeout:
            return  # _expire fails it at its deadline
        except KVAsyncError as error:  # OutOfBlocks: it can never fit; MapError, closed
            self._finish(request, _failure(request, need, error))
            return
        if request in self._running:
            request.blocks.extend(blocks)
        else:  # expired or aborted while its alloc waited
            self._free(blocks)

    def _collect_grows(self) -> None:
        """Takes the blocks of the grows that completed; preempts the youngest request when one
        has waited past the patience (Note [Engine scheduling])."""
        now = self._loop.time()
        overdue = False
        for request in list(self._running):
            task = request.grow
            if task is None:
                continue
            if not task.done():
                overdue = overdue or now - request.grow_since > self._patience
                continue
            request.grow = None
            error = task.exception()
            if error is None:
                request.blocks.extend(task.result())
                self._admit_paused = False  # memory arrived
            elif isinstance(error, AllocTimeout):
                pass  # its deadline passed: _expire fails it
            elif isinstance(error, OutOfBlocks) and len(self._running) > 1:
                self._preempt(self._youngest())
            elif isinstance(error, KVAsyncError):  # can never fit alone, MapError, closed
                self._finish(request, _failure(request, self._blocks_needed(request), error))
            else:  # a bug: fail the request with it rather than ask again forever
                self._finish(
                    request, RequestFailed(f"growing request {request.request_id}: {error!r}")
                )
        if overdue and len(self._running) > 1:
            self._preempt(self._youngest())

    async def _vacate_draining(self) -> None:
        """Moves the running requests' blocks out of the pages the allocator drains (Note
        [Drain] of kvasync's page pool), preempting the youngest holders only while the blocks
        to move do not fit below the drain. A request alone whose blocks cannot fit is preempted
        too: requeued, it is readmitted when memory allows, or fails with RequestFailed if the
        lowered limit can never hold it."""
        drain = self.kv.drain_from()
        if drain is None or not any(r.blocks and max(r.blocks) >= drain for r in self._running):
            return  # nothing of ours there: the draining pages go back as they empty
        # Grows are asked again after the move: a waiting one holds blocks back from it. Its
        # cancellation reaches the allocator when the task runs, so wait for that first.
        growing = [r.grow for r in self._running if r.grow is not None]
        for request in self._running:
            self._drop_grow(request)
        if growing:
            await asyncio.wait(growing, timeout=self._patience)
        holders = sorted(
            (r for r in self._running if r.blocks and max(r.blocks) >= drain), key=_age_key
        )
        moving = sum(b >= drain for r in holders for b in r.blocks)
        room = self.kv.available_blocks()
        while holders and moving > room:
            victim = holders.pop()  # the youngest
            moving -= sum(b >= drain for b in victim.blocks)
            self._preempt(victim)
            room = self.kv.available_blocks()
        if not holders:
            return
        try:
            targets = iter(self.kv.alloc_nowait(moving))
        except KVAsyncError:  # WouldBlock: pages still on their way; the next step tries again
            return
        sources, destinations = [], []
        for request in holders:
            for index, block in enumerate(request.blocks):
                if block >= drain:
                    request.blocks[index] = next(targets)
                    sources.append(block)
                    destinations.append(request.blocks[index])
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
        if task is None:
            return
        if not task.done():
            task.cancel()  # cancelling an alloc leaks nothing (kvasync's contract)
        elif not task.cancelled() and task.exception() is None:
            self._free(task.result())

    def _free(self, blocks: list[int]) -> None:
        # NOTE: no free(after=stream) on cuda: a step ends by copying its sampled tokens to the
        # host, so the device work that used the blocks is complete when the step is.
        if self._step_future is not None:
            self._deferred_frees.extend(blocks)  # the running step may still write into them
        else:
            self.kv.free(blocks)

    def _youngest(self) -> _Request:
        return max(self._running, key=_age_key)

    def _preempt(self, victim: _Request) -> None:
        self._running.remove(victim)
        self._drop_grow(victim)
        self._free(victim.blocks)
        victim.blocks = []
        victim.num_computed = 0
        victim.preemptions += 1
        self._counts["preemptions"] += 1
        # Back in the queue in arrival order: it was admitted before anything still waiting.
        self._waiting.appendleft(victim)
        self._admit_paused = False

    async def _step(self) -> None:
        batch = [r for r in self._running if self._blocks_needed(r) <= 0]
        if not batch:
            # Every running request waits for blocks: wait for the first (bounded by the
            # patience, after which _collect_grows preempts the youngest).
            growing = [r.grow for r in self._running if r.grow is not None]
            if growing:
                # Not past any deadline either: _expire must fail that request on time.
                deadlines = [r.deadline for r in (*self._running, *self._waiting)]
                wait = min(self._patience, min(deadlines) - self._loop.time())
                await asyncio.wait(
                    growing, timeout=max(0.0, wait), return_when=asyncio.FIRST_COMPLETED
                )
                self._collect_grows()
            return
        tokens = [r.tokens for r in batch]
        starts = [r.num_computed for r in batch]
        tables = [list(r.blocks) for r in batch]
        step = self._executor.submit(self._compute, tokens, starts, tables, batch)
        self._step_future = step
        try:
            sampled = await asyncio.wrap_future(step)
        finally:
            if step.done():
                self._step_future = None
                deferred, self._deferred_frees = self._deferred_frees, []
                if deferred:
                    self.kv.free(deferred)
        self._counts["steps"] += 1
        now = time.monotonic()
        for request, token, seq_tokens in zip(batch, sampled, tokens, strict=True):
            if request.done or request not in self._running:
                continue  # expired, aborted or preempted during the step
            request.num_computed = len(seq_tokens)
            request.output.append(token)
            self._token_counts["output"] += 1
            if request.first_token is None:
                request.first_token = now
                self._token_counts["prompt"] += len(request.prompt)
            request.events.put_nowait(token)
            if len(request.output) >= request.max_tokens:
                self._finish(request, None)

    def _compute(
        self,
        tokens: list[list[int]],
        starts: list[int],
        tables: list[list[int]],
        batch: list[_Request],
    ) -> list[int]:
        logits = self.runner.step(tokens, starts, tables)
        ends = list(itertools.accumulate(len(t) - s for t, s in zip(tokens, starts, strict=True)))
        last = logits[torch.tensor([e - 1 for e in ends], device=logits.device)]
        last = last + self._sample_mask
        result = last.argmax(-1)
        for i, request in enumerate(batch):
            if request.temperature > 0:
                probs = torch.softmax(last[i] / request.temperature, -1)
                result[i] = torch.multinomial(probs, 1, generator=request.generator)[0]
        return [int(t) for t in result.tolist()]

    def _finish(self, request: _Request, error: BaseException | None) -> None:
        if request.done:
            return
        request.done = True
        if request in self._running:
            self._running.remove(request)
        elif request in self._waiting:
            self._waiting.remove(request)
        self._drop_grow(request)
        if request.blocks:
            self._free(request.blocks)
            self._admit_paused = False
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


def _age_key(request: _Request) -> tuple[float, int]:
    return (request.arrival, request.request_id)


def _failure(request: _Request, need: int, error: KVAsyncError) -> RequestFailed:
    if isinstance(error, OutOfBlocks):
        return RequestFailed(
            f"request {request.request_id} needs {need} more KV blocks, more than the cache can "
            f"ever hold ({error}); shorten it or raise the memory limit"
        )
    return RequestFailed(f"request {request.request_id} failed: {type(error).__name__}: {error}")


def _kv_config(config: EngineConfig, layout: KVLayout, device: torch.device) -> Config:
    backend = config.backend
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" else "host"
    page_size = config.page_size or ((2 << 20) if backend == "cuda" else (64 << 10))
    extra: dict[str, Any] = {}
    if config.share is not None:  # co-location (Config.share / device_budget)
        extra = {"share": config.share, "device_budget": config.device_budget, "name": config.name}
    kv_config = Config(
        backend=backend,
        max_blocks=config.max_blocks,
        memory_limit=config.memory_limit,
        page_size=page_size,
        reserve_pages=config.reserve_pages,
        default_timeout=max(5.0, config.alloc_timeout),
        device=(device.index or 0) if device.type == "cuda" else 0,
        **extra,
    )
    if config.static:
        # Map everything the engine may use, up front, and keep it: the reserve's watermarks at
        # the whole budget (so nothing is ever unmapped).
        per_page = layout.blocks_per_page(page_size)
        pages = -(-config.max_blocks // per_page)
        if config.memory_limit is not None:
            pages = min(pages, config.memory_limit // (page_size * layout.num_ranges))
        kv_config = replace(kv_config, reserve_pages=(pages, pages))
    return kv_config


async def _map_everything(kv: Allocator, timeout: float = 60.0) -> None:
    """Waits (at most ``timeout``) until a static engine's reserve holds its whole budget."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    target = kv.config.reserve_pages[0]
    while kv.stats().mapped_pages < target:
        if loop.time() > deadline:
            raise AllocTimeout(
                f"the static KV pool mapped {kv.stats().mapped_pages} of {target} pages in "
                f"{timeout} s"
            )
        await asyncio.sleep(0.005)


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
