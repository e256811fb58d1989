"""bench/_vllm_many_sim.py: the simulated scheduler, the step model fit, the split search."""

from __future__ import annotations

import itertools
import pathlib
import random
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import _vllm_many_sim as sim

# 10 ms a step, nothing else: times come out exact.
FLAT = sim.StepModel(0.01, 0.0, 0.0)


def request(rid: str, at: float, prompt: int, output: int) -> dict[str, object]:
    return {"id": rid, "at": at, "prompt_len": prompt, "output_len": output}


def test_a_fixed_pool_hands_out_each_block_once_and_never_the_null_block() -> None:
    pool = sim.FixedPool(5)
    taken = pool.take(4)
    assert taken is not None and sorted(taken) == [1, 2, 3, 4]
    assert pool.take(1) is None and pool.free_count() == 0
    pool.give(taken[:2])
    assert pool.free_count() == 2 and pool.take(0) == []
    with pytest.raises(ValueError, match="null block"):
        sim.FixedPool(1)


def test_one_request_prefills_then_decodes_a_token_a_step() -> None:
    done = sim.simulate([request("a", 0.0, 20, 3)], 10, FLAT, horizon_s=10, give_up_s=5)
    (a,) = done
    # Step 1 computes the prompt and emits token 1; steps 2 and 3 one token each.
    assert a.first == pytest.approx(0.01) and a.finished == pytest.approx(0.03)
    assert a.generated == 3 and a.blocks == [] and a.preempted == 0


def test_a_long_prompt_is_chunked_by_the_token_budget() -> None:
    done = sim.simulate(
        [request("a", 0.0, 100, 1)], 20, FLAT, horizon_s=10, give_up_s=5, max_num_batched_tokens=40
    )
    assert done[0].first == pytest.approx(0.03)  # 40 + 40 + 20 tokens


def test_the_head_of_the_queue_blocks_the_rest_when_its_blocks_are_not_there() -> None:
    # 4 usable blocks: "a" holds 3 (48 tokens), "b" needs 2 and waits, "c" needs 1 and would
    # fit but comes after "b" (first come, first served).
    trace = [request("a", 0.0, 40, 5), request("b", 0.001, 20, 1), request("c", 0.002, 10, 1)]
    done = {r.id: r for r in sim.simulate(trace, 5, FLAT, horizon_s=10, give_up_s=5)}
    assert done["c"].first is not None and done["b"].first is not None
    assert done["c"].first >= done["b"].first >= done["a"].finished  # type: ignore[operator]


def test_a_request_that_cannot_grow_preempts_the_newest_which_recomputes() -> None:
    # 4 usable blocks of 16 tokens: two requests of 16-token prompts and 40-token outputs need 4
    # blocks each at their end. The older keeps running; the newer is preempted, recomputes its
    # prompt and output so far, and finishes after it.
    trace = [request("old", 0.0, 16, 40), request("new", 0.0, 16, 40)]
    scheduler_done = sim.simulate(trace, 5, FLAT, horizon_s=100, give_up_s=50)
    old, new = scheduler_done
    assert old.preempted == 0 and new.preempted >= 1
    assert old.finished is not None and new.finished is not None and new.finished > old.finished
    assert new.generated == 40


def test_clients_give_up_on_requests_with_no_token() -> None:
    # One block: "a" runs 50 steps (0.5 s); "b" waits and is given up at 0.2 s.
    trace = [request("a", 0.0, 4, 10), request("b", 0.0, 4, 1)]
    done = {
        r.id: r
        for r in sim.simulate(trace, 2, sim.StepModel(0.05, 0, 0), horizon_s=10, give_up_s=0.2)
    }
    assert done["a"].finished is not None
    assert done["b"].first is None and done["b"].aborted == pytest.approx(0.2)


def test_within_slo_needs_the_first_token_in_time_and_the_pace_after_it() -> None:
    base = {"at": 1.0, "first": 2.0, "finished": 3.0, "output_tokens": 11}
    assert sim.within_slo(base, 1.0, 0.1)
    assert not sim.within_slo(base, 0.99, 0.1)
    assert not sim.within_slo(base, 1.0, 0.099)
    assert not sim.within_slo({**base, "finished": None}, 1.0, 0.1)
    assert not sim.within_slo({**base, "first": None}, 1.0, 0.1)
    assert sim.within_slo({**base, "output_tokens": 1}, 1.0, 0.0)


def test_the_step_model_fit_recovers_known_coefficients() -> None:
    truth = sim.StepModel(0.012, 4e-5, 7e-6)
    rng = random.Random(0)
    steps = []
    for _ in range(200):
        running, prefill = rng.randint(1, 128), rng.choice([0, 0, 512, 4096])
        steps.append(
            {
                "running": running,
                "tokens": running + prefill,
                "seconds": truth.step_s(running, prefill),
            }
        )
    fitted = sim.fit_step_model(steps, sim.StepModel(1, 1, 1))
    assert fitted.base_s == pytest.approx(truth.base_s, rel=1e-6)
    assert fitted.per_seq_s == pytest.approx(truth.per_seq_s, rel=1e-6)
    assert fitted.per_token_s == pytest.approx(truth.per_token_s, rel=1e-6)


def test_the_step_model_fit_keeps_the_prior_without_enough_steps_or_for_a_negative_slope() -> None:
    prior = sim.StepModel(0.5, 2e-5, 1e-6)
    few = [{"running": 1, "tokens": 1, "seconds": 0.01}] * 19
    assert sim.fit_step_model(few, prior) == prior
    # No prefill logged (its slope is the prior's), and steps that get faster with more
    # sequences (that slope is the prior's too): the base is fitted around them.
    falling = [{"running": n, "tokens": n, "seconds": 0.1 - 0.0001 * n} for n in range(1, 60)]
    fitted = sim.fit_step_model(falling, prior)
    assert fitted.per_seq_s == prior.per_seq_s and fitted.per_token_s == prior.per_token_s
    # The base alone, around the prior's slope of 20 us a sequence: the mean of the residuals.
    assert fitted.base_s == pytest.approx(
        sum(s["seconds"] - 2e-5 * s["running"] for s in falling) / len(falling)
    )


def test_best_split_is_the_brute_force_optimum_on_the_grid() -> None:
    budget, grid = 100, 10
    minima = [10, 20, 5]
    rng = random.Random(3)
    # Concave-ish, increasing curves with plateaus, as the simulated engines give.
    caps = [rng.randint(10, 100) for _ in minima]
    weights = [rng.randint(1, 5) for _ in minima]

    def score(engine: int, capacity: int) -> int:
        return weights[engine] * min(capacity, caps[engine])

    found = sim.best_split(budget, minima, score, grid=grid)
    assert sum(found.split) <= budget
    assert all(part >= low for part, low in zip(found.split, minima, strict=True))
    free = (budget - sum(minima)) // (budget // grid)
    best = max(
        sum(score(e, minima[e] + k * 10) for e, k in enumerate(ks))
        for ks in itertools.product(range(free + 1), repeat=3)
        if sum(ks) <= free
    )
    assert found.within == best == sum(found.per_engine)
    assert found.per_engine == [score(e, part) for e, part in enumerate(found.split)]


def test_best_split_spreads_a_budget_nobody_needs_evenly() -> None:
    found = sim.best_split(120, [0, 0, 0], lambda engine, capacity: 7, grid=12)
    assert found.split == [40, 40, 40] and found.within == 21


def test_best_split_refuses_minima_over_the_budget() -> None:
    with pytest.raises(ValueError, match="exceed the budget"):
        sim.best_split(10, [6, 6], lambda e, c: 0)
