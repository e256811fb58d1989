"""The engine side of bench/bench_sglang.py: one SGLang engine in its own process, doing one task.

The driver writes a spec (JSON) and runs ``bench_sglang.py --child SPEC``. The child imports
SGLang, says so, waits for its ``go`` file, builds an offline ``sglang.Engine`` (dummy weights
from a written Llama config, token-id prompts, no tokenizer), and runs its task, reporting
progress as JSON lines in its events file (``imported``, ``up``, ``round``, ``served``,
``released``, ``done``, ``error``): the driver holds a deadline on each (bench/_vllm_procs.py's
``Engine``), so an engine that hangs is reported as a hang, never waited out.

Tasks:
- ``prompts``: ``rounds`` rounds of one batch of prompts, greedy; each round's output ids, wall
  time and output tokens a second.
- ``trace``: timed arrivals, each request streamed (time to first token, time per output token);
  ``hold`` keeps serving a steady load instead, until the driver's ``stop`` file appears.
- ``release``: serve, ``release_memory_occupation(["kv_cache"])``, ``resume``, serve again.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _vllm_child import write_model_config


def _emit(spec: dict[str, Any], event: str, **fields: Any) -> None:
    record = {"event": event, "wall": time.time(), **fields}
    with open(spec["events"], "a") as out:
        out.write(json.dumps(record) + "\n")


def _wait_go(spec: dict[str, Any]) -> None:
    go = pathlib.Path(spec["go"])
    deadline = time.monotonic() + float(spec["go_within_s"])
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go within {spec['go_within_s']} s")
        time.sleep(0.02)


def _engine(spec: dict[str, Any]) -> Any:
    import sglang

    model = write_model_config(pathlib.Path(spec["model_dir"]), spec.get("model", "1b"))
    args = dict(
        model_path=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        page_size=16,
        attention_backend=spec.get("attention_backend", "triton"),
        random_seed=0,
        sampling_backend="pytorch",
        log_level="warning",
        disable_cuda_graph=bool(spec.get("disable_cuda_graph", False)),
    )
    args.update(spec.get("engine_args", {}))
    return sglang.Engine(**args)


def _params(max_new: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}


def _output_ids(item: dict[str, Any]) -> list[int]:
    return [int(t) for t in item.get("output_ids") or []]


def task_prompts(spec: dict[str, Any], engine: Any) -> dict[str, Any]:
    prompts = spec["prompts"]
    outputs: list[list[list[int]]] = []
    rounds = []
    for index in range(int(spec.get("rounds", 1))):
        if spec.get("gated"):  # the driver interleaves this engine's rounds with another's
            gate = pathlib.Path(f"{spec['go']}.{index}")
            deadline = time.monotonic() + float(spec.get("gate_within_s", 600.0))
            while not gate.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no gate for round {index}")
                time.sleep(0.005)
        started = time.perf_counter()
        got = engine.generate(
            input_ids=[p["ids"] for p in prompts],
            sampling_params=[_params(p["max_new"]) for p in prompts],
        )
        wall = time.perf_counter() - started
        ids = [_output_ids(item) for item in got]
        tokens = sum(len(x) for x in ids)
        cached = sum(int(item.get("meta_info", {}).get("cached_tokens", 0)) for item in got)
        rounds.append(
            {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall, "cached": cached}
        )
        outputs.append(ids)
        _emit(spec, "round", index=index, wall_s=wall, tok_s=tokens / wall, cached=cached)
    return {"rounds": rounds, "outputs": outputs}


async def _one(engine: Any, request: dict[str, Any], t0: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + request["at"] - time.perf_counter()))
    sent = time.perf_counter()
    first: float | None = None
    tokens = 0
    error = None
    try:
        stream = await engine.async_generate(
            input_ids=request["ids"], sampling_params=_params(request["max_new"]), stream=True
        )
        async for chunk in stream:
            if first is None:
                first = time.perf_counter()
            tokens = max(tokens, int(chunk.get("meta_info", {}).get("completion_tokens", 0)))
    except Exception as caught:  # a request error is a result (counted), never the run's end
        error = f"{type(caught).__name__}: {caught}"[:300]
    done = time.perf_counter()
    ttft = None if first is None else first - sent
    tpot = None if first is None or tokens < 2 else (done - first) / (tokens - 1)
    return {
        "at": request["at"],
        "sent": sent - t0,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "tokens": tokens,
        "error": error,
        "family": request.get("family"),
    }


def warm_up(spec: dict[str, Any], engine: Any) -> None:
    """A batch of the trace's shapes (not its prefixes), before the trace."""
    warm = spec["requests"][: int(spec.get("warmup", 8))]
    engine.generate(
        input_ids=[[t + 1 for t in r["ids"]] for r in warm],
        sampling_params=[_params(min(32, r["max_new"])) for r in warm],
    )
    _emit(spec, "warm")


async def _trace(spec: dict[str, Any], engine: Any) -> list[dict[str, Any]]:
    """The requests at their times from the wall time the driver writes to ``trace_go`` (every
    engine of a run starts its trace together)."""
    go = pathlib.Path(spec["trace_go"])
    deadline = time.monotonic() + 300.0
    while not go.exists() or not go.read_text().strip():
        if time.monotonic() > deadline:
            raise TimeoutError("no trace_go within 300 s")
        await asyncio.sleep(0.005)
    start_wall = float(go.read_text())
    t0 = time.perf_counter() + (start_wall - time.time())
    return list(await asyncio.gather(*(_one(engine, r, t0) for r in spec["requests"])))


async def _hold(spec: dict[str, Any], engine: Any) -> dict[str, Any]:
    """A steady load (``concurrency`` requests in flight) until the stop file appears."""
    stop = pathlib.Path(spec["stop"])
    served = 0
    errors = 0
    load = spec["hold"]

    async def worker(k: int) -> None:
        nonlocal served, errors
        i = 0
        while not stop.exists():
            request = {
                "at": 0.0,
                "ids": load["ids"][(k + i) % len(load["ids"])],
                "max_new": load["max_new"],
            }
            result = await _one(engine, request, time.perf_counter())
            served += 1
            errors += result["error"] is not None
            i += 1

    _emit(spec, "serving")
    await asyncio.gather(*(worker(k) for k in range(int(load["concurrency"]))))
    return {"served": served, "errors": errors}


def task_release(spec: dict[str, Any], engine: Any) -> dict[str, Any]:
    prompts = spec["prompts"]

    def serve() -> float:
        started = time.perf_counter()
        engine.generate(
            input_ids=[p["ids"] for p in prompts],
            sampling_params=[_params(p["max_new"]) for p in prompts],
        )
        return time.perf_counter() - started

    first = serve()
    _emit(spec, "served")
    started = time.perf_counter()
    engine.release_memory_occupation(tags=["kv_cache"])
    release_s = time.perf_counter() - started
    _emit(spec, "released", release_s=release_s)
    time.sleep(float(spec.get("released_for_s", 2.0)))  # the driver samples memory meanwhile
    started = time.perf_counter()
    engine.resume_memory_occupation(tags=["kv_cache"])
    resume_s = time.perf_counter() - started
    _emit(spec, "resumed", resume_s=resume_s)
    started = time.perf_counter()
    engine.generate(input_ids=[prompts[0]["ids"]], sampling_params=[_params(1)])
    first_after_s = time.perf_counter() - started
    again = serve()
    return {
        "serve_s": first,
        "release_s": release_s,
        "resume_s": resume_s,
        "first_request_after_resume_s": first_after_s,
        "serve_again_s": again,
    }


def main(spec_path: str) -> None:
    spec = json.loads(pathlib.Path(spec_path).read_text())
    try:
        import sglang  # noqa: F401 - the import is what 'imported' reports

        _emit(spec, "imported")
        _wait_go(spec)
        started = time.perf_counter()
        engine = _engine(spec)
        _emit(spec, "up", start_s=time.perf_counter() - started)
        task = spec["task"]
        if task == "prompts":
            result = task_prompts(spec, engine)
        elif task == "trace":
            warm_up(spec, engine)
            # On the engine's own loop: SGLang's engine is bound to the loop it was built on.
            result = {"requests": engine.loop.run_until_complete(_trace(spec, engine))}
        elif task == "hold":
            result = engine.loop.run_until_complete(_hold(spec, engine))
        elif task == "release":
            result = task_release(spec, engine)
        else:
            raise ValueError(f"unknown task {task!r}")
        pathlib.Path(spec["result"]).write_text(json.dumps(result))
        _emit(spec, "done")
        engine.shutdown()
    except BaseException as error:  # reported to the driver, then the process ends
        _emit(spec, "error", error=f"{type(error).__name__}: {error}"[:2000])
        traceback.print_exc()
        os._exit(1)
    os._exit(0)
