"""kvasync's vLLM pool when its allocator fails or its limit binds, under vLLM's own ``Scheduler``
(no model: each step is ``schedule()`` and ``update_from_output()`` with one sampled token per
request whose prompt is done, as the engine core's loop calls them; Note [When the allocator
fails] in ``_pool``).

The tests need vLLM importable (``make vllm-test`` builds such an environment); CI's venv has no
vLLM, and they skip there, saying so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvasync import AllocatorClosed, Config, KVLayout, MapError, open_allocator_sync
from kvasync.integrations import vllm as plugin
from kvasync.integrations._settings import read_settings
from kvasync.integrations.vllm._engine import EngineKV, hold_null_block
from kvasync.integrations.vllm._pool import counting_demand, make_block_pool_class

try:
    # vLLM's scheduler module imports its kernels' modules, which call torch APIs this torch
    # deprecates: vLLM's warnings, not this test's.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import vllm.v1.core.block_pool as vllm_block_pool
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
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

    VLLM_ERROR = ""
except Exception as error:  # any import failure means: no vLLM here
    VLLM_ERROR = (
        f"vLLM is not importable here ({type(error).__name__}: {error}); run make vllm-test"
    )

pytestmark = pytest.mark.skipif(bool(VLLM_ERROR), reason=VLLM_ERROR or "vLLM present")

BLOCK_SIZE = 16  # tokens a block, vLLM's default
PAGE_BYTES = 64 << 10  # host_engine's pages: 16 blocks of 4 KiB
BLOCKS_PER_PAGE = 16
DEADLINE = 10.0
VOCAB = 32_000
LOGGER = "kvasync.vllm"

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


def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Waits for ``condition`` (the mapper thread's work) until a deadline."""
    due = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > due:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.005)


class Clock:
    """The pool's clock, moved by the test: the warnings' intervals without waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engines() -> Iterator[list[EngineKV]]:
    """Host-backend engines the test opens; closed at its end (a second close does nothing)."""
    opened: list[EngineKV] = []
    yield opened
    for engine in opened:
        engine.allocator.close()


def open_engine(
    engines: list[EngineKV], num_blocks: int, *, memory_limit: int | None = None
) -> EngineKV:
    """host_engine's allocator (the pool vLLM's own tests get) with a small reserve."""
    settings = read_settings(
        {"KVASYNC_VLLM": "1"}
        if memory_limit is None
        else {"KVASYNC_MEMORY_LIMIT": str(memory_limit)}
    )
    engine = plugin.host_engine(num_blocks, settings, reserve_pages=(1, 2))
    engines.append(engine)
    return engine


def open_faulty_engine(engines: list[EngineKV], num_blocks: int, faults: Any) -> EngineKV:
    """host_engine's allocator with a small reserve and ``faults`` in its mapper thread."""
    layout = KVLayout(1, 1, 256, BLOCK_SIZE, dtype=torch.int8, kv_buffers=1)
    config = Config(
        backend="host",
        max_blocks=num_blocks,
        page_size=PAGE_BYTES,
        reserve_pages=(1, 2),
        faults=faults,
    )
    kv = open_allocator_sync(layout, config)
    engine = EngineKV(allocator=kv)
    engines.append(engine)
    hold_null_block(kv, DEADLINE)
    return engine


def make_scheduler(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    engine: EngineKV,
    *,
    caching: bool = False,
    max_seqs: int = 16,
) -> Any:
    """vLLM's Scheduler over kvasync's pool, patched as ``register()`` patches vLLM."""
    init_none_hash(sha256)
    monkeypatch.setattr(
        vllm_coordinator,
        "BlockPool",
        make_block_pool_class(vllm_block_pool.BlockPool, lambda n: engine),
    )
    coordinator = vllm_coordinator.KVCacheCoordinator
    monkeypatch.setattr(
        coordinator,
        "get_num_blocks_to_allocate",
        counting_demand(coordinator.get_num_blocks_to_allocate),
    )
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    model = ModelConfig(model=str(tmp_path), dtype="float16", seed=0, skip_tokenizer_init=True)
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=2048,
            max_model_len=int(model.max_model_len),
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig(device="cpu"),  # the scheduler touches no device
    )
    num_blocks = engine.allocator.num_blocks
    vllm_config.cache_config.num_gpu_blocks = num_blocks
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
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=BLOCK_SIZE,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def add_request(scheduler: Any, request_id: str, prompt: int, output: int = 64) -> Any:
    """A request of ``prompt`` distinct tokens decoding ``output`` tokens."""
    first = 1000 * (len(scheduler.requests) + 1)
    request = Request(
        request_id=request_id,
        prompt_token_ids=[(first + t) % VOCAB for t in range(prompt)],
        sampling_params=SamplingParams(max_tokens=output, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    scheduler.add_request(request)
    return request


def step(scheduler: Any) -> int:
    """One engine step: ``schedule()``, then one sampled token for each scheduled request whose
    prompt is done (a chunk of a longer prompt samples nothing). Returns the tokens scheduled."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for index, req_id in enumerate(req_ids):
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_prompt_tokens
        sampled.append([(7 * index + 11) % VOCAB] if done else [])
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: k for k, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        ),
    )
    return int(output.total_num_scheduled_tokens)


def lines(caplog: pytest.LogCaptureFixture, pattern: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if re.search(pattern, r.getMessage())]


# -- a closed allocator: an orderly stop, said once ----------------------------------------


def test_a_closed_allocator_stops_the_scheduler_with_an_explained_error_said_once(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    engines: list[EngineKV],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Review: schedule() raised the allocator's bare AllocatorClosed from get_num_free_blocks ->
    # _promise -> alloc_nowait, which vLLM reports as an unexplained fatal EngineCore error.
    caplog.set_level(logging.ERROR, logger=LOGGER)
    engine = open_engine(engines, 512)
    scheduler = make_scheduler(monkeypatch, tmp_path, engine)
    first = add_request(scheduler, "first", 40)
    assert step(scheduler) == 40
    engine.allocator.close()
    add_request(scheduler, "second", 100)  # needs new blocks: the count asks the allocator
    for _ in range(2):  # every later step stops the same way
        with pytest.raises(AllocatorClosed, match="KV cache allocator is closed") as raised:
            scheduler.schedule()
        assert "no step can run" in str(raised.value)
        assert "restart" in str(raised.value)
    said = lines(caplog, "KV cache allocator is closed")
    assert len(said) == 1  # one error line, whatever vLLM calls after
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    # vLLM's shutdown ends the requests: frees into the closed allocator raise nothing.
    scheduler.finish_requests(["first", "second"], RequestStatus.FINISHED_ABORTED)
    assert first.status == RequestStatus.FINISHED_ABORTED
    assert not scheduler.requests


def test_a_closed_allocator_stops_decode_steps_that_ask_for_no_block(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    engines: list[EngineKV],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A request decoding inside its last block asks for no block: the count's hot path, where a
    # closed allocator raises nothing (it has none available). Before, schedule() went on and
    # scheduled decode steps over unmapped KV pages.
    caplog.set_level(logging.ERROR, logger=LOGGER)
    engine = open_engine(engines, 512)
    scheduler = make_scheduler(monkeypatch, tmp_path, engine)
    add_request(scheduler, "decoding", 20)  # 2 blocks: 12 tokens free in the second
    assert step(scheduler) == 20
    assert step(scheduler) == 1  # decoding inside its second block
    engine.allocator.close()
    with pytest.raises(AllocatorClosed, match="KV cache allocator is closed"):
        scheduler.schedule()
    assert len(lines(caplog, "KV cache allocator is closed")) == 1


def run_in_forked_child(work: Callable[[], str], timeout: float = DEADLINE) -> str:
    """``work()`` in a forked child: what it returned, or the error it raised, as a line; a
    child still running at the deadline is killed and fails the test."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on
        os.close(read_end)
        try:
            line = work()
        except BaseException as error:  # reported to the parent, which asserts on it
            line = f"{type(error).__name__}: {error}"
        os.write(write_end, line.encode()[:60_000])
        os._exit(0)
    os.close(write_end)
    due = time.monotonic() + timeout
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > due:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"the forked child did not finish within {timeout} s")
            time.sleep(0.01)
        with os.fdopen(read_end, "rb") as reader:
            return reader.read().decode()
    finally:
        with contextlib.suppress(OSError):
            os.close(read_end)


def test_a_forked_child_of_the_engine_stops_with_an_explained_error_instead_of_a_lock(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engines: list[EngineKV]
) -> None:
    # The count's hot path reads the allocator's pool directly; in a forked child that pool's
    # threads and locks are the parent's, so the child gets the allocator's fork error instead.
    engine = open_engine(engines, 512)
    scheduler = make_scheduler(monkeypatch, tmp_path, engine)
    add_request(scheduler, "decoding", 20)
    assert step(scheduler) == 20  # then a decode step inside its second block: no block asked
    said = run_in_forked_child(lambda: str(scheduler.schedule().total_num_scheduled_tokens))
    assert said.startswith("AllocatorClosed: kvasync's vLLM pool: the engine's KV cache")
    assert "forked child" in said
    assert step(scheduler) == 1  # the parent's engine goes on


def test_a_child_forked_mid_step_reads_the_room_afresh_and_stops_with_the_explained_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engines: list[EngineKV]
) -> None:
    # A step's counts of no block reuse the room its first one read, until the step's end
    # (update_from_output): forked before that end, the child has the room in its copy of the
    # pool. It must read it afresh, and get the fork's error.
    engine = open_engine(engines, 512)
    scheduler = make_scheduler(monkeypatch, tmp_path, engine)
    request = add_request(scheduler, "decoding", 20)
    assert step(scheduler) == 20
    # The next step's count for it, as schedule() makes it: no block asked, the room kept.
    assert scheduler.kv_cache_manager.allocate_slots(request, 1) is not None
    said = run_in_forked_child(lambda: str(scheduler.schedule().total_num_scheduled_tokens))
    assert said.startswith("AllocatorClosed: kvasync's vLLM pool: the engine's KV cache"), said
    assert "forked child" in said


# -- a failing map: a miss, never an error -------------------------------------------------


def test_failing_maps_are_misses_of_the_scheduler_and_it_recovers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engines: list[EngineKV]
) -> None:
    from kvasync.testing import FaultInjector

    faults = FaultInjector()
    engine = open_faulty_engine(engines, 512, faults)
    kv = engine.allocator
    scheduler = make_scheduler(monkeypatch, tmp_path, engine)
    wait_until(lambda: 0 < kv.stats().free_blocks < 100, "the reserve mapped, and small")
    faults.fail(10_000)  # every map fails as the driver's out-of-memory
    add_request(scheduler, "big", 100 * BLOCK_SIZE)
    for _ in range(5):  # each step's count asks the mapper again; each is a miss
        assert step(scheduler) == 0
    wait_until(lambda: kv.stats().map_errors > 0, "the mapper's failure")
    assert "ENOMEM" in kv.stats().last_error
    faults.release()
    tokens = 0

    def scheduled() -> bool:
        nonlocal tokens
        tokens = step(scheduler)
        return tokens > 0

    wait_until(scheduled, "the request scheduled once maps succeed")
    assert tokens == min(100 * BLOCK_SIZE, 2048)


def test_an_uncounted_allocation_whose_maps_fail_evicts_cached_blocks_instead_of_raising(
    engines: list[EngineKV],
) -> None:
    # A call vLLM did not count waits for pages the budget allows, and evicts what the allocator
    # lacks. A failed map is such a lack: before, its MapError escaped though vLLM's queue held
    # cached blocks enough.
    from kvasync.testing import FaultInjector

    faults = FaultInjector()
    engine = open_faulty_engine(engines, 512, faults)
    kv = engine.allocator
    pool = make_block_pool_class(vllm_block_pool.BlockPool, lambda n: engine)(512, True, 16)
    cached = pool.get_new_blocks(40)
    for block in cached:  # a prefix-cache entry each, as vLLM's cache_full_blocks gives
        key = vllm_block_pool.make_block_hash_with_group_id(
            vllm_block_pool.BlockHash(block.block_id.to_bytes(32, "little")), 0
        )
        block.set_block_hash(key, num_tokens=BLOCK_SIZE)
        pool.cached_block_hash_to_block.insert(key, block)
    pool.free_blocks(cached)
    assert pool.cached_free_queue.num_free_blocks == 40
    faults.fail(10_000)
    # A reserve refill already in flight when the faults began still lands: wait for the mapper
    # to be idle (every later map fails), then take the mapped free blocks, so that the next
    # call needs a map. (Without the wait the refill's blocks were handed out on vLLM 0.28 in
    # the matrix, once.)
    wait_until(
        lambda: kv.stats().mapping_pages == 0 and kv.stats().queued_jobs == 0, "the mapper idle"
    )
    held = kv.alloc(kv.stats().free_blocks, timeout=DEADLINE) if kv.stats().free_blocks else []
    blocks = pool.get_new_blocks(30)
    assert len(blocks) == 30
    assert {b.block_id for b in blocks} <= {b.block_id for b in cached}
    assert pool.cached_free_queue.num_free_blocks == 10
    assert kv.stats().map_errors > 0
    faults.release()
    kv.free(held)
    pool.free_blocks(blocks)


def test_an_uncounted_allocation_whose_maps_fail_with_nothing_cached_raises_map_error(
    engines: list[EngineKV],
) -> None:
    # Nothing to evict: as stock vLLM raises when it is out of blocks, and takes nothing.
    from kvasync.testing import FaultInjector

    faults = FaultInjector()
    engine = open_faulty_engine(engines, 512, faults)
    kv = engine.allocator
    pool = make_block_pool_class(vllm_block_pool.BlockPool, lambda n: engine)(512, False, 16)
    faults.fail(10_000)
    held = kv.alloc(kv.stats().free_blocks, timeout=DEADLINE) if kv.stats().free_blocks else []
    used = kv.stats().used_blocks
    with pytest.raises(MapError, match="ENOMEM"):
        pool.get_new_blocks(30)
    assert kv.stats().used_blocks == used
    faults.release()
    kv.free(held)


# -- a limit below a request's need: seen, said, and recovered -----------------------------


def test_a_request_the_limit_cannot_hold_is_warned_at_a_bounded_rate_and_recovers(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    engines: list[EngineKV],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Review: with the limit lowered below one request's need, the scheduler ran 615-627 steps
    # scheduling 0 tokens and nothing was logged; it recovered when the limit rose.
    caplog.set_level(logging.INFO, logger=LOGGER)
    engine = open_engine(engines, 512)
    kv = engine.allocator
    scheduler = make_scheduler(monkeypatch, tmp_path, engine)
    pool = scheduler.kv_cache_manager.block_pool
    clock = Clock()
    pool.clock = clock
    kv.resize(memory_limit=2 * PAGE_BYTES, timeout=DEADLINE)  # 32 blocks, the null block's in
    add_request(scheduler, "big", 40 * BLOCK_SIZE)  # 40 blocks
    steps = 100
    for _ in range(steps):
        assert step(scheduler) == 0
        clock.now += 1.0  # 100 s of steps: a line at 0, 30, 60 and 90 s
    warned = lines(caplog, "cannot be scheduled")
    assert len(warned) == 4
    assert re.search(
        r"request big cannot be scheduled: it needs 40 KV blocks and the memory limit in force "
        r"lets this engine hold 31 \(its limit is 32 blocks; 0 held by requests, 0 by the "
        r"prefix cache\)\. It has waited 0\.0 s \(1 counts\)",
        warned[0],
    ), warned[0]
    assert "It has waited 90.0 s (91 counts)" in warned[3]
    assert pool.num_stalled_counts == steps
    assert pool.stalled is not None and pool.stalled.request_id == "big"
    kv.resize(memory_limit=None, timeout=DEADLINE)
    tokens = 0

    def scheduled() -> bool:  # the next steps map what the limit allows now
        nonlocal tokens
        tokens = step(scheduler)
        return tokens > 0

    wait_until(scheduled, "the request scheduled once the limit rose")
    assert tokens == 40 * BLOCK_SIZE
    assert pool.stalled is None
    recovered = lines(caplog, "is scheduled again")
    assert len(recovered) == 1
    assert "request big is scheduled again: it needs 40 KV blocks" in recovered[0]
    assert len(lines(caplog, "cannot be scheduled")) == 4


def test_a_request_waiting_for_others_to_finish_is_no_stall(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    engines: list[EngineKV],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A full cache is ordinary (stock vLLM waits too): only a need beyond what the limit lets the
    # engine hold at all is warned.
    caplog.set_level(logging.INFO, logger=LOGGER)
    engine = open_engine(engines, 512, memory_limit=4 * PAGE_BYTES)  # 64 blocks
    scheduler = make_scheduler(monkeypatch, tmp_path, engine)
    pool = scheduler.kv_cache_manager.block_pool
    add_request(scheduler, "first", 40 * BLOCK_SIZE, output=8)
    add_request(scheduler, "second", 40 * BLOCK_SIZE, output=8)
    served = 0
    for _ in range(200):
        served += step(scheduler)
        if not scheduler.has_requests():
            break
    assert not scheduler.has_requests()
    assert served == 2 * (40 * BLOCK_SIZE + 7)
    assert pool.num_stalled_counts == 0
    assert lines(caplog, "cannot be scheduled") == []
