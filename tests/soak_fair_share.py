"""The fair-share soak behind ``make soak`` (not in CI): the share's policy under churn and under
members that only claim.

Note [Fair-share soak]
~~~~~~~~~~~~~~~~~~~~~~
Real processes join one share (host backend, small pages, a budget of ``BUDGET_PAGES``), each in
one role:

- *hog*: reports its demand, allocates ``HOG_PAGES`` pages, holds them 1-3 s without ever looking
  at ``drain_from()`` (it does not vacate, whatever its fair share), frees, and again;
- *churner*: allocates 1-``CHURN_PAGES`` pages with short deadlines, holds them a moment, frees,
  now and then trims;
- *claimer*: only reports demand (``set_demand`` of its whole capacity, every 50 ms; half of
  them report 0 once every 0.5-3 s and claim anew), and never allocates: a claim that no
  request follows;
- *probe*: asks again and again for ``PROBE_PAGES`` pages (at most budget / members, whatever
  the membership), holds them a moment and frees them.

The roles' pages in use add up to at most the budget (``HOGS * HOG_PAGES + CHURN_PAGES + PROBES *
PROBE_PAGES``), so a probe's request always fits beside what the others hold in use: by the
share's guarantee (Note [Fair share under pressure] in csrc/ledger/ledger.h) it is served from
the free budget whatever the claimers claim, and the others' reserves come back within a watcher
tick when it blocks. Every ``CHURN_EVERY_S`` the parent ends a hog, churner or claimer, by kill -9
or by a clean close in turn, and starts another in its place: dead members' pages are reclaimed,
and each new claimer's first claim counts for the claim hold (Note [Demand claims] in
csrc/pool/limit_policy.h) and then never again.

A sampler takes ledger snapshots (under the lock, as ``kvasync top`` does) every
``SAMPLE_EVERY_S`` and checks, at each:

- the budget: the committed bytes add up to at most the budget;
- the minimum: a member blocked on the budget (``blocked``) with fewer pages committed than its
  guaranteed minimum, min(demand, budget / members), while a page of the budget is free, is an
  episode; one that lasts past ``BELOW_MINIMUM_BOUND_S`` breaks the guarantee (it is served at
  the next release in the share or watcher tick: 100 ms);
- the claims: a claimer's published demand must be gone ``CLAIM_BOUND_S`` after it was first
  seen (the claim hold, 1 s, and the tick that publishes it, with slack for a loaded machine).

It also counts each member's limit turns (a fall, then a rise) and the closest two of one member,
as figures: the ledger shows the limit, not the guaranteed minimum, so it cannot tell a turn to a
new peak of the minimum (allowed sooner) from a flap; tests/test_share_policy.py pins that bound.

Members check their own allocs: a probe's that times out, and anyone's that returns ``HANG_S``
past its deadline beyond what its loop was starved of CPU (as tests/soak_share.py measures it).

It fails (exit status 1) on: committed bytes over the budget; an episode below the minimum with
budget free past its bound; a claim counted past its bound; a probe's alloc timed out; an alloc
returned past its deadline; a member that could not join or stop within its deadline; entries
left after every member left; the parent's open fds grown; the whole run overrunning
SOAK_SECONDS by ``RUN_GRACE_S``.

Usage: ``SOAK_SECONDS=60 python tests/soak_fair_share.py`` (default 600).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from rich.console import Console
from rich.table import Table
from soak_share import fd_links, ms, run_queue_wait_s

import kvasync
from kvasync import _core, share
from kvasync._stats import percentile

# 8 KiB blocks, 8 to a 64 KiB page (one range): maps are cheap, the ledger is churned hard.
LAYOUT = kvasync.KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, block_size=16, contiguous=True)
PAGE_SIZE = 64 << 10
BLOCKS_PER_PAGE = PAGE_SIZE // LAYOUT.range_block_bytes  # 8
MAX_BLOCKS = 16 * BLOCKS_PER_PAGE  # 16 pages per member
BUDGET_PAGES = 32
BUDGET = BUDGET_PAGES * PAGE_SIZE
ROLES = ["hog", "hog", "churner", "claimer", "claimer", "probe", "probe"]
HOGS, PROBES = ROLES.count("hog"), ROLES.count("probe")
HOG_PAGES = 8
CHURN_PAGES = 6
# The most members at once: the roles, the parent's anchor, and a newcomer started before the
# member it replaces has left. budget / members stays at least PROBE_PAGES.
MAX_MEMBERS = len(ROLES) + 2
PROBE_PAGES = BUDGET_PAGES // MAX_MEMBERS
assert HOGS * HOG_PAGES + CHURN_PAGES + PROBES * PROBE_PAGES <= BUDGET_PAGES
PROBE_DEADLINE_S = 2.0  # a tick (100 ms) to get the others' reserves back, and a dead member
CHURN_EVERY_S = 1.5  # one hog, churner or claimer ended (kill -9 or close) and replaced
CLAIM_HOLD_S = _core.CLAIM_HOLD_S
WATCHER_TICK_S = 0.1  # ShareMember::kTick
CLAIM_BOUND_S = CLAIM_HOLD_S + WATCHER_TICK_S + 0.5
BELOW_MINIMUM_BOUND_S = 1.0  # a tick and a loaded machine's slack; a starved member waits on
SAMPLE_EVERY_S = 0.01
SNAPSHOT_TIMEOUT_S = 1.0
JOIN_DEADLINE_S = 30.0
STOP_DEADLINE_S = 15.0
HANG_S = 1.0  # an alloc this late (beyond its loop's lag) is a hang, not a late wake
LAG_PROBE_S = 0.01
PROGRESS_EVERY_S = 1.0
RUN_GRACE_S = 180.0
FD_GROWTH = 2  # the forkserver's and the resource tracker's pipes stay open


# -- a member: one process of the share -------------------------------------------------------


@dataclass
class MemberFigures:
    allocs: int = 0
    timeouts: int = 0
    probe_waits_s: list[float] = field(default_factory=list)
    probe_timeouts: int = 0
    max_overrun_s: float = 0.0
    max_loop_lag_s: float = 0.0
    problems: list[str] = field(default_factory=list)


class Member:
    """One allocator on the share in one role, until the parent stops or kills it."""

    def __init__(
        self, conn: multiprocessing.connection.Connection, role: str, name: str, seed: int
    ) -> None:
        self.conn = conn
        self.role = role
        self.name = name
        self.rng = random.Random(seed)
        self.figures = MemberFigures()
        self.kv: kvasync.Allocator | None = None
        self.lag_s = 0.0  # the loop's largest lateness in the last second
        self.probe_due = time.monotonic()
        self.loop_reader_closed = False

    async def run(self, share_name: str) -> None:
        fds_before = fd_links()
        config = kvasync.Config(
            backend="host",
            max_blocks=MAX_BLOCKS,
            page_size=PAGE_SIZE,
            reserve_pages=(0, 2) if self.role in ("hog", "churner") else (0, 0),
            default_timeout=2.0,
            share=share_name,
            device_budget=BUDGET,
            name=self.name,
        )
        self.kv = await kvasync.Allocator.open(LAYOUT, config)
        self.conn.send({"joined": os.getpid()})
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), lambda: self.read_command(stop))
        work = {"hog": self.hog, "churner": self.churn, "claimer": self.claim, "probe": self.probe}
        tasks = [
            asyncio.ensure_future(work[self.role]()),
            asyncio.ensure_future(self.report_progress()),
            asyncio.ensure_future(self.watch_loop_lag()),
        ]
        try:
            await stop.wait()
        finally:
            if not self.loop_reader_closed:
                loop.remove_reader(self.conn.fileno())
            for task in tasks:
                task.cancel()
            stuck = (await asyncio.wait(tasks, timeout=5.0))[1]
            if stuck:
                self.problem(f"{len(stuck)} tasks did not unwind within 5 s of being cancelled")
            tasks.clear()  # their tracebacks hold the allocator's frames (see soak_share.py)
        await self.stop(fds_before)

    def read_command(self, stop: asyncio.Event) -> None:
        try:
            command = self.conn.recv()
        except (EOFError, OSError):  # the parent is gone: stop, never outlive it
            command = {"cmd": "stop"}
            self.loop_reader_closed = True
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
        if command["cmd"] == "stop":
            stop.set()

    # -- the roles ------------------------------------------------------------------------------

    async def hog(self) -> None:
        assert self.kv is not None
        while True:
            self.kv.set_demand(HOG_PAGES * BLOCKS_PER_PAGE)  # what it asks for next: a claim
            blocks = await self.alloc(HOG_PAGES * BLOCKS_PER_PAGE, self.rng.choice([0.5, 1, 2]))
            try:
                await asyncio.sleep(self.rng.uniform(1.0, 3.0))  # drain_from() never read
            finally:
                if blocks:
                    self.kv.free(blocks)
            await asyncio.sleep(self.rng.uniform(0, 0.2))

    async def churn(self) -> None:
        assert self.kv is not None
        while True:
            pages = self.rng.randint(1, CHURN_PAGES)
            blocks = await self.alloc(pages * BLOCKS_PER_PAGE, self.rng.choice([0.05, 0.2, 0.5]))
            try:
                await asyncio.sleep(self.rng.uniform(0, 0.05))
            finally:
                if blocks:
                    self.kv.free(blocks)
            if self.rng.random() < 0.05:
                with contextlib.suppress(kvasync.AllocTimeout, kvasync.MapError):
                    await self.kv.trim(timeout=0.5)

    async def claim(self) -> None:
        # Every 50 ms the whole capacity; half the claimers drop to 0 for one report every
        # 0.5-3 s and claim anew (which renews nothing: no request follows).
        assert self.kv is not None
        flapping = self.rng.random() < 0.5
        next_flap = time.monotonic() + self.rng.uniform(0.5, 3.0)
        while True:
            if flapping and time.monotonic() >= next_flap:
                self.kv.set_demand(0)
                next_flap = time.monotonic() + self.rng.uniform(0.5, 3.0)
            else:
                self.kv.set_demand(self.kv.num_blocks)
            await asyncio.sleep(0.05)

    async def probe(self) -> None:
        assert self.kv is not None
        while True:
            await asyncio.sleep(self.rng.uniform(0.05, 0.3))
            started = time.monotonic()
            blocks = await self.alloc(PROBE_PAGES * BLOCKS_PER_PAGE, PROBE_DEADLINE_S)
            if not blocks:
                self.figures.probe_timeouts += 1
                self.problem(
                    f"a request for {PROBE_PAGES} pages (within budget / members) timed out "
                    f"after {PROBE_DEADLINE_S} s (loop lag {self.lag_s:.2f} s)"
                )
                continue
            self.figures.probe_waits_s.append(time.monotonic() - started)
            try:
                await asyncio.sleep(self.rng.uniform(0, 0.2))
            finally:
                self.kv.free(blocks)

    async def alloc(self, n: int, timeout: float) -> list[int]:
        """``n`` blocks, or none at a timeout; checks that it returned by its deadline."""
        assert self.kv is not None
        started, waited_for_cpu = time.monotonic(), run_queue_wait_s()
        try:
            blocks = await self.kv.alloc(n, timeout=timeout)
        except kvasync.AllocTimeout:
            self.figures.timeouts += 1
            return []
        finally:
            overrun = time.monotonic() - started - timeout
            self.figures.max_overrun_s = max(self.figures.max_overrun_s, overrun)
            starved = max(
                self.lag_s,
                time.monotonic() - self.probe_due,
                run_queue_wait_s() - waited_for_cpu,
            )
            if overrun > HANG_S + starved:
                self.problem(
                    f"an alloc of {n} returned {overrun:.2f} s after its deadline "
                    f"(the loop was starved {starved:.2f} s)"
                )
        self.figures.allocs += 1
        return blocks

    # -- upkeep ---------------------------------------------------------------------------------

    async def watch_loop_lag(self) -> None:
        window: list[float] = []
        while True:
            self.probe_due = time.monotonic() + LAG_PROBE_S
            await asyncio.sleep(LAG_PROBE_S)
            lag = time.monotonic() - self.probe_due
            window = [*window[-int(1 / LAG_PROBE_S) :], lag]
            self.lag_s = max(window)
            self.figures.max_loop_lag_s = max(self.figures.max_loop_lag_s, lag)

    async def report_progress(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            self.conn.send({"progress": self.figures.__dict__})

    async def stop(self, fds_before: dict[str, str]) -> None:
        assert self.kv is not None
        stats = self.kv.stats()
        if stats.used_blocks or stats.waiters:
            self.problem(
                f"at its end: {stats.used_blocks} blocks allocated, {stats.waiters} waiters"
            )
        await self.kv.close(timeout=2.0)
        self.kv = None
        grown = {fd: link for fd, link in fd_links().items() if fd not in fds_before}
        if grown:
            self.problem(f"fds opened and not closed across open..close: {grown}")
        with contextlib.suppress(OSError):  # a parent gone meanwhile
            self.conn.send({"stopped": self.figures.__dict__})

    def problem(self, text: str) -> None:
        if len(self.figures.problems) < 20:
            self.figures.problems.append(f"{self.name}: {text}")


def member_main(
    conn: multiprocessing.connection.Connection, share_name: str, role: str, name: str
) -> None:
    """A member process's entry point (started by the forkserver)."""
    member = Member(conn, role, name, seed=os.getpid())
    try:
        asyncio.run(member.run(share_name))
    except Exception as error:  # reported to the parent, which fails the soak with it
        conn.send({"error": f"{name}: {type(error).__name__}: {error}"})
        sys.exit(1)


# -- the parent -------------------------------------------------------------------------------


@dataclass
class Process:
    role: str
    name: str
    proc: BaseProcess
    conn: multiprocessing.connection.Connection
    pid: int
    started_at: float
    joined: bool = False
    progress: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] | None = None


@dataclass
class Figures:
    started: int = 0
    kills: int = 0
    closes: int = 0
    snapshots: int = 0
    max_committed: int = 0
    max_members_seen: int = 0
    snapshots_with_claim: int = 0
    below_minimum: int = 0  # episodes: blocked below its minimum while budget was free
    longest_below_s: float = 0.0
    claims_seen: int = 0
    longest_claim_s: float = 0.0
    turns: int = 0
    closest_turns_s: float = math.inf
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)


class Sampler(threading.Thread):
    """Snapshots under the lock, checking the budget, the minimum and the claims (Note
    [Fair-share soak]), until stopped."""

    def __init__(self, share_name: str, figures: Figures) -> None:
        super().__init__(daemon=True)
        self.share_name = share_name
        self.figures = figures
        self.done = threading.Event()
        self.below_since: dict[tuple[int, int], float] = {}  # (pid, serial) -> since when
        # A claimer's demand seen: first and last (a flapping one's claim is seen on and off:
        # it counts from the first sighting to the last), and whether it broke the bound.
        self.claims: dict[tuple[int, int], tuple[float, float, bool]] = {}
        self.limits: dict[tuple[int, int], tuple[int, bool, float]] = {}  # -> limit, fell, turn

    def run(self) -> None:
        while not self.done.is_set():
            try:
                entries = share.snapshot(self.share_name, timeout=SNAPSHOT_TIMEOUT_S)
            except kvasync.KVAsyncError as error:
                self.figures.problem(f"snapshot: {error}")
                continue
            self.check(entries, time.monotonic())
            time.sleep(SAMPLE_EVERY_S)
        self.check([], time.monotonic())  # ends the episodes still open
        for first, last, _ in self.claims.values():
            self.figures.claims_seen += 1
            self.figures.longest_claim_s = max(self.figures.longest_claim_s, last - first)

    def check(self, entries: list[share.LedgerEntry], now: float) -> None:
        f = self.figures
        committed = sum(e.committed_bytes for e in entries)
        if entries:
            f.snapshots += 1
            f.max_committed = max(f.max_committed, committed)
            f.max_members_seen = max(f.max_members_seen, len(entries))
        if committed > BUDGET:
            f.problem(f"{committed} bytes committed by {len(entries)} members, budget {BUDGET}")
        free = BUDGET - committed
        equal_pages = BUDGET // max(1, len(entries)) // PAGE_SIZE
        below: set[tuple[int, int]] = set()
        claiming = False
        for e in entries:
            key = (e.pid, e.serial)
            minimum = min(e.demand_bytes // PAGE_SIZE, equal_pages)
            if e.blocked > 0 and e.committed_bytes < minimum * PAGE_SIZE and free >= PAGE_SIZE:
                below.add(key)
                self.below_since.setdefault(key, now)
            if e.name.startswith("claimer") and e.demand_bytes > 0:
                claiming = True
                self.claim_seen(key, e.name, now)
            self.count_turns(key, e.limit_bytes, now)
        if claiming:
            f.snapshots_with_claim += 1
        for key in [k for k in self.below_since if k not in below]:
            self.end_below(key, now)

    def end_below(self, key: tuple[int, int], now: float) -> None:
        lasted = now - self.below_since.pop(key)
        self.figures.below_minimum += 1
        self.figures.longest_below_s = max(self.figures.longest_below_s, lasted)
        if lasted > BELOW_MINIMUM_BOUND_S:
            self.figures.problem(
                f"pid {key[0]} was blocked below its guaranteed minimum for {lasted:.2f} s with "
                f"budget free (bound {BELOW_MINIMUM_BOUND_S} s)"
            )

    def claim_seen(self, key: tuple[int, int], name: str, now: float) -> None:
        first, _, broke = self.claims.get(key, (now, now, False))
        if now - first > CLAIM_BOUND_S and not broke:
            broke = True
            self.figures.problem(
                f"{name} (pid {key[0]})'s claim still counted {now - first:.2f} s after it was "
                f"first seen, past its bound ({CLAIM_BOUND_S:.2f} s), no request following it"
            )
        self.claims[key] = (first, now, broke)

    def count_turns(self, key: tuple[int, int], limit: int, now: float) -> None:
        """Fall->rise turns of a member's limit, and the closest two of one member."""
        before, fell, last_turn = self.limits.get(key, (limit, False, -math.inf))
        if limit < before:
            fell = True
        elif limit > before and fell:
            self.figures.turns += 1
            self.figures.closest_turns_s = min(self.figures.closest_turns_s, now - last_turn)
            fell, last_turn = False, now
        self.limits[key] = (limit, fell, last_turn)


class Soak:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.share_name = f"soak-fair-{uuid.uuid4().hex[:10]}"
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["__main__", "torch", "kvasync._allocator"])
        self.figures = Figures()
        self.members: list[Process] = []
        self.finished: list[Process] = []
        self.rng = random.Random()
        self.parent_fds = (0, 0)

    def spawn(self, role: str) -> Process:
        parent_end, child_end = self.context.Pipe()
        name = f"{role}-{self.figures.started}"
        proc = self.context.Process(
            target=member_main, args=(child_end, self.share_name, role, name), daemon=True
        )
        proc.start()
        child_end.close()
        self.figures.started += 1
        assert proc.pid is not None
        return Process(role, name, proc, parent_end, proc.pid, time.monotonic())

    def drain(self, member: Process) -> None:
        try:
            while member.conn.poll():
                message = member.conn.recv()
                if "joined" in message:
                    member.joined = True
                elif "progress" in message:
                    member.progress = message["progress"]
                elif "stopped" in message:
                    member.report = message["stopped"]
                elif "error" in message:
                    self.figures.problem(message["error"])
        except (EOFError, OSError):
            pass  # killed: its pipe ends (perhaps in the middle of a message)

    def check_joins(self) -> None:
        for member in list(self.members):
            if member.joined:
                continue
            if not member.proc.is_alive():
                self.figures.problem(f"{member.name} exited {member.proc.exitcode} unjoined")
            elif time.monotonic() - member.started_at > JOIN_DEADLINE_S:
                self.figures.problem(f"{member.name} did not join in {JOIN_DEADLINE_S} s")
                member.proc.kill()
                member.proc.join(5.0)
            else:
                continue
            self.members.remove(member)
            self.retire(member)

    def wait_for_joins(self) -> None:
        deadline = time.monotonic() + JOIN_DEADLINE_S + 1.0
        while not all(m.joined for m in self.members) and time.monotonic() < deadline:
            multiprocessing.connection.wait([m.conn for m in self.members], timeout=0.1)
            for member in self.members:
                self.drain(member)
            self.check_joins()

    def replace_one(self, count: int) -> None:
        """Ends a hog, churner or claimer (kill -9 and clean close in turn) and starts another
        of its role, which joins while the old one's entry is still being reclaimed."""
        candidates = [m for m in self.members if m.joined and m.role != "probe"]
        if not candidates:
            return
        victim = self.rng.choice(candidates)
        self.members.append(self.spawn(victim.role))
        if count % 2 == 0:
            os.kill(victim.pid, signal.SIGKILL)
            victim.proc.join(5.0)
            self.figures.kills += 1
        else:
            self.stop([victim])
            self.figures.closes += 1
        self.members.remove(victim)
        self.retire(victim)

    def stop(self, members: list[Process]) -> None:
        for member in members:
            member.conn.send({"cmd": "stop"})
        deadline = time.monotonic() + STOP_DEADLINE_S
        for member in members:
            while member.report is None and time.monotonic() < deadline:
                if member.conn.poll(max(0.0, deadline - time.monotonic())):
                    self.drain(member)
                elif not member.proc.is_alive():
                    break
            member.proc.join(max(0.0, deadline - time.monotonic()))
            if member.report is None or member.proc.exitcode != 0:
                self.figures.problem(
                    f"{member.name} did not stop cleanly within {STOP_DEADLINE_S} s "
                    f"(exit {member.proc.exitcode})"
                )
                member.proc.kill()
                member.proc.join(5.0)

    def retire(self, member: Process) -> None:
        self.drain(member)
        figures = member.report or member.progress  # killed: up to its last progress report
        self.figures.problems.extend(figures.get("problems", []))
        member.conn.close()
        member.proc.close()
        self.finished.append(member)

    def run(self) -> int:
        fds_before = fd_links()
        anchor_config = kvasync.Config(
            backend="host",
            max_blocks=BLOCKS_PER_PAGE,
            page_size=PAGE_SIZE,
            reserve_pages=(0, 0),
            share=self.share_name,
            device_budget=BUDGET,
            name="soak-parent",
        )
        # The parent is a member too (it maps nothing and claims nothing): the file stays while
        # members come and go.
        anchor = kvasync.open_allocator_sync(LAYOUT, anchor_config)
        sampler = Sampler(self.share_name, self.figures)
        console = Console()
        console.print(
            f"fair-share soak: {self.seconds:.0f} s, share {self.share_name}, budget "
            f"{BUDGET_PAGES} pages; {', '.join(ROLES)}; probes ask {PROBE_PAGES} pages (budget / "
            f"{MAX_MEMBERS} members); a member replaced every {CHURN_EVERY_S} s"
        )
        try:
            self.members = [self.spawn(role) for role in ROLES]
            self.wait_for_joins()
            sampler.start()
            began = time.monotonic()
            next_churn, count = began + CHURN_EVERY_S, 0
            while time.monotonic() - began < self.seconds:
                for member in self.members:
                    self.drain(member)
                self.check_joins()
                if time.monotonic() >= next_churn:
                    self.replace_one(count)
                    count += 1
                    next_churn += CHURN_EVERY_S * self.rng.uniform(0.5, 1.5)
                time.sleep(0.01)
            self.wait_for_joins()  # the last newcomer, so that it stops cleanly
            self.stop(self.members)
            for member in list(self.members):
                self.members.remove(member)
                self.retire(member)
        finally:
            sampler.done.set()
            sampler.join(5.0)
            for member in self.members:  # only after a failure above
                member.proc.kill()
            left = [e for e in share.snapshot(self.share_name) if e.pid != os.getpid()]
            if left:
                self.figures.problem(f"entries left after every member ended: {left}")
            anchor.close()
        del anchor
        gc.collect()
        fds_after = fd_links()
        self.parent_fds = (len(fds_before), len(fds_after))
        if len(fds_after) - len(fds_before) > FD_GROWTH:
            grown = {fd: link for fd, link in fds_after.items() if fd not in fds_before}
            self.figures.problem(f"the parent's open fds grew: {grown}")
        return self.print_report(console)

    def print_report(self, console: Console) -> int:
        f = self.figures
        reports = [m.report or m.progress for m in self.finished]
        waits = [w for r in reports for w in r.get("probe_waits_s", [])]
        table = Table(title="fair-share soak", title_justify="left")
        table.add_column("what")
        table.add_column("seen", justify="right")
        table.add_row("processes started (live at once)", f"{f.started} ({len(ROLES)} + parent)")
        table.add_row("  ended by kill -9 / by close", f"{f.kills} / {f.closes}")
        table.add_row(
            f"probe allocs of {PROBE_PAGES} pages: served / timed out",
            f"{len(waits)} / {sum(r.get('probe_timeouts', 0) for r in reports)}",
        )
        table.add_row(
            "  wait p50 / p99 / max",
            f"{ms(percentile(waits, 50))} / {ms(percentile(waits, 99))} / "
            f"{ms(max(waits, default=0.0))}",
        )
        table.add_row(
            "blocked below its minimum, budget free: episodes",
            f"{f.below_minimum}",
        )
        table.add_row("  longest (bound)", f"{ms(f.longest_below_s)} ({ms(BELOW_MINIMUM_BOUND_S)})")
        table.add_row("claims of claim-only members seen", f"{f.claims_seen}")
        table.add_row("  longest counted (bound)", f"{ms(f.longest_claim_s)} ({ms(CLAIM_BOUND_S)})")
        table.add_row("snapshots (largest member count)", f"{f.snapshots} ({f.max_members_seen})")
        table.add_row("  with a claim counted", f"{f.snapshots_with_claim}")
        table.add_row(
            "largest committed / budget",
            f"{f.max_committed // PAGE_SIZE} / {BUDGET_PAGES} pages",
        )
        table.add_row(
            "allocs, all members: served / timed out",
            f"{sum(r.get('allocs', 0) for r in reports)} / "
            f"{sum(r.get('timeouts', 0) for r in reports)}",
        )
        table.add_row("  largest overrun of a deadline", ms(max_of(reports, "max_overrun_s")))
        table.add_row("  largest loop lag (CPU starved)", ms(max_of(reports, "max_loop_lag_s")))
        closest = "none" if math.isinf(f.closest_turns_s) else ms(f.closest_turns_s)
        table.add_row(
            "limit turns (fall, then rise) / closest of a member", f"{f.turns} / {closest}"
        )
        table.add_row("parent's open fds: start / end", "{} / {}".format(*self.parent_fds))
        table.add_row("problems", f"{len(f.problems)}")
        console.print(table)
        for problem in f.problems:
            console.print(f"PROBLEM: {problem}", markup=False)
        console.print("fair-share soak: FAILED" if f.problems else "fair-share soak: passed")
        return 1 if f.problems else 0


def max_of(reports: list[dict[str, Any]], key: str) -> float:
    return max((float(r.get(key, 0.0)) for r in reports), default=0.0)


def main() -> int:
    seconds = float(os.environ.get("SOAK_SECONDS", "600"))
    # The soak's own deadline: past it, every thread's stack is printed and it exits 1.
    faulthandler.dump_traceback_later(seconds + RUN_GRACE_S, exit=True)
    return Soak(seconds).run()


if __name__ == "__main__":
    sys.exit(main())
