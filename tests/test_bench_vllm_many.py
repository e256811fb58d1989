"""bench/_vllm_many.py: the models' KV bytes, the traces, the static splits, the paper rows."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import _vllm_many as plan

GIB = 2**30
MIB = 2**20


def memory4(**overrides: object) -> plan.CaseSpec:
    fields: dict[str, object] = {
        "name": "memory4",
        "kind": "memory",
        "models": ("1b", "1b", "3b", "8b"),
        "budget": 8 * GIB,
        "duration_s": 32.0,
    }
    fields.update(overrides)
    return plan.CaseSpec(**fields)  # type: ignore[arg-type]


def test_token_kv_bytes_are_k_and_v_of_every_layer_in_bf16() -> None:
    assert plan.token_kv_bytes("1b") == 2 * 8 * 64 * 2 * 16 == 32 * 1024
    assert plan.token_kv_bytes("0.5b") == 48 * 1024
    assert plan.token_kv_bytes("3b") == 112 * 1024
    assert plan.token_kv_bytes("8b") == 128 * 1024


def test_the_1b_config_is_bench_vllms_own() -> None:
    from _vllm_child import MODEL_CONFIG

    assert plan.MODEL_CONFIGS["1b"] == MODEL_CONFIG


def test_request_kv_rounds_up_to_whole_blocks() -> None:
    assert plan.request_kv_bytes("1b", 16) == 16 * 32 * 1024
    assert plan.request_kv_bytes("1b", 17) == 32 * 32 * 1024


def test_write_model_config_writes_the_models_json(tmp_path: pathlib.Path) -> None:
    folder = plan.write_model_config(tmp_path / "m", "8b")
    assert json.loads((folder / "config.json").read_text()) == plan.MODEL_CONFIGS["8b"]
    assert [p.name for p in folder.iterdir()] == ["config.json"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kind": "both"}, "memory or compute"),
        ({"models": ("1b", "70b")}, "models must be"),
        ({"models": ()}, "models must be"),
        ({"budget": 0}, "positive"),
        ({"output_range": (192, 1024)}, "does not fit max_model_len"),
    ],
)
def test_a_bad_case_is_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        memory4(**overrides)


def test_hot_order_turns_over_engine_0_and_the_last_two() -> None:
    assert plan.hot_order(4, 5) == [0, 3, 2, 0, 3]
    assert plan.hot_order(8, 4) == [0, 7, 6, 0]
    assert plan.hot_order(2, 3) == [0, 1, 0]


def test_bursts_fill_the_same_share_of_the_budget_at_each_models_bytes() -> None:
    case = memory4()
    sizes = plan.burst_sizes(case)
    assert sizes == [110, 110, 31, 28]
    for model, size in zip(case.models, sizes, strict=True):
        need = size * plan.request_kv_bytes(model, case.mean_tokens())
        assert 0.75 * case.budget <= need <= 0.85 * case.budget


def test_the_memory_trace_is_seeded_sorted_and_as_described() -> None:
    case = memory4()
    trace = plan.traces(case)
    assert trace == plan.traces(case)  # the same requests in every variant
    assert plan.traces(memory4(seed=1)) != trace
    for engine in trace:
        assert [r["at"] for r in engine] == sorted(r["at"] for r in engine)
        for r in engine:
            assert 1024 <= r["prompt_len"] <= 2048 and 192 <= r["output_len"] <= 320
    # Bursts: 0.5, 10.5, 20.5, 30.5 s to engines 0, 3, 2, 0, each of its burst size.
    bursts = {
        (e, r["id"].split("-")[1])
        for e, engine in enumerate(trace)
        for r in engine
        if "-b" in r["id"]
    }
    assert bursts == {(0, "b0"), (3, "b1"), (2, "b2"), (0, "b3")}
    first_b1 = min(r["at"] for r in trace[3] if "-b1-" in r["id"])
    assert first_b1 == 10.5
    # Engine 1 is never hot: its first request comes 2-4 s into burst 1 (engine 3 holds the
    # budget then), the others' first requests are their first bursts.
    cold = plan.first_arrivals(trace)
    assert cold[1] is not None and cold[1]["id"] == "e1-cold0" and 12.5 <= cold[1]["at"] <= 14.5
    assert [c["at"] for c in cold if c] == [0.5, cold[1]["at"], 20.5, 10.5]
    assert plan.trace_end(trace) < case.duration_s


def test_a_hot_engine_gets_no_trickle_in_its_own_hot_phase() -> None:
    trace = plan.traces(memory4())
    trickle = [r["at"] for r in trace[3] if "-c" in r["id"]]
    assert trickle  # it trickles after its phase
    assert not [t for t in trickle if 10.5 <= t < 20.5]


def test_the_compute_trace_asks_overload_times_the_prefill_rate() -> None:
    case = memory4(
        name="compute4",
        kind="compute",
        duration_s=200.0,
        prompt_median=1024,
        prompt_range=(768, 1280),
        output_range=(32, 64),
        max_num_seqs=64,
    )
    trace = plan.traces(case)
    asked = sum(
        len(engine) * case.prompt_median / plan.PREFILL_TOK_S[model] / case.duration_s
        for engine, model in zip(trace, case.models, strict=True)
    )
    assert asked == pytest.approx(case.overload, rel=0.1)
    budget = plan.compute_budget(case)
    per_engine = budget // case.n
    for model in case.models:  # a 1/N partition holds the full batch of the longest requests
        assert per_engine >= 64 * plan.request_kv_bytes(model, 1280 + 64)
    assert budget % GIB == 0


def test_splits_stay_within_the_budget_and_above_each_minimum() -> None:
    case = memory4()
    equal = plan.equal_split(case)
    assert equal == [2 * GIB] * 4
    by_size = plan.size_split(case)
    assert sum(by_size) <= case.budget
    assert by_size[0] == by_size[1] < by_size[2] < by_size[3]
    for e, part in enumerate(by_size):
        assert part >= plan.min_engine_bytes(case, e)
        assert part % MIB == 0


def test_a_split_below_the_engines_minima_is_refused() -> None:
    case = memory4(budget=512 * MIB)
    with pytest.raises(ValueError, match="exceed the budget"):
        plan.split_by_weights(case, [1, 1, 1, 1])
    with pytest.raises(ValueError, match="4 non-negative weights"):
        plan.split_by_weights(memory4(), [1, 1])


def test_paper_rows_give_each_engines_bytes_and_what_a_partition_holds() -> None:
    case = memory4()
    rows = plan.paper_rows(case, plan.traces(case))
    assert len(rows) == 4 and len(rows[0]) == len(plan.PAPER_COLUMNS)
    assert rows[3][:5] == ["e3", "8b", "128", "238", "28"]
    assert rows[3][6] == "2.00 (8)"  # 2 GiB holds 8 of the 8B's 238 MiB requests
