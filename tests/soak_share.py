"""The share soak behind ``make soak`` (not in CI): 16 processes on one share, killed with kill -9.

Note [Share soak]
~~~~~~~~~~~~~~~~~
``MEMBERS`` real processes join one share (host backend, small pages, a budget well under what
they ask for together) and churn: each runs a few requests that allocate, write a signature into
every block, hold it a moment, check it and free it, with map delays and now and then a trim. A
killer in the parent sends SIGKILL to one member every ``KILL_EVERY_S`` and starts another in its
place, so that ``MEMBERS`` stay live. The kills rotate between three kinds:

- *lock*: the parent watches the word of the ledger's robust mutex (its owner's thread id, glibc)
  and kills the member whose thread holds the lock at that moment. Whether the member died holding
  it is read afterwards from the header's ``repairs`` counter (a lock taker that finds its holder
  dead repairs the lock and counts it), so a kill that came a moment late is not counted.
- *mid-map*: the member is told to make its maps hang and answers once a map hangs inside its
  mapper thread (pages charged to the ledger, not yet mapped); then it is killed.
- *random*: a member at a random time.

Meanwhile a sampler takes ledger snapshots (under the lock, as ``kvasync top`` does) and checks
that the members' committed bytes never exceed the budget. After each kill the parent measures
how long the dead member's entry stays in the ledger, read without the lock from the file itself
(the sampler pauses then: its snapshot would clear the entry itself), so the figure is the
members' own reclaiming. At the end every member is stopped: it frees what it holds and closes,
and reports its figures.

The raw reads (the mutex word, ``repairs``, the entries' pid and state) follow the layout of
csrc/ledger/ledger.h (version 2 on); the soak checks it against the header's sizes and the
parent's own entry first, and where it does not match it says so, kills at random times only and
measures clearing with snapshots.

It fails (exit status 1) on: committed bytes over the budget at a snapshot; a dead member's entry
left past ``CLEAR_DEADLINE_S``; a snapshot that waited for the lock past its timeout; a member
that could not join, or did not stop, within its deadline; a block handed out twice or whose
data changed, inside a member; an alloc that returned ``HANG_S`` past its deadline; blocks still
allocated or pages still mapped in a member at its end; the ledger's file left after the last
member left; open fds of the parent or of a member grown; the whole run overrunning
SOAK_SECONDS by ``RUN_GRACE_S`` (every thread's stack is printed; the members see their pipe end
and stop).

Usage: ``SOAK_SECONDS=60 python tests/soak_share.py`` (default 600).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import mmap
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from rich.console import Console
from rich.table import Table

import kvasync
from kvasync import share
from kvasync._stats import percentile
from kvasync.testing import FaultInjector

MEMBERS = 16
# 8 KiB blocks, 8 to a 64 KiB page: maps are cheap, so the members churn the ledger hard.
LAYOUT = kvasync.KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, block_size=16, contiguous=True)
PAGE_SIZE = 64 << 10
MAX_BLOCKS = 128  # 16 pages per member
BUDGET = 96 * PAGE_SIZE  # the members ask for about twice this together: some wait on it
REQUESTS_PER_MEMBER = 3
KILL_EVERY_S = 40 / 30  # the review's rate: 30 kills in 40 s
LOCK_WATCH_S = 0.5  # how long a lock kill watches for a member holding the lock
CLEAR_DEADLINE_S = 1.5  # a dead member's entry is gone this long after its death (reclaim: 250 ms)
JOIN_DEADLINE_S = 30.0
STOP_DEADLINE_S = 15.0
SNAPSHOT_TIMEOUT_S = 1.0  # a lock held this long is a hang (a dead holder is repaired at once)
SAMPLE_EVERY_S = 0.005
HANG_S = 1.0  # an alloc this late (beyond its loop's lag) is a hang, not a late wake
LAG_PROBE_S = 0.01
PROGRESS_EVERY_S = 1.0
RUN_GRACE_S = 180.0  # the run's deadline past SOAK_SECONDS: joins, stops and exits included
FD_GROWTH = 2  # the forkserver's and the resource tracker's pipes stay open

# Layout of csrc/ledger/ledger.h from version 2 on (later versions added fields after these):
# checked at start by the sizes in the header and against the parent's own entry.
LEDGER_MAGIC = 0x31524744454C4B56
LEDGER_VERSION = 2  # the first version with this layout
HEADER_BYTES = 192
ENTRY_BYTES = 320
MUTEX_OFFSET = 64  # glibc's pthread_mutex_t starts with its futex word: the owner's thread id
REPAIRS_OFFSET = 144
FUTEX_TID_MASK = 0x3FFFFFFF
ENTRY_NAME, ENTRY_PAGE_BYTES, ENTRY_BUDGET, ENTRY_OP_STARTED = 44, 152, 160, 200


# -- a member: one process of the share -------------------------------------------------------


@dataclass
class MemberFigures:
    allocs: int = 0
    timeouts: int = 0
    map_errors: int = 0
    trims: int = 0
    max_overrun_s: float = 0.0
    max_loop_lag_s: float = 0.0  # the loop itself late to wake (the process starved of CPU)
    problems: list[str] = field(default_factory=list)


class Member:
    """One allocator on the share, churning until the parent stops or kills it."""

    def __init__(self, conn: multiprocessing.connection.Connection, name: str, seed: int) -> None:
        self.conn = conn
        self.name = name
        self.rng = random.Random(seed)
        self.faults = FaultInjector()
        self.figures = MemberFigures()
        self.held: dict[int, float] = {}  # block -> its signature
        self.kv: kvasync.Allocator | None = None
        self.lag_s = 0.0  # the loop's largest lateness in the last second
        self.loop_reader_closed = False
        self.probe_due = time.monotonic()  # when the lag probe should wake next

    async def run(self, share_name: str) -> None:
        fds_before = fd_links()
        self.faults.delay(self.rng.choice([0.0, 0.001, 0.003]))  # kills land mid-map too
        config = kvasync.Config(
            backend="host",
            max_blocks=MAX_BLOCKS,
            page_size=PAGE_SIZE,
            reserve_pages=(0, 2),
            default_timeout=2.0,
            faults=self.faults,
            share=share_name,
            device_budget=BUDGET,
            name=self.name,
        )
        self.kv = await kvasync.Allocator.open(LAYOUT, config)
        self.conn.send({"joined": os.getpid()})
        commands: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), lambda: commands.put_nowait(self.read_command()))
        tasks = [asyncio.ensure_future(self.request()) for _ in range(REQUESTS_PER_MEMBER)]
        tasks.append(asyncio.ensure_future(self.report_progress()))
        tasks.append(asyncio.ensure_future(self.watch_loop_lag()))
        try:
            while True:
                command = await commands.get()
                if command["cmd"] == "hang":
                    self.conn.send({"hung": await self.hang_a_map()})
                elif command["cmd"] == "stop":
                    break
        finally:
            if not self.loop_reader_closed:
                loop.remove_reader(self.conn.fileno())
            for task in tasks:
                task.cancel()
            stuck = (await asyncio.wait(tasks, timeout=5.0))[1]
            if stuck:
                self.problem(f"{len(stuck)} tasks did not unwind within 5 s of being cancelled")
            # NOTE: a cancelled task keeps its exception, whose traceback holds the allocator's
            # frames: let them go, or the fd check below sees the allocator still open.
            tasks.clear()
        await self.stop(fds_before)

    def read_command(self) -> dict[str, Any]:
        try:
            return dict(self.conn.recv())
        except (EOFError, OSError):  # the parent is gone: stop, never outlive it
            self.loop_reader_closed = True
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            return {"cmd": "stop"}

    async def request(self) -> None:
        assert self.kv is not None
        mine: list[int] = []
        try:
            while True:
                mine = await self.alloc(self.rng.randint(1, 24))
                await asyncio.sleep(self.rng.uniform(0, 0.02))
                self.verify(mine)
                for block in mine:
                    del self.held[block]
                done, mine = mine, []
                self.kv.free(done)
                if self.rng.random() < 0.03:
                    self.figures.trims += 1
                    with contextlib.suppress(kvasync.AllocTimeout, kvasync.MapError):
                        await self.kv.trim(timeout=0.5)
        finally:
            for block in mine:
                self.held.pop(block, None)
            if mine:
                self.kv.free(mine)

    async def alloc(self, n: int) -> list[int]:
        assert self.kv is not None
        timeout = self.rng.choice([0.05, 0.2, 0.5])
        started, waited_for_cpu = time.monotonic(), run_queue_wait_s()
        try:
            blocks = await self.kv.alloc(n, timeout=timeout)
        except kvasync.AllocTimeout:
            self.figures.timeouts += 1
            return []
        except kvasync.MapError:
            self.figures.map_errors += 1
            return []
        finally:
            overrun = time.monotonic() - started - timeout
            self.figures.max_overrun_s = max(self.figures.max_overrun_s, overrun)
            # The time the loop could not run (16 processes, and others, on a few cores) is not
            # the allocator's overrun: its lag as the probe saw it, how late the probe is now,
            # and the loop thread's own wait for a CPU (the kernel's schedstat) meanwhile.
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
        twice = [b for b in blocks if b in self.held]
        if twice:
            self.problem(f"blocks {twice[:4]} handed out while held")
        for block in blocks:
            signature = float(self.rng.randrange(1, 2000))  # exact in fp16
            for buffer in self.buffers():
                buffer[block].fill_(signature)
            self.held[block] = signature
        return blocks

    def buffers(self) -> list[Any]:
        assert self.kv is not None
        return [t for i in range(LAYOUT.num_layers) for t in self.kv.layer(i)]

    def verify(self, blocks: list[int]) -> None:
        for block in blocks:
            for buffer in self.buffers():
                if buffer[block].min().item() != buffer[block].max().item() or (
                    buffer[block][0, 0, 0].item() != self.held[block]
                ):
                    self.problem(f"block {block} lost its data")
                    return

    async def hang_a_map(self) -> int:
        """Makes maps hang; returns how many hang in the mapper thread (0: none within 1 s,
        e.g. the share's budget is taken, so no map was granted)."""
        assert self.kv is not None
        self.faults.hang()
        # Gives the mapper something to map: a trim first, so that a map is needed.
        with contextlib.suppress(kvasync.AllocTimeout, kvasync.MapError):
            await self.kv.trim(timeout=0.2)
        deadline = time.monotonic() + 1.0
        while self.faults.hung_maps == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        return self.faults.hung_maps

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
        self.faults.release()
        stats = self.kv.stats()
        if stats.used_blocks or stats.waiters or self.held:
            self.problem(
                f"after its requests ended: {stats.used_blocks} blocks allocated, "
                f"{stats.waiters} waiters, {len(self.held)} blocks in its books"
            )
        await self.kv.close(timeout=2.0)
        if self.kv.stats().mapped_pages:
            self.problem(f"{self.kv.stats().mapped_pages} pages still mapped after close")
        self.kv = None
        grown = {fd: link for fd, link in fd_links().items() if fd not in fds_before}
        if grown:
            self.problem(f"fds opened and not closed across open..close: {grown}")
        with contextlib.suppress(OSError):  # a parent gone meanwhile
            self.conn.send({"stopped": self.figures.__dict__})

    def problem(self, text: str) -> None:
        if len(self.figures.problems) < 20:
            self.figures.problems.append(f"{self.name}: {text}")


def run_queue_wait_s() -> float:
    """Seconds this thread has waited for a CPU, runnable, since it started (schedstat)."""
    with open("/proc/thread-self/schedstat") as schedstat:
        return int(schedstat.read().split()[1]) / 1e9


def fd_links() -> dict[str, str]:
    """This process's open fds, each with what it refers to."""
    gc.collect()  # an allocator's fds go with the object: after the collector finds its cycles
    links = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own fd, closed by now
            links[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return links


def member_main(conn: multiprocessing.connection.Connection, share_name: str, name: str) -> None:
    """A member process's entry point (started by the forkserver)."""
    member = Member(conn, name, seed=os.getpid())
    try:
        asyncio.run(member.run(share_name))
    except Exception as error:  # reported to the parent, which fails the soak with it
        conn.send({"error": f"{name}: {type(error).__name__}: {error}"})
        sys.exit(1)


# -- the parent: the ledger seen from outside -------------------------------------------------


class RawLedger:
    """The ledger file read without its lock (Note [Share soak]): for what snapshot cannot show
    (who holds the lock, how many holders died) or would change (it reclaims dead entries)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self.map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def matches(self, pid: int, name: str) -> str | None:
        """None when the layout is the one this soak reads; else what differs."""
        magic, version, header_bytes, _, entries, entry_bytes = struct.unpack_from(
            "<QIIQII", self.map, 0
        )
        if (magic, header_bytes, entry_bytes) != (LEDGER_MAGIC, HEADER_BYTES, ENTRY_BYTES) or (
            version < LEDGER_VERSION
        ):
            return f"ledger version {version}, header {header_bytes} B, entry {entry_bytes} B"
        self.entries = entries
        for slot in range(entries):
            offset = HEADER_BYTES + slot * ENTRY_BYTES
            if self.live(offset) != pid:
                continue
            raw_name = self.map[offset + ENTRY_NAME : offset + ENTRY_NAME + 64].split(b"\0")[0]
            figures = struct.unpack_from("<qq", self.map, offset + ENTRY_PAGE_BYTES)
            if raw_name.decode() == name and figures == (PAGE_SIZE, BUDGET):
                return None
        return "the parent's own entry is not where the layout puts it"

    def live(self, offset: int) -> int:
        state, pid = struct.unpack_from("<Ii", self.map, offset)
        return pid if state == 1 else 0

    def live_pids(self) -> set[int]:
        return {self.live(HEADER_BYTES + slot * ENTRY_BYTES) for slot in range(self.entries)} - {0}

    def busy_mapping(self, pid: int) -> bool:
        """Whether ``pid``'s entry shows its mapper busy (as its watcher last published)."""
        for slot in range(self.entries):
            offset = HEADER_BYTES + slot * ENTRY_BYTES
            if self.live(offset) == pid:
                return bool(struct.unpack_from("<q", self.map, offset + ENTRY_OP_STARTED)[0])
        return False

    def lock_owner_tid(self) -> int:
        return int(struct.unpack_from("<I", self.map, MUTEX_OFFSET)[0]) & FUTEX_TID_MASK

    def repairs(self) -> int:
        return int(struct.unpack_from("<Q", self.map, REPAIRS_OFFSET)[0])


@dataclass
class Process:
    index: int
    proc: BaseProcess
    conn: multiprocessing.connection.Connection
    pid: int
    started_at: float
    joined: bool = False
    progress: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] | None = None
    hung: int | None = None  # its answer to "hang": maps hung in its mapper


@dataclass
class Figures:
    started: int = 0
    kills: dict[str, int] = field(default_factory=lambda: {"lock": 0, "mid-map": 0, "random": 0})
    lock_seen: int = 0  # lock kills sent while the mutex word named the victim's thread
    died_holding_lock: dict[str, int] = field(
        default_factory=lambda: {"lock": 0, "mid-map": 0, "random": 0}
    )
    hung_maps_at_kill: int = 0  # mid-map kills with a map hung in the victim's mapper
    busy_at_kill: int = 0  # kills while the victim's entry showed its mapper busy
    joining_at_kill: int = 0  # random kills of a member still joining
    clear_s: list[float] = field(default_factory=list)  # from the kill
    clear_after_death_s: list[float] = field(default_factory=list)  # from its reaping
    join_s: list[float] = field(default_factory=list)
    snapshots: int = 0
    max_committed: int = 0
    max_members_seen: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)


class Sampler(threading.Thread):
    """Snapshots under the lock, checking the budget, until stopped; pauses while asked."""

    def __init__(self, share_name: str, figures: Figures) -> None:
        super().__init__(daemon=True)
        self.share_name = share_name
        self.figures = figures
        self.running = threading.Event()  # cleared: paused
        self.running.set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if not self.running.wait(timeout=0.1):
                continue
            try:
                entries = share.snapshot(self.share_name, timeout=SNAPSHOT_TIMEOUT_S)
            except kvasync.KVAsyncError as error:
                self.figures.problem(f"snapshot: {error}")
                continue
            committed = sum(e.committed_bytes for e in entries)
            self.figures.snapshots += 1
            self.figures.max_committed = max(self.figures.max_committed, committed)
            self.figures.max_members_seen = max(self.figures.max_members_seen, len(entries))
            if committed > BUDGET or share.budget(entries) != BUDGET:
                self.figures.problem(
                    f"{committed} bytes committed by {len(entries)} members, budget "
                    f"{share.budget(entries)} (set {BUDGET})"
                )
            time.sleep(SAMPLE_EVERY_S)


class Soak:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.share_name = f"soak-{uuid.uuid4().hex[:10]}"
        self.context = multiprocessing.get_context("forkserver")
        # The forkserver imports this module (so torch and the extension) once; each member is a
        # fork of it: a real process that starts in milliseconds instead of seconds.
        self.context.set_forkserver_preload(["__main__", "torch", "kvasync._allocator"])
        self.figures = Figures()
        self.members: list[Process] = []
        self.finished: list[Process] = []  # killed or stopped
        self.rng = random.Random()
        self.raw: RawLedger | None = None
        self.raw_mismatch: str | None = None
        self.parent_fds = (0, 0)

    def spawn(self, index: int) -> Process:
        """Starts a member; it joins the share in the background (``drain`` sees it join)."""
        parent_end, child_end = self.context.Pipe()
        proc = self.context.Process(
            target=member_main, args=(child_end, self.share_name, f"member-{index}"), daemon=True
        )
        proc.start()
        child_end.close()
        self.figures.started += 1
        assert proc.pid is not None
        return Process(index, proc, parent_end, proc.pid, time.monotonic())

    def check_joins(self) -> None:
        for member in list(self.members):
            if member.joined:
                continue
            if not member.proc.is_alive():
                self.figures.problem(f"member-{member.index} exited {member.proc.exitcode}")
            elif time.monotonic() - member.started_at > JOIN_DEADLINE_S:
                self.figures.problem(f"member-{member.index} did not join in {JOIN_DEADLINE_S} s")
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

    def drain(self, member: Process) -> None:
        try:
            while member.conn.poll():
                message = member.conn.recv()
                if "joined" in message:
                    member.joined = True
                    self.figures.join_s.append(time.monotonic() - member.started_at)
                elif "progress" in message:
                    member.progress = message["progress"]
                elif "hung" in message:
                    member.hung = message["hung"]
                elif "stopped" in message:
                    member.report = message["stopped"]
                elif "error" in message:
                    self.figures.problem(message["error"])
        except (EOFError, OSError):
            pass  # killed: its pipe ends (perhaps in the middle of a message)

    def threads_of(self) -> dict[int, Process]:
        owners = {}
        for member in self.members:
            if not member.joined:
                continue
            try:
                for tid in os.listdir(f"/proc/{member.pid}/task"):
                    owners[int(tid)] = member
            except FileNotFoundError:
                pass
        return owners

    def kill_lock_holder(self) -> Process | None:
        """Watches the lock's owner; kills the member holding it (None: none seen in time)."""
        assert self.raw is not None
        owners = self.threads_of()
        deadline = time.monotonic() + LOCK_WATCH_S
        while time.monotonic() < deadline:
            member = owners.get(self.raw.lock_owner_tid())
            if member is not None:
                os.kill(member.pid, signal.SIGKILL)
                self.figures.lock_seen += 1
                return member
            os.sched_yield()
        return None

    def kill_one(self, kind: str) -> None:
        victim: Process | None = None
        # Before the kill: the first lock taker after a death while holding repairs the lock.
        repairs = self.raw.repairs() if self.raw is not None else 0
        if kind == "lock" and self.raw is not None:
            victim = self.kill_lock_holder()
        if victim is None:
            kind = "random" if kind == "lock" else kind
            joined = [m for m in self.members if m.joined]
            victim = self.rng.choice(joined if kind == "mid-map" else self.members)
            if not victim.joined:
                self.figures.joining_at_kill += 1
            if kind == "mid-map" and self.hang_a_map(victim):
                self.figures.hung_maps_at_kill += 1
            if kind == "random" and self.raw is not None and self.raw.busy_mapping(victim.pid):
                self.figures.busy_at_kill += 1
            os.kill(victim.pid, signal.SIGKILL)
        self.figures.kills[kind] += 1
        killed_at = time.monotonic()
        self.sampler.running.clear()  # its snapshots would clear the entry themselves
        victim.proc.join(5.0)
        if victim.proc.exitcode != -signal.SIGKILL:
            self.figures.problem(f"member-{victim.index} exited {victim.proc.exitcode}")
        self.clear_wait(victim.pid, killed_at, dead_at=time.monotonic())
        if self.raw is not None:
            # The taker repairs the lock before it reclaims: once the entry is gone, the counter
            # has moved if it is to.
            self.figures.died_holding_lock[kind] += self.raw.repairs() - repairs
        self.sampler.running.set()
        self.members.remove(victim)
        self.retire(victim)

    def hang_a_map(self, member: Process) -> bool:
        """Tells ``member`` to make its maps hang; whether one hangs in its mapper now."""
        member.conn.send({"cmd": "hang"})
        deadline = time.monotonic() + 3.0
        while member.hung is None and member.conn.poll(max(0.0, deadline - time.monotonic())):
            self.drain(member)
        if member.hung is None:
            self.figures.problem(f"member-{member.index} did not answer 'hang' within 3 s")
        return bool(member.hung)

    def clear_wait(self, pid: int, killed_at: float, dead_at: float) -> None:
        """Waits for ``pid``'s entry to leave the ledger. The figure runs from the kill (so it
        includes the process's exit: its entry is reclaimable once it is a zombie); the
        deadline from its reaping (a process with torch mapped can take a while to exit, the
        more so on a loaded machine)."""

        def gone() -> bool:
            if self.raw is not None:
                return pid not in self.raw.live_pids()
            return all(e.pid != pid for e in share.snapshot(self.share_name))

        while not gone():
            if time.monotonic() - dead_at > CLEAR_DEADLINE_S:
                self.figures.problem(
                    f"dead member {pid} still in the ledger {CLEAR_DEADLINE_S} s after its death"
                )
                return
            time.sleep(0.001)
        now = time.monotonic()
        self.figures.clear_s.append(now - killed_at)
        self.figures.clear_after_death_s.append(max(0.0, now - dead_at))

    def retire(self, member: Process) -> None:
        self.drain(member)
        if member.report is None:  # killed: what it saw up to its last progress report
            self.figures.problems.extend(member.progress.get("problems", []))
        member.conn.close()
        member.proc.close()
        self.finished.append(member)

    def run(self) -> int:
        fds_before = fd_links()
        anchor_config = kvasync.Config(
            backend="host",
            max_blocks=8,
            page_size=PAGE_SIZE,
            reserve_pages=(0, 0),
            share=self.share_name,
            device_budget=BUDGET,
            name="soak-parent",
        )
        # The parent is a member too (it maps nothing): the file stays while members come and
        # go, so that its counters (repairs) span the run.
        anchor = kvasync.open_allocator_sync(LAYOUT, anchor_config)
        self.raw = RawLedger(share.path(self.share_name))
        self.raw_mismatch = self.raw.matches(os.getpid(), "soak-parent")
        if self.raw_mismatch is not None:
            self.raw = None
        self.sampler = Sampler(self.share_name, self.figures)
        console = Console()
        console.print(
            f"share soak: {self.seconds:.0f} s, {MEMBERS} processes on share {self.share_name}, "
            f"budget {BUDGET >> 20} MiB, a kill every {KILL_EVERY_S:.2f} s"
        )
        try:
            self.members = [self.spawn(i) for i in range(MEMBERS)]
            self.wait_for_joins()
            self.sampler.start()
            began = time.monotonic()
            kinds = ["lock", "mid-map", "random"]
            next_kill, count = began + KILL_EVERY_S, 0
            while time.monotonic() - began < self.seconds:
                for member in self.members:
                    self.drain(member)
                self.check_joins()
                if time.monotonic() >= next_kill and any(m.joined for m in self.members):
                    self.kill_one(kinds[count % len(kinds)])
                    count += 1
                    self.members.append(self.spawn(self.figures.started))
                    next_kill += KILL_EVERY_S * self.rng.uniform(0.5, 1.5)
                time.sleep(0.01)
            self.stop_members()
        finally:
            self.sampler.done.set()
            self.sampler.join(5.0)
            for member in self.members:  # only after a failure above
                member.proc.kill()
            self.check_ledger_and_close(anchor)
        # NOTE: a closed allocator keeps its memfd and eventfds until it is dropped.
        del anchor
        self.raw = None
        gc.collect()
        fds_after = fd_links()
        self.parent_fds = (len(fds_before), len(fds_after))
        if len(fds_after) - len(fds_before) > FD_GROWTH:
            grown = {fd: link for fd, link in fds_after.items() if fd not in fds_before}
            self.figures.problem(f"the parent's open fds grew: {grown}")
        return self.print_report(console)

    def stop_members(self) -> None:
        for member in self.members:
            member.conn.send({"cmd": "stop"})
        deadline = time.monotonic() + STOP_DEADLINE_S
        for member in self.members:
            while member.report is None and time.monotonic() < deadline:
                if member.conn.poll(max(0.0, deadline - time.monotonic())):
                    self.drain(member)
                elif not member.proc.is_alive():
                    break
            member.proc.join(max(0.0, deadline - time.monotonic()))
            if member.report is None or member.proc.exitcode != 0:
                self.figures.problem(
                    f"member-{member.index} did not stop cleanly within {STOP_DEADLINE_S} s "
                    f"(exit {member.proc.exitcode})"
                )
                member.proc.kill()
                member.proc.join(5.0)
            else:
                self.figures.problems.extend(member.report["problems"])
        for member in list(self.members):
            self.members.remove(member)
            self.retire(member)

    def check_ledger_and_close(self, anchor: kvasync.SyncAllocator) -> None:
        left = [e for e in share.snapshot(self.share_name) if e.pid != os.getpid()]
        if left:
            self.figures.problem(f"entries left after every member ended: {left}")
        anchor.close()
        if self.share_name in share.shares():
            self.figures.problem(f"the ledger file of {self.share_name} stayed after all left")

    def print_report(self, console: Console) -> int:
        f = self.figures
        reports = [m.report or m.progress for m in self.finished]
        table = Table(title="share soak", title_justify="left")
        table.add_column("what")
        table.add_column("seen", justify="right")
        total = sum(f.kills.values())
        table.add_row("processes started (live at once)", f"{f.started} ({MEMBERS})")
        table.add_row("allocations, all members", f"{sum(r.get('allocs', 0) for r in reports)}")
        table.add_row("  timed out (budget taken)", f"{sum(r.get('timeouts', 0) for r in reports)}")
        table.add_row("  largest overrun of a deadline", ms(max_of(reports, "max_overrun_s")))
        table.add_row("  largest loop lag (CPU starved)", ms(max_of(reports, "max_loop_lag_s")))
        table.add_row("kill -9", f"{total}")
        if self.raw_mismatch is None:
            table.add_row("  aimed at the lock's holder", f"{f.kills['lock']} ({f.lock_seen} seen)")
            died = f.died_holding_lock
            table.add_row(
                "  died holding the ledger's lock (aimed, others)",
                f"{sum(died.values())} ({died['lock']}, {died['mid-map'] + died['random']})",
            )
        else:
            table.add_row("  died holding the ledger's lock", "not observable (see below)")
        table.add_row(
            "  told to hang a map, then killed (hung)",
            f"{f.kills['mid-map']} ({f.hung_maps_at_kill})",
        )
        table.add_row(
            "  at a random time (mapper busy, joining)",
            f"{f.kills['random']} ({f.busy_at_kill}, {f.joining_at_kill})",
        )
        table.add_row("snapshots (largest member count)", f"{f.snapshots} ({f.max_members_seen})")
        table.add_row(
            "largest committed / budget",
            f"{f.max_committed / 2**20:.2f} / {BUDGET / 2**20:.2f} MiB",
        )
        how = "read without the lock" if self.raw_mismatch is None else "by snapshot"
        table.add_row(f"dead member cleared ({how}): p50", ms(percentile(f.clear_s, 50)))
        table.add_row("  max", ms(max(f.clear_s, default=0.0)))
        table.add_row("  max after it was reaped", ms(max(f.clear_after_death_s, default=0.0)))
        table.add_row("join of a new member: max", ms(max(f.join_s, default=0.0)))
        table.add_row("parent's open fds: start / end", "{} / {}".format(*self.parent_fds))
        table.add_row("problems", f"{len(f.problems)}")
        console.print(table)
        if self.raw_mismatch is not None:
            console.print(
                f"The ledger's file is not laid out as this soak reads it ({self.raw_mismatch}; "
                f"it reads header {HEADER_BYTES} B, entry {ENTRY_BYTES} B): kills at random "
                "times only, dead members' clearing timed by snapshots (which clear them too).",
                markup=False,
            )
        for problem in f.problems:
            console.print(f"PROBLEM: {problem}", markup=False)
        console.print("share soak: FAILED" if f.problems else "share soak: passed")
        return 1 if f.problems else 0


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def max_of(reports: list[dict[str, Any]], key: str) -> float:
    return max((float(r.get(key, 0.0)) for r in reports), default=0.0)


def main() -> int:
    seconds = float(os.environ.get("SOAK_SECONDS", "600"))
    # The soak's own deadline: past it, every thread's stack is printed and it exits 1 (its
    # members see their pipe end and stop).
    faulthandler.dump_traceback_later(seconds + RUN_GRACE_S, exit=True)
    return Soak(seconds).run()


if __name__ == "__main__":
    sys.exit(main())
