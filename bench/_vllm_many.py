"""The plan of bench/bench_vllm_many.py: the models, each engine's trace, the static splits and
the arithmetic on paper, before any engine starts (no vLLM, no torch here).

Models are Llama-architecture configs with dummy weights; what matters to a KV budget is each
one's KV bytes per token (K and V of every layer, bf16):

    0.5b  24 layers x 8 KV heads x 64   48 KiB a token
    1b    16 layers x 8 KV heads x 64   32 KiB  (bench_vllm.py's 1B)
    3b    28 layers x 8 KV heads x 128 112 KiB  (Llama-3.2-3B's shape)
    8b    32 layers x 8 KV heads x 128 128 KiB  (Llama-3-8B's shape)

The memory-bound trace, engine by engine (``memory_traces``): one hot model at a time, changing
every ``period_s``: burst k (``burst_n[e]`` requests arriving within ``burst_window_s``) goes to
the k-th engine of ``hot_order`` (engine 0, then the last, then the one before it, ...). A
burst is sized from the budget and the engine's own bytes per token: ``hot_fill`` of the whole
budget at its requests' full length (prompt + output), so that a 1/N partition holds about
1 / (N x hot_fill) of it at once and the rest waits a whole request lifetime (seconds: far
past the TTFT SLO), while the shared budget holds it with room for the cold engines. Every
engine that is not hot first is *cold*: its first request arrives 2-4 s into a burst of
another engine (the hot one holds most of the budget then), then a Poisson trickle at a rate
skewed by popularity (Zipf over the engines' order). Prompts are long (lognormal around
``prompt_median``) and so are outputs (uniform over ``output_range``): each request holds KV for
seconds. The compute-bound trace (``compute_traces``): every engine gets steady Poisson arrivals
of prefill-heavy requests (long prompts, short outputs) at ``overload`` times what the GPU's
prefill rate (a prior per model, ``PREFILL_TOK_S``) serves, shared among the engines, and the
budget holds every engine's full batch under a static 1/N: memory cannot bind there.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GIB = 2**30
MIB = 2**20
BLOCK_TOKENS = 16  # vLLM's default block size on CUDA

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _config(**shape: Any) -> dict[str, Any]:
    return dict(_LLAMA, **shape)


MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "0.5b": _config(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "1b": _config(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "3b": _config(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "8b": _config(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
# Prefill tokens a second on an H200 (bf16, eager): priors for the compute trace's rates and
# the simulation's step model before the run measures its own (about 2 x params FLOP a token at
# ~40% of the H200's dense bf16 peak).
PREFILL_TOK_S = {"0.5b": 250_000.0, "1b": 150_000.0, "3b": 60_000.0, "8b": 25_000.0}
# A decode step's fixed cost (s, eager: kernel launches, vLLM's CPU work) and per sequence.
DECODE_BASE_S = {"0.5b": 0.012, "1b": 0.011, "3b": 0.018, "8b": 0.022}
DECODE_PER_SEQ_S = {"0.5b": 2e-5, "1b": 2e-5, "3b": 5e-5, "8b": 6e-5}


def write_model_config(directory: pathlib.Path, model: str) -> pathlib.Path:
    """Writes ``model``'s config.json into ``directory`` (atomically: engines start at once)."""
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / f".config.{os.getpid()}.json"
    staging.write_text(json.dumps(MODEL_CONFIGS[model]))
    os.replace(staging, directory / "config.json")
    return directory


def parse_size(text: str) -> int:
    """``8GiB`` -> bytes (kvasync's own parser, as its settings read them)."""
    from kvasync._sizes import parse_size as parse

    return parse(text)


def token_kv_bytes(model: str) -> int:
    """KV bytes of one token across all layers: K and V, every KV head, bf16."""
    config = MODEL_CONFIGS[model]
    heads, dim, layers = (
        int(config[k]) for k in ("num_key_value_heads", "head_dim", "num_hidden_layers")
    )
    return 2 * heads * dim * 2 * layers


def request_kv_bytes(model: str, tokens: float) -> int:
    """The KV a request of ``tokens`` holds at its end, in whole blocks."""
    return math.ceil(tokens / BLOCK_TOKENS) * BLOCK_TOKENS * token_kv_bytes(model)


@dataclass(frozen=True)
class CaseSpec:
    """One case of the bench: its engines' models, the KV budget, the trace's shape, the SLOs."""

    name: str
    kind: str  # "memory" or "compute"
    models: tuple[str, ...]
    budget: int  # bytes of KV, all engines together
    duration_s: float  # arrivals end before this
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    seed: int = 0
    period_s: float = 10.0  # memory: one burst every period, the hot engine changing
    burst_window_s: float = 1.0
    hot_fill: float = 0.8  # memory: a burst's KV at full length, of the budget
    cold_rate: float = 0.4  # memory: the most popular cold engine's trickle, requests/s
    prompt_median: int = 1536
    prompt_range: tuple[int, int] = (1024, 2048)
    output_range: tuple[int, int] = (192, 320)
    overload: float = 1.3  # compute: arrivals over the GPU's prefill rate
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2560

    def __post_init__(self) -> None:
        if self.kind not in ("memory", "compute"):
            raise ValueError(f"a case is memory or compute, got {self.kind!r}")
        unknown = [m for m in self.models if m not in MODEL_CONFIGS]
        if unknown or not self.models:
            raise ValueError(f"models must be some of {sorted(MODEL_CONFIGS)}, got {self.models}")
        if self.budget <= 0 or self.duration_s <= 0 or self.period_s <= 0:
            raise ValueError("budget, duration_s and period_s must be positive")
        if self.prompt_range[1] + self.output_range[1] > self.max_model_len:
            raise ValueError(
                f"the longest request ({self.prompt_range[1]} + {self.output_range[1]} tokens) "
                f"does not fit max_model_len {self.max_model_len}"
            )

    @property
    def n(self) -> int:
        return len(self.models)

    def mean_tokens(self) -> float:
        """A request's mean length at its end: prompt + output."""
        return self.prompt_median * math.exp(0.35**2 / 2) + sum(self.output_range) / 2


def hot_set(engines: int) -> list[int]:
    """The engines that get bursts, in their first turn's order: engine 0, then the last ones
    (the bigger models of the cases' lists): 0, N-1, N-2 (fewer with fewer engines)."""
    return [0, *range(engines - 1, 0, -1)][: min(3, engines)]


def hot_order(engines: int, bursts: int) -> list[int]:
    """The hot engine of each burst: the hot set in turn (``hot_set``), then again."""
    cycle = hot_set(engines)
    return [cycle[k % len(cycle)] for k in range(bursts)]


def burst_sizes(case: CaseSpec) -> list[int]:
    """Each engine's burst: ``hot_fill`` of the budget at full length, at most a full batch."""
    sizes = []
    for model in case.models:
        per_request = request_kv_bytes(model, case.mean_tokens())
        sizes.append(
            max(4, min(case.max_num_seqs, round(case.hot_fill * case.budget / per_request)))
        )
    return sizes


def _lengths(rng: random.Random, case: CaseSpec) -> tuple[int, int]:
    low, high = case.prompt_range
    prompt = int(min(high, max(low, rng.lognormvariate(math.log(case.prompt_median), 0.35))))
    return prompt, rng.randint(*case.output_range)


def _request(engine: int, tag: str, at: float, lengths: tuple[int, int]) -> dict[str, Any]:
    return {
        "at": round(at, 4),
        "id": f"e{engine}-{tag}",
        "prompt_len": lengths[0],
        "output_len": lengths[1],
    }


def memory_traces(case: CaseSpec) -> list[list[dict[str, Any]]]:
    """Each engine's requests in arrival order (``{"at", "id", "prompt_len", "output_len"}``,
    the format bench_vllm.py's trace task reads); see the module's docstring."""
    rng = random.Random(f"memory/{case.seed}/{case.n}")
    bursts = max(2, int((case.duration_s - case.burst_window_s - 0.5) // case.period_s) + 1)
    order = hot_order(case.n, bursts)
    sizes = burst_sizes(case)
    plan: list[list[dict[str, Any]]] = [[] for _ in range(case.n)]
    starts = [0.5 + k * case.period_s for k in range(bursts)]
    for k, engine in enumerate(order):
        for i in range(sizes[engine]):
            at = starts[k] + case.burst_window_s * i / sizes[engine]
            plan[engine].append(_request(engine, f"b{k}-{i}", at, _lengths(rng, case)))
    # Each engine trickles from its first moment on: a hot one from its first burst; one that
    # is never hot from its cold start, 2-4 s into a burst of another engine (the hot one holds
    # most of the budget then), the cold engines spread over the bursts.
    never_hot = [e for e in range(case.n) if e not in order]
    first = {e: starts[order.index(e)] for e in set(order)}
    for rank, engine in enumerate(never_hot):
        burst = 1 + rank % (bursts - 1)
        first[engine] = starts[burst] + 2.0 + 2.0 * rng.random()
        plan[engine].append(_request(engine, "cold0", first[engine], _lengths(rng, case)))
    # Popularity: Zipf over the engines in their order (engine 0 the most popular).
    for engine in range(case.n):
        rate = case.cold_rate / (engine + 1)
        t, index = first[engine], 1
        while True:
            t += rng.expovariate(rate)
            if t >= case.duration_s:
                break
            if any(
                s <= t < s + case.period_s
                for s, e in zip(starts, order, strict=True)
                if e == engine
            ):
                continue  # its own hot phase: its burst is its load then
            plan[engine].append(_request(engine, f"c{index}", t, _lengths(rng, case)))
            index += 1
    for engine in range(case.n):
        plan[engine].sort(key=lambda r: r["at"])
    return plan


def first_arrivals(plan: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any] | None]:
    """Each engine's first request: the cold start (no request before it), or None."""
    return [engine[0] if engine else None for engine in plan]


def compute_traces(case: CaseSpec) -> list[list[dict[str, Any]]]:
    """Steady Poisson arrivals per engine, at ``overload`` / N of what the GPU prefills of its
    model (``PREFILL_TOK_S``): together they ask ``overload`` x the GPU's prefill time."""
    rng = random.Random(f"compute/{case.seed}/{case.n}")
    plan: list[list[dict[str, Any]]] = []
    for engine, model in enumerate(case.models):
        rate = case.overload / case.n * PREFILL_TOK_S[model] / case.prompt_median
        requests, t, index = [], 0.0, 0
        while True:
            t += rng.expovariate(rate)
            if t >= case.duration_s:
                break
            requests.append(_request(engine, f"r{index}", t, _lengths(rng, case)))
            index += 1
        plan.append(requests)
    return plan


def traces(case: CaseSpec) -> list[list[dict[str, Any]]]:
    return memory_traces(case) if case.kind == "memory" else compute_traces(case)


def trace_end(plan: Sequence[Sequence[dict[str, Any]]]) -> float:
    """The last arrival of all engines (seconds after the trace's start)."""
    return max((r["at"] for engine in plan for r in engine), default=0.0)


def compute_budget(case: CaseSpec) -> int:
    """The compute case's budget: a static 1/N holds every engine's full batch of its longest
    requests (so memory cannot bind), in whole GiB."""
    longest = case.prompt_range[1] + case.output_range[1]
    need = max(request_kv_bytes(m, longest) for m in case.models) * case.max_num_seqs
    return math.ceil(need * case.n / GIB) * GIB


# -- static splits -----------------------------------------------------------------------------


def min_engine_bytes(case: CaseSpec, engine: int) -> int:
    """The least KV an engine starts with: one request of ``max_model_len`` (vLLM refuses to
    start below it), plus its null block."""
    return request_kv_bytes(case.models[engine], case.max_model_len + BLOCK_TOKENS)


def split_by_weights(case: CaseSpec, weights: Sequence[float]) -> list[int]:
    """The budget split by ``weights``, each at least its engine's minimum, in whole MiB, never
    more than the budget in all.

    Raises:
        ValueError: the weights do not match the engines, or the minima alone exceed the budget.
    """
    if len(weights) != case.n or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{case.n} non-negative weights wanted, got {list(weights)}")
    floors = [-(-min_engine_bytes(case, e) // MIB) * MIB for e in range(case.n)]
    if sum(floors) > case.budget:
        raise ValueError(
            f"the engines' minima ({sum(floors) / GIB:.2f} GiB: one max_model_len request each) "
            f"exceed the budget {case.budget / GIB:.2f} GiB: raise the budget"
        )
    free = case.budget - sum(floors)
    total = sum(weights)
    split = [f + int(free * w / total) // MIB * MIB for f, w in zip(floors, weights, strict=True)]
    assert sum(split) <= case.budget, f"bug: a split of {sum(split)} over {case.budget}"
    return split


def equal_split(case: CaseSpec) -> list[int]:
    """budget / N each, in whole MiB (what an operator sets by hand)."""
    share = case.budget // case.n // MIB * MIB
    if share < max(min_engine_bytes(case, e) for e in range(case.n)):
        raise ValueError(f"budget / {case.n} is below an engine's minimum: raise the budget")
    return [share] * case.n


def size_split(case: CaseSpec) -> list[int]:
    """The budget split by the models' KV bytes per token (a bigger model gets more)."""
    return split_by_weights(case, [float(token_kv_bytes(m)) for m in case.models])


# -- on paper ----------------------------------------------------------------------------------


def paper_rows(case: CaseSpec, plan: Sequence[Sequence[dict[str, Any]]]) -> list[list[str]]:
    """Per engine: its model, KV bytes per token, a mean request's KV, its burst and the KV the
    burst needs at once, how many of it a 1/N and a by-size partition hold at once, and its
    requests in the trace."""
    sizes = burst_sizes(case)
    equal, by_size = equal_split(case), size_split(case)
    rows = []
    for e, model in enumerate(case.models):
        per_request = request_kv_bytes(model, case.mean_tokens())
        rows.append(
            [
                f"e{e}",
                model,
                f"{token_kv_bytes(model) // 1024}",
                f"{per_request / MIB:.0f}",
                str(sizes[e]) if case.kind == "memory" else "-",
                f"{sizes[e] * per_request / GIB:.2f}" if case.kind == "memory" else "-",
                f"{equal[e] / GIB:.2f} ({equal[e] // per_request})",
                f"{by_size[e] / GIB:.2f} ({by_size[e] // per_request})",
                str(len(plan[e])),
            ]
        )
    return rows


PAPER_COLUMNS = [
    "engine",
    "model",
    "KV KiB/token",
    "KV MiB/request",
    "burst",
    "burst KV GiB",
    "1/N GiB (requests held)",
    "by size GiB (requests held)",
    "requests",
]
