"""Measuring a serving run: KV memory over time, latency percentiles and other figures, a plot.

Used by ``kvasync demo`` and bench/bench_serving.py; not imported by ``kvasync.serve``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._stats import percentile
from ._records import RequestRecord

__all__ = ["MemorySampler", "RunResult", "plot_runs", "summarize"]

MIB = 1 << 20


class MemorySampler:
    """Samples ``(seconds since start, bytes)`` of a probe at an interval, in a task.

    Args:
        probe: returns the bytes to record (e.g. ``lambda: kv.stats().mapped_bytes``).
        interval: seconds between samples.
    """

    def __init__(self, probe: Callable[[], int], interval: float = 0.02) -> None:
        self._probe = probe
        self._interval = interval
        self.start = time.monotonic()
        self.samples: list[tuple[float, int]] = []
        self._task: asyncio.Task[None] | None = None

    def __enter__(self) -> MemorySampler:
        self._task = asyncio.ensure_future(self._sample())
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self.samples.append((time.monotonic() - self.start, self._probe()))

    async def _sample(self) -> None:
        while True:
            self.samples.append((time.monotonic() - self.start, self._probe()))
            await asyncio.sleep(self._interval)


@dataclass
class RunResult:
    """One variant's run: its requests' records and its memory samples."""

    name: str
    records: list[RequestRecord]
    samples: list[tuple[float, int]]
    start: float  # time.monotonic() of the run's start (the samples' zero)
    duration: float
    extra: dict[str, float] = field(default_factory=dict)


def summarize(run: RunResult, slo_ttft: float | None = None) -> dict[str, float]:
    """Throughput, latency percentiles (ms), preemptions and memory (MiB) of a run."""
    done = [r for r in run.records if r.error is None]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [r.tpot for r in done if r.tpot is not None]
    memory = [b for _, b in run.samples] or [0]
    times = [t for t, _ in run.samples] or [0.0]
    # Memory held over time: the time-weighted mean of the samples.
    mean_memory = (
        float(np.trapezoid(memory, times) / (times[-1] - times[0]))
        if len(times) > 1
        else float(memory[0])
    )
    summary = {
        "requests done": float(len(done)),
        "requests failed": float(len(run.records) - len(done)),
        "output tok/s": sum(r.output_tokens for r in done) / run.duration,
        "TTFT p50 ms": 1e3 * percentile(ttft, 50),
        "TTFT p99 ms": 1e3 * percentile(ttft, 99),
        "TPOT p50 ms": 1e3 * percentile(tpot, 50),
        "TPOT p99 ms": 1e3 * percentile(tpot, 99),
        "preemptions": float(sum(r.preemptions for r in run.records)),
        "KV peak MiB": max(memory) / MIB,
        "KV mean MiB": mean_memory / MIB,
    }
    if slo_ttft is not None:
        summary["within SLO"] = float(sum(1 for t in ttft if t <= slo_ttft))
    summary.update(run.extra)
    return summary


def plot_runs(runs: Sequence[RunResult], path: Path, title: str) -> Path:
    """Writes a PNG: KV memory held over time (top) and latency per request (bottom), per run.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory_ax, ttft_ax, tpot_ax) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for run in runs:
        times = [t for t, _ in run.samples]
        # Baselines dashed: a static pool's flat line would hide an elastic one beneath it.
        style = "--" if "static" in run.name else "-"
        memory_ax.step(
            times, [b / MIB for _, b in run.samples], style, where="post", label=run.name
        )
        done = [r for r in run.records if r.ttft is not None]
        firsts = [(r.first_token or 0.0) - run.start for r in done]
        ttft_ax.plot(firsts, [1e3 * (r.ttft or 0.0) for r in done], ".", label=run.name)
        timed = [r for r in done if r.tpot is not None]
        tpot_ax.plot(
            [r.finish - run.start for r in timed],
            [1e3 * (r.tpot or 0.0) for r in timed],
            ".",
            label=run.name,
        )
    memory_ax.set_ylabel("KV memory held (MiB)")
    ttft_ax.set_ylabel("TTFT (ms)")
    tpot_ax.set_ylabel("time per output token (ms)")
    tpot_ax.set_xlabel("seconds since start (TTFT at each first token, TPOT at each finish)")
    for ax in (memory_ax, ttft_ax, tpot_ax):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    memory_ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
