#!/usr/bin/env python3
"""vLLM's scheduler step on the CPU: stock vLLM's ``BlockPool`` against kvasync's pool, in one run.

On a GPU the scheduler's CPU time per step is hidden behind (eager) or beside (CUDA graphs) the
model's step, and the GPU's noise swamps it. Here vLLM 0.26's own ``Scheduler`` runs with no
model: each step is ``schedule()`` and then ``update_from_output()`` with one sampled token per
request whose prompt is done, as the engine core's loop calls them. Everything the scheduler
does for the KV cache is vLLM's own code over the pool under test (``get_computed_blocks``,
``allocate_slots`` for every running request every step, ``free`` of finished requests, the
per-step ``usage``); kvasync's side is installed as ``register()`` installs it (its pool class
and the coordinator's counting patch) over a host-backend allocator whose pages and reserve are
sized as the worker sizes them (``reserve_pages_for``, ``step_blocks``).

The pattern: ``--requests`` requests of ``--prompt`` tokens arrive at once and decode ``--output``
tokens each (``ignore_eos``), ``--max-seqs`` at a time, ``--batched-tokens`` a step (chunked
prefill); with prefix caching each prompt starts with a ``--shared-prefix`` of tokens common to
all (a system prompt), the rest its own. Both pools run the same steps: the table says how many.

Each round runs, for each caching setting, every pool's scheduler side by side in lock step (each
step of each pool, the pools taking the first turn in turn), so that a step of kvasync's pool is
timed beside the same step of stock's under the same load of the machine: once timing whole
steps and once timing each call (every call wrapped in a timer, so the step pass carries no
wrapper). Each scheduler gets its own copy of the requests, made request by request across the
schedulers (``add_requests_interleaved``: made scheduler after scheduler, the first's ran 1.8%
slower than the last's over the same pool). Per step: the scheduler thread's CPU time
(``time.thread_time``: the mapper thread's work and the time the thread is descheduled are not
in it) of ``schedule()`` +
``update_from_output()``, median, p90, p99 over every step of every round; the CPU time of a
whole run against stock's (all rounds, and the lowest and highest of each round's run over
stock's run beside it: the spread, and their median with its 95% confidence interval by the
bootstrap: enough rounds, ``--rounds 10`` or more, make it narrow); the median over steps of
a step's time over stock's same step; the wall median. Per call (wall time): the scheduler's
calls into the KV cache (``KVCacheManager.allocate_slots``, ``free``, ``get_computed_blocks``,
the coordinator's ``get_num_blocks_to_allocate``) and the pool's methods they reach
(``get_num_free_blocks``, ``get_new_blocks``, ``free_blocks``, ``get_usage``, which the per-step
stats read).
``--before REV`` adds kvasync's pool as it is at a git revision (``git show REV:...``), for a
before/after table in one run.

``--share`` adds kvasync's pool in a share, twice, each in a fresh share of its own whose device
budget does not bind (twice every page of the allocator): ``kvasync+share``, its allocator joined
and nothing else, and ``kvasync+share+report``, its ``Scheduler.schedule`` also wrapped with
``reporting_demand`` as ``register()`` wraps it in a share (after each step the pool's
``report_demand`` tells the share the blocks held and what the waiting requests that fit the
batch need: Note [The engine's demand in a share]). Both run in the same lock-step rounds as
stock and the plain pool; a second table sets each against the pool beside it (the plain pool,
and the joined one for the report alone): CPU a step, each run over the other's run and each
step less the other's same step, medians with their 95% CIs; the per-call table adds
``report_demand``. The ledgers in /dev/shm are gone at the end.

``--scaling N,N,...`` then measures the cost per unit of work: decode steps of ``N`` running
requests (prompts done, none finishing), stock's and kvasync's schedulers (``--before``'s and
``--share``'s too) in lock step, each pool's step less stock's same step for each ``N``, and the
line through them: a cost a step and a cost a running request a step (with its share of new
blocks, one every 16 steps).

``--profile`` then runs kvasync's pool under cProfile for one pass of each caching setting and
prints the functions with the most time of their own.

Runs where vLLM 0.26 imports (``make vllm-test`` makes such a venv, under
``~/.cache/kvasync/vllm-matrix/0.26.0/venv``); no
GPU is used. Usage: bench/bench_vllm_scheduler.py [--rounds N] [--caching on|off|both]
[--requests N] [--prompt T] [--output T] [--before REV] [--share] [--scaling N,N,...]
[--profile] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import io
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM's first import
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model's config is a local file

import _tables as tables
import torch

from kvasync import Config, KVLayout, open_allocator_sync
from kvasync import share as ledger
from kvasync._stats import percentile
from kvasync.integrations.vllm import _pool
from kvasync.integrations.vllm._demand import reporting_demand
from kvasync.integrations.vllm._engine import EngineKV, hold_null_block
from kvasync.integrations.vllm._worker import reserve_pages_for, step_blocks

try:
    import vllm
    import vllm.v1.core.kv_cache_coordinator as vllm_coordinator
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
except ImportError as error:
    sys.exit(
        f"bench_vllm_scheduler needs vLLM 0.26 importable ({error}); run it with a Python that "
        "has vLLM and kvasync (make vllm-test VLLM_VERSION=0.26.0 makes one: "
        "~/.cache/kvasync/vllm-matrix/0.26.0/venv/bin/python)"
    )

BLOCK_SIZE = 16  # tokens a block, vLLM's default
# A block of 4 KiB a range on 128 KiB pages: 32 blocks a page, as a 64 KiB layer block (Llama 3
# 8B: 16 tokens x 8 KV heads x 128 x fp16 x K and V) on the driver's 2 MiB pages.
LAYOUT = KVLayout(1, 1, 256, BLOCK_SIZE, dtype=torch.int8, kv_buffers=1)
PAGE_SIZE = 128 << 10
VOCAB = 32_000
DEADLINE = 30.0  # for the reserve's first mapping

# A tiny Llama's config: the scheduler reads the model's config (max length, architecture), never
# its weights.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

STOCK = "stock"
# The scheduler's calls into the KV cache (KVCacheManager and its coordinator), then the pool's.
MANAGER_CALLS = ("allocate_slots", "free", "get_computed_blocks")
COORDINATOR_CALLS = ("get_num_blocks_to_allocate",)
POOL_CALLS = ("get_num_free_blocks", "get_new_blocks", "free_blocks", "get_usage")
# In a share, the demand report's call into the pool (kvasync's pools alone have it).
REPORT_CALLS = ("report_demand",)
CALLS = (*MANAGER_CALLS, *COORDINATOR_CALLS, *POOL_CALLS, *REPORT_CALLS)
# --share's pools: kvasync's in a share of its own, without and with the demand report.
SHARED = "kvasync+share"
REPORTING = "kvasync+share+report"


@dataclass(frozen=True)
class PoolUnderTest:
    """A scheduler's KV side: stock's ``BlockPool`` (``module`` None) or the pool of kvasync's
    ``_pool`` module ``module``; ``share``: the share its allocator joins (None: none);
    ``report``: ``Scheduler.schedule`` reports the engine's demand after each step, as
    ``register()`` wraps it in a share (Note [The engine's demand in a share])."""

    module: Any = None
    share: str | None = None
    report: bool = False


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt: int
    output: int
    shared_prefix: int
    max_seqs: int
    batched_tokens: int
    num_blocks: int


@dataclass
class Samples:
    """One pool and caching setting's samples over every round."""

    steps: list[float] = field(default_factory=list)  # the scheduler thread's CPU seconds a step
    walls: list[float] = field(default_factory=list)  # wall seconds a step
    ratios: list[float] = field(default_factory=list)  # a step's CPU time over stock's same step
    steps_per_run: list[int] = field(default_factory=list)
    run_cpu: list[float] = field(default_factory=list)  # the CPU seconds of each whole run
    calls: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    misses: list[int] = field(default_factory=list)  # kvasync: counts answered short


# -- vLLM's scheduler, stock or with kvasync's pool --------------------------------------------


def vllm_config_for(workload: Workload, caching: bool, model_dir: str) -> Any:
    model = ModelConfig(model=model_dir, dtype="float16", seed=0, skip_tokenizer_init=True)
    scheduler = SchedulerConfig(
        max_num_seqs=workload.max_seqs,
        max_num_batched_tokens=workload.batched_tokens,
        max_model_len=int(model.max_model_len),
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,  # the plain Scheduler's loop: schedule, then its output
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching)
    cache.num_gpu_blocks = workload.num_blocks
    return VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig(device="cpu"),  # the scheduler touches no device
    )


def share_budget(num_blocks: int) -> int:
    """A device budget that never binds an allocator of ``num_blocks``: twice its every page."""
    pages = -(-num_blocks // (PAGE_SIZE // LAYOUT.range_block_bytes))
    return 2 * pages * PAGE_SIZE * LAYOUT.num_ranges


def open_engine(vllm_config: Any, num_blocks: int, share: str | None = None) -> EngineKV:
    """A host-backend allocator with the reserve the worker would give this scheduler, its
    reserve mapped (an engine that has been up a while); ``share``: it joins that share, with a
    budget that does not bind (``share_budget``)."""
    low, high = reserve_pages_for(LAYOUT, PAGE_SIZE, step_blocks(vllm_config, BLOCK_SIZE))
    kv = open_allocator_sync(
        LAYOUT,
        Config(
            backend="host",
            max_blocks=num_blocks,
            page_size=PAGE_SIZE,
            reserve_pages=(low, high),
            share=share,
            device_budget=None if share is None else share_budget(num_blocks),
            name=None if share is None else "bench-scheduler",
        ),
    )
    try:
        hold_null_block(kv, DEADLINE)
        per_page = PAGE_SIZE // LAYOUT.range_block_bytes
        due = time.monotonic() + DEADLINE
        while kv.stats().free_blocks < low * per_page - 1:
            if time.monotonic() > due:
                raise RuntimeError(f"the reserve of {low} pages was not mapped in {DEADLINE} s")
            time.sleep(0.01)
    except BaseException:
        kv.close()
        raise
    return EngineKV(allocator=kv, owned=False)


def pool_at(rev: str) -> Any:
    """kvasync's ``_pool`` module as it is at git revision ``rev`` (for a before/after table in
    one run), imported beside today's, in the same package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(
        ["git", "show", f"{rev}:src/kvasync/integrations/vllm/_pool.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    fd, path = tempfile.mkstemp(prefix="kvasync_pool_", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(source)
    name = f"kvasync.integrations.vllm._pool_at_{rev.replace('~', '_').replace('^', '_')}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    os.unlink(path)
    return module


@contextmanager
def fresh_share(tag: str) -> Iterator[str]:
    """A share name no one uses (a ledger of its own, made when an allocator joins); a ledger
    file left in /dev/shm at the end is removed (the last member to leave removes it itself, one
    killed or a round that failed before its close does not)."""
    name = f"bench-scheduler-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        yield name
    finally:
        if os.path.exists(ledger.path(name)):
            os.unlink(ledger.path(name))


@contextmanager
def scheduler_for(pool: PoolUnderTest, vllm_config: Any, num_blocks: int) -> Iterator[Any]:
    """vLLM's Scheduler over stock's BlockPool, or over the pool of a kvasync ``_pool`` module
    as ``register()`` patches it (the pool class the coordinator builds, the coordinator's
    count, and in a share ``Scheduler.schedule``'s demand report)."""
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    engine = None
    try:
        if pool.module is not None:
            engine = open_engine(vllm_config, num_blocks, pool.share)
            found = engine
            vllm_coordinator.BlockPool = pool.module.make_block_pool_class(
                BlockPool, lambda n: found
            )
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            block_size=BLOCK_SIZE,
            log_stats=True,  # as `vllm serve` runs: usage and prefix-cache stats every step
            structured_output_manager=StructuredOutputManager(vllm_config),
        )
        vllm_coordinator.BlockPool = BlockPool
        if pool.module is not None:
            # register() patches the classes; here this scheduler's objects alone (their own
            # instance attributes), so that pools of several revisions run side by side.
            coordinator = scheduler.kv_cache_manager.coordinator
            stock_count = type(coordinator).get_num_blocks_to_allocate
            coordinator.get_num_blocks_to_allocate = MethodType(
                pool.module.counting_demand(stock_count), coordinator
            )
        if pool.report:
            stock_schedule = type(scheduler).schedule
            scheduler.schedule = MethodType(reporting_demand(stock_schedule), scheduler)
        yield scheduler
    finally:
        vllm_coordinator.BlockPool = BlockPool
        if engine is not None:
            engine.allocator.close()


def make_requests(
    workload: Workload, hasher: Any, round_seed: int, stagger: bool = False
) -> list[Any]:
    """Prompts of a common prefix then tokens of their own (distinct across rounds, so that a
    round's prefix hits are its own); ``stagger``: request ``i``'s prompt ``i % BLOCK_SIZE``
    tokens longer, so that their decodes start new blocks at different steps."""
    return [
        make_request(workload, hasher, round_seed, i, stagger) for i in range(workload.requests)
    ]


def make_request(
    workload: Workload, hasher: Any, round_seed: int, i: int, stagger: bool = False
) -> Any:
    """Request ``i`` of ``make_requests``."""
    shared = [(round_seed * 7919 + t) % VOCAB for t in range(workload.shared_prefix)]
    longer = i % BLOCK_SIZE if stagger else 0
    own = [
        (round_seed * 104_729 + i * 1_009 + t * 31) % VOCAB
        for t in range(workload.prompt - workload.shared_prefix + longer)
    ]
    return Request(
        request_id=f"r{round_seed}-{i}",
        prompt_token_ids=shared + own,
        sampling_params=SamplingParams(max_tokens=workload.output, ignore_eos=True),
        pooling_params=None,
        block_hasher=hasher,
    )


def add_requests_interleaved(
    schedulers: dict[str, Any],
    workload: Workload,
    hasher: Any,
    round_seed: int,
    stagger: bool = False,
) -> None:
    """Gives each scheduler its own copy of ``make_requests``' requests, made and added request
    by request across the schedulers (request ``i`` of every one before request ``i + 1`` of
    any), so that each scheduler's requests lie alike in memory. Made scheduler after
    scheduler, the first one's requests took the memory earlier garbage left and the last's
    fresh memory: two schedulers over the same pool in lock step then differed by 1.8% a run,
    the one whose requests were made first the slower (0.997x interleaved), and stock's
    requests, made first, cost stock about as much."""
    for i in range(workload.requests):
        for scheduler in schedulers.values():
            scheduler.add_request(make_request(workload, hasher, round_seed, i, stagger))


def model_output(scheduler: Any, output: Any, step: int) -> Any:
    """One sampled token for each scheduled request whose prompt is done (a chunk of a longer
    prompt samples nothing), as the model runner reports it."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for index, req_id in enumerate(req_ids):
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_prompt_tokens
        sampled.append([(step * 131 + index) % VOCAB] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: k for k, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def timed(method: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    clock = time.perf_counter

    def call(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return method(*args, **kwargs)
        finally:
            into.append(clock() - start)

    return call


def wrap_calls(scheduler: Any, calls: dict[str, list[float]]) -> None:
    """Times each of ``CALLS`` on this scheduler's objects (instance attributes shadow the
    methods, so calls between them are timed too)."""
    manager = scheduler.kv_cache_manager
    for name in MANAGER_CALLS:
        setattr(manager, name, timed(getattr(manager, name), calls[name]))
    for name in COORDINATOR_CALLS:
        target = manager.coordinator
        setattr(target, name, timed(getattr(target, name), calls[name]))
    for name in POOL_CALLS:
        setattr(manager.block_pool, name, timed(getattr(manager.block_pool, name), calls[name]))
    for name in REPORT_CALLS:
        if hasattr(manager.block_pool, name):  # kvasync's pools; called only in a share
            method = getattr(manager.block_pool, name)
            setattr(manager.block_pool, name, timed(method, calls[name]))


def run_together(
    schedulers: dict[str, Any],
    workload: Workload,
    hasher: Any,
    round_seed: int,
    samples: dict[str, Samples],
    timing_calls: bool,
) -> None:
    """Serves the workload on every scheduler, step by step in lock step (each pool takes the
    first turn in turn), so that each step of a pool is timed beside the same step of the
    others, under the same load of the machine. Records each step's time, or (``timing_calls``)
    each call's."""
    if timing_calls:
        for name, scheduler in schedulers.items():
            wrap_calls(scheduler, samples[name].calls)
    add_requests_interleaved(schedulers, workload, hasher, round_seed)
    gc.collect()
    clock, cpu = time.perf_counter, time.thread_time
    names = list(schedulers)
    limit = workload.requests * (workload.prompt + workload.output)  # a step makes progress
    steps = dict.fromkeys(names, 0)
    run_cpu = dict.fromkeys(names, 0.0)
    step = 0
    while any(s.has_requests() for s in schedulers.values()):
        times: dict[str, float] = {}
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            scheduler = schedulers[name]
            if not scheduler.has_requests():
                continue
            start, start_cpu = clock(), cpu()
            output = scheduler.schedule()
            scheduler.update_from_output(output, model_output(scheduler, output, step))
            times[name] = cpu() - start_cpu
            wall = clock() - start
            steps[name] += 1
            run_cpu[name] += times[name]
            if not timing_calls:
                samples[name].steps.append(times[name])
                samples[name].walls.append(wall)
        if not timing_calls and STOCK in times:
            for name, seconds in times.items():
                samples[name].ratios.append(seconds / max(times[STOCK], 1e-9))
        step += 1
        if step > limit:
            raise RuntimeError(f"the workload did not finish in {limit} steps")
    for name, scheduler in schedulers.items():
        manager = scheduler.kv_cache_manager
        if not manager.enable_caching and manager.usage > 0.0:
            raise RuntimeError(f"{name}: blocks still held after every request finished")
        if timing_calls:
            continue
        samples[name].steps_per_run.append(steps[name])
        samples[name].run_cpu.append(run_cpu[name])
        misses = getattr(manager.block_pool, "num_map_ahead_misses", None)
        if misses is not None:
            samples[name].misses.append(int(misses))


# -- the report --------------------------------------------------------------------------------


def median_ci(values: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The median of ``values`` and its 95% confidence interval, by the bootstrap (the medians
    of ``resamples`` resamples, seeded: the same values print the same interval). Distribution
    free: a run's ratio on a shared machine has outliers on both sides."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return statistics.median(values), medians[resamples * 25 // 1000], medians[-resamples // 40]


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def step_table(
    results: dict[tuple[str, str], Samples], pools: list[str], settings: list[str]
) -> str:
    rows = []
    for caching in settings:
        stock = results[(STOCK, caching)]
        base = sum(stock.steps) / len(stock.steps_per_run)
        for pool in pools:
            s = results[(pool, caching)]
            per_run = sum(s.steps) / len(s.steps_per_run)
            # Each run against stock's run beside it (same round, same load): their spread, and
            # their median with its confidence interval.
            ratios = [mine / theirs for mine, theirs in zip(s.run_cpu, stock.run_cpu, strict=True)]
            median, low, high = median_ci(ratios)
            rows.append(
                [
                    pool,
                    caching,
                    "/".join(str(n) for n in sorted(set(s.steps_per_run))),
                    fmt_ms(percentile(s.steps, 50)),
                    fmt_ms(percentile(s.steps, 90)),
                    fmt_ms(percentile(s.steps, 99)),
                    fmt_ms(per_run),
                    f"{per_run / base:.3f}x",
                    f"{min(ratios):.3f}-{max(ratios):.3f}x",
                    f"{median:.3f}x [{low:.3f}, {high:.3f}]",
                    f"{percentile(s.ratios, 50):.3f}x",
                    fmt_ms(percentile(s.walls, 50)),
                    str(max(s.misses)) if s.misses else "-",
                ]
            )
    return tables.markdown(
        [
            "pool",
            "prefix caching",
            "steps a run",
            "step CPU p50 ms",
            "p90 ms",
            "p99 ms",
            "CPU ms a run",
            "run vs stock",
            "runs vs stock, min-max",
            "runs vs stock, median [95% CI]",
            "step vs stock p50",
            "step wall p50 ms",
            "map-ahead misses",
        ],
        rows,
    )


def same_step_deltas(mine: Samples, theirs: Samples) -> tuple[list[float], int]:
    """Each step of ``mine`` less ``theirs``'s same step, over the runs that took as many steps
    (a count answered short adds a step, and the steps after it are not the same steps), and
    how many runs those are."""
    deltas: list[float] = []
    runs = mine_start = their_start = 0
    for mine_steps, their_steps in zip(mine.steps_per_run, theirs.steps_per_run, strict=True):
        if mine_steps == their_steps:
            own = mine.steps[mine_start : mine_start + mine_steps]
            other = theirs.steps[their_start : their_start + their_steps]
            deltas += [m - t for m, t in zip(own, other, strict=True)]
            runs += 1
        mine_start += mine_steps
        their_start += their_steps
    return deltas, runs


def added_table(
    results: dict[tuple[str, str], Samples], pairs: list[tuple[str, str]], settings: list[str]
) -> str:
    """What a pool adds to another's step, for each ``(pool, against)`` of ``pairs``: their CPU
    time a step (a run's over its steps), the difference, each run against the other's run
    beside it (median, 95% CI) and each step less the other's same step (median, 95% CI; the
    same steps when both runs took as many)."""
    rows = []
    for caching in settings:
        for pool, against in pairs:
            mine, theirs = results[(pool, caching)], results[(against, caching)]
            per_step = sum(mine.steps) / len(mine.steps)
            base = sum(theirs.steps) / len(theirs.steps)
            paired = zip(mine.run_cpu, theirs.run_cpu, strict=True)
            median, low, high = median_ci([m / t for m, t in paired])
            deltas, runs = same_step_deltas(mine, theirs)
            same_steps = "-"
            if deltas:
                d, d_low, d_high = median_ci(deltas)
                same_steps = f"{fmt_us(d)} [{fmt_us(d_low)}, {fmt_us(d_high)}], {runs} runs"
            rows.append(
                [
                    pool,
                    against,
                    caching,
                    fmt_us(per_step),
                    fmt_us(base),
                    fmt_us(per_step - base),
                    f"{median:.3f}x [{low:.3f}, {high:.3f}]",
                    same_steps,
                ]
            )
    return tables.markdown(
        [
            "pool",
            "against",
            "prefix caching",
            "CPU µs a step",
            "against's µs a step",
            "added µs a step",
            "runs vs against, median [95% CI]",
            "step - against's same step p50 µs [95% CI], runs",
        ],
        rows,
    )


def call_table(
    results: dict[tuple[str, str], Samples], pools: list[str], settings: list[str]
) -> str:
    rows = []
    for caching in settings:
        for name in CALLS:
            for pool in pools:
                s = results[(pool, caching)]
                samples = s.calls.get(name, [])
                if not samples:
                    continue
                runs = len(s.steps_per_run)
                rows.append(
                    [
                        name,
                        pool,
                        caching,
                        str(len(samples) // runs),
                        fmt_us(percentile(samples, 50)),
                        fmt_us(percentile(samples, 90)),
                        fmt_us(percentile(samples, 99)),
                        fmt_ms(sum(samples) / runs),
                    ]
                )
    return tables.markdown(
        ["call", "pool", "prefix caching", "calls a run", "p50 µs", "p90 µs", "p99 µs", "ms a run"],
        rows,
        justify=["left", "left", "left", "right", "right", "right", "right", "right"],
    )


def decode_scaling(
    args: argparse.Namespace,
    under_test: dict[str, PoolUnderTest],
    settings: list[str],
    model_dir: str,
    hasher: Any,
) -> str:
    """The cost per unit of work: stock's scheduler and each kvasync pool's (``under_test``) in
    lock step over decode steps of ``n`` running requests (prompts done, none finishing; their
    prompts' lengths staggered, so that about ``n / BLOCK_SIZE`` of them start a new block each
    step), for each ``n`` of ``--scaling``; a pool's CPU time a step less stock's same step, and
    the line through them (a cost a step, and a cost a running request a step, which includes
    its share of new blocks: one every ``BLOCK_SIZE`` steps)."""
    pools = [pool for pool in under_test if pool != STOCK]
    rows = []
    lines = []
    for caching in settings:
        points: dict[str, list[tuple[int, float]]] = {pool: [] for pool in pools}
        for n in args.scaling:
            per_request = -(-(args.prompt + BLOCK_SIZE + args.scaling_steps + 64) // BLOCK_SIZE)
            workload = Workload(
                requests=n,
                prompt=args.prompt,
                output=args.scaling_steps + 64,  # none finishes
                shared_prefix=args.shared_prefix,
                max_seqs=max(args.max_seqs, n),
                batched_tokens=args.batched_tokens,
                # And room for the reserve the worker would give the scheduler.
                num_blocks=max(n * per_request, 4096) + 1,
            )
            vllm_config = vllm_config_for(workload, caching == "on", model_dir)
            steps: dict[str, list[float]] = {pool: [] for pool in under_test}
            with ExitStack() as stack:
                schedulers = {
                    pool: stack.enter_context(
                        scheduler_for(under, vllm_config, workload.num_blocks)
                    )
                    for pool, under in under_test.items()
                }
                add_requests_interleaved(schedulers, workload, hasher, 20_000 + n, stagger=True)
                step = 0
                while any(  # the prompts' steps: not measured
                    r.num_computed_tokens < r.num_prompt_tokens
                    for s in schedulers.values()
                    for r in s.requests.values()
                ):
                    for scheduler in schedulers.values():
                        output = scheduler.schedule()
                        scheduler.update_from_output(output, model_output(scheduler, output, step))
                    step += 1
                    if step > 10 * n + 100:
                        raise RuntimeError(f"{n} prompts were not done in {step} steps")
                gc.collect()
                names = list(schedulers)
                for index in range(args.scaling_steps):
                    shift = index % len(names)
                    for name in names[shift:] + names[:shift]:
                        scheduler = schedulers[name]
                        start = time.thread_time()
                        output = scheduler.schedule()
                        scheduler.update_from_output(output, model_output(scheduler, output, step))
                        steps[name].append(time.thread_time() - start)
                        if len(output.num_scheduled_tokens) != n:
                            raise RuntimeError(f"{name}: a decode step did not run all {n}")
                    step += 1
            stock = percentile(steps[STOCK], 50)
            for pool in pools:
                paired = zip(steps[pool], steps[STOCK], strict=True)
                deltas = [mine - theirs for mine, theirs in paired]
                median, low, high = median_ci(deltas)
                points[pool].append((n, median))
                rows.append(
                    [
                        pool,
                        caching,
                        str(n),
                        fmt_us(stock),
                        fmt_us(percentile(steps[pool], 50)),
                        f"{fmt_us(median)} [{fmt_us(low)}, {fmt_us(high)}]",
                        f"{median / n * 1e6:.3f}",
                        f"{median / stock * 100:.1f}%",
                    ]
                )
        for pool in pools:
            line = points[pool]
            if len({n for n, _ in line}) < len(line) or len(line) < 2:
                continue  # one size, or a size twice: no line
            # The line through the medians (Theil-Sen: the median of the slopes between every
            # two sizes, so that one size's noisy median does not tilt it): a cost a step and
            # one a running request.
            slope = statistics.median(
                (d2 - d1) / (n2 - n1) for i, (n1, d1) in enumerate(line) for n2, d2 in line[i + 1 :]
            )
            intercept = statistics.median(d - slope * n for n, d in line)
            lines.append(
                f"- {pool}, prefix caching {caching}: {pool} - stock = {fmt_us(intercept)} µs a "
                f"step + {slope * 1e6:.3f} µs a running request a step"
            )
    table = tables.markdown(
        [
            "pool",
            "prefix caching",
            "running requests",
            "stock step p50 µs",
            "pool step p50 µs",
            "pool - stock p50 µs [95% CI]",
            "µs a running request",
            "of stock's step",
        ],
        rows,
    )
    return table + "\n\nThe line through the sizes (Theil-Sen):\n\n" + "\n".join(lines)


def profile(workload: Workload, settings: list[str], model_dir: str, hasher: Any, top: int) -> str:
    """cProfile of kvasync's pool serving the workload once per caching setting."""
    out = io.StringIO()
    for caching in settings:
        vllm_config = vllm_config_for(workload, caching == "on", model_dir)
        sink = {"kvasync": Samples()}
        with scheduler_for(PoolUnderTest(_pool), vllm_config, workload.num_blocks) as scheduler:
            profiler = cProfile.Profile()
            profiler.enable()
            run_together({"kvasync": scheduler}, workload, hasher, 10_000, sink, False)
            profiler.disable()
        stats = pstats.Stats(profiler, stream=out)
        out.write(f"\n## kvasync pool, prefix caching {caching}: top {top} by own time\n")
        stats.sort_stats("tottime").print_stats(top)
        out.write(f"\n## kvasync pool, prefix caching {caching}: kvasync's functions, cumulative\n")
        stats.sort_stats("cumulative").print_stats(r"kvasync", top)
    return out.getvalue()


def measure(
    args: argparse.Namespace,
    pools: dict[str, PoolUnderTest],
    settings: list[str],
    configs: dict[str, Any],
    workload: Workload,
    hasher: Any,
) -> dict[tuple[str, str], Samples]:
    """``--rounds`` rounds: in each, for each caching setting, every pool's scheduler in lock step
    (``run_together``), once timing steps and once timing calls."""
    results = {(p, c): Samples() for p in pools for c in settings}
    for round_index in range(args.rounds):
        for caching in settings:
            for timing_calls in (False, True):
                with ExitStack() as stack:
                    schedulers = {
                        name: stack.enter_context(
                            scheduler_for(pool, configs[caching], workload.num_blocks)
                        )
                        for name, pool in pools.items()
                    }
                    run_together(
                        schedulers,
                        workload,
                        hasher,
                        round_index * 2 + int(timing_calls),
                        {name: results[(name, caching)] for name in pools},
                        timing_calls,
                    )
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return results


def pools_for(args: argparse.Namespace, stack: ExitStack) -> dict[str, PoolUnderTest]:
    """Stock's and kvasync's, then ``--before``'s and ``--share``'s (each in a fresh share of
    its own, whose ledger ``stack`` removes at the end)."""
    pools = {STOCK: PoolUnderTest(), "kvasync": PoolUnderTest(_pool)}
    if args.before:
        pools[f"kvasync@{args.before}"] = PoolUnderTest(pool_at(args.before))
    if args.share:
        pools[SHARED] = PoolUnderTest(_pool, share=stack.enter_context(fresh_share("joined")))
        pools[REPORTING] = PoolUnderTest(
            _pool, share=stack.enter_context(fresh_share("report")), report=True
        )
    return pools


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--caching", choices=("on", "off", "both"), default="both")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512, help="tokens a prompt")
    parser.add_argument("--output", type=int, default=128, help="tokens each request decodes")
    parser.add_argument("--shared-prefix", type=int, default=128, help="tokens all prompts share")
    parser.add_argument("--max-seqs", type=int, default=256)
    parser.add_argument("--batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--before",
        metavar="REV",
        help="also run kvasync's pool as it is at this git revision (a before/after row)",
    )
    parser.add_argument(
        "--share",
        action="store_true",
        help="also run kvasync's pool in a share, without and with the demand report",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile kvasync's pool after")
    parser.add_argument("--top", type=int, default=30, help="profile lines to print")
    parser.add_argument("--quick", action="store_true", help="1 round of 64 requests")
    parser.add_argument(
        "--scaling",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[],
        metavar="N,N,...",
        help="then decode steps of N running requests each (the cost a step and a request)",
    )
    parser.add_argument("--scaling-steps", type=int, default=600, help="decode steps an N")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests = min(args.rounds, 1), 64
    if not 0 <= args.shared_prefix < args.prompt:
        parser.error("--shared-prefix must be below --prompt")
    return args


def main() -> None:
    args = parse_args()
    per_request = -(-(args.prompt + args.output) // BLOCK_SIZE)
    # Room for every request at once and as many cached blocks again: no preemption, and the
    # pool's capacity is what vLLM would size from a large GPU.
    num_blocks = 2 * args.requests * per_request + 1
    workload = Workload(
        requests=args.requests,
        prompt=args.prompt,
        output=args.output,
        shared_prefix=args.shared_prefix,
        max_seqs=args.max_seqs,
        batched_tokens=args.batched_tokens,
        num_blocks=num_blocks,
    )
    settings = ["on", "off"] if args.caching == "both" else [args.caching]

    with (
        ExitStack() as shares,
        tempfile.TemporaryDirectory(prefix="kvasync-bench-model-") as model_dir,
    ):
        pools = pools_for(args, shares)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(MODEL_CONFIG, f)
        configs = {c: vllm_config_for(workload, c == "on", model_dir) for c in settings}
        hash_fn = get_hash_fn_by_name(configs[settings[0]].cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)

        results = measure(args, pools, settings, configs, workload, hasher)
        names = list(pools)
        if args.rounds > 0:
            print(
                f"# vLLM {vllm.__version__}'s scheduler on the CPU ({os.cpu_count()} cores, "
                f"Python {platform.python_version()}): {args.requests} requests of "
                f"{args.prompt}-token prompts ({args.shared_prefix} shared) decoding "
                f"{args.output} tokens, max_num_seqs {args.max_seqs}, {args.batched_tokens} "
                f"tokens a step, {num_blocks} blocks, {args.rounds} round(s)\n"
            )
            print(
                "Per step (schedule() + update_from_output(); the scheduler thread's CPU time):\n"
            )
            print(step_table(results, names, settings))
            if args.share:
                print(
                    "\nWhat the share and the demand report add (the scheduler thread's CPU time; "
                    "each against the pool beside it in the same rounds):\n"
                )
                pairs = [(SHARED, "kvasync"), (REPORTING, "kvasync"), (REPORTING, SHARED)]
                print(added_table(results, pairs, settings))
            print("\nPer call (wall time, timed in a pass of their own):\n")
            print(call_table(results, names, settings))
        if args.scaling:
            print(
                f"\nDecode steps of N running requests ({args.prompt}-token prompts done, "
                f"{args.scaling_steps} steps each, the scheduler thread's CPU time, a pool's "
                "step less stock's same step):\n"
            )
            print(decode_scaling(args, pools, settings, model_dir, hasher))
        if args.profile:
            print(profile(workload, settings, model_dir, hasher, args.top))


if __name__ == "__main__":
    main()
