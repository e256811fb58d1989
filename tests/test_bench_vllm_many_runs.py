"""bench/_vllm_many_runs.py: the share's ledger watch on a real share, the summary's rounding."""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import _vllm_many_runs as runs

from kvasync import Config, KVLayout, open_allocator_sync


def test_compact_rounds_floats_and_keeps_everything_else(tmp_path: pathlib.Path) -> None:
    value = {"a": [1.23456789, 2, "x", (0.5, math.inf)], "b": {"c": 1764676800.123456789}}
    assert runs.compact(value) == {
        "a": [1.2346, 2, "x", [0.5, math.inf]],
        "b": {"c": 1764676800.1235},
    }
    assert math.isnan(runs.compact(math.nan))
    runs.write_summary(tmp_path / "summary.json", {"t": 0.123456})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"t": 0.1235}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_the_share_watch_sees_each_members_bytes_scaled() -> None:
    share = f"many-test-{os.getpid()}"
    layout = KVLayout(1, 1, 8, 16, dtype=torch.float16)  # K and V ranges, 256-byte blocks
    config = Config(
        backend="host",
        max_blocks=64,
        page_size=4096,  # 16 blocks a page, 8 KiB a page id (both ranges)
        share=share,
        device_budget=64 * 1024,
        name="e0-1b",
        reserve_pages=(0, 0),
        default_timeout=10.0,
    )
    expected = 2 * 8192 * 1024  # 20 blocks: 2 page ids, in real bytes (x the dry scale)
    watch = runs.ShareWatch(share, scale=1024, period=0.02)
    watch.start()
    with open_allocator_sync(layout, config) as kv:
        kv.alloc(20)
        deadline = time.monotonic() + 10
        while not any(
            s["members"].get("e0-1b", {}).get("mapped") == expected for s in watch.samples
        ):
            assert time.monotonic() < deadline, "no ledger sample with the member's 2 pages"
            time.sleep(0.02)
    samples = watch.finish()
    member = next(
        s["members"]["e0-1b"]
        for s in samples
        if s["members"].get("e0-1b", {}).get("mapped") == expected
    )
    assert member["committed"] == expected
    # Its limit in force: its capacity (64 blocks of 512 bytes), under the 64 KiB budget.
    assert member["limit"] == 64 * 512 * 1024
    assert set(member) == {"committed", "mapped", "used", "limit", "demand", "blocked"}
    assert not watch.is_alive()
