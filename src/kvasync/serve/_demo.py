"""``kvasync demo``: a burst of concurrent requests through the engine, with the tiny model.

Every request is a real one: its prompt's bytes are prefilled, its K/V written into blocks that
kvasync maps on demand, and each output token attends over them. The KV memory limit is below
what the burst needs at its peak, so the engine preempts (frees and requeues) the youngest
requests and the allocator maps and unmaps pages as the load rises and falls.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .._errors import KVAsyncError
from .._sizes import format_bytes
from ._engine import Engine, EngineConfig
from ._errors import RequestFailed
from ._report import MemorySampler, RunResult, plot_runs, summarize

__all__ = ["run_demo", "run_demo_command"]

_WORDS = ["the", "a", "paged", "cache", "block", "page", "maps", "memory", "token", "engine"]
_DEMO_TIMEOUT_S = 45.0  # every request's deadline; the whole burst ends well before
_WAVES = 3  # the burst arrives in waves, so memory rises and falls more than once
_WAVE_GAP_S = 0.8


def demo_prompts(count: int, seed: int) -> list[tuple[str, int]]:
    """``count`` (prompt, max_tokens) pairs of random lengths, the same for the same seed."""
    rng = random.Random(seed)
    return [
        (" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 40))), rng.randint(8, 48))
        for _ in range(count)
    ]


async def run_demo(
    requests: int, max_tokens: int, memory_limit: int, seed: int, console: Console
) -> RunResult:
    """Runs the burst (in waves); returns its measurements."""
    config = EngineConfig(
        preset="tiny",
        memory_limit=memory_limit,
        max_blocks=4096,
        request_timeout=_DEMO_TIMEOUT_S,
        name="demo",
    )
    if config.resolved_device().type == "cpu":
        # 16 blocks (256 tokens) a page: memory follows the load closely.
        config = replace(config, page_size=32 << 10)
    else:
        # cuda maps 2 MiB per buffer at least: one page id of the tiny model is 8 MiB.
        config = replace(config, memory_limit=max(config.memory_limit or 0, 8 << 20))
    prompts = [(p, min(n, max_tokens)) for p, n in demo_prompts(requests, seed)]
    engine = await Engine.open(config)
    async with engine:
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
        )
        start = time.monotonic()
        with progress, MemorySampler(lambda: engine.kv.stats().mapped_bytes) as sampler:
            task = progress.add_task("requests", total=len(prompts), status="")

            async def one(index: int, prompt: str, n: int) -> None:
                await asyncio.sleep(_WAVE_GAP_S * (index * _WAVES // len(prompts)))
                with contextlib.suppress(RequestFailed):  # counted in the records
                    await engine.complete(prompt, max_tokens=n)
                s = engine.stats()
                progress.update(
                    task,
                    advance=1,
                    # One space apart: the row fits 80 columns (a bar of a few cells there).
                    status=f"running {s.running:3d} waiting {s.waiting:3d} preempted "
                    f"{s.preemptions:3d} KV {s.kv_mapped_bytes / 2**20:5.2f} MiB",
                )

            await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(prompts)))
        duration = time.monotonic() - start
    name = f"kvasync elastic (tiny, {engine.model.device.type})"
    limit = {"KV memory limit MiB": (config.memory_limit or 0) / 2**20}
    return RunResult(name, engine.records(), sampler.samples, start, duration, limit)


def run_demo_command(
    requests: int, max_tokens: int, memory_limit: int, seed: int, plot: Path
) -> None:
    """The body of ``kvasync demo`` (see serve/_cli.py)."""
    console = Console()
    console.print(
        f"kvasync demo: {requests} requests in {_WAVES} waves, tiny model, KV memory limit "
        f"{format_bytes(memory_limit)}"
    )
    try:
        result = asyncio.run(run_demo(requests, max_tokens, memory_limit, seed, console))
    except (ValueError, KVAsyncError) as error:
        click.echo(f"kvasync demo: {error}", err=True)
        sys.exit(2)
    summary = summarize(result)
    table = Table(title="kvasync demo")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}")
    table.add_row("KV MiB held at the end", f"{result.samples[-1][1] / 2**20:.3g}")
    table.add_row("seconds", f"{result.duration:.2f}")
    console.print(table)
    path = plot_runs([result], plot, "kvasync demo: a burst of requests on the tiny model")
    console.print(f"plot written to {path.resolve()}")
    failed = [r for r in result.records if r.error]
    if failed:
        console.print(f"{len(failed)} request(s) failed, e.g. {failed[0].error}")
        sys.exit(1)
