"""The engine side of bench/bench_vllm_many.py: one engine in its own process serving its trace.

A vLLM engine runs bench_vllm.py's child protocol (``_vllm_child.run_child``: ``imported``,
``go``, ``up``, then this module's task ``many``, ``result``, ``done``). The task is the trace
loop of bench_vllm.py's ``trace`` task (timed arrivals through vLLM's engine loop, each token
seen as it leaves a step), with what the many-engine bench needs besides: a log of every step
(its start, seconds, scheduled tokens, running and waiting requests: the regime checks and the
step model of the hindsight search read it), clients that give up on a request with no token
``give_up_s`` after its arrival (``LLMEngine.abort_request``: it could be within no SLO), and
the kvasync allocator's page and reserve (the idle check's floor).

The dry mode (``--dry``, where vLLM is absent) runs the same protocol and the same loop in a
real process, with bench/_vllm_many_sim.py's scheduler standing in for vLLM's, stepping in real
time (each step sleeps the step model's seconds). Its blocks come from a fixed pool (stock) or
from a real kvasync allocator on the host backend (kvasync kinds: the share, its budget, the
limit, the ledger and the idle release are kvasync's own), at ``1 / DRY_SCALE`` of the bytes.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import _vllm_many_sim as sim
from _vllm_child import Events, Sampler, wait_file

GIB = 2**30
# Dry engines keep 1/DRY_SCALE of the real bytes (KiB for MiB): a dry budget of 8 GiB maps
# 8 MiB of host memory.
DRY_SCALE = 1024


class StepCounter:
    """What each step of a vLLM scheduler scheduled (tokens) and the queues it left (running,
    waiting): the bench's own instrument, an instance attribute over ``schedule`` (vLLM's class
    and every other scheduler untouched)."""

    def __init__(self, scheduler: Any) -> None:
        self.last: tuple[int | None, int, int] = (None, 0, 0)
        stock = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = stock(*args, **kwargs)
            waiting = len(scheduler.waiting) + len(getattr(scheduler, "skipped_waiting", ()))
            self.last = (int(out.total_num_scheduled_tokens), len(scheduler.running), waiting)
            return out

        scheduler.schedule = schedule


class VllmDriver:
    """vLLM's engine loop, as the trace loop drives it."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.ours: dict[str, str] = {}  # vLLM's request id -> the trace's
        self.counter: StepCounter | None = None
        try:
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        except AttributeError:  # the engine core in another process: no step figures
            return
        self.counter = StepCounter(scheduler)

    @property
    def last(self) -> tuple[int | None, int, int]:
        return self.counter.last if self.counter is not None else (None, 0, 0)

    def params(self, max_tokens: int) -> Any:
        """Greedy, token ids only, each step's new tokens (deltas)."""
        from vllm import SamplingParams  # type: ignore[attr-defined,unused-ignore]
        from vllm.sampling_params import (  # type: ignore[import-not-found,unused-ignore]
            RequestOutputKind,
        )

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            detokenize=False,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )

    def warm(self, shape: Sequence[int]) -> None:
        from _vllm_child import generate

        generate(self.llm, "warm", *shape)

    def prompts(self, salt: str, plan: Sequence[dict[str, Any]]) -> list[Any]:
        """Each request's prompt, rendered before the trace as ``LLM.generate`` renders it."""
        from _vllm_child import prompt_tokens
        from vllm.inputs import TokensPrompt  # type: ignore[import-not-found,unused-ignore]

        render = getattr(self.llm, "_preprocess_cmpl", None)
        found = []
        for index, request in enumerate(plan):
            prompt = TokensPrompt(
                prompt_token_ids=prompt_tokens(salt, index, request["prompt_len"])
            )
            found.append(render([prompt])[0] if render is not None else prompt)
        return found

    def submit(self, request: dict[str, Any], prompt: Any) -> None:
        rid = self.engine.add_request(request["id"], prompt, self.params(request["output_len"]))
        self.ours[str(rid)] = request["id"]

    def abort(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)

    def busy(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def step(self) -> list[tuple[str, int, bool]]:
        found = []
        for out in self.engine.step():
            # vLLM 0.26 reports the id it was given (the external one); an internal one (with
            # vLLM's random suffix) is mapped back.
            ours = self.ours.get(out.request_id, out.request_id)
            got = len(out.outputs[0].token_ids) if out.outputs else 0
            found.append((ours, got, bool(out.finished)))
        return found

    def preemptions(self) -> float | None:
        from _vllm_child import preemptions

        return preemptions(self.llm)

    def kv_geometry(self) -> dict[str, Any] | None:
        """The kvasync allocator's page (bytes of a page id) and reserve (low, high pages)."""
        try:
            from kvasync.integrations.vllm._engine import current_engine
        except ImportError:
            return None
        registered = current_engine()
        if registered is None:
            return None
        allocator = registered.allocator
        return {
            "page_bytes": allocator.stats().page_bytes,
            "reserve_pages": list(allocator.config.reserve_pages),
        }

    def kv_blocks(self) -> int:
        """The KV blocks vLLM sized its cache to (its capacity; kvasync: the virtual one)."""
        return int(self.engine.vllm_config.cache_config.num_gpu_blocks or 0)


class AllocatorPool:
    """A dry engine's blocks from a kvasync allocator (host backend): ``alloc_nowait`` as the
    plugin's pool does (a miss starts mapping what it lacks), ``free``, and the demand."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator

    def take(self, n: int) -> list[int] | None:
        from kvasync import OutOfBlocks, WouldBlock

        if n == 0:
            return []
        try:
            return list(self.allocator.alloc_nowait(n))
        except (WouldBlock, OutOfBlocks):
            return None

    def give(self, ids: list[int]) -> None:
        if ids:
            self.allocator.free(ids)

    def free_count(self) -> int:
        return int(self.allocator.available_blocks())


def dry_allocator(spec: dict[str, Any]) -> Any:
    """A kvasync allocator for a dry engine: the model's bytes per token / DRY_SCALE (one layer,
    K and V, fp16, one head of ``bytes / 4`` elements), 4 KiB pages, the spec's KVASYNC_*
    settings (already scaled by the driver)."""
    import torch

    from kvasync import Config, KVLayout, open_allocator_sync
    from kvasync._sizes import parse_size

    env = spec["env"]
    token_bytes = int(spec["token_kv_bytes"]) // DRY_SCALE
    layout = KVLayout(1, 1, max(1, token_bytes // 4), sim.BLOCK_TOKENS, dtype=torch.float16)
    limit = parse_size(env["KVASYNC_MEMORY_LIMIT"]) if env.get("KVASYNC_MEMORY_LIMIT") else None
    share = env.get("KVASYNC_SHARE")
    budget = parse_size(env["KVASYNC_DEVICE_BUDGET"]) if env.get("KVASYNC_DEVICE_BUDGET") else None
    capacity = limit or budget or 0
    blocks = max(2, capacity // (token_bytes * sim.BLOCK_TOKENS))
    config = Config(
        backend="host",
        max_blocks=blocks,
        page_size=4096,
        memory_limit=limit,
        share=share,
        device_budget=budget,
        name=env.get("KVASYNC_NAME"),
        reserve_pages=(1, 2),
        default_timeout=10.0,
    )
    allocator = open_allocator_sync(layout, config)
    allocator.alloc(1)  # the null block, as vLLM's
    return allocator


class DryDriver:
    """bench/_vllm_many_sim.py's scheduler stepping in real time (see the module's docstring)."""

    def __init__(self, spec: dict[str, Any], model: sim.StepModel) -> None:
        self.model = model
        self.allocator = dry_allocator(spec) if spec["kind"] == "kvasync" else None
        self.block_bytes = int(spec["token_kv_bytes"]) * sim.BLOCK_TOKENS  # real bytes
        if self.allocator is not None:
            pool: sim.BlockSource = AllocatorPool(self.allocator)
            self.capacity_blocks = int(self.allocator.num_blocks)
        else:
            block_bytes = int(spec["token_kv_bytes"]) * sim.BLOCK_TOKENS
            self.capacity_blocks = int(spec["kv_cache_bytes"]) // block_bytes
            pool = sim.FixedPool(self.capacity_blocks)
        self.scheduler = sim.Scheduler(
            pool,
            max_num_seqs=int(spec["max_num_seqs"]),
            max_num_batched_tokens=int(spec["engine_kwargs"]["max_num_batched_tokens"]),
        )
        self.requests: dict[str, sim.SimRequest] = {}
        self.last: tuple[int | None, int, int] = (None, 0, 0)

    def warm(self, shape: Sequence[int]) -> None:
        time.sleep(self.model.base_s)

    def prompts(self, salt: str, plan: Sequence[dict[str, Any]]) -> list[Any]:
        return [None] * len(plan)

    def submit(self, request: dict[str, Any], prompt: Any) -> None:
        ours = sim.SimRequest(
            request["id"], request["at"], request["prompt_len"], request["output_len"]
        )
        self.requests[ours.id] = ours
        self.scheduler.add(ours)

    def abort(self, ids: list[str]) -> None:
        scheduler = self.scheduler
        for request in [self.requests[i] for i in ids]:
            if request in scheduler.running:
                scheduler.running.remove(request)
            elif request in scheduler.waiting:
                scheduler.waiting.remove(request)
            scheduler.pool.give(request.blocks)
            request.blocks = []

    def busy(self) -> bool:
        return self.scheduler.busy()

    def step(self) -> list[tuple[str, int, bool]]:
        plan, prefill = self.scheduler.schedule()
        self.last = (
            sum(n for _, n in plan),
            len(self.scheduler.running),
            len(self.scheduler.waiting),
        )
        if self.allocator is not None:  # what the plugin reports each step (set_demand)
            held = sum(len(r.blocks) for r in self.scheduler.running)
            waiting = sum(math.ceil(r.wanted() / sim.BLOCK_TOKENS) for r in self.scheduler.waiting)
            self.allocator.set_demand(held + waiting)
        time.sleep(self.model.step_s(len(plan), prefill) if plan else 0.005)
        emitted = self.scheduler.finish_step(plan, time.monotonic())
        return [(r.id, 1, r.finished is not None) for r in emitted]

    def preemptions(self) -> float | None:
        return float(self.scheduler.preemptions)

    def kv_blocks(self) -> int:
        return self.capacity_blocks

    def kv_geometry(self) -> dict[str, Any] | None:
        if self.allocator is None:
            return None
        return {
            "page_bytes": self.allocator.stats().page_bytes * DRY_SCALE,
            "reserve_pages": list(self.allocator.config.reserve_pages),
        }


def dry_probes(driver: DryDriver) -> dict[str, Callable[[], float]]:
    """The dry engine's samples: its allocator's mapped GiB and its blocks in use (real bytes)."""
    found: dict[str, Callable[[], float]] = {}
    allocator = driver.allocator
    if allocator is not None:
        found["mapped_gib"] = lambda: allocator.stats().mapped_bytes * DRY_SCALE / GIB
    block_gib = driver.block_bytes / GIB
    scheduler = driver.scheduler
    # Read from the sampler's thread while the loop steps: a copy of the list, then its blocks.
    found["kv_used_gib"] = lambda: sum(len(r.blocks) for r in list(scheduler.running)) * block_gib
    return found


def serve_trace(
    driver: VllmDriver | DryDriver,
    spec: dict[str, Any],
    events: Events,
    probes: dict[str, Callable[[], float]],
) -> dict[str, Any]:
    """Warm-up, then the trace from the wall time in ``trace_go`` (all engines of a variant
    start it together): arrivals at their times, clients that give up, a step log."""
    args = spec["args"]
    plan: list[dict[str, Any]] = args["plan"]
    give_up_s = float(args["give_up_s"])
    driver.warm(args["warmup"])
    prompts = driver.prompts(args["salt"], plan)
    records: dict[str, dict[str, Any]] = {}
    steps: dict[str, list[float | int | None]] = {
        k: [] for k in ("t", "seconds", "tokens", "running", "waiting")
    }
    sampler = Sampler(probes, 0.05)
    sampler.start()
    before = driver.preemptions()
    events.emit("warm")
    start_wall = float(wait_file(pathlib.Path(args["trace_go"]), time.monotonic() + 300, "go"))
    t0 = time.monotonic() + (start_wall - time.time())
    due = t0 + float(args["max_s"])
    pending = deque(zip(plan, prompts, strict=True))
    unserved: deque[str] = deque()  # no token yet, in arrival order (so in give-up order)
    # Every engine stays until the last arrival of all of them (and a little more): an engine
    # idle meanwhile is watched giving its memory back.
    hold = t0 + float(args["hold_s"])
    while pending or driver.busy() or time.monotonic() < hold:
        now = time.monotonic()
        if now > due:
            events.emit("trace deadline", left=len(pending))
            break
        while pending and t0 + pending[0][0]["at"] <= now:
            request, prompt = pending.popleft()
            driver.submit(request, prompt)
            records[request["id"]] = {
                "at": request["at"],
                "arrived": now - t0,
                "first": None,
                "finished": None,
                "aborted": None,
                "output_tokens": 0,
            }
            unserved.append(request["id"])
        gone = []
        while unserved and (
            records[unserved[0]]["first"] is not None
            or now - t0 >= records[unserved[0]]["at"] + give_up_s
        ):
            rid = unserved.popleft()
            if records[rid]["first"] is None:
                records[rid]["aborted"] = now - t0
                gone.append(rid)
        if gone:
            driver.abort(gone)
        if not driver.busy():
            time.sleep(min(0.01, max(0.0, t0 + pending[0][0]["at"] - now)) if pending else 0.01)
            continue
        began = time.monotonic()
        outs = driver.step()
        ended = time.monotonic()
        tokens, running, waiting = driver.last
        for key, value in zip(
            steps, (began - t0, ended - began, tokens, running, waiting), strict=True
        ):
            steps[key].append(value)
        for rid, got, finished in outs:
            record = records.get(rid)
            if record is None or record["aborted"] is not None:
                continue
            if got and record["first"] is None:
                record["first"] = ended - t0
            record["output_tokens"] += got
            if finished:
                record["finished"] = ended - t0
    after = driver.preemptions()
    return {
        "requests": records,
        "steps": steps,
        "t0_wall": start_wall,
        "samples": sampler.finish(),
        "kv_geometry": driver.kv_geometry(),
        "kv_blocks": driver.kv_blocks(),
        "index": spec.get("index"),
        "preemptions": None if before is None or after is None else after - before,
    }


def vllm_probes(llm: Any, spec: dict[str, Any]) -> dict[str, Callable[[], float]]:
    """bench_vllm.py's probes (device used, mapped KV, KV in use), with the KV in use counted
    at this model's bytes per token (those probes count the 1B's)."""
    from _vllm_child import TOKEN_KV_BYTES, probes

    found = probes(llm, spec)
    in_use = found.get("kv_used_gib")
    if in_use is not None:
        ratio = int(spec["token_kv_bytes"]) / TOKEN_KV_BYTES
        found["kv_used_gib"] = lambda: in_use() * ratio
    return found


def task_many(llm: Any, spec: dict[str, Any], events: Events) -> dict[str, Any]:
    """The ``many`` task of a vLLM engine (registered in _vllm_child.TASKS by the bench)."""
    return serve_trace(VllmDriver(llm), spec, events, vllm_probes(llm, spec))


def run_dry_child(spec_path: pathlib.Path) -> None:
    """A dry engine's whole life, in the child protocol's events; ends the process itself."""
    spec: dict[str, Any] = json.loads(spec_path.read_text())
    events = Events(pathlib.Path(spec["events"]))
    code = 0
    driver_pid = os.getppid()

    def watch_driver() -> None:
        while os.getppid() == driver_pid:
            time.sleep(0.5)
        events.emit("driver gone")
        os._exit(5)

    threading.Thread(target=watch_driver, daemon=True).start()
    try:
        events.emit("imported", seconds=0.0)
        wait_file(pathlib.Path(spec["go"]), time.monotonic() + spec["go_within_s"], "go")
        events.emit("go")
        t = time.monotonic()
        model = sim.StepModel(*spec["step_model"])
        driver = DryDriver(spec, model)
        events.emit("up", start_s=time.monotonic() - t)
        result = serve_trace(driver, spec, events, dry_probes(driver))
        result.update(name=spec["name"], kind=spec["kind"], start_s=0.0)
        staging = pathlib.Path(spec["result"]).with_suffix(".tmp")
        staging.write_text(json.dumps(result))
        os.replace(staging, spec["result"])
        events.emit("result")
        if driver.allocator is not None:
            driver.allocator.close(timeout=10.0)
        events.emit("done", shutdown_s=0.0)
    except BaseException as error:  # reported to the driver, which also has the log
        events.emit("error", error=f"{type(error).__name__}: {error}"[:400])
        code = 1
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)
