"""The parent's side: a pool of worker processes whose replies are read with deadlines, and a
run of one variant (every engine's trace started at one moment; the share's ledger and the GPU
sampled meanwhile)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _colocate_many.shapes import LEDGER_SAMPLE_S, READY_TIMEOUT_S, Regime
from _colocate_many.traces import TraceRequest

# The command line the workers run, with --worker (worker.run_worker).
SCRIPT = Path(__file__).resolve().parent.parent / "bench_colocate_many.py"


class Worker:
    """One worker process, its replies read by a thread into a queue (read with deadlines)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.started = False  # its first "ready" (imports done) was read
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with contextlib.suppress(json.JSONDecodeError):  # a stray print: not a reply
                self.replies.put(json.loads(line))
        self.replies.put(None)

    def send(self, **command: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def expect(self, key: str, timeout: float) -> dict[str, Any]:
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"worker {self.index}: no {key!r} within {timeout:.0f} s") from None
        if reply is None:
            raise RuntimeError(f"worker {self.index} exited ({self.process.wait(5)})")
        if key not in reply:
            raise RuntimeError(f"worker {self.index}: {reply.get('error', reply)}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send(op="quit")
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


# (seconds since start, [(member, committed, used, waiters, blocked, limit bytes)])
LedgerSample = tuple[float, list[tuple[str, int, int, int, int, int]]]


class LedgerWatch:
    """Samples the share's ledger in a thread (``LedgerSample``s)."""

    def __init__(self, share: str, start_wall: float) -> None:
        self.share = share
        self.start_wall = start_wall
        self.samples: list[LedgerSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kvasync import share as ledger

        while not self._stop.wait(LEDGER_SAMPLE_S):
            try:
                entries = ledger.snapshot(self.share, timeout=1.0)
            except Exception:  # the ledger is gone (the run ended) or its lock was busy
                continue
            self.samples.append(
                (
                    time.time() - self.start_wall,
                    [
                        (
                            e.name,
                            e.committed_bytes,
                            e.used_bytes,
                            e.waiters,
                            e.blocked,
                            e.limit_bytes,
                        )
                        for e in entries
                    ],
                )
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class GpuBusy:
    """Samples the GPU's utilization (NVML: the share of time a kernel ran) in a thread, when
    NVML is there; samples nothing otherwise."""

    def __init__(self, start_wall: float, device: str) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._start = start_wall
        self._thread: threading.Thread | None = None
        if device != "cuda":
            return
        try:
            import pynvml  # type: ignore[import-not-found, unused-ignore]

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            return

        def run() -> None:
            while not self._stop.wait(0.1):
                busy = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                self.samples.append((time.time() - self._start, float(busy)))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@dataclass
class EngineRun:
    """One engine's side of a run, parsed from its worker's result."""

    name: str
    records: list[Any]
    memory: list[tuple[float, int]]
    waiting: list[tuple[float, int]]
    running: list[tuple[float, int]]
    held_for: list[tuple[float, int]]  # what the waiting requests waited for (HELD_CODES)
    steps: list[tuple[float, float, int, int]]
    duration: float
    extra: dict[str, float]
    limit_bytes: int | None  # the static split; None when shared


@dataclass
class VariantRun:
    variant: str
    engines: list[EngineRun]
    ledger: list[LedgerSample]
    gpu_busy: list[tuple[float, float]]


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workers: list[Worker] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-colocate-many-"))
        self.runs = 0

    def pool(self, count: int) -> list[Worker]:
        while len(self.workers) < count:
            self.workers.append(Worker(len(self.workers)))
        for worker in self.workers:
            if not worker.started:
                worker.expect("ready", READY_TIMEOUT_S)
                worker.started = True
        return self.workers[:count]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()

    def base_config(self, max_batch: int, max_batch_tokens: int, **changes: Any) -> dict[str, Any]:
        config: dict[str, Any] = {
            "preset": self.args.preset,
            "device": self.args.device,
            "max_blocks": 1 << 17 if self.args.preset == "small" else 1 << 14,
            "max_batch": max_batch,
            "max_batch_tokens": max_batch_tokens,
            "request_timeout": 600.0,  # the client gives up first (give_up_s)
        }
        config.update(changes)
        return config

    def calibrate(
        self,
        regime: Regime,
        bursts: list[tuple[int, int, int]],
        stream: list[TraceRequest] | None = None,
    ) -> dict[str, Any]:
        (worker, *_) = self.pool(1)
        out = self.tmp / "calibration.json"
        config = self.base_config(regime.max_batch, regime.max_batch_tokens, name="calibration")
        stream_path = None
        if stream is not None:
            stream_path = self.tmp / "calibration_stream.json"
            stream_path.write_text(json.dumps([dataclasses.astuple(r) for r in stream]))
        worker.send(
            op="calibrate",
            config=config,
            bursts=bursts,
            stream=None if stream_path is None else str(stream_path),
            out=str(out),
        )
        worker.expect("done", 600)
        result: dict[str, Any] = json.loads(out.read_text())
        return result

    def calibrate_together(
        self,
        regime: Regime,
        bursts: list[list[tuple[int, int, int]]],
        streams: list[list[TraceRequest]] | None = None,
    ) -> list[dict[str, Any]]:
        """Bursts on several engines at once (one list of bursts per engine), then each engine's
        stream (one per engine, where given), all started at the same moment."""
        workers = self.pool(len(bursts))
        outs = []
        for index, (worker, mine) in enumerate(zip(workers, bursts, strict=True)):
            out = self.tmp / f"calibration_{index}.json"
            outs.append(out)
            config = self.base_config(
                regime.max_batch, regime.max_batch_tokens, name=f"calibration{index}"
            )
            stream_path = None
            if streams is not None:
                stream_path = self.tmp / f"calibration_stream_{index}.json"
                stream_path.write_text(json.dumps([dataclasses.astuple(r) for r in streams[index]]))
            worker.send(
                op="calibrate",
                config=config,
                bursts=mine,
                stream=None if stream_path is None else str(stream_path),
                together=True,
                out=str(out),
            )
        for worker in workers:
            worker.expect("ready", READY_TIMEOUT_S)
        start_at = time.time() + 0.5
        for worker in workers:
            worker.send(op="go", start_at=start_at)
        for worker in workers:
            worker.expect("done", 600)
        return [json.loads(out.read_text()) for out in outs]

    def run(
        self,
        variant: str,
        traces: list[list[TraceRequest]],
        configs: list[dict[str, Any]],
        share: str | None,
        give_up_s: float,
        horizon_s: float,
        duration: float,
    ) -> VariantRun:
        self.runs += 1
        workers = self.pool(len(traces))
        outs = []
        for index, (worker, trace, config) in enumerate(zip(workers, traces, configs, strict=True)):
            trace_path = self.tmp / f"trace_{self.runs}_{index}.json"
            trace_path.write_text(json.dumps([dataclasses.astuple(r) for r in trace]))
            out = self.tmp / f"run_{self.runs}_{index}.json"
            outs.append(out)
            worker.send(
                op="run",
                name=f"{variant} e{index}",
                engine=index,
                seed=self.args.seed,
                config=config,
                trace=str(trace_path),
                give_up_s=give_up_s,
                horizon_s=horizon_s,
                duration=duration,
                out=str(out),
            )
        for worker in workers:
            worker.expect("ready", READY_TIMEOUT_S)
        start_at = time.time() + 0.5
        watch = LedgerWatch(share, start_at) if share is not None else None
        busy = GpuBusy(start_at, self.args.device)
        for worker in workers:
            worker.send(op="go", start_at=start_at)
        try:
            for worker in workers:
                worker.expect("done", duration + horizon_s + 120)
        finally:
            if watch is not None:
                watch.stop()
            busy.stop()
        from kvasync.serve import RequestRecord

        engines = []
        for out, config in zip(outs, configs, strict=True):
            data = json.loads(out.read_text())
            engines.append(
                EngineRun(
                    name=data["name"],
                    records=[RequestRecord(**r) for r in data["records"]],
                    memory=[(float(t), int(b)) for t, b in data["memory"]],
                    waiting=[(float(t), int(n)) for t, n in data["waiting"]],
                    running=[(float(t), int(n)) for t, n in data["running"]],
                    held_for=[(float(t), int(n)) for t, n in data["held for"]],
                    steps=[(float(t), float(d), int(b), int(k)) for t, d, b, k in data["steps"]],
                    duration=data["duration"],
                    extra=data["extra"],
                    limit_bytes=None if share is not None else config.get("memory_limit"),
                )
            )
        return VariantRun(variant, engines, watch.samples if watch else [], busy.samples)
