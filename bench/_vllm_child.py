"""The engine side of bench/bench_vllm.py: one vLLM engine in its own process, doing one task.

The driver (bench_vllm.py) writes a spec (JSON) and runs ``bench_vllm.py --child SPEC``. The child
imports vLLM, says so, waits for its ``go`` file (so that the driver can import the next engine
while the current one runs, and start two engines at a moment it picks), builds the engine, and
runs its task. It reports progress as JSON lines in its events file (``imported``, ``up``,
``measured``, ``batch``, ``served``, ``released``, ``done``, ...): the driver holds a deadline on
each, so an engine that hangs is reported as a hang with its elapsed time, never waited out.

Nothing here imports vLLM or torch at module level: the driver imports this module for the
prompts, the trace and the model config.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import pathlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# A Llama-3-8B-shaped config, for runs where the GPU, not vLLM's per-step CPU work, should set
# the pace (``bench_vllm.py --model 8b``; only the throughput and identity modes take it).
MODEL_CONFIG_8B = dict(
    MODEL_CONFIG,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    head_dim=128,
    tie_word_embeddings=False,
)
# DeepSeek-V2-Lite's attention (MLA: kv_lora_rank 512, qk_rope_head_dim 64, 16 heads, no q
# LoRA), 27 layers, its dense MLP in every layer instead of the MoE (first_k_dense_replace = all
# layers), plain RoPE: 2.6B parameters, for SGLang's MLA KV pool (``bench_sglang.py --model mla``).
MODEL_CONFIG_MLA: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 27,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "vocab_size": 102400,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 100000,
    "eos_token_id": 100001,
}
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "1b": MODEL_CONFIG,
    "8b": MODEL_CONFIG_8B,
    "mla": MODEL_CONFIG_MLA,
}
# KV bytes of one token across all layers: K and V, 8 heads of 64, bf16, 16 layers (32 KiB).
TOKEN_KV_BYTES = 2 * 8 * 64 * 2 * 16
GIB = 2**30
# Log lines vLLM prints once the worker took its start-up memory snapshot and before the profile
# run compares free memory against it (V2 model runner, V1 model runner).
AFTER_SNAPSHOT = ("Loading model from scratch", "Starting to load model")


def write_model_config(directory: pathlib.Path, model: str = "1b") -> pathlib.Path:
    """Writes the model's config.json (atomically: several engines may start at once)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "config.json"
    staging = directory / f".config.{os.getpid()}.json"
    staging.write_text(json.dumps(MODEL_CONFIGS[model]))
    os.replace(staging, target)
    return directory


def prompt_tokens(salt: str, index: int, length: int) -> list[int]:
    """A deterministic prompt of random token ids: two prompts share no prefix block, so
    prefix caching (stock vLLM's default) finds nothing to reuse in any engine."""
    rng = random.Random(f"{salt}/{index}")
    return rng.choices(range(10, 50010), k=length)


def tokens_digest(tokens: Sequence[int]) -> str:
    """A short digest of an output's token ids (identity is compared digest by digest)."""
    return hashlib.blake2b(json.dumps(list(tokens)).encode(), digest_size=8).hexdigest()


def alternating_trace(
    *,
    engines: int,
    bursts: int,
    period_s: float,
    requests: int,
    window_s: float,
    prompt_len: int,
    output_len: int,
) -> list[list[dict[str, Any]]]:
    """Each engine's arrivals: burst ``k`` goes to engine ``k % engines`` at ``k * period_s``,
    ``requests`` arrivals spread evenly over ``window_s``; the other engines are quiet then.

    Returns:
        Per engine, its requests in arrival order: ``{"at": s, "id": str, "prompt_len": n,
        "output_len": n}``.
    """
    if engines < 1 or bursts < 1 or requests < 1 or period_s <= 0 or window_s < 0:
        raise ValueError("alternating_trace: engines, bursts, requests >= 1, period_s > 0")
    plan: list[list[dict[str, Any]]] = [[] for _ in range(engines)]
    for burst in range(bursts):
        engine = burst % engines
        for index in range(requests):
            plan[engine].append(
                {
                    "at": burst * period_s + window_s * index / requests,
                    "id": f"b{burst}-{index}",
                    "prompt_len": prompt_len,
                    "output_len": output_len,
                }
            )
    return plan


class Events:
    """The child's progress, one JSON object a line, flushed at once."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        record = {"event": event, "wall": time.time(), "t": time.monotonic() - self.t0, **fields}
        with self._lock, self.path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")
            stream.flush()


def wait_file(path: pathlib.Path, deadline: float, what: str) -> str:
    """The text of ``path`` once it exists (the driver writes it whole with a rename).

    Raises:
        TimeoutError: not there by ``deadline`` (``time.monotonic``).
    """
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} ({path}) within the child's deadline")
        time.sleep(0.02)
    return path.read_text()


class Sampler(threading.Thread):
    """Samples, every ``period`` seconds: wall time, device used GiB, the engine's kvasync mapped
    GiB (NaN when none), and vLLM's KV usage (the fraction of its blocks in use)."""

    def __init__(self, probes: dict[str, Callable[[], float]], period: float) -> None:
        super().__init__(daemon=True)
        self.probes = probes
        self.period = period
        self.samples: list[dict[str, float]] = []
        self.marks: list[tuple[float, str]] = []
        self.stop_event = threading.Event()

    def mark(self, phase: str) -> None:
        self.marks.append((time.time(), phase))

    def run(self) -> None:
        while not self.stop_event.wait(self.period):
            sample = {"wall": time.time()}
            for name, probe in self.probes.items():
                try:
                    sample[name] = probe()
                except Exception:  # a probe is best effort: a missing figure is NaN
                    sample[name] = math.nan
            self.samples.append(sample)

    def finish(self) -> list[dict[str, float]]:
        self.stop_event.set()
        self.join(5.0)
        return self.samples


def probes(llm: Any, spec: dict[str, Any]) -> dict[str, Callable[[], float]]:
    """What the sampler reads in this engine: the device's used memory, the kvasync allocator's
    mapped bytes (its own allocator when the worker is in this process, else the share's
    ledger: with the multiprocess executor the worker is another process), vLLM's KV usage
    (the fraction its block pool reports) and the KV its requests hold, in GiB."""
    import torch

    found: dict[str, Callable[[], float]] = {}

    def device_used() -> float:
        free, total = torch.cuda.mem_get_info()
        return (total - free) / GIB

    found["device_gib"] = device_used
    # What PyTorch's caching allocator holds in this process (the worker's, with the in-process
    # executor): activations, the profile run's leftovers, and stock vLLM's KV tensors; kvasync's
    # KV is mapped outside it (the 1 GiB limit's question in issue 25: which of the two is more).
    found["torch_reserved_gib"] = lambda: torch.cuda.memory_reserved() / GIB
    found["torch_allocated_gib"] = lambda: torch.cuda.memory_allocated() / GIB
    if spec["kind"] == "kvasync":
        from kvasync.integrations.vllm._engine import current_engine

        registered = current_engine()
        share = spec["env"].get("KVASYNC_SHARE")
        # With the multiprocess executor the pages are mapped in the worker's process: the
        # share's ledger sees them, this process's allocator (if any) does not.
        if registered is not None and not (share and spec["executor"] == "mp"):
            allocator = registered.allocator
            found["mapped_gib"] = lambda: allocator.stats().mapped_bytes / GIB
        elif share:
            from kvasync import share as shares

            name = spec["env"].get("KVASYNC_NAME", "")

            def ledger_mapped() -> float:
                entries = shares.snapshot(share)
                return sum(e.mapped_bytes for e in entries if e.name.startswith(name)) / GIB

            found["mapped_gib"] = ledger_mapped
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        block_gib = int(cache.block_size) * TOKEN_KV_BYTES / GIB
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
    except AttributeError:  # the engine core in another process: no usage figure
        return found
    found["kv_usage"] = lambda: float(scheduler.kv_cache_manager.usage)
    kvasync_pool = getattr(pool, "kvasync_allocator", None)
    # kvcached's block pool (its ElasticBlockPool) keeps its page allocator's manager here; with
    # the in-process executor the pages are mapped in this process. Its figure counts the pages in
    # use over all layers, K and V.
    kvcached_manager = (
        getattr(pool, "kv_cache_manager", None) if spec["kind"] == "kvcached" else None
    )
    if kvcached_manager is not None and "mapped_gib" not in found:
        found["mapped_gib"] = lambda: float(kvcached_manager.get_mapped_memory_size()) / GIB
    if kvasync_pool is not None:
        # Its usage is over what the budget allows now, not over the capacity: count blocks
        # (less vLLM's null block).
        found["kv_used_gib"] = lambda: (kvasync_pool.stats().used_blocks - 1) * block_gib
    else:
        usable = int(cache.num_gpu_blocks or 0) - 1  # vLLM's null block is never handed out
        found["kv_used_gib"] = lambda: float(scheduler.kv_cache_manager.usage) * usable * block_gib
    return found


def kvcached_patched() -> bool:
    """Whether kvcached's import hook patched vLLM's engine core (its marker on the method)."""
    from vllm.v1.engine.core import EngineCore

    return getattr(EngineCore.__init__, "init", False) is True


def allocator_counters() -> dict[str, int] | None:
    """The kvasync allocator's map and unmap counts in this process, or None."""
    from kvasync.integrations.vllm._engine import current_engine

    registered = current_engine()
    if registered is None:
        return None
    stats = registered.allocator.stats()
    return {"maps_done": stats.maps_done, "unmaps_done": stats.unmaps_done}


def preemptions(llm: Any) -> float | None:
    """vLLM's ``vllm:num_preemptions`` counter (needs the engine's stats on), or None."""
    try:
        metrics = llm.get_metrics()
    except Exception:
        return None
    values = [m.value for m in metrics if m.name == "vllm:num_preemptions"]
    return float(sum(values)) if values else None


def build_engine(spec: dict[str, Any]) -> tuple[Any, float]:
    """The engine of ``spec``, and its start time (the ``LLM`` constructor's seconds)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec["model_dir"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        # CUDA graphs are captured once at start, before any request: the plugin must not map
        # or unmap in a way that breaks a capture (--cuda-graphs tries it).
        "enforce_eager": not spec.get("cuda_graphs", False),
        "gpu_memory_utilization": spec["utilization"],
        "max_model_len": spec["max_model_len"],
        "dtype": "bfloat16",
        "seed": 0,
        "attention_config": {"backend": spec.get("attention", "TRITON_ATTN")},
        "distributed_executor_backend": spec["executor"],
        "tensor_parallel_size": int(spec.get("tensor_parallel_size", 1)),
        "disable_log_stats": not spec.get("stats", False),
    }
    if spec.get("kv_cache_bytes"):
        kwargs["kv_cache_memory_bytes"] = int(spec["kv_cache_bytes"])
    if spec.get("max_num_seqs"):
        kwargs["max_num_seqs"] = int(spec["max_num_seqs"])
    kwargs.update(spec.get("engine_kwargs", {}))  # any other LLM argument a bench sets
    started = time.monotonic()
    llm = LLM(**kwargs)
    return llm, time.monotonic() - started


def batch_of(salt: str, count: int, prompt_len: int, output_len: int) -> tuple[list[Any], Any]:
    """``count`` greedy requests: their prompts and their sampling parameters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=output_len, temperature=0, detokenize=False, ignore_eos=True)
    prompts = [
        TokensPrompt(prompt_token_ids=prompt_tokens(salt, i, prompt_len)) for i in range(count)
    ]
    return prompts, params


def generate(llm: Any, salt: str, count: int, prompt_len: int, output_len: int) -> list[Any]:
    prompts, params = batch_of(salt, count, prompt_len, output_len)
    return list(llm.generate(prompts, params, use_tqdm=False))


def output_tokens(outs: Sequence[Any]) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outs)


# -- tasks -----------------------------------------------------------------------------------


def task_phases(llm: Any, spec: dict[str, Any], events: Events) -> dict[str, Any]:
    """Warm-up, then ``rounds`` equal rounds (throughput, and each output's digest for the
    identity check), then an idle pause and a trickle (the memory plot's way down)."""
    args = spec["args"]
    sampler = Sampler(probes(llm, spec), 0.05)
    sampler.start()
    sampler.mark("warmup")
    for k, (count, prompt_len, output_len) in enumerate(args["warmup"]):
        generate(llm, f"warmup{k}", count, prompt_len, output_len)
    rounds = []
    for r in range(args["rounds"]):
        count, prompt_len, output_len = args["round"]
        prompts, params = batch_of(f"round{r}", count, prompt_len, output_len)
        sampler.mark(f"round {r + 1}")
        t = time.monotonic()
        outs = list(llm.generate(prompts, params, use_tqdm=False))
        seconds = time.monotonic() - t
        produced = output_tokens(outs)
        rounds.append(
            {
                "seconds": seconds,
                "output_tokens": produced,
                "tok_s": produced / seconds,
                "digests": [tokens_digest(o.outputs[0].token_ids) for o in outs],
            }
        )
        events.emit("round", index=r, tok_s=produced / seconds, seconds=seconds)
    events.emit("measured")
    sampler.mark("idle")
    time.sleep(args["idle_s"])
    count, prompt_len, output_len = args["trickle"]
    sampler.mark("trickle")
    trickle = generate(llm, "trickle", count, prompt_len, output_len)
    sampler.mark("end")
    time.sleep(0.5)
    return {
        "rounds": rounds,
        "trickle_digests": [tokens_digest(o.outputs[0].token_ids) for o in trickle],
        "samples": sampler.finish(),
        "marks": sampler.marks,
        "kv_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }


def task_paired(llm: Any, spec: dict[str, Any], events: Events) -> dict[str, Any]:
    """Warm-up, then one round each time the driver writes this engine's turn file
    (``<turn>.<k>``, k = 0, 1, ...) until it writes ``<turn>.stop``: the driver alternates two
    engines that are up at once, round by round, so that the GPU's and the host's drift falls on
    both alike (bench/_vllm_paired.py). Round k's prompts are the same in every engine."""
    args = spec["args"]
    for k, (count, prompt_len, output_len) in enumerate(args["warmup"]):
        generate(llm, f"warmup{k}", count, prompt_len, output_len)
    events.emit("warm")
    turn, stop = pathlib.Path(args["turn"]), pathlib.Path(args["turn"] + ".stop")
    count, prompt_len, output_len = args["round"]
    rounds = []
    for k in itertools.count():
        deadline = time.monotonic() + args["turn_within_s"]
        mine = pathlib.Path(f"{turn}.{k}")
        while not mine.exists():
            if stop.exists():
                return {"rounds": rounds}
            if time.monotonic() > deadline:
                raise TimeoutError(f"no turn {k} ({mine}) within {args['turn_within_s']} s")
            time.sleep(0.002)
        prompts, params = batch_of(f"pair{k}", count, prompt_len, output_len)
        t = time.monotonic()
        outs = list(llm.generate(prompts, params, use_tqdm=False))
        seconds = time.monotonic() - t
        produced = output_tokens(outs)
        digests = [tokens_digest(o.outputs[0].token_ids) for o in outs]
        digest = hashlib.blake2b(",".join(digests).encode(), digest_size=8).hexdigest()
        rounds.append({"seconds": seconds, "output_tokens": produced, "digest": digest})
        events.emit("round", index=k, tok_s=produced / seconds, seconds=seconds, digest=digest)
    raise AssertionError("unreachable: itertools.count() does not end")


def task_serve(llm: Any, spec: dict[str, Any], events: Events) -> dict[str, Any]:
    """Serves the ``batches`` in a cycle with an idle ``gap_s`` between them (so a kvasync engine
    maps and unmaps) until the driver writes ``stop`` (finish the batch, report) or ``release``
    (leave at once: the process ends and the device gets its memory back), or ``max_s``."""
    args = spec["args"]
    stop = pathlib.Path(args["stop"])
    release = pathlib.Path(args["release"])

    def watch_release() -> None:
        while not release.exists():
            time.sleep(0.01)
        events.emit("released")
        os._exit(0)

    threading.Thread(target=watch_release, daemon=True).start()
    sampler = Sampler(probes(llm, spec), 0.1)
    sampler.start()
    counters = allocator_counters()
    batches = []
    due = time.monotonic() + args["max_s"]
    k = 0
    while not stop.exists() and time.monotonic() < due:
        count, prompt_len, output_len = args["batches"][k % len(args["batches"])]
        begin = time.time()
        outs = generate(llm, f"serve{k}", count, prompt_len, output_len)
        end = time.time()
        batch = {"begin": begin, "end": end, "output_tokens": output_tokens(outs)}
        batches.append(batch)
        events.emit("batch", index=k, **batch)
        k += 1
        time.sleep(args["gap_s"])
    after = allocator_counters()
    return {
        "batches": batches,
        "samples": sampler.finish(),
        "maps": None
        if counters is None or after is None
        else after["maps_done"] - counters["maps_done"],
        "unmaps": None
        if counters is None or after is None
        else after["unmaps_done"] - counters["unmaps_done"],
    }


def task_starter(llm: Any, spec: dict[str, Any], events: Events) -> dict[str, Any]:
    """A few requests, then the engine is shut down (timed)."""
    count, prompt_len, output_len = spec["args"]["serve"]
    t = time.monotonic()
    outs = generate(llm, "starter", count, prompt_len, output_len)
    seconds = time.monotonic() - t
    events.emit("served", seconds=seconds, output_tokens=output_tokens(outs))
    return {"served_s": seconds, "output_tokens": output_tokens(outs)}


def task_trace(llm: Any, spec: dict[str, Any], events: Events) -> dict[str, Any]:
    """Timed arrivals through vLLM's engine loop (``LLMEngine.add_request``/``step``, outputs
    streamed as deltas), so each request's time to first token is seen when its first token
    comes out of a step. The trace starts at the wall time the driver writes to ``trace_go``
    (both engines of a run start it together)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    args = spec["args"]
    generate(llm, "warm", *args["warmup"])
    engine = llm.llm_engine
    plan = args["plan"]
    # Prompts rendered as LLM.generate renders them (its private step; the raw prompt where it
    # is gone), and the sampler running, before the trace: nothing but add_request on its path.
    render = getattr(llm, "_preprocess_cmpl", None)
    prompts = []
    for index, request in enumerate(plan):
        prompt = TokensPrompt(
            prompt_token_ids=prompt_tokens(args["salt"], index, request["prompt_len"])
        )
        prompts.append(render([prompt])[0] if render is not None else prompt)
    records: dict[str, dict[str, Any]] = {}
    sampler = Sampler(probes(llm, spec), 0.05)
    sampler.start()
    before = preemptions(llm)
    events.emit("warm")
    start_wall = float(wait_file(pathlib.Path(args["trace_go"]), time.monotonic() + 120, "go"))
    t0 = time.monotonic() + (start_wall - time.time())
    due = t0 + args["max_s"]
    pending = list(zip(plan, prompts, strict=True))
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        if now > due:
            events.emit(
                "trace deadline", left=len(pending), running=engine.get_num_unfinished_requests()
            )
            break
        while pending and t0 + pending[0][0]["at"] <= now:
            request, prompt = pending.pop(0)
            params = SamplingParams(
                max_tokens=request["output_len"],
                temperature=0,
                detokenize=False,
                ignore_eos=True,
                output_kind=RequestOutputKind.DELTA,
            )
            engine.add_request(request["id"], prompt, params)
            records[request["id"]] = {
                "at": request["at"],
                "arrived": time.monotonic() - t0,
                "first": None,
                "finished": None,
                "output_tokens": 0,
            }
        if not engine.has_unfinished_requests():
            if pending:
                time.sleep(min(0.01, max(0.0, t0 + pending[0][0]["at"] - now)))
            continue
        for out in engine.step():
            # vLLM reports the id it was given; the suffix it adds inside is not expected here.
            record = records.get(out.request_id) or records.get(out.request_id.rsplit("-", 1)[0])
            if record is None:
                continue
            got = len(out.outputs[0].token_ids) if out.outputs else 0
            if got and record["first"] is None:
                record["first"] = time.monotonic() - t0
            record["output_tokens"] += got
            if out.finished:
                record["finished"] = time.monotonic() - t0
    after = preemptions(llm)
    capacity = (llm.llm_engine.vllm_config.cache_config.num_gpu_blocks or 0) * 16 * TOKEN_KV_BYTES
    return {
        "requests": records,
        "t0_wall": start_wall,
        "samples": sampler.finish(),
        "kv_capacity_gib": capacity / GIB,
        "preemptions": None if before is None or after is None else after - before,
    }


TASKS: dict[str, Callable[[Any, dict[str, Any], Events], dict[str, Any]]] = {
    "phases": task_phases,
    "paired": task_paired,
    "serve": task_serve,
    "starter": task_starter,
    "trace": task_trace,
}


def run_child(spec_path: pathlib.Path) -> None:
    """The child's whole life; ends the process itself (``os._exit``) after a timed shutdown,
    so that no Python teardown of vLLM's can keep it alive past its report."""
    spec: dict[str, Any] = json.loads(spec_path.read_text())
    events = Events(pathlib.Path(spec["events"]))
    code = 0
    # The driver's engines live in their own sessions (so that a kill takes the executor's
    # workers too); an engine whose driver is gone ends itself instead of holding the GPU.
    driver = os.getppid()

    def watch_driver() -> None:
        while os.getppid() == driver:
            time.sleep(0.5)
        events.emit("driver gone")
        os._exit(5)

    threading.Thread(target=watch_driver, daemon=True).start()
    try:
        t = time.monotonic()
        if spec["kind"] == "kvcached":  # its import hook must be in place before vLLM's import
            from _vllm_reference import enable_in_this_process

            enable_in_this_process(spec["kvcached_site"])
        # What build_engine and the tasks use, so that a start times the engine, not imports
        # (as the earlier bench_vllm.py, which imported LLM at its top).
        from vllm import LLM, SamplingParams  # noqa: F401
        from vllm.inputs import TokensPrompt  # noqa: F401

        if spec["kind"] == "kvcached":
            events.emit("kvcached", patched=kvcached_patched())
        events.emit("imported", seconds=time.monotonic() - t)
        if spec.get("go"):
            wait_file(pathlib.Path(spec["go"]), time.monotonic() + spec["go_within_s"], "go")
            events.emit("go")
        llm, start_s = build_engine(spec)
        events.emit("up", start_s=start_s)
        result = TASKS[spec["task"]](llm, spec, events)
        result.update(name=spec["name"], kind=spec["kind"], start_s=start_s)
        result_path = pathlib.Path(spec["result"])
        staging = result_path.with_suffix(".tmp")
        staging.write_text(json.dumps(result))
        os.replace(staging, result_path)
        events.emit("result")
        t = time.monotonic()

        def shutdown_hang() -> None:
            events.emit("shutdown hang")
            os._exit(4)

        watchdog = threading.Timer(20.0, shutdown_hang)
        watchdog.daemon = True
        watchdog.start()
        llm.llm_engine.engine_core.shutdown()
        watchdog.cancel()
        events.emit("done", shutdown_s=time.monotonic() - t)
    except BaseException as error:  # reported to the driver, which also has the log
        events.emit("error", error=f"{type(error).__name__}: {error}"[:400])
        code = 1
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)
