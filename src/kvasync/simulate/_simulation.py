"""The simulation behind ``python -m kvasync simulate``: requests growing a KV cache (no model).

Note [Demo workload]
~~~~~~~~~~~~~~~~~~~~
Hundreds of concurrent requests each grow a KV cache block by block: a prefill allocates the
prompt's blocks at once and writes them in every layer, then every ``block_size`` decode steps the
request allocates one more block and writes a token into it, until its random target length; then
it checks that its blocks still hold what it wrote and frees them all. Admissions follow a slow
wave (many requests, then few, then many), so the allocator maps pages as the load rises and
unmaps them as it falls. The memory limit is below the peak demand: allocs wait for frees, and an
alloc that times out is retried, then the request is dropped (its blocks are freed, as a serving
engine preempts). Every wait is bounded: each alloc has a timeout, and at the overall time cap the
requests still running are cancelled (cancellation leaks nothing, Note [Futures and ownership]).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import click
import torch
from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from .._allocator import Allocator, open_allocator
from .._config import Config
from .._errors import AllocTimeout, KVAsyncError
from .._layout import KVLayout
from .._sizes import format_bytes
from .._stats import percentile
from ..cli import SIZE, deprecated_memory_limit_mib, memory_limit_of

__all__ = ["DemoOptions", "DemoReport", "format_report", "run_demo", "simulate_command"]

MIB = 1 << 20

# A small model: 4 layers, K and V, 16 tokens x 4 heads x 64 x fp16 = 8 KiB a block in each of the
# 8 buffers (64 KiB a block in all); 256 KiB pages hold 32 blocks, so a page id is 2 MiB.
DEMO_LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)
DEMO_PAGE_SIZE = 256 << 10

_ADMIT_INTERVAL_S = 0.005  # how often the admission loop looks for room
_WAVE_PERIOD_S = 6.0  # one rise and fall of the offered load
_SAMPLE_INTERVAL_S = 0.05  # stats sampling (peak mapped memory)
_CANCEL_GRACE_S = 2.0  # how long cancelled requests get to unwind at the cap


@dataclass(frozen=True)
class DemoOptions:
    """The knobs of the simulation.

    Args:
        requests: requests to serve in all.
        concurrency: requests in flight at most (the crest of the load wave).
        memory_limit: physical KV memory the allocator may map, in bytes.
        seconds: overall time cap; requests still running then are cancelled.
        alloc_timeout: seconds one alloc may wait.
        retries: restarts of a request preempted by an alloc timeout, before it is dropped.
        token_time_ms: one decode step, in milliseconds.
        max_prompt_blocks: prompts take 1 to this many blocks.
        max_decode_blocks: decoding adds 1 to this many blocks.
        overcommit: admission lets the final sizes of the running requests add up to this many
            times the memory limit (they hold less than that on average).
        seed: the random generator's seed.

    Raises:
        ValueError: a value out of range.
    """

    requests: int = 4000
    concurrency: int = 300
    memory_limit: int = 128 * MIB
    seconds: float = 20.0
    alloc_timeout: float = 0.5
    retries: int = 2
    token_time_ms: float = 4.0
    max_prompt_blocks: int = 4
    max_decode_blocks: int = 16
    overcommit: float = 1.7
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "concurrency", "memory_limit", "max_prompt_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.retries < 0 or self.max_decode_blocks < 1:
            raise ValueError("retries must be >= 0 and max_decode_blocks >= 1")
        for name in ("seconds", "alloc_timeout", "token_time_ms", "overcommit"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.limit_blocks < self.max_request_blocks:
            page_mib = DEMO_PAGE_SIZE * DEMO_LAYOUT.num_ranges / MIB
            raise ValueError(
                f"memory_limit {self.memory_limit} bytes ({format_bytes(self.memory_limit)}) "
                f"holds {self.limit_blocks} blocks ({page_mib:g} MiB pages of "
                f"{DEMO_LAYOUT.blocks_per_page(DEMO_PAGE_SIZE)}), fewer than one request's "
                f"{self.max_request_blocks}; raise it"
            )

    @property
    def max_request_blocks(self) -> int:
        """The most blocks one request can hold."""
        return self.max_prompt_blocks + self.max_decode_blocks

    @property
    def limit_blocks(self) -> int:
        """Blocks the memory limit holds: the allocator rounds it down to whole pages."""
        pages = self.memory_limit // (DEMO_PAGE_SIZE * DEMO_LAYOUT.num_ranges)
        return pages * DEMO_LAYOUT.blocks_per_page(DEMO_PAGE_SIZE)


@dataclass
class DemoReport:
    """What the demo measured. ``leaked_blocks`` and ``corrupt_blocks`` must be zero."""

    requests: int
    concurrency: int
    memory_limit: int  # bytes
    done: int = 0
    dropped: int = 0
    cut_off: int = 0
    not_started: int = 0
    timeouts: int = 0
    preemptions: int = 0
    blocks_allocated: int = 0
    blocks_verified: int = 0
    corrupt_blocks: int = 0
    alloc_ns: list[int] = field(default_factory=list)
    waited_allocs: int = 0
    maps: int = 0
    unmaps: int = 0
    peak_mapped_bytes: int = 0
    leaked_blocks: int = 0
    seconds: float = 0.0

    @property
    def blocks_per_s(self) -> float:
        """Blocks allocated per second of the run."""
        return self.blocks_allocated / self.seconds if self.seconds > 0 else 0.0

    def alloc_us(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of successful alloc latencies, in µs (0 when there were
        none): ``kvasync._stats.percentile``, as everywhere in kvasync."""
        if not self.alloc_ns:
            return 0.0
        return percentile(self.alloc_ns, q) / 1e3


class _Preempted(Exception):
    """An alloc timed out: the request frees its blocks and starts again (as vLLM preempts)."""


class _Dropped(Exception):
    """An alloc failed in a way a restart does not fix (OutOfBlocks, MapError)."""


class _Simulation:
    """One run: the allocator, the random source, the counters."""

    def __init__(
        self, kv: Allocator, options: DemoOptions, report: DemoReport, limit_blocks: int
    ) -> None:
        self.kv = kv
        self.limit_blocks = limit_blocks
        self.options = options
        self.report = report
        self.rng = random.Random(options.seed)
        self.in_flight = 0
        self.committed_blocks = 0  # prompt + decode blocks of the requests in flight
        self.started_requests = 0
        self.loop = asyncio.get_running_loop()
        self.started = self.loop.time()
        self.layers = [kv.layer(i) for i in range(kv.layout.num_layers)]

    # -- one request ------------------------------------------------------------------------

    async def serve(self, request: int, prompt: int, decode: int) -> None:
        """Runs a request to its end, preempting and restarting it when an alloc times out.

        Its admission counted it in ``in_flight`` and ``committed_blocks``; this takes it out.
        """
        try:
            for attempt in range(self.options.retries + 1):
                if attempt:
                    self.report.preemptions += 1
                    await self.wait_for_room(prompt + decode)
                try:
                    await self.serve_once(request, prompt, decode)
                except _Preempted:
                    continue
                self.report.done += 1
                return
            self.report.dropped += 1
        except _Dropped:
            self.report.dropped += 1
        finally:
            self.in_flight -= 1
            self.committed_blocks -= prompt + decode

    async def serve_once(self, request: int, prompt: int, decode: int) -> None:
        """Prefill, decode block by block, verify; frees the blocks however it ends."""
        blocks: list[int] = []
        signature = float(request % 2048 + 1)  # exact in fp16; distinct among those in flight
        step_s = self.kv.layout.block_size * self.options.token_time_ms / 1e3
        try:
            blocks += await self.grow(prompt)
            self.write_prefill(blocks, signature)
            for _ in range(decode):
                await asyncio.sleep(step_s)  # block_size decode steps fill the last block
                new = await self.grow(1)
                blocks += new
                self.write_token(request, new, signature)
            self.verify(request, blocks, signature)
        finally:
            if blocks:
                self.kv.free(blocks)

    async def grow(self, n: int) -> list[int]:
        """Allocates ``n`` blocks.

        Raises:
            _Preempted: the alloc timed out; the request gives its blocks back and restarts.
            _Dropped: the alloc failed in a way a restart does not fix.
        """
        start = time.perf_counter_ns()
        try:
            ids = await self.kv.alloc(n, timeout=self.options.alloc_timeout)
        except AllocTimeout as error:
            self.report.timeouts += 1
            raise _Preempted(str(error)) from error
        except KVAsyncError as error:  # OutOfBlocks, MapError
            raise _Dropped(str(error)) from error
        elapsed = time.perf_counter_ns() - start
        self.report.alloc_ns.append(elapsed)
        self.report.waited_allocs += elapsed > 50_000  # a hot alloc takes ~1 µs
        self.report.blocks_allocated += n
        return ids

    # -- the data ---------------------------------------------------------------------------

    def write_prefill(self, blocks: list[int], signature: float) -> None:
        """Fills the prompt's blocks in every layer: K with the signature, V with its negative."""
        index = torch.tensor(blocks, dtype=torch.long)
        for layer in self.layers:
            layer[0].index_fill_(0, index, signature)
            layer[-1].index_fill_(0, index, -signature)

    def write_token(self, request: int, blocks: list[int], signature: float) -> None:
        """Writes the first token of new decode blocks in the request's own layer."""
        layer = self.layers[request % len(self.layers)]
        for block in blocks:
            layer[0][block, 0] = signature
            layer[-1][block, 0] = -signature

    def verify(self, request: int, blocks: list[int], signature: float) -> None:
        """Checks that no other request wrote into this one's blocks."""
        layer = self.layers[request % len(self.layers)]
        index = torch.tensor(blocks, dtype=torch.long)
        keys = layer[0][index, 0, 0, 0]
        values = layer[-1][index, 0, 0, 0]
        good = (keys == signature) & (values == -signature)
        self.report.blocks_verified += len(blocks)
        self.report.corrupt_blocks += len(blocks) - int(good.sum().item())

    # -- admissions and progress ------------------------------------------------------------

    def target_in_flight(self) -> int:
        """The offered load now: a wave between a fifth of the concurrency and all of it."""
        phase = (self.loop.time() - self.started) / _WAVE_PERIOD_S
        share = 0.2 + 0.8 * (0.5 + 0.5 * math.cos(2 * math.pi * phase))
        return max(1, round(self.options.concurrency * share))

    def has_room(self, blocks: int) -> bool:
        """Admission control, as a serving engine does it, over-committing the memory limit.

        A request is admitted while nobody waits and the blocks the running requests will reach
        (prompt plus decode) stay within ``overcommit`` times the limit. Requests hold about
        two thirds of their final size on average, so the limit is tight: decode allocs wait for
        frees at the crest of the load, and some time out.
        """
        budget = self.options.overcommit * self.limit_blocks
        return self.committed_blocks + blocks <= budget and self.kv.stats().waiters == 0

    async def wait_for_room(self, blocks: int) -> None:
        """Waits until admission would let a preempted request in again, at most a few seconds.

        Restarting at once would put its prefill at the head of the allocator's FIFO, where it
        would hold up every decode behind it (Note [Waiters] in csrc/pool/page_pool.h).
        """
        give_up = self.loop.time() + 4 * self.options.alloc_timeout
        self.committed_blocks -= blocks
        try:
            while not self.has_room(blocks) and self.loop.time() < give_up:
                await asyncio.sleep(_ADMIT_INTERVAL_S)
        finally:
            self.committed_blocks += blocks

    async def admit_all(self, deadline: float, tasks: set[asyncio.Task[None]]) -> None:
        """Starts requests as the load wave and the memory allow, until all or the deadline."""
        options = self.options
        prompt = self.rng.randint(1, options.max_prompt_blocks)
        decode = self.rng.randint(1, options.max_decode_blocks)
        while self.started_requests < options.requests and self.loop.time() < deadline:
            while (
                self.started_requests < options.requests
                and self.in_flight < self.target_in_flight()
                and self.has_room(prompt + decode)
            ):
                self.in_flight += 1
                self.committed_blocks += prompt + decode
                task = asyncio.create_task(self.serve(self.started_requests, prompt, decode))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                self.started_requests += 1
                prompt = self.rng.randint(1, options.max_prompt_blocks)
                decode = self.rng.randint(1, options.max_decode_blocks)
            await asyncio.sleep(_ADMIT_INTERVAL_S)

    async def watch(self, progress: Progress | None) -> None:
        """Samples the peak mapped memory; updates the progress bar (5 Hz) when there is one."""
        task = None
        if progress is not None:
            task = progress.add_task("requests", total=self.options.requests, status="")
        every = 0.2
        next_update = self.loop.time() + every
        try:
            while True:
                await asyncio.sleep(_SAMPLE_INTERVAL_S)
                stats = self.kv.stats()
                peak = max(self.report.peak_mapped_bytes, stats.mapped_bytes)
                self.report.peak_mapped_bytes = peak
                if self.loop.time() >= next_update:
                    next_update += every
                    self.show(progress, task, stats.mapped_bytes, stats.waiters)
        finally:  # cancelled at the end: the bar shows the final figures
            stats = self.kv.stats()
            self.show(progress, task, stats.mapped_bytes, stats.waiters)

    def show(
        self, progress: Progress | None, task: TaskID | None, mapped: int, waiters: int
    ) -> None:
        if progress is not None and task is not None:
            ended = self.report.done + self.report.dropped
            progress.update(task, completed=ended, status=self.status(mapped, waiters))

    def status(self, mapped_bytes: int, waiters: int) -> str:
        """The progress bar's figures beside the requests ended."""
        r = self.report
        elapsed = self.loop.time() - self.started
        return (
            f"in flight {self.in_flight:4d}  done {r.done:5d}  "
            f"dropped {r.dropped:3d}  blocks/s {r.blocks_allocated / max(elapsed, 1e-9):7,.0f}  "
            f"mapped {mapped_bytes / MIB:5.0f}/{self.options.memory_limit / MIB:.0f} MiB  "
            f"waiting {waiters:3d}  timeouts {r.timeouts:3d}"
        )


def _progress(out: TextIO | None) -> Progress | None:
    """A rich progress bar on ``out`` (live on a terminal; elsewhere rich prints its last state
    when it stops), or None."""
    if out is None:
        return None
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        # Off a terminal rich assumes 80 columns, too few for the figures on one line.
        console=Console(file=out, width=None if out.isatty() else 200),
    )


async def run_demo(options: DemoOptions, out: TextIO | None = None) -> DemoReport:
    """Runs the serving simulation (Note [Demo workload]) on the host backend.

    Args:
        options: the workload.
        out: where the progress bar goes; None for none.

    Returns:
        The measured figures, with ``leaked_blocks`` taken after every request ended.

    Raises:
        KVAsyncError: the host backend cannot be used here.
    """
    per_page = DEMO_LAYOUT.blocks_per_page(DEMO_PAGE_SIZE)
    limit_blocks = options.limit_blocks
    config = Config(
        backend="host",
        max_blocks=max(2 * limit_blocks, 8 * per_page),
        memory_limit=options.memory_limit,
        page_size=DEMO_PAGE_SIZE,
        reserve_pages=(1, 4),
        default_timeout=max(2.0, options.alloc_timeout),
    )
    report = DemoReport(options.requests, options.concurrency, options.memory_limit)
    async with open_allocator(DEMO_LAYOUT, config) as kv:
        simulation = _Simulation(kv, options, report, limit_blocks)
        start = time.perf_counter()
        deadline = simulation.started + options.seconds
        tasks: set[asyncio.Task[None]] = set()
        progress = _progress(out)
        with progress if progress is not None else contextlib.nullcontext():
            watcher = asyncio.create_task(simulation.watch(progress))
            try:
                await simulation.admit_all(deadline, tasks)
                if tasks:
                    remaining = max(0.0, deadline - simulation.loop.time())
                    await asyncio.wait(set(tasks), timeout=remaining)
                await _cancel_all(tasks)
            finally:
                await _cancel_all({watcher, *tasks})
        report.seconds = time.perf_counter() - start
        report.cut_off = simulation.started_requests - report.done - report.dropped
        report.not_started = options.requests - simulation.started_requests
        stats = kv.stats()
        report.maps, report.unmaps = stats.maps_done, stats.unmaps_done
        report.peak_mapped_bytes = max(report.peak_mapped_bytes, stats.mapped_bytes)
        report.leaked_blocks = stats.used_blocks
    return report


async def _cancel_all(tasks: set[asyncio.Task[None]]) -> None:
    """Cancels the tasks and waits for them to unwind, at most ``_CANCEL_GRACE_S``."""
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=_CANCEL_GRACE_S)


def format_report(report: DemoReport) -> str:
    """The closing table, as Markdown (a rich table in its Markdown box)."""
    rows = [
        ("requests done", f"{report.done} of {report.requests}"),
        ("requests dropped (preempted too often)", f"{report.dropped}"),
        ("preemptions (alloc timed out: freed all, restarted)", f"{report.preemptions}"),
        (
            "requests cut off / not started at the time cap",
            f"{report.cut_off} / {report.not_started}",
        ),
        ("alloc timeouts", f"{report.timeouts}"),
        ("blocks allocated", f"{report.blocks_allocated:,}"),
        ("blocks allocated/s", f"{report.blocks_per_s:,.0f}"),
        ("alloc p50 / p99 (µs)", f"{report.alloc_us(50):,.1f} / {report.alloc_us(99):,.1f}"),
        ("allocs that waited (> 50 µs)", f"{report.waited_allocs:,} of {len(report.alloc_ns):,}"),
        ("pages mapped / unmapped", f"{report.maps} / {report.unmaps}"),
        (
            "peak mapped MiB (limit)",
            f"{report.peak_mapped_bytes / MIB:,.0f} ({report.memory_limit / MIB:,.0f})",
        ),
        ("blocks verified / corrupt", f"{report.blocks_verified:,} / {report.corrupt_blocks}"),
        ("leaked blocks", f"{report.leaked_blocks}"),
        ("wall time (s)", f"{report.seconds:.1f}"),
    ]
    table = Table(box=box.MARKDOWN)
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    with console.capture() as capture:
        console.print(table)
    # The Markdown box draws an empty bottom edge (not part of the table), and a rule with no
    # alignment: the value column's ends with ":" (right-justified).
    lines = [line.rstrip() for line in capture.get().splitlines() if line.strip()]
    lines[1] = lines[1][:-2] + ":|"
    return "\n".join(lines)


_DEFAULTS = DemoOptions()


@click.command(
    "simulate",
    help="Simulates an LLM server's KV cache on the host backend: concurrent requests grow their "
    "caches block by block under a memory limit; prints live progress, then a table. Exits 1 if a "
    "block leaked or was corrupted, 2 on a usage error or an unusable backend.",
)
@click.option(
    "--requests", type=int, default=_DEFAULTS.requests, show_default=True, help="Requests in all."
)
@click.option(
    "--concurrency",
    type=int,
    default=_DEFAULTS.concurrency,
    show_default=True,
    help="Requests in flight at most.",
)
@click.option(
    "--memory-limit",
    type=SIZE,
    default=None,
    help="Physical KV memory the allocator may map (64MiB, 1GiB, ...).  [default: "
    f"{_DEFAULTS.memory_limit // MIB}MiB]",
)
@deprecated_memory_limit_mib
@click.option(
    "--seconds", type=float, default=_DEFAULTS.seconds, show_default=True, help="Overall time cap."
)
@click.option(
    "--alloc-timeout",
    type=float,
    default=_DEFAULTS.alloc_timeout,
    show_default=True,
    help="Seconds one alloc may wait.",
)
@click.option(
    "--retries",
    type=int,
    default=_DEFAULTS.retries,
    show_default=True,
    help="Restarts of a preempted request.",
)
@click.option(
    "--token-time-ms",
    type=float,
    default=_DEFAULTS.token_time_ms,
    show_default=True,
    help="One decode step, in milliseconds.",
)
@click.option("--seed", type=int, default=_DEFAULTS.seed, show_default=True, help="Random seed.")
def simulate_command(
    requests: int,
    concurrency: int,
    memory_limit: int | None,
    memory_limit_mib: int | None,
    seconds: float,
    alloc_timeout: float,
    retries: int,
    token_time_ms: float,
    seed: int,
) -> None:
    limit = memory_limit_of(memory_limit, memory_limit_mib, "simulate")
    try:
        options = DemoOptions(
            requests=requests,
            concurrency=concurrency,
            memory_limit=_DEFAULTS.memory_limit if limit is None else limit,
            seconds=seconds,
            alloc_timeout=alloc_timeout,
            retries=retries,
            token_time_ms=token_time_ms,
            seed=seed,
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    click.echo(
        f"kvasync simulate: {options.requests} requests, up to {options.concurrency} in flight, "
        f"memory limit {format_bytes(options.memory_limit)}, host backend, "
        f"cap {options.seconds:g} s"
    )
    try:
        report = asyncio.run(run_demo(options, sys.stdout))
    except KVAsyncError as error:
        click.echo(f"kvasync simulate: {error}", err=True)
        raise SystemExit(2) from None
    click.echo(format_report(report))
    if report.leaked_blocks or report.corrupt_blocks:
        raise SystemExit(1)
