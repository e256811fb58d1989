"""What a vLLM engine in a share wants now, told to the share once a scheduler step.

Note [The engine's demand in a share]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A share divides its budget by demand (Note [Fair share under pressure] in csrc/ledger/ledger.h).
What a pool sees itself is what it holds and what its waiters ask for; but vLLM's scheduler
never waits on the allocator: it counts the blocks of the first waiting request, finds them
short and stops admitting (Note [Count only what is mapped] in _pool), and its queue behind that
request is invisible to the pool. Without a report, an engine with a hundred requests queued
reads to the share as wanting exactly what it holds: the share sees no shortage, applies no
pressure, and the idle members keep their reserves. On the H200 (bench/bench_vllm_many.py,
memory4, 2026-12-02) the three idle engines kept 3.4 GiB of an 8 GiB budget mapped while the hot
one queued 110 requests, and the shared run served 151 requests within SLO against 244 for the
best static split.

So in a share the plugin wraps ``Scheduler.schedule``: after each step it reports the blocks its
running requests hold (with the pool's pocket and the null block) plus what the waiting requests
that fit the batch (``max_num_seqs`` less those running) need for their prompts, the figure our
own engine reports (serve/_scheduler.py). Prefix-cache hits are not subtracted: the report is an
upper bound, and a claim above what the pool holds counts only while requests follow it (Note
[Demand claims] in csrc/pool/limit_policy.h: vLLM's count that misses is such a request). The
walk stops at the batch's free slots, so a step costs at most ``max_num_seqs`` reads; outside a
share nothing is wrapped. The pool passes a rise of a page's blocks or more to the share at once
(a queue forming), and anything else at most every 50 ms: a report that changes the share's
figure wakes every member's watcher, whose tick takes its pool's lock, and on a loaded host a
report every step held the scheduler's next call into the pool for milliseconds (p90 5 ms in
bench_vllm_scheduler --share on 2 busy cores); the watchers themselves tick every 100 ms.

The report must never stop the engine (Note [When the allocator fails] in _pool): an allocator
error is the pool's to count and log, and a failure to read vLLM's queue (a shape the seam table
missed) is logged once and ends the reports, leaving the engine as it would be without them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kvasync.vllm")

__all__ = ["reporting_demand", "waiting_need"]


def waiting_need(scheduler: Any) -> int:
    """The blocks the waiting requests that fit ``scheduler``'s batch need for what they have
    not computed (their prompts, or a preempted request's tokens), first in line first."""
    room = int(scheduler.max_num_running_reqs) - len(scheduler.running)
    if room <= 0:
        return 0
    block_size = int(scheduler.block_size)
    need: int = 0
    # 0.26-0.30 keep requests skipped this step aside (skipped_waiting); both are in line.
    for queue in (scheduler.waiting, getattr(scheduler, "skipped_waiting", None) or ()):
        for request in queue:
            need += (request.num_tokens - request.num_computed_tokens) // block_size + 1
            room -= 1
            if room == 0:
                return need
    return need


def reporting_demand(schedule: Callable[..., Any]) -> Callable[..., Any]:
    """``Scheduler.schedule`` that reports the engine's demand to its pool after each step
    (Note [The engine's demand in a share])."""
    failed = False

    @functools.wraps(schedule)
    def schedule_and_report_demand(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal failed
        output = schedule(self, *args, **kwargs)
        if not failed:
            report = getattr(self.kv_cache_manager.block_pool, "report_demand", None)
            if report is not None:
                try:
                    need = waiting_need(self)
                except Exception:  # vLLM's own objects: any failure ends the reports, not vLLM
                    failed = True
                    logger.exception(
                        "kvasync: reading vLLM's waiting requests failed; the engine no longer "
                        "reports its demand to the share (the share sees what it holds)"
                    )
                else:
                    report(need)
        return output

    return schedule_and_report_demand
