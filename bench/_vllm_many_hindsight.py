"""The arithmetic of bench/bench_vllm_many.py that needs the simulation: each static split's
simulated requests within SLO, each engine's step model fitted to the steps its engine logged,
the best static split with hindsight, and a case's plan on paper."""

from __future__ import annotations

from typing import Any

import _vllm_many as plan_
import _vllm_many_sim as sim


def prior(model: str) -> sim.StepModel:
    return sim.StepModel(
        plan_.DECODE_BASE_S[model], plan_.DECODE_PER_SEQ_S[model], 1 / plan_.PREFILL_TOK_S[model]
    )


def horizon(case: plan_.CaseSpec, plan: list[list[dict[str, Any]]], give_up: float) -> float:
    """Where an engine stops its trace: past it no request can still be within both SLOs."""
    return (
        plan_.trace_end(plan)
        + max(give_up, case.slo_ttft_s)
        + case.output_range[1] * case.slo_tpot_s
        + 1.0
    )


def simulate_engine(
    case: plan_.CaseSpec,
    plan: list[list[dict[str, Any]]],
    engine: int,
    capacity: int,
    model: sim.StepModel,
    give_up: float,
) -> int:
    """The engine's requests within SLO with a static KV cache of ``capacity`` bytes, simulated."""
    return sim.count_within(
        plan[engine],
        capacity // (plan_.token_kv_bytes(case.models[engine]) * plan_.BLOCK_TOKENS),
        model,
        horizon_s=horizon(case, plan, give_up),
        give_up_s=give_up,
        ttft_s=case.slo_ttft_s,
        tpot_s=case.slo_tpot_s,
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
    )


def simulated(
    case: plan_.CaseSpec,
    plan: list[list[dict[str, Any]]],
    split: list[int],
    models: list[sim.StepModel],
    give_up: float,
) -> list[int]:
    """Each engine's requests within SLO under a static ``split`` (bytes), simulated."""
    return [simulate_engine(case, plan, e, split[e], models[e], give_up) for e in range(case.n)]


def fitted_models(case: plan_.CaseSpec, variants: dict[str, Any]) -> list[sim.StepModel]:
    """Each engine's step model fitted to every step its engine logged in the variants so far."""
    found = []
    for e, model in enumerate(case.models):
        steps: list[dict[str, Any]] = []
        for record in variants.values():
            for engine in record.get("engines") or []:
                if engine.get("index") == e:
                    log = engine["steps"]
                    steps += [
                        dict(zip(log, row, strict=True)) for row in zip(*log.values(), strict=True)
                    ]
        found.append(sim.fit_step_model(steps, prior(model)))
    return found


def hindsight_splits(
    case: plan_.CaseSpec,
    plan: list[list[dict[str, Any]]],
    variants: dict[str, Any],
    runs: int,
    give_up: float,
) -> tuple[list[list[int]], dict[str, Any]]:
    """The best static split with hindsight (and, for ``runs`` 2, the split by the shared run's
    mean KV in use), with what the search saw."""
    models = fitted_models(case, variants)
    minima = [plan_.min_engine_bytes(case, e) for e in range(case.n)]

    def score(e: int, capacity: int) -> int:
        return simulate_engine(case, plan, e, capacity, models[e], give_up)

    search = sim.best_split(case.budget, minima, score)
    splits = [search.split]
    info: dict[str, Any] = {
        "models": [[m.base_s, m.per_seq_s, m.per_token_s] for m in models],
        "best": search.split,
        "best_within": search.within,
        "best_per_engine": search.per_engine,
        "curves": search.curves,
        "grid_bytes": search.grid_bytes,
    }
    shared = variants.get("shared", {}).get("engines")
    if runs > 1 and shared:
        means = []
        for engine in shared:
            used = [s.get("kv_used_gib", 0.0) for s in engine.get("samples", [])]
            means.append(max(1e-6, sum(used) / max(1, len(used))))
        by_demand = plan_.split_by_weights(case, means)
        info["by_demand"] = by_demand
        info["by_demand_within"] = sum(simulated(case, plan, by_demand, models, give_up))
        splits.append(by_demand)
    return splits, info


def paper(case: plan_.CaseSpec, plan: list[list[dict[str, Any]]], give_up: float) -> dict[str, Any]:
    """The case's arithmetic before any engine: each engine's bytes, burst and partitions, and
    the simulated requests within SLO (step model priors) under static 1/N, by size, and each
    engine alone with the whole budget (an upper bound for shared)."""
    found: dict[str, int] = {}
    models = [prior(m) for m in case.models]
    # The simulation runs each engine on a GPU of its own, so it sees no compute bound (the
    # engines' contention is in the fitted models only): on paper for the memory cases alone.
    for label, parts in (
        ("static 1/N", plan_.equal_split(case)),
        ("by size", plan_.size_split(case)),
        ("alone", [case.budget] * case.n),
    ):
        if case.kind == "memory":
            found[label] = sum(simulated(case, plan, parts, models, give_up))
    prefill = sum(
        r["prompt_len"] / plan_.PREFILL_TOK_S[model]
        for engine, model in zip(plan, case.models, strict=True)
        for r in engine
    )
    return {
        "columns": plan_.PAPER_COLUMNS,
        "rows": plan_.paper_rows(case, plan),
        "simulated": found,
        "requests": sum(len(engine) for engine in plan),
        # The GPU's time the prompts ask, over the arrivals' span (PREFILL_TOK_S: priors).
        "prefill_load": prefill / max(1e-9, plan_.trace_end(plan)),
    }
