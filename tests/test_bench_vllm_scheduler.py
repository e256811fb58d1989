"""bench/bench_vllm_scheduler.py's pools in a share (``--share``): each in a fresh share of its
own, the reporting one's ``Scheduler.schedule`` wrapped as ``register()`` wraps it, all of them
in lock step beside stock's, and the ledgers gone at the end.

Needs vLLM importable (``make vllm-test``); CI's venv has none, and the tests skip there.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from kvasync import share as ledger

try:
    # vLLM's scheduler itself: a bare ``import vllm`` also finds bench/vllm/ (results, no
    # package) as a namespace package once a test has put bench/ on sys.path.
    import vllm.v1.core.sched.scheduler  # noqa: F401

    VLLM_ERROR = ""
except Exception as error:  # any import failure means: no vLLM here
    VLLM_ERROR = f"vLLM is not importable here ({type(error).__name__}: {error}); make vllm-test"

pytestmark = pytest.mark.skipif(bool(VLLM_ERROR), reason=VLLM_ERROR or "vLLM present")

if not VLLM_ERROR:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import bench_vllm_scheduler as bench

# 8 requests of 4 blocks, 8 at a time, 64 tokens a step: the first step schedules the first
# prompt alone, and the other 7 wait with a slot each in the batch.
REQUESTS, PROMPT, MAX_SEQS, BATCHED = 8, 64, 8, 64
NUM_BLOCKS = 4097  # room for the reserve the worker would give this scheduler


@pytest.fixture
def setup(tmp_path: pathlib.Path) -> tuple[Any, Any, Any]:
    """The workload, its vLLM config (prefix caching on) and the request hasher, as main()."""
    (tmp_path / "config.json").write_text(json.dumps(bench.MODEL_CONFIG))
    workload = bench.Workload(
        requests=REQUESTS,
        prompt=PROMPT,
        output=4,
        shared_prefix=16,
        max_seqs=MAX_SEQS,
        batched_tokens=BATCHED,
        num_blocks=NUM_BLOCKS,
    )
    config = bench.vllm_config_for(workload, True, str(tmp_path))
    hash_fn = bench.get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    bench.init_none_hash(hash_fn)
    return workload, config, bench.get_request_block_hasher(bench.BLOCK_SIZE, hash_fn)


@pytest.fixture
def shares() -> Iterator[tuple[str, str]]:
    """--share's two fresh shares (plain, reporting), as pools_for makes them."""
    with ExitStack() as stack:
        yield (
            stack.enter_context(bench.fresh_share("joined")),
            stack.enter_context(bench.fresh_share("report")),
        )


def pools_under_test(shares: tuple[str, str]) -> dict[str, Any]:
    joined, report = shares
    return {
        bench.STOCK: bench.PoolUnderTest(),
        "kvasync": bench.PoolUnderTest(bench._pool),
        bench.SHARED: bench.PoolUnderTest(bench._pool, share=joined),
        bench.REPORTING: bench.PoolUnderTest(bench._pool, share=report, report=True),
    }


def entry(share: str) -> Any:
    (found,) = ledger.snapshot(share)
    return found


def test_each_share_pool_joins_its_own_share_with_a_budget_that_does_not_bind(
    setup: tuple[Any, Any, Any], shares: tuple[str, str]
) -> None:
    workload, config, hasher = setup
    pools = pools_under_test(shares)
    with ExitStack() as stack:
        schedulers = {
            name: stack.enter_context(bench.scheduler_for(pool, config, NUM_BLOCKS))
            for name, pool in pools.items()
        }
        for share in shares:
            (member,) = ledger.snapshot(share)
            assert member.name == "bench-scheduler"
            assert ledger.budget([member]) == bench.share_budget(NUM_BLOCKS)
        # Twice every page of the allocator: all of its blocks mapped fit in half of it.
        per_page = bench.PAGE_SIZE // bench.LAYOUT.range_block_bytes
        assert bench.share_budget(NUM_BLOCKS) == 2 * -(-NUM_BLOCKS // per_page) * bench.PAGE_SIZE
        for scheduler in schedulers.values():
            for request in bench.make_requests(workload, hasher, 0):
                scheduler.add_request(request)
        for name, scheduler in schedulers.items():
            output = scheduler.schedule()
            assert list(output.num_scheduled_tokens.values()) == [BATCHED], name
        # Both share members hold the null block and the first prompt's 4 blocks (one page of
        # 32 blocks); the reporting one also told its share what the 7 waiting requests need
        # (4 + 1 blocks each: 1 + 4 + 35 blocks, two pages), the plain one told it nothing.
        joined, report = shares
        assert entry(joined).demand_bytes == bench.PAGE_SIZE
        assert entry(report).demand_bytes == 2 * bench.PAGE_SIZE
    # Stock's and the plain pool's scheduler keep vLLM's own schedule().
    assert "schedule" not in vars(schedulers[bench.STOCK])
    assert "schedule" not in vars(schedulers["kvasync"])
    assert "schedule" not in vars(schedulers[bench.SHARED])


def test_share_pools_take_stocks_steps_in_lock_step_and_the_reporting_one_reports_each_step(
    setup: tuple[Any, Any, Any], shares: tuple[str, str]
) -> None:
    workload, config, hasher = setup
    pools = pools_under_test(shares)
    results = {(name, "on"): bench.Samples() for name in pools}
    for timing_calls in (False, True):
        with ExitStack() as stack:
            schedulers = {
                name: stack.enter_context(bench.scheduler_for(pool, config, NUM_BLOCKS))
                for name, pool in pools.items()
            }
            samples = {name: results[(name, "on")] for name in pools}
            bench.run_together(schedulers, workload, hasher, 0, samples, timing_calls)
    (steps,) = results[(bench.STOCK, "on")].steps_per_run
    for name in pools:
        assert results[(name, "on")].steps_per_run == [steps], name
        assert len(results[(name, "on")].steps) == steps, name
    # The same requests in the call pass: one report a step, from the reporting pool alone.
    assert len(results[(bench.REPORTING, "on")].calls["report_demand"]) == steps
    for name in (bench.STOCK, "kvasync", bench.SHARED):
        assert results[(name, "on")].calls.get("report_demand", []) == [], name
    pairs = [(bench.SHARED, "kvasync"), (bench.REPORTING, "kvasync")]
    table = bench.added_table(results, pairs, ["on"]).splitlines()
    assert [[cell.strip() for cell in row.split("|")[1:4]] for row in table[2:]] == [
        [bench.SHARED, "kvasync", "on"],
        [bench.REPORTING, "kvasync", "on"],
    ]


def test_a_fresh_share_leaves_no_ledger_behind(setup: tuple[Any, Any, Any]) -> None:
    _, config, _ = setup
    with bench.fresh_share("report") as share:
        pool = bench.PoolUnderTest(bench._pool, share=share, report=True)
        with bench.scheduler_for(pool, config, NUM_BLOCKS):
            assert os.path.exists(ledger.path(share))
        # The last member to leave removes the ledger (Note [Share ledger])...
        assert not os.path.exists(ledger.path(share))
        # ...but a member killed, or a round that failed before its close, leaves one behind:
        # a stand-in for it.
        with open(ledger.path(share), "wb") as f:
            f.write(b"left behind")
    assert not os.path.exists(ledger.path(share))


def test_same_step_deltas_pair_the_steps_of_runs_of_equal_length_only() -> None:
    # Run 2 of ``mine`` took a step more (a count answered short): its steps are not stock's
    # same steps, and run 3's are still paired with run 3's.
    mine = bench.Samples(steps=[5.0, 6.0, 1.0, 1.0, 1.0, 9.0, 8.0], steps_per_run=[2, 3, 2])
    theirs = bench.Samples(steps=[4.0, 4.0, 1.0, 1.0, 7.0, 7.0], steps_per_run=[2, 2, 2])
    assert bench.same_step_deltas(mine, theirs) == ([1.0, 2.0, 2.0, 1.0], 2)
