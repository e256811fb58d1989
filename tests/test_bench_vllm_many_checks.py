"""bench/_vllm_many_checks.py and the goals of _vllm_many_report.py, on hand-built records."""

from __future__ import annotations

import math
import pathlib
import sys
from typing import Any

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import _vllm_many_checks as checks
import _vllm_many_report as report

GIB = 2**30
T0 = 1000.0  # the trace's wall time


def record(
    at: float, first: float | None, finished: float | None, tokens: int = 11
) -> dict[str, Any]:
    return {
        "at": at,
        "arrived": at,
        "first": first,
        "finished": finished,
        "aborted": None if first is not None else at + 6.0,
        "output_tokens": tokens if first is not None else 0,
    }


def steps(rows: list[tuple[float, float, int, int, int]]) -> dict[str, list[Any]]:
    keys = ("t", "seconds", "tokens", "running", "waiting")
    return {k: [row[i] for row in rows] for i, k in enumerate(keys)}


def test_engine_summary_counts_both_slos_and_the_give_ups() -> None:
    result = {
        "requests": {
            "a": record(0.0, 0.5, 1.5),  # TTFT 0.5, TPOT 0.1: within
            "b": {**record(0.0, 2.5, 3.5), "arrived": 0.25},  # TTFT over 2 s; handed in late
            "c": record(0.0, 0.5, 3.5),  # TPOT 0.3 s
            "d": record(0.0, None, None),  # given up
        },
        "samples": [{"wall": T0, "mapped_gib": 1.0}, {"wall": T0 + 1, "mapped_gib": 2.5}],
        "preemptions": 3.0,
        "start_s": 9.0,
    }
    found = checks.engine_summary(result, 2.0, 0.1)
    assert found["requests"] == 4 and found["finished"] == 3 and found["aborted"] == 1
    assert found["within_ttft"] == 2 and found["within_slo"] == 1
    assert found["mapped_max_gib"] == 2.5 and math.isnan(found["kv_used_max_gib"])
    assert found["ttft_p50"] == pytest.approx(0.5) and found["preemptions"] == 3.0
    assert found["late_max_s"] == 0.25


def test_queue_seconds_say_what_held_the_queue() -> None:
    log = steps(
        [
            (0.0, 0.1, 4096, 10, 2),  # the token budget used up: compute, 2 x 0.1
            (0.1, 0.1, 100, 128, 3),  # the batch full: 3 x 0.2
            (0.3, 0.1, 50, 10, 4),  # neither: memory, 4 x 0.1
            (0.4, 0.1, 50, 10, 0),  # nothing waits
            (0.5, 0.5, 50, 10, 1),  # the last step: its own seconds, memory
        ]
    )
    found = checks.queue_seconds(log, 128, 4096)
    assert found["compute"] == pytest.approx(0.2)
    assert found["batch"] == pytest.approx(0.6)
    assert found["memory"] == pytest.approx(0.4 + 0.5)


def test_the_crest_is_the_busiest_second_of_all_engines() -> None:
    quiet = {"steps": steps([(0.0, 0.01, 10, 1, 0), (5.0, 0.01, 10, 1, 0)])}
    busy = {"steps": steps([(2.0, 0.02, 3000, 40, 0), (2.5, 0.04, 3000, 50, 0)])}
    found = checks.crest([quiet, busy])
    assert found == {"tokens_s": 6000.0, "step_ms": pytest.approx(30.0), "running": 50.0}


def test_busy_spells_merge_overlapping_requests() -> None:
    requests = {
        "a": record(0.0, 0.1, 2.0),
        "b": record(1.0, 1.1, 3.0),
        "c": record(5.0, None, None),  # given up at 11.0
    }
    assert checks.busy_spells(requests, 20.0) == [(0.0, 3.0), (5.0, 11.0)]


def kvasync_engine(mapped: list[tuple[float, float]], requests: dict[str, Any]) -> dict[str, Any]:
    return {
        "t0_wall": T0,
        "kv_geometry": {"page_bytes": 64 * 2**20, "reserve_pages": [2, 4]},
        "samples": [{"wall": T0 + t, "mapped_gib": m} for t, m in mapped],
        "requests": requests,
    }


def test_idle_release_times_each_idle_spell_down_to_the_null_page_and_reserve() -> None:
    floor = 5 * 64 / 1024  # (1 + 4) pages of 64 MiB
    engine = kvasync_engine(
        [(0.0, 3.0), (2.0, 3.0), (2.2, 1.0), (2.6, floor), (4.9, 2.0), (6.0, 2.0), (9.0, 2.0)],
        {"a": record(0.0, 0.1, 2.0), "b": record(5.0, 5.1, 6.0)},
    )
    found = checks.idle_release(engine)
    # Spell 2.0-5.0: down at 2.6 s (0.6 s); spell 6.0-9.0 (the end): never down.
    assert [(x["begin"], x["length"]) for x in found] == [(2.0, 3.0), (6.0, 3.0)]
    assert found[0]["release_s"] == pytest.approx(0.6) and math.isnan(found[1]["release_s"])
    assert found[0]["floor_gib"] == pytest.approx(floor)


def test_idle_release_reads_the_floor_through_the_summarys_rounding() -> None:
    # summary.json keeps 4 decimals: 48 MiB (3 pages of 16 MiB) is 0.046875 GiB, read back as
    # 0.0469. That is at the floor, not over it.
    engine = kvasync_engine(
        [(0.0, 1.0), (2.1, 0.0469), (5.0, 0.0469)], {"a": record(0.0, 0.1, 2.0)}
    )
    engine["kv_geometry"] = {"page_bytes": 16 * 2**20, "reserve_pages": [1, 2]}
    (spell,) = checks.idle_release(engine)
    assert spell["release_s"] == pytest.approx(0.1)


def test_idle_release_judges_no_short_spell_and_no_stock_engine() -> None:
    engine = kvasync_engine(
        [(0.0, 3.0), (3.0, 3.0)], {"a": record(0.0, 0.1, 1.0), "b": record(2.0, 2.1, 3.0)}
    )
    assert checks.idle_release(engine) == []  # 1.0 s idle < IDLE_MIN_S
    assert checks.idle_release({**engine, "kv_geometry": None}) == []


def test_cold_starts_time_each_engines_first_request_and_see_the_hot_one() -> None:
    plan = [
        [{"id": "e0-b0-0", "at": 0.5}],
        [{"id": "e1-cold0", "at": 12.0}],
        [{"id": "e2-cold0", "at": 14.0}],
    ]
    engines = [
        {"t0_wall": T0, "requests": {"e0-b0-0": record(0.5, 0.6, 3.0)}},
        {"t0_wall": T0, "requests": {"e1-cold0": record(12.0, 13.5, 20.0)}},
        {"t0_wall": T0, "requests": {"e2-cold0": record(14.0, 16.5, 20.0)}},
    ]
    ledger = [
        {"wall": T0 + 12.0, "members": {"e0": {"committed": 6 * GIB}, "e1": {"committed": 0}}},
        {
            "wall": T0 + 14.0,
            "members": {"e0": {"committed": 1 * GIB}, "e2": {"committed": 7 * GIB}},
        },
    ]
    found = checks.cold_starts(plan, engines, 2.0, ledger, 8 * GIB, ["e0", "e1", "e2"])
    assert [(c["engine"], c["within"]) for c in found] == [(1, True), (2, False)]
    assert found[0]["ttft_s"] == pytest.approx(1.5)
    # e1 came while e0 held 6 of 8 GiB; e2's own 7 GiB do not count, e0's 1 does.
    assert found[0]["others_max_share"] == 0.75 and found[1]["others_max_share"] == 0.125


def test_ledger_peak_sums_one_snapshot_at_a_time() -> None:
    ledger = [
        {
            "wall": 0,
            "members": {"a": {"committed": 5, "mapped": 4}, "b": {"committed": 1, "mapped": 1}},
        },
        {
            "wall": 1,
            "members": {"a": {"committed": 1, "mapped": 1}, "b": {"committed": 6, "mapped": 6}},
        },
    ]
    assert checks.ledger_peak(ledger) == {"committed": 7, "mapped": 7}


def test_limit_turns_count_changes_and_fall_rise_turns() -> None:
    limits = [8, 8, 4, 6, 6, 2, 9, 9]  # falls at 2, rises at 3, falls at 5, rises at 6
    ledger = [
        {"wall": float(t), "members": {"a": {"limit": v}, "b": {"limit": 4}}}
        for t, v in enumerate(limits)
    ]
    found = checks.limit_turns(ledger, budget=8)  # 9 reads as the budget, 8
    assert found["a"] == {"changes": 4.0, "turns": 2.0, "closest_s": 3.0}
    assert found["b"]["changes"] == 0.0 and math.isnan(found["b"]["closest_s"])


def test_the_regime_checks() -> None:
    static = {"queue_memory_s": 100.0, "queue_compute_s": 5.0}
    shared = {"queue_memory_s": 10.0, "queue_compute_s": 4.0}
    assert checks.memory_bound(static, shared) and checks.memory_bound(static, None)
    assert not checks.memory_bound({"queue_memory_s": 5.0, "queue_compute_s": 5.0}, shared)
    assert not checks.memory_bound(static, {"queue_memory_s": 1.0, "queue_compute_s": 4.0})
    # A shared run that served everything: a little queue, most of it the step's token budget;
    # 0.13 s of compute wait a request against a 2 s SLO is no sign that compute binds.
    served = {"queue_memory_s": 4.0, "queue_compute_s": 39.0, "requests": 291}
    assert checks.memory_bound(static, served, slo_ttft_s=2.0)
    assert not checks.memory_bound(static, served)  # no SLO given: the queue's shares alone
    assert not checks.memory_bound(static, {**served, "queue_compute_s": 600.0}, slo_ttft_s=2.0)
    computing = {"queue_memory_s": 1.0, "queue_compute_s": 50.0}
    assert checks.compute_bound(computing, computing)
    assert not checks.compute_bound(computing, static)
    assert not checks.compute_bound({"queue_memory_s": 0.0, "queue_compute_s": 0.0}, computing)


def summary(within: int, memory: float = 100.0, compute: float = 0.0, cold: Any = ()) -> Any:
    return {
        "within_slo": within,
        "queue_memory_s": memory,
        "queue_compute_s": compute,
        "cold_starts": list(cold),
    }


def test_goal_rows_judge_each_goal_beside_its_baseline() -> None:
    cases: dict[str, dict[str, Any]] = {"memory4": {}, "memory8": {}, "compute4": {}}
    found = {
        "memory4": {
            "stock-1N": summary(100),
            "shared": summary(
                250,
                10.0,
                1.0,
                [
                    {"within": True, "others_max_share": 0.7},
                    {"within": True, "others_max_share": 0.5},
                ],
            ),
            "hindsight-1": summary(240),
            "hindsight-2": summary(262),
        },
        "memory8": {
            "stock-1N": summary(100),
            "shared": summary(199, cold=[{"within": False, "others_max_share": 0.9}]),
        },
        "compute4": {
            "stock-1N": summary(300, 0.0, 80.0),
            "shared": summary(292, 0.0, 90.0),
        },
    }
    rows = report.goal_rows(cases, found)
    assert [row[0].split(":")[0] for row in rows] == [
        "memory4",
        "memory8",
        "memory4",
        "compute4",
        "cold starts",
    ]
    assert [row[-1] for row in rows] == ["met", "NOT met", "met", "met", "NOT met"]
    assert rows[0][1:4] == ["250", "100 (stock 1/N)", "2.50"]
    assert rows[1][3] == "1.99"
    # The best hindsight run is the baseline; 250 / 262 is within 5%.
    assert rows[2][1:4] == ["250", "262 (hindsight-2)", "0.95"]
    assert rows[3][3] == "0.973"
    # Over half the budget held by another engine: 0.7 and 0.9, not 0.5.
    assert rows[4][1:3] == [
        "2",
        "3 cold starts (2 while another engine held over half the budget)",
    ]


def test_a_goal_whose_regime_check_fails_says_so() -> None:
    found = {"memory4": {"stock-1N": summary(100, 1.0, 50.0), "shared": summary(300)}}
    (row,) = report.goal_rows({"memory4": {}}, found)
    assert row[-1] == "met (regime check: not memory-bound)"


def test_goal_rows_hold_the_shared_run_to_the_budget_and_the_idle_bound() -> None:
    cases: dict[str, dict[str, Any]] = {"memory8": {"spec": {"budget": 8 * GIB}}}
    shared = {
        **summary(300),
        "ledger_peak": {"committed": 8 * GIB, "mapped": 7 * GIB},
        "idle": {"0": [{"release_s": 0.2}], "3": [{"release_s": 0.9}, {"release_s": 0.4}]},
    }
    found = {"memory8": {"stock-1N": summary(100), "shared": shared}}
    rows = report.goal_rows(cases, found)
    assert [row[-1] for row in rows] == ["met", "met", "met"]
    assert rows[1][1:4] == ["8.000 GiB", "8.000 GiB", "1.000"]
    assert rows[2][1:3] == ["0.90 s (slowest)", "3 idle spells"]
    # One byte over the budget, and a spell that never came back (NaN) wherever it is.
    shared["ledger_peak"]["committed"] = 8 * GIB + 1
    shared["idle"]["0"] = [{"release_s": math.nan}, {"release_s": 0.1}]
    rows = report.goal_rows(cases, found)
    assert [row[-1] for row in rows] == ["met", "NOT met", "NOT met"]
    assert rows[2][1] == "one never back"
