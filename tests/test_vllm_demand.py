"""A vLLM engine in a share tells the share what its waiting requests need (Note [The engine's
demand in a share] in ``kvasync.integrations.vllm._demand``), under vLLM's own ``Scheduler``.

Needs vLLM importable (``make vllm-test``); CI's venv has none, and the tests skip there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_vllm_pool_failures import (
    BLOCK_SIZE,
    DEADLINE,
    PAGE_BYTES,
    VLLM_ERROR,
    Clock,
    add_request,
    make_scheduler,
    step,
    wait_until,
)

from kvasync import Config, KVLayout, SyncAllocator, open_allocator_sync
from kvasync import share as ledger
from kvasync.integrations.vllm import _demand, _pool
from kvasync.integrations.vllm._demand import reporting_demand, waiting_need
from kvasync.integrations.vllm._engine import EngineKV, hold_null_block

pytestmark = pytest.mark.skipif(bool(VLLM_ERROR), reason=VLLM_ERROR or "vLLM present")

if not VLLM_ERROR:
    from vllm.v1.core.sched.scheduler import Scheduler

LAYOUT = KVLayout(1, 1, 256, BLOCK_SIZE, dtype=torch.int8, kv_buffers=1)  # 16 blocks a page
BLOCKS_PER_PAGE = PAGE_BYTES // LAYOUT.range_block_bytes


@pytest.fixture
def allocators() -> Iterator[list[SyncAllocator]]:
    opened: list[SyncAllocator] = []
    yield opened
    for kv in opened:
        kv.close()


def open_member(
    allocators: list[SyncAllocator], share: str, name: str, reserve: tuple[int, int]
) -> SyncAllocator:
    kv = open_allocator_sync(
        LAYOUT,
        Config(
            backend="host",
            max_blocks=16 * BLOCKS_PER_PAGE,
            page_size=PAGE_BYTES,
            reserve_pages=reserve,
            share=share,
            device_budget=16 * PAGE_BYTES,
            name=name,
        ),
    )
    allocators.append(kv)
    return kv


def entry(share: str, name: str) -> ledger.LedgerEntry:
    (found,) = [e for e in ledger.snapshot(share) if e.name == name]
    return found


def reporting_scheduler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kv: SyncAllocator, max_seqs: int = 16
) -> Any:
    """vLLM's Scheduler over ``kv``, patched as ``register()`` patches it in a share."""
    hold_null_block(kv, DEADLINE)
    scheduler = make_scheduler(monkeypatch, tmp_path, EngineKV(allocator=kv), max_seqs=max_seqs)
    monkeypatch.setattr(Scheduler, "schedule", reporting_demand(Scheduler.schedule))
    return scheduler


def test_waiting_need_counts_the_requests_that_fit_the_batch_first_in_line_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, share: str, allocators: list[SyncAllocator]
) -> None:
    kv = open_member(allocators, share, "engine", (1, 2))
    scheduler = reporting_scheduler(monkeypatch, tmp_path, kv, max_seqs=3)
    for index, prompt in enumerate((40, 16, 100, 7)):
        add_request(scheduler, f"r{index}", prompt)
    # Nothing scheduled yet: 3 free slots, so the first three, each its prompt's blocks and
    # the block its first output token starts (40 // 16 + 1, 16 // 16 + 1, 100 // 16 + 1).
    assert waiting_need(scheduler) == 3 + 2 + 7


def test_an_engine_with_requests_queued_makes_an_idle_member_give_its_reserve_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, share: str, allocators: list[SyncAllocator]
) -> None:
    # The share: 16 pages. An idle member keeps a reserve of 6 to 8 pages mapped; the engine
    # can map the other 8 and has 12 requests of 2 pages each queued. vLLM's scheduler admits
    # what is mapped and stops at the first request short: without its queue's demand the share
    # sees no shortage (the engine wants what it holds) and the idle member's reserve stays
    # (bench_vllm_many memory4 on the H200: 3.4 of 8 GiB idle beside a queue of 110).
    idle = open_member(allocators, share, "idle", (6, 8))
    idle.free(idle.alloc(7 * BLOCKS_PER_PAGE, timeout=DEADLINE))  # its reserve, mapped
    wait_until(lambda: entry(share, "idle").mapped_bytes >= 6 * PAGE_BYTES, "the idle reserve")
    kv = open_member(allocators, share, "engine", (1, 2))
    scheduler = reporting_scheduler(monkeypatch, tmp_path, kv)
    for index in range(12):
        add_request(scheduler, f"r{index}", 2 * BLOCKS_PER_PAGE * BLOCK_SIZE - BLOCK_SIZE)

    def reserve_given_back() -> bool:
        step(scheduler)
        return entry(share, "idle").mapped_bytes <= PAGE_BYTES

    wait_until(reserve_given_back, "the idle member's reserve given back to the share")
    # The report: what the engine holds and what its waiting requests need, in pages.
    demand = entry(share, "engine").demand_bytes
    assert demand > entry(share, "engine").committed_bytes
    # And the engine runs more requests than the 8 pages it could map beside the reserve.
    wait_until(
        lambda: step(scheduler) >= 0 and len(scheduler.running) > 4,
        "the engine running requests on the pages the idle member gave back",
    )


def test_a_rise_of_a_page_is_reported_at_once_and_anything_else_at_most_every_interval(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, share: str, allocators: list[SyncAllocator]
) -> None:
    kv = open_member(allocators, share, "engine", (1, 2))
    pool = reporting_scheduler(monkeypatch, tmp_path, kv).kv_cache_manager.block_pool
    clock = Clock()
    pool.clock = clock

    def demand_pages() -> int:
        return entry(share, "engine").demand_bytes // PAGE_BYTES

    pool.report_demand(2 * BLOCKS_PER_PAGE)  # the first report: 1 + 32 blocks, 3 pages
    assert demand_pages() == 3
    pool.report_demand(BLOCKS_PER_PAGE // 2)  # a fall, within the interval: not yet
    pool.report_demand(2 * BLOCKS_PER_PAGE + 4)  # a rise of less than a page: not yet
    assert demand_pages() == 3
    pool.report_demand(3 * BLOCKS_PER_PAGE)  # a rise of a page: at once
    assert demand_pages() == 4
    clock.now += _pool._REPORT_INTERVAL
    pool.report_demand(BLOCKS_PER_PAGE // 2)  # the interval passed: the fall goes through
    assert demand_pages() == 1


def test_a_queue_vllm_cannot_read_ends_the_reports_once_with_a_log_and_the_engine_runs_on(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    share: str,
    allocators: list[SyncAllocator],
    caplog: pytest.LogCaptureFixture,
) -> None:
    kv = open_member(allocators, share, "engine", (1, 2))
    scheduler = reporting_scheduler(monkeypatch, tmp_path, kv)
    add_request(scheduler, "r0", 40)

    def unreadable(scheduler: Any) -> int:  # a vLLM whose queue has a shape the table missed
        raise AttributeError("'Request' object has no attribute 'num_computed_tokens'")

    monkeypatch.setattr(_demand, "waiting_need", unreadable)
    with caplog.at_level(logging.ERROR, logger="kvasync.vllm"):
        assert step(scheduler) > 0
        assert step(scheduler) > 0
    failures = [r for r in caplog.records if "no longer reports its demand" in r.getMessage()]
    assert len(failures) == 1
