"""One engine in a worker process (``bench_colocate_many.py --worker``): calibration bursts and
streams, and the replay of a trace, as the parent's JSON lines on stdin say."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from _colocate_many.shapes import HELD_CODES, SAMPLE_S
from _colocate_many.traces import TraceRequest, prompt_text


def record_to_json(record: Any, start: float) -> dict[str, object]:
    data = dataclasses.asdict(record)
    for key in ("arrival", "first_token", "finish"):
        if data[key] is not None:
            data[key] -= start
    return data


class StepLog:
    """Times every step of an engine: wraps its runner's ``execute`` (the forward pass and the
    sampling, synchronous, run in the engine's step thread) so the measured step is the real one.
    """

    def __init__(self, engine: Any) -> None:
        self.start = time.monotonic()
        self.steps: list[tuple[float, float, int, int]] = []  # (start, seconds, batch, new tok)
        execute = engine.runner.execute

        def timed(tokens: Any, starts: Any, tables: Any, sampling: Any) -> Any:
            begin = time.monotonic()
            result = execute(tokens, starts, tables, sampling)
            new = sum(len(t) - s for t, s in zip(tokens, starts, strict=True))
            self.steps.append((begin - self.start, time.monotonic() - begin, len(tokens), new))
            return result

        engine.runner.execute = timed


def engine_config(spec: dict[str, Any]) -> Any:
    from kvasync.serve import EngineConfig

    return EngineConfig(**spec["config"])


async def _read_command() -> dict[str, Any]:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if not line:
        raise SystemExit(0)  # the parent is gone
    command: dict[str, Any] = json.loads(line)
    return command


def _reply(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def calibrate(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine. Bursts: per (batch, prompt tokens, output tokens), the median decode step time
    (steps that were all decode at that batch) and the prefill rate. With ``together``, the
    engine says ready and starts its bursts at the parent's go, at the same moment as the other
    engines' (the step time co-located). Stream: a trace replayed at its rate on the engine
    alone; its requests' lifetimes and the KV it held once steady (the second half)."""
    from kvasync.serve import Engine

    engine = await Engine.open(engine_config(spec))
    async with engine:
        await engine.complete("warm up", max_tokens=2)
        if spec.get("together"):
            _reply(ready=True)
            go = await _read_command()
            await asyncio.sleep(max(0.0, go["start_at"] - time.time()))
        log = StepLog(engine)
        results: dict[str, Any] = {"bursts": []}
        for batch, prompt_tokens, output in spec["bursts"]:
            first = len(log.steps)
            prompts = [prompt_text(99, 0, i, prompt_tokens) for i in range(batch)]
            await asyncio.wait_for(
                asyncio.gather(*(engine.complete(p, max_tokens=output) for p in prompts)), 300
            )
            decode = [s for _, s, b, new in log.steps[first:] if b == batch and new == batch]
            # Steps that were mostly prefill (new tokens >= 2x the batch): their tokens/s.
            prefill = [(s, new) for _, s, b, new in log.steps[first:] if new >= 2 * b]
            prefill_s = sum(s for s, _ in prefill)
            results["bursts"].append(
                {
                    "batch": batch,
                    "prompt_tokens": prompt_tokens,
                    "step_s": float(np.median(decode)) if decode else float("nan"),
                    "decode_steps": len(decode),
                    "prefill_tok_s": (
                        sum(n for _, n in prefill) / prefill_s if prefill_s > 0 else float("nan")
                    ),
                }
            )
        if spec.get("stream"):
            trace = [TraceRequest(*r) for r in json.loads(Path(spec["stream"]).read_text())]
            results["stream"] = await _stream(engine, log, trace)
        return results


async def _stream(engine: Any, log: StepLog, trace: list[TraceRequest]) -> dict[str, Any]:
    """A trace replayed at its rate on the engine: its requests' lifetimes, the KV it held once
    steady (the second half), its steps. A trace of no request measures nothing: a cold
    engine's, at a low rate over a short calibration, may have none (the parent says so)."""
    from kvasync.serve._report import MemorySampler

    if not trace:
        return {"requests": 0, "most_running": 0}
    kv = engine.kv
    start = time.monotonic()
    log.start, first_step = start, len(log.steps)

    async def one(index: int, request: TraceRequest) -> tuple[float, float, float]:
        await asyncio.sleep(max(0.0, start + request.arrival - time.monotonic()))
        prompt = prompt_text(98, 0, index, request.prompt_tokens)
        record = (await engine.complete(prompt, max_tokens=request.max_tokens)).record
        assert record is not None and record.first_token is not None
        tpot = record.tpot or 0.0
        # KV is held from admission (about a step before the first token) to the end;
        # the wait in the queue before it holds none.
        return record.ttft or 0.0, record.finish - record.first_token + tpot, tpot

    with MemorySampler(lambda: kv.stats().used_blocks, SAMPLE_S) as used:
        used.start = start
        lives = await asyncio.wait_for(
            asyncio.gather(*(one(i, r) for i, r in enumerate(trace))), 300
        )
    end = trace[-1].arrival
    steady = [n for t, n in used.samples if end / 2 <= t <= end]
    return {
        "mean_used_blocks": float(np.mean(steady)) if steady else 0.0,
        "mean_ttft_s": float(np.mean([t for t, _, _ in lives])),
        "mean_kv_life_s": float(np.mean([k for _, k, _ in lives])),
        "mean_tpot_s": float(np.mean([p for _, _, p in lives])),
        "most_running": max((b for _, _, b, _ in log.steps[first_step:]), default=0),
        "requests": len(trace),
        # The steps once steady: prefills and decodes mixed, as in the runs.
        "steady_step_s": float(
            np.mean([d for t, d, _, _ in log.steps[first_step:] if end / 2 <= t <= end] or [np.nan])
        ),
    }


async def replay(spec: dict[str, Any]) -> dict[str, Any]:
    """Opens the engine, says ready, replays the trace from the start time the parent sends."""
    from kvasync.serve import Engine, RequestFailed, RequestTooLarge
    from kvasync.serve._report import MemorySampler

    trace = [TraceRequest(*r) for r in json.loads(Path(spec["trace"]).read_text())]
    engine = await Engine.open(engine_config(spec))
    async with engine:
        await engine.complete("warm up", max_tokens=2)  # first step's lazy inits, off the clock
        prompts = [
            prompt_text(spec["seed"], spec["engine"], i, r.prompt_tokens)
            for i, r in enumerate(trace)
        ]
        _reply(ready=True)
        go = await _read_command()
        await asyncio.sleep(max(0.0, go["start_at"] - time.time()))
        start = time.monotonic()
        log = StepLog(engine)
        log.start = start
        kv, scheduler = engine.kv, engine.scheduler
        give_up = spec["give_up_s"]
        counts = {"refused": 0, "gave up": 0}

        async def one(index: int, request: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, start + request.arrival - time.monotonic()))
            stream = engine.generate(prompts[index], max_tokens=request.max_tokens)
            try:
                async with asyncio.timeout(give_up):
                    await anext(stream, None)
                async for _ in stream:
                    pass
            except RequestTooLarge:  # refused at submit: no record
                counts["refused"] += 1
            except RequestFailed:  # recorded by the engine (its deadline, ...)
                pass
            except TimeoutError:  # no token within give_up: the client leaves (recorded)
                counts["gave up"] += 1
            finally:
                await stream.aclose()

        memory = MemorySampler(lambda: kv.stats().mapped_bytes, SAMPLE_S)
        waiting = MemorySampler(lambda: len(scheduler.waiting), SAMPLE_S)
        running = MemorySampler(lambda: len(scheduler.running), SAMPLE_S)
        # What the waiting requests wait for (Scheduler.held_for), as a code (HELD_CODES).
        held = MemorySampler(lambda: HELD_CODES.get(scheduler.held_for or "", 0), SAMPLE_S)
        for sampler in (memory, waiting, running, held):
            sampler.start = start
        with memory, waiting, running, held:
            tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(trace)]
            # A run ends at its SLO horizon: the last arrival plus the TTFT SLO plus the longest
            # output at the TPOT SLO, the latest any request within both SLOs can finish. What
            # is unfinished then is cut (recorded as abandoned; it had missed the SLO already),
            # so that a slow drain or a stall costs a bounded time.
            _, late = await asyncio.wait(tasks, timeout=spec["duration"] + spec["horizon_s"])
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=30)
        duration = time.monotonic() - start
        stats = engine.stats()
        records = [r for r in engine.records() if r.arrival >= start]
        return {
            "name": spec["name"],
            "duration": duration,
            "memory": memory.samples,
            "waiting": waiting.samples,
            "running": running.samples,
            "held for": held.samples,
            "steps": log.steps,
            "records": [record_to_json(r, start) for r in records],
            "extra": {
                "moved blocks": stats.moved_blocks,
                "refused": counts["refused"],
                "gave up": counts["gave up"],
                "cut": len(late),
            },
        }


def run_worker() -> None:
    """A worker process: one engine at a time, as the parent's JSON lines say (stdin)."""
    import kvasync.serve  # noqa: F401  (imported before saying ready: torch's start-up)

    _reply(ready=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            return
        try:
            if command["op"] == "calibrate":
                result = asyncio.run(calibrate(command))
            else:
                result = asyncio.run(replay(command))
            Path(command["out"]).write_text(json.dumps(result))
            _reply(done=True)
        except Exception as error:  # the parent fails the run with it
            _reply(error=f"{type(error).__name__}: {error}")
