"""bench/bench_vllm_many.py end to end in its dry mode: real engine processes on the child
protocol (simulated schedulers; the kvasync variants on real host-backend allocators in a real
share), the driver's deadlines, the ledger watch, the hindsight search, the report."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import _vllm_many as plan  # noqa: E402
from _vllm_procs import Died, Engine  # noqa: E402

# Small requests and a tight TTFT SLO, so that memory binds at this scale in a few seconds.
SMALL = [
    "--dry",
    "--cases",
    "memory4",
    "--duration",
    "4.5",
    "--period",
    "2",
    "--prompt-median",
    "64",
    "--prompt-range",
    "32",
    "128",
    "--output-range",
    "30",
    "45",
    "--max-model-len",
    "256",
    "--budget4",
    "256MiB",
    "--slo-ttft",
    "0.5",
]


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "bench_vllm_many.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, str]:
    out = tmp_path_factory.mktemp("dry")
    done = bench(
        *SMALL,
        "--variants4",
        "stock-1N",
        "shared",
        "hindsight",
        "--out",
        str(out),
        "--work",
        str(out / "work"),
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


@pytest.mark.timeout(120)
def test_every_variant_serves_every_request_of_its_engines_trace(
    dry_run: tuple[pathlib.Path, str],
) -> None:
    out, _ = dry_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry"] is True
    case = summary["cases"]["memory4"]
    assert list(case["variants"]) == ["stock-1N", "shared", "hindsight-1"]
    for name, variant in case["variants"].items():
        assert "failure" not in variant, name
        assert [e["index"] for e in variant["engines"]] == [0, 1, 2, 3]
        for trace, engine in zip(case["plan"], variant["engines"], strict=True):
            assert set(engine["requests"]) == {r["id"] for r in trace}
            for r in engine["requests"].values():  # each one answered or given up on
                assert (r["finished"] is not None) != (r["aborted"] is not None), (name, r)
            assert len(engine["steps"]["t"]) == len(engine["steps"]["tokens"]) > 0


@pytest.mark.timeout(120)
def test_the_shared_run_keeps_the_ledger_within_the_budget(
    dry_run: tuple[pathlib.Path, str],
) -> None:
    out, _ = dry_run
    case = json.loads((out / "summary.json").read_text())["cases"]["memory4"]
    shared = case["variants"]["shared"]
    ledger = shared["ledger"]
    assert len(ledger) > 20
    # Every engine a member at once (they leave one by one as they end).
    assert max(len(s["members"]) for s in ledger) == 4
    assert {n for s in ledger for n in s["members"]} == {"e0-1b", "e1-1b", "e2-3b", "e3-8b"}
    peak = max(sum(m["committed"] for m in s["members"].values()) for s in ledger)
    assert 0 < peak <= 256 * 2**20
    for engine in shared["engines"]:
        assert engine["kv_geometry"]["reserve_pages"] == [1, 2]
    assert "ledger" not in case["variants"]["stock-1N"]
    # The share's ledger file went with its engines.
    from kvasync import share as shares

    assert shared["share"] not in shares.shares()


@pytest.mark.timeout(120)
def test_the_hindsight_run_is_the_searchs_best_split(dry_run: tuple[pathlib.Path, str]) -> None:
    out, _ = dry_run
    case = json.loads((out / "summary.json").read_text())["cases"]["memory4"]
    search = case["hindsight"]
    split = case["variants"]["hindsight-1"]["split"]
    assert split == search["best"]
    assert sum(split) <= 256 * 2**20
    fields: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in case["spec"].items() if k != "n"
    }
    spec = plan.CaseSpec(**fields)
    for e, part in enumerate(split):
        assert part >= plan.min_engine_bytes(spec, e)
    # The step models were fitted to the steps the earlier variants logged: not the priors.
    priors = [
        [plan.DECODE_BASE_S[m], plan.DECODE_PER_SEQ_S[m], 1 / plan.PREFILL_TOK_S[m]]
        for m in spec.models
    ]
    assert search["models"] != priors


@pytest.mark.timeout(120)
def test_the_report_gives_the_tables_the_checks_the_goals_and_the_files(
    dry_run: tuple[pathlib.Path, str],
) -> None:
    out, stdout = dry_run
    text = (out / "report.md").read_text()
    assert text == stdout  # what was printed is kept
    for needle in (
        "| variant",
        "within SLO (TTFT and TPOT)",
        "shared: ledger max",
        "cold starts: ",
        "idle release: ",
        "limit turns",
        "regime: crest",
        "### Goals (issue 28)",
        "memory4: shared >= 2x stock static 1/N",
        "memory4: shared >= best static split with hindsight",
    ):
        assert needle in text, needle
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [
        "engines.tar.gz",
        "report.md",
        "summary.json",
        "vllm_many_memory4.png",
    ]
    again = bench("--report", str(out), timeout=60)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "### Goals (issue 28)" in again.stdout


@pytest.mark.timeout(60)
def test_a_run_without_time_for_a_variant_says_so_and_starts_no_engine(
    tmp_path: pathlib.Path,
) -> None:
    done = bench(
        *SMALL, "--budget-s", "5", "--out", str(tmp_path), "--work", str(tmp_path / "w"), timeout=50
    )
    assert done.returncode == 0, done.stderr[-2000:]
    case = json.loads((tmp_path / "summary.json").read_text())["cases"]["memory4"]
    for name in ("stock-1N", "stock-size", "kvasync-1N", "shared"):
        assert case["variants"][name]["failure"].startswith("not run: memory4"), name
    assert not list((tmp_path / "w" / "memory4").glob("*.events.jsonl"))


@pytest.mark.timeout(60)
def test_an_engine_that_fails_at_start_is_reported_with_its_error(tmp_path: pathlib.Path) -> None:
    spec: dict[str, Any] = {
        "kind": "stock",
        "task": "many",
        "dry": True,
        "args": {},
        "kv_cache_bytes": 1,  # no block at all: the dry pool refuses it at start
        "token_kv_bytes": 32 * 1024,
        "max_num_seqs": 8,
        "engine_kwargs": {"max_num_batched_tokens": 64},
        "step_model": [0.01, 0.0, 0.0],
    }
    engine = Engine(tmp_path, "broken", spec, {}, script=BENCH / "bench_vllm_many.py")
    try:
        engine.wait("imported", time.monotonic() + 30)
        engine.go()
        with pytest.raises(Died, match="a pool needs the null block"):
            engine.wait("up", time.monotonic() + 30)
    finally:
        engine.kill()
