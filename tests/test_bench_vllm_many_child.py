"""bench/_vllm_many_child.py's trace loop, in this process, over the dry engine: arrivals at
their times, clients that give up, the step log, the hold until the trace's end."""

from __future__ import annotations

import pathlib
import sys
import time
from typing import Any

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import _vllm_many_child as child
import _vllm_many_sim as sim
from _vllm_child import Events


def dry_spec(tmp_path: pathlib.Path, plan: list[dict[str, Any]], blocks: int) -> dict[str, Any]:
    go = tmp_path / "trace_go"
    go.write_text(repr(time.time() + 0.05))
    return {
        "kind": "stock",
        "kv_cache_bytes": blocks * 16 * 32 * 1024,  # blocks of the 1B's 32 KiB tokens
        "token_kv_bytes": 32 * 1024,
        "max_num_seqs": 8,
        "engine_kwargs": {"max_num_batched_tokens": 256},
        "index": 2,
        "args": {
            "warmup": [1, 16, 1],
            "trace_go": str(go),
            "plan": plan,
            "salt": "t",
            "max_s": 10.0,
            "give_up_s": 0.3,
            "hold_s": 0.6,
        },
    }


@pytest.mark.timeout(30)
def test_the_trace_loop_serves_gives_up_and_logs_each_step(tmp_path: pathlib.Path) -> None:
    # 5 blocks (4 usable, 64 tokens), 50 ms steps: "long" takes 3 blocks from its first step
    # (40 + 8 tokens) for 8 steps (0.4 s); "starved" needs 2 and arrives right after: its
    # client gives up at 0.3 s; "late" comes after "long" ended and is served at once.
    plan = [
        {"at": 0.0, "id": "e2-long", "prompt_len": 40, "output_len": 8},
        {"at": 0.01, "id": "e2-starved", "prompt_len": 20, "output_len": 2},
        {"at": 0.45, "id": "e2-late", "prompt_len": 8, "output_len": 2},
    ]
    spec = dry_spec(tmp_path, plan, 5)
    driver = child.DryDriver(spec, sim.StepModel(0.05, 0.0, 0.0))
    events = Events(tmp_path / "events.jsonl")
    result = child.serve_trace(driver, spec, events, child.dry_probes(driver))
    long, starved, late = (result["requests"][r["id"]] for r in plan)
    assert long["output_tokens"] == 8 and long["finished"] == pytest.approx(0.4, abs=0.1)
    assert starved["first"] is None and starved["output_tokens"] == 0
    assert 0.3 <= starved["aborted"] <= 0.4
    assert late["first"] - late["at"] < 0.1 and late["finished"] is not None
    # It stayed until its hold (0.6 s) although its last request ended before.
    assert result["samples"][-1]["wall"] - result["t0_wall"] >= 0.55
    steps = result["steps"]
    assert len(steps["t"]) == len(steps["seconds"]) == len(steps["tokens"]) == 10
    assert steps["tokens"][:2] == [40, 1] and steps["running"][0] == 1
    assert max(steps["waiting"]) == 1  # "starved", until its client left
    assert result["kv_blocks"] == 5 and result["index"] == 2 and result["kv_geometry"] is None
    assert [e["event"] for e in _events(tmp_path)] == ["warm"]
    assert driver.scheduler.pool.free_count() == 4  # every block back


def _events(tmp_path: pathlib.Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
