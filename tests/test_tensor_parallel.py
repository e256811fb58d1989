"""Tensor-parallel groups (kvasync._group, csrc/group/): one scheduler's pool, N rank processes.

Every rank is a real process (tests/tp_rank_worker.py) with its own host backend: a real memfd
reservation, so a page it has not mapped faults when touched. The scheduler's pool runs in this
process on the group's backend, except where the scheduler's own exit is the point
(tests/tp_scheduler_worker.py). Every wait has a deadline; nothing sleeps to let things settle.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvasync
from kvasync import KVAsyncError, _core
from kvasync._group import (
    RankMapper,
    TensorParallel,
    TensorParallelGroup,
    group_geometry,
    group_path,
    open_group,
)

HERE = Path(__file__).resolve().parent
RANK_WORKER = HERE / "tp_rank_worker.py"
SCHEDULER_WORKER = HERE / "tp_scheduler_worker.py"
ALLOCATOR_WORKER = HERE / "tp_allocator_worker.py"
NUM_RANGES = 2
NUM_PAGES = 8
PAGE_SIZE = 64 << 10
BLOCKS_PER_PAGE = 4
MAP_OK = 0
MAP_ERROR = 1
EVENT_TIMEOUT = 30.0  # a process's start (imports) on a loaded 2-core machine


# Every worker started by the running test (stopped at its end by the `processes` fixture, also
# those started before a failing read).
_STARTED: list[Process] = []


class Process:
    """A worker process spoken to by JSON lines, every read bounded by a deadline."""

    def __init__(self, args: list[str]) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=HERE.parent,
        )
        self._buffer = ""
        _STARTED.append(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def read(self, timeout: float = EVENT_TIMEOUT) -> dict[str, Any]:
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.popen.stdout.fileno()
        while "\n" not in self._buffer:
            left = deadline - time.monotonic()
            assert left > 0, f"worker {self.pid} said nothing within {timeout} s"
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536).decode()
                assert chunk, f"worker {self.pid} exited (rc {self.popen.poll()})"
                self._buffer += chunk
        line, self._buffer = self._buffer.split("\n", 1)
        event: dict[str, Any] = json.loads(line)
        return event

    def has_output(self) -> bool:
        """Whether the worker has written anything not read yet (without waiting)."""
        assert self.popen.stdout is not None
        ready, _, _ = select.select([self.popen.stdout.fileno()], [], [], 0)
        return bool(self._buffer) or bool(ready)

    def ask(self, command: str, timeout: float = EVENT_TIMEOUT) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()
        return self.read(timeout)

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self) -> None:
        """Ends the worker (end of input, then SIGKILL if it does not exit) and its pipes."""
        assert self.popen.stdin is not None and self.popen.stdout is not None
        with contextlib.suppress(OSError):  # OSError: it is gone, and the pipe with it
            self.popen.stdin.close()  # a worker reads end of input as "close"
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self.popen.stdout.close()


def start_rank(name: str, rank: int, *extra: str) -> Process:
    return Process(
        [
            str(RANK_WORKER),
            f"--group={name}",
            f"--rank={rank}",
            f"--ranges={NUM_RANGES}",
            f"--pages={NUM_PAGES}",
            f"--page-size={PAGE_SIZE}",
            *extra,
        ]
    )


def start_ranks(name: str, count: int, **extra: list[str]) -> list[Process]:
    """Starts `count` ranks; extra["r<rank>"] are more arguments for one of them."""
    ranks = [start_rank(name, r, *extra.get(f"r{r}", [])) for r in range(count)]
    for rank in ranks:
        assert rank.read()["event"] == "joined"
    return ranks


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    """The workers a test names; every worker it started is stopped (or killed) at its end."""
    yield []
    while _STARTED:
        _STARTED.pop().stop()


@pytest.fixture
def name() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def local_backend() -> _core.HostBackend:
    return _core.HostBackend(NUM_RANGES, NUM_PAGES, PAGE_SIZE)


def open_pool(group: TensorParallelGroup) -> _core.PagePool:
    # No reserve: every map is for a request, so a test sees exactly the jobs it asks for.
    return _core.PagePool(
        group.backend, NUM_PAGES * BLOCKS_PER_PAGE, BLOCKS_PER_PAGE, NUM_PAGES, 0, 0, 30.0
    )


def alloc_and_wait(pool: _core.PagePool, n: int, timeout: float) -> tuple[int, list[int], str]:
    result = pool.alloc(n, time.monotonic() + timeout)
    if isinstance(result, list):
        return MAP_OK, result, ""
    return wait_completion(pool, result, timeout)


def wait_completion(
    pool: _core.PagePool, request: int, timeout: float
) -> tuple[int, list[int], str]:
    deadline = time.monotonic() + timeout
    while True:
        for got, status, blocks, message in pool.drain():
            assert got == request, f"unexpected completion of {got}"
            return status, blocks, message
        left = deadline - time.monotonic()
        assert left > 0, f"request {request} not completed within {timeout} s"
        select.select([pool.completion_fd], [], [], left)


def wait_rank_pages(rank: Process, pages: list[int], timeout: float = 10.0) -> dict[str, Any]:
    """Waits until the rank holds exactly `pages` (its own record, then its memory touched)."""
    deadline = time.monotonic() + timeout
    while True:
        status = rank.ask("status")
        if status["mapped"] == pages:
            return status
        assert time.monotonic() < deadline, f"rank holds {status['mapped']}, expected {pages}"
        # Polled: the rank's pages change on its own thread, which tells this process nothing.
        select.select([], [], [], 0.01)


def pages_of(blocks: list[int]) -> list[int]:
    return sorted({b // BLOCKS_PER_PAGE for b in blocks})


def close_all(pool: _core.PagePool, group: TensorParallelGroup) -> None:
    assert pool.close(10.0)
    group.close()


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_tensor_parallel_alloc_maps_every_rank_and_trim_unmaps_every_rank(
    name: str, processes: list[Process], num_ranks: int
) -> None:
    local = local_backend()
    group = open_group(name, num_ranks, local)
    processes += start_ranks(name, num_ranks)
    group.wait_ready(EVENT_TIMEOUT)
    pool = open_pool(group)

    status, blocks, message = alloc_and_wait(pool, 2 * BLOCKS_PER_PAGE + 1, 10.0)

    assert (status, message) == (MAP_OK, "")
    pages = pages_of(blocks)
    assert len(pages) == 3
    for rank in processes:
        assert rank.ask("touch")["pages"] == pages  # really mapped: touching did not fault
    for index in range(NUM_RANGES):
        view = np.asarray(_core.range_view(local, index))
        view[pages[-1] * PAGE_SIZE] = 7  # the scheduler's own backend mapped them too
    assert [r["mapped_pages"] for r in group.ranks()] == [3] * num_ranks
    assert all(r["state"] == "joined" for r in group.ranks())

    pool.free(blocks)
    barrier = pool.trim(time.monotonic() + 10.0)
    assert wait_completion(pool, barrier, 10.0)[0] == MAP_OK
    for rank in processes:
        assert rank.ask("status")["mapped"] == []  # the unmap returned only once every rank had
    close_all(pool, group)
    for rank in processes:
        left = rank.ask("wait_left 10")
        assert left["ok"] and left["reason"] == "the scheduler closed the group"
    assert not os.path.exists(group_path(name))


def test_tensor_parallel_rank_killed_mid_map_fails_the_alloc_naming_the_rank(
    name: str, processes: list[Process]
) -> None:
    group = open_group(name, 2, local_backend(), map_timeout=20.0)
    processes += start_ranks(name, 2, r1=["--hang"])
    group.wait_ready(EVENT_TIMEOUT)
    pool = open_pool(group)
    request = pool.alloc(BLOCKS_PER_PAGE, time.monotonic() + 30.0)
    assert isinstance(request, int)
    deadline = time.monotonic() + 10.0
    while processes[1].ask("status")["hung_maps"] != 1:  # rank 1 is inside its map
        assert time.monotonic() < deadline, "rank 1 never started its map"
    victim = processes[1].pid

    started = time.monotonic()
    processes[1].kill()
    status, _blocks, message = wait_completion(pool, request, 10.0)

    # Failed for the death (at the next liveness slice), not at the 20 s map timeout.
    assert time.monotonic() - started < 10.0
    assert status == MAP_ERROR
    assert f"rank 1 (pid {victim}) died" in message, message
    wait_rank_pages(processes[0], [])  # rank 0's map of that job was rolled back
    assert group.broken is not None and f"rank 1 (pid {victim}) died" in group.broken
    # The group is broken: the next map fails at once, naming the dead rank again.
    status, _blocks, message = alloc_and_wait(pool, BLOCKS_PER_PAGE, 5.0)
    assert status == MAP_ERROR and "rank 1" in message and "reopened" in message
    assert [r["state"] for r in group.ranks()] == ["joined", "dead"]
    close_all(pool, group)


def test_tensor_parallel_rank_failure_unmaps_what_the_others_mapped(
    name: str, processes: list[Process]
) -> None:
    local = local_backend()
    group = open_group(name, 3, local)
    processes += start_ranks(name, 3)
    group.wait_ready(EVENT_TIMEOUT)
    pool = open_pool(group)
    processes[2].ask("fail 1")

    status, _blocks, message = alloc_and_wait(pool, BLOCKS_PER_PAGE, 10.0)

    assert status == MAP_ERROR
    assert f"rank 2 (pid {processes[2].pid}) failed to map page 0: ENOMEM: injected" in message
    for rank in processes:
        wait_rank_pages(rank, [])
    assert pool.stats()["mapped_pages"] == 0
    # A refusal is not a death: the group still serves, and the next alloc maps everywhere.
    assert group.broken is None
    status, blocks, _message = alloc_and_wait(pool, BLOCKS_PER_PAGE, 10.0)
    assert status == MAP_OK
    for rank in processes:
        assert rank.ask("touch")["pages"] == pages_of(blocks)
    close_all(pool, group)


def test_tensor_parallel_rank_slower_than_the_unmap_timeout_is_reported_not_silent(
    name: str, processes: list[Process]
) -> None:
    # The pool goes on as if a rank's late (or failed) unmap had happened: only the local unmap's
    # outcome counts (group_stress: blocks were handed out on pages the others had unmapped).
    # But that rank's device keeps memory the share no longer counts, and nothing said so.
    group = open_group(name, 2, local_backend(), map_local=False, unmap_timeout=0.3)
    processes += start_ranks(name, 2)
    group.wait_ready(EVENT_TIMEOUT)
    pool = open_pool(group)
    status, blocks, _message = alloc_and_wait(pool, BLOCKS_PER_PAGE, 10.0)
    assert status == MAP_OK
    processes[1].ask("delay 1.5")  # its next unmap outlives the scheduler's 0.3 s

    pool.free(blocks)
    assert wait_completion(pool, pool.trim(time.monotonic() + 10.0), 10.0)[0] == MAP_OK

    last_error = pool.stats()["last_error"]
    assert f"rank 1 (pid {processes[1].pid}), alive, did not finish unmap page 0" in last_error
    assert "keeps those pages mapped" in last_error
    wait_rank_pages(processes[0], [])
    wait_rank_pages(processes[1], [])  # the slow unmap ran to its end all the same
    processes[1].ask("delay 0")
    close_all(pool, group)


def test_tensor_parallel_slow_rank_delays_the_alloc_within_its_deadline(
    name: str, processes: list[Process]
) -> None:
    group = open_group(name, 2, local_backend(), map_timeout=10.0)
    processes += start_ranks(name, 2, r1=["--delay=0.3"])
    group.wait_ready(EVENT_TIMEOUT)
    pool = open_pool(group)

    started = time.monotonic()
    status, blocks, message = alloc_and_wait(pool, BLOCKS_PER_PAGE, 10.0)

    assert (status, message) == (MAP_OK, "")
    assert time.monotonic() - started >= 0.3  # it waited for the slow rank's map
    for rank in processes:
        assert rank.ask("touch")["pages"] == pages_of(blocks)
    close_all(pool, group)


def test_tensor_parallel_rank_slower_than_the_map_timeout_fails_it_then_unmaps(
    name: str, processes: list[Process]
) -> None:
    group = open_group(name, 2, local_backend(), map_timeout=0.5)
    processes += start_ranks(name, 2, r1=["--delay=2.0"])
    group.wait_ready(EVENT_TIMEOUT)
    pool = open_pool(group)

    status, _blocks, message = alloc_and_wait(pool, BLOCKS_PER_PAGE, 10.0)

    assert status == MAP_ERROR
    assert f"rank 1 (pid {processes[1].pid}), alive, did not finish map page 0 within 0.5 s" in (
        message
    )
    # The rollback was queued behind the slow map: rank 1 ends with nothing mapped.
    wait_rank_pages(processes[1], [], timeout=10.0)
    wait_rank_pages(processes[0], [])
    assert group.broken is None  # slow is not dead
    processes[1].ask("release")
    status, blocks, _message = alloc_and_wait(pool, BLOCKS_PER_PAGE, 10.0)
    assert status == MAP_OK
    assert processes[1].ask("touch")["pages"] == pages_of(blocks)
    close_all(pool, group)


def test_tensor_parallel_rank_that_never_starts_fails_open_and_alloc_naming_it(
    name: str, processes: list[Process]
) -> None:
    with pytest.raises(KVAsyncError, match=r"ranks 0, 1 never joined group '.*' within 0\.3 s"):
        open_group(name, 2, local_backend(), ready_timeout=0.3)
    assert not os.path.exists(group_path(name))  # closed again

    group = open_group(name, 2, local_backend(), map_timeout=0.5)
    processes += start_ranks(name, 1)
    pool = open_pool(group)
    started = time.monotonic()
    status, _blocks, message = alloc_and_wait(pool, BLOCKS_PER_PAGE, 10.0)
    assert time.monotonic() - started < 5.0
    assert status == MAP_ERROR and "rank 1 never joined group" in message, message
    assert processes[0].ask("status")["mapped"] == []  # nothing was posted to rank 0
    assert [r["state"] for r in group.ranks()] == ["joined", "absent"]
    close_all(pool, group)


def test_tensor_parallel_seed_a_second_engine_starts_while_the_first_maps(
    name: str, processes: list[Process]
) -> None:
    # Seed 001, reproduction A, with TP: engine A's map is stuck on a rank (driver contention);
    # engine B starts beside it and must come up and map, not hang behind A.
    group_a = open_group(name + "-a", 2, local_backend(), map_timeout=30.0)
    ranks_a = start_ranks(name + "-a", 2, r0=["--hang"], r1=["--hang"])
    processes += ranks_a
    group_a.wait_ready(EVENT_TIMEOUT)
    pool_a = open_pool(group_a)
    request_a = pool_a.alloc(BLOCKS_PER_PAGE, time.monotonic() + 60.0)
    assert isinstance(request_a, int)
    deadline = time.monotonic() + 10.0
    while ranks_a[0].ask("status")["hung_maps"] != 1:
        assert time.monotonic() < deadline, "engine A's rank never started its map"

    group_b = open_group(name + "-b", 2, local_backend(), map_timeout=10.0)
    ranks_b = start_ranks(name + "-b", 2)
    processes += ranks_b
    group_b.wait_ready(EVENT_TIMEOUT)
    pool_b = open_pool(group_b)
    status, blocks, message = alloc_and_wait(pool_b, 2 * BLOCKS_PER_PAGE, 10.0)

    assert (status, message) == (MAP_OK, "")
    for rank in ranks_b:
        assert rank.ask("touch")["pages"] == pages_of(blocks)
    assert pool_a.drain() == []  # A is still mapping: B did not wait for it
    for rank in ranks_a:
        rank.ask("release")
    status, blocks_a, _message = wait_completion(pool_a, request_a, 10.0)
    assert status == MAP_OK
    for rank in ranks_a:
        assert rank.ask("touch")["pages"] == pages_of(blocks_a)
    close_all(pool_b, group_b)
    close_all(pool_a, group_a)


def test_tensor_parallel_scheduler_exit_while_ranks_map_makes_them_unmap_and_leave(
    name: str, processes: list[Process]
) -> None:
    scheduler = Process(
        [
            str(SCHEDULER_WORKER),
            f"--group={name}",
            "--ranks=2",
            f"--ranges={NUM_RANGES}",
            f"--pages={NUM_PAGES}",
            f"--page-size={PAGE_SIZE}",
            f"--blocks-per-page={BLOCKS_PER_PAGE}",
        ]
    )
    processes.append(scheduler)
    ranks = start_ranks(name, 2)
    processes += ranks
    assert scheduler.read()["event"] == "ready"
    first = scheduler.ask("alloc 4")
    assert scheduler.ask(f"wait {first['request']} 10")["status"] == MAP_OK
    for rank in ranks:
        assert rank.ask("touch")["pages"] == [0]
        rank.ask("hang")
    assert scheduler.ask("alloc 4")["event"] == "posted"
    deadline = time.monotonic() + 10.0
    while not all(rank.ask("status")["hung_maps"] == 1 for rank in ranks):
        assert time.monotonic() < deadline, "the ranks never started the second map"

    scheduler.kill()  # mid-map
    for rank in ranks:
        rank.ask("release")  # the driver call returns; the rank then finds the scheduler gone

    for rank in ranks:
        left = rank.ask("wait_left 5")
        assert left["ok"], left
        assert left["reason"] == f"the scheduler (pid {scheduler.pid}) died"
        assert left["mapped"] == []
    # The dead scheduler's file is replaced by the next scheduler of that name.
    group = open_group(name, 1, local_backend())
    group.close()


def test_tensor_parallel_rank_with_another_geometry_is_refused_and_named(
    name: str,
) -> None:
    group = open_group(name, 1, local_backend())
    try:
        wrong = _core.HostBackend(NUM_RANGES, NUM_PAGES * 2, PAGE_SIZE)
        with pytest.raises(KVAsyncError, match="rank 0 cannot join group"):
            RankMapper(name, 0, wrong, timeout=1.0)
        with pytest.raises(KVAsyncError, match=r"rank 0 .* was refused by group"):
            group.wait_ready(1.0)
    finally:
        group.close()


def test_tensor_parallel_group_name_in_use_by_a_live_scheduler_is_refused(name: str) -> None:
    with (
        open_group(name, 1, local_backend()),
        pytest.raises(KVAsyncError, match="in use by the live scheduler pid"),
    ):
        open_group(name, 1, local_backend())


def test_tensor_parallel_rank_join_waits_for_the_scheduler_within_its_timeout(name: str) -> None:
    started = time.monotonic()
    with pytest.raises(KVAsyncError, match=r"rank 0 cannot join .* no group file"):
        RankMapper(name, 0, local_backend(), timeout=0.2)
    assert time.monotonic() - started >= 0.2


@pytest.mark.parametrize("bad", ["", "../x", "a b", "-x"])
def test_tensor_parallel_bad_group_name_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="group name"):
        group_path(bad)


async def test_tensor_parallel_allocator_blocks_are_usable_on_every_rank(
    name: str, processes: list[Process]
) -> None:
    layout = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    tensor_parallel = TensorParallel(name, 2, map_timeout=EVENT_TIMEOUT)
    config = kvasync.Config(
        backend="host", max_blocks=1024, reserve_pages=(0, 0), tensor_parallel=tensor_parallel
    )
    async with kvasync.open_allocator(layout, config) as kv:
        # Started after the scheduler: the first map waits for them to join, within its timeout.
        ranks = [start_rank(name, r, "--layout=2,2,64,16", "--max-blocks=1024") for r in range(2)]
        processes += ranks

        blocks = await kv.alloc(600, timeout=EVENT_TIMEOUT)

        for rank in ranks:
            assert rank.read()["event"] == "joined"
            assert rank.ask(f"write_blocks {json.dumps(blocks)}") == {
                "event": "written",
                "ok": True,
            }
        kv.free(blocks)
    for rank in ranks:
        assert rank.ask("status")["mapped"] == []  # close unmapped every page on every rank


def test_tensor_parallel_maps_complete_while_the_scheduler_holds_the_gil(
    name: str, processes: list[Process]
) -> None:
    # Seed 000 with TP: a native thread that needs the GIL for its per-rank IPC stalls while the
    # caller holds it. Here the scheduler's thread holds the GIL (busy, never released) until the
    # reserve refill (2 pages) has been mapped on every rank.
    group = open_group(name, 2, local_backend(), map_timeout=10.0)
    processes += start_ranks(name, 2)
    group.wait_ready(EVENT_TIMEOUT)
    pool = _core.PagePool(
        group.backend, NUM_PAGES * BLOCKS_PER_PAGE, BLOCKS_PER_PAGE, NUM_PAGES, 2, 2, 10.0
    )

    assert _core.spin_holding_gil(pool, 2, 10.0)

    for rank in processes:
        assert rank.ask("touch")["pages"] == [0, 1]
    close_all(pool, group)


async def test_tensor_parallel_allocator_alloc_raises_map_error_naming_a_killed_rank(
    name: str, processes: list[Process]
) -> None:
    layout = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    tensor_parallel = TensorParallel(name, 2, ready_timeout=EVENT_TIMEOUT, map_timeout=20.0)
    config = kvasync.Config(
        backend="host", max_blocks=1024, reserve_pages=(0, 0), tensor_parallel=tensor_parallel
    )
    # Started first: the allocator's open waits for them (ready_timeout).
    ranks = [
        start_rank(name, 0, "--layout=2,2,64,16", "--max-blocks=1024"),
        start_rank(name, 1, "--layout=2,2,64,16", "--max-blocks=1024", "--hang"),
    ]
    processes += ranks
    async with kvasync.open_allocator(layout, config) as kv:
        for rank in ranks:
            assert rank.read()["event"] == "joined"
        alloc = asyncio.ensure_future(kv.alloc(8, timeout=30.0))
        deadline = time.monotonic() + 10.0
        # Asked from a thread: the loop keeps running (and so starts the alloc) meanwhile.
        while (await asyncio.to_thread(ranks[1].ask, "status"))["hung_maps"] != 1:
            assert time.monotonic() < deadline, "rank 1 never started its map"
        victim = ranks[1].pid
        ranks[1].kill()

        with pytest.raises(kvasync.MapError, match=rf"rank 1 \(pid {victim}\) died"):
            await asyncio.wait_for(alloc, 10.0)
    assert ranks[0].ask("status")["mapped"] == []


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # two close paths (_loops)
@pytest.mark.anyio
async def test_tensor_parallel_allocator_close_closes_its_group_and_removes_its_file(
    anyio_backend: str, name: str, processes: list[Process]
) -> None:
    layout = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    config = kvasync.Config(
        backend="host",
        max_blocks=1024,
        reserve_pages=(0, 0),
        tensor_parallel=TensorParallel(name, 2, ready_timeout=EVENT_TIMEOUT),
    )
    ranks = [start_rank(name, r, "--layout=2,2,64,16", "--max-blocks=1024") for r in range(2)]
    processes += ranks
    async with kvasync.open_allocator(layout, config) as kv:
        for rank in ranks:
            assert rank.read()["event"] == "joined"
        kv.free(await kv.alloc(600, timeout=EVENT_TIMEOUT))

    # `kv` is still referenced (and an allocator is freed only by the cycle collector): the close
    # itself must end the group, not the release of its backend, which may come at exit or never.
    assert not os.path.exists(group_path(name))
    for rank in ranks:
        left = rank.ask("wait_left 10")
        assert left["ok"] and left["reason"] == "the scheduler closed the group", left
        assert left["mapped"] == []
    # So the name is free again in this process: not "in use by the live scheduler".
    again = dataclasses.replace(config, tensor_parallel=TensorParallel(name, 2))  # no ranks
    async with kvasync.open_allocator(layout, again):
        assert os.path.exists(group_path(name))
    assert not os.path.exists(group_path(name))


def test_tensor_parallel_allocator_never_closed_has_its_group_closed_at_exit(
    name: str, processes: list[Process]
) -> None:
    ranks = [
        start_rank(name, r, "--layout=2,2,64,16", "--max-blocks=1024", "--join-timeout=60")
        for r in range(2)
    ]
    processes += ranks
    scheduler = Process(
        [
            str(ALLOCATOR_WORKER),
            f"--group={name}",
            "--ranks=2",
            "--layout=2,2,64,16",
            "--max-blocks=1024",
            "--blocks=600",
        ]
    )
    processes.append(scheduler)
    for rank in ranks:
        assert rank.read()["event"] == "joined"
    ready = scheduler.read()
    assert ready["event"] == "ready"
    for rank in ranks:
        assert rank.ask(f"write_blocks {json.dumps(ready['blocks'])}")["ok"]  # mapped there

    scheduler.stop()  # end of input: it exits normally, its allocator never closed

    assert scheduler.popen.returncode == 0
    # Closed by the exit hook ("closed", not "died": the file then stays until the name's reuse).
    for rank in ranks:
        left = rank.ask("wait_left 10")
        assert left["ok"] and left["reason"] == "the scheduler closed the group", left
        assert left["mapped"] == []
    assert not os.path.exists(group_path(name))


def test_tensor_parallel_corrupt_group_file_is_refused_by_a_rank_and_replaced_by_a_scheduler(
    name: str,
) -> None:
    path = group_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, b"not a group" * 100_000)
    finally:
        os.close(fd)
    try:
        with pytest.raises(KVAsyncError, match="is not a kvasync group of this version"):
            RankMapper(name, 0, local_backend(), timeout=1.0)
        # No live scheduler: the scheduler replaces it, and a rank joins the new one.
        with (
            open_group(name, 1, local_backend()) as group,
            RankMapper(name, 0, local_backend(), timeout=1.0),
        ):
            group.wait_ready(5.0)
        assert not os.path.exists(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def mapped_permissions(base: int, size: int) -> set[str]:
    """The permissions of this process's mappings over [base, base + size) (/proc/self/maps)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start < base + size and end > base:
                found.add(perms)
    return found


def test_tensor_parallel_scheduler_without_local_memory_maps_only_the_ranks(
    name: str, processes: list[Process]
) -> None:
    local = local_backend()
    group = open_group(name, 2, local, map_local=False)
    processes += start_ranks(name, 2)
    group.wait_ready(EVENT_TIMEOUT)
    pool = open_pool(group)

    status, blocks, _message = alloc_and_wait(pool, 2 * BLOCKS_PER_PAGE, 10.0)

    assert status == MAP_OK
    for rank in processes:
        assert rank.ask("touch")["pages"] == pages_of(blocks)
    for index in range(NUM_RANGES):
        # Still the PROT_NONE reservation: no page of it was mapped in the scheduler's process.
        assert mapped_permissions(local.range_base(index), NUM_PAGES * PAGE_SIZE) == {"---p"}
    close_all(pool, group)


def test_tensor_parallel_zero_on_alloc_without_local_memory_is_refused() -> None:
    with pytest.raises(ValueError, match="zero_on_alloc needs KV memory in this process"):
        kvasync.Config(zero_on_alloc=True, tensor_parallel=TensorParallel("x", 2, map_local=False))


def wait_idle(pool: _core.PagePool, timeout: float = 10.0) -> dict[str, Any]:
    """Waits until the pool's mapper has no job queued or running."""
    deadline = time.monotonic() + timeout
    while True:
        stats = pool.stats()
        busy = stats["queued_jobs"] + stats["mapping_pages"] + stats["unmapping_pages"]
        if busy == 0 and stats["mapper_op"] is None:
            return stats
        assert time.monotonic() < deadline, f"mapper still busy after {timeout} s: {stats}"
        select.select([pool.completion_fd], [], [], 0.005)  # woken by completions, else polled


def test_tensor_parallel_ranks_hold_exactly_the_pools_pages_under_random_allocs_and_failures(
    name: str, processes: list[Process]
) -> None:
    rng = random.Random(17)
    group = open_group(name, 2, local_backend())
    processes += start_ranks(name, 2)
    group.wait_ready(EVENT_TIMEOUT)
    pool = _core.PagePool(
        group.backend, NUM_PAGES * BLOCKS_PER_PAGE, BLOCKS_PER_PAGE, NUM_PAGES, 0, 2, 10.0
    )
    held: list[list[int]] = []
    failures = 0
    for step in range(200):
        op = rng.random()
        if op < 0.1:
            processes[rng.randrange(2)].ask("fail 1")  # the rank's next map fails
        elif op < 0.55 and pool.available_blocks() >= 6:  # never waits for a free
            status, blocks, message = alloc_and_wait(pool, rng.randint(1, 6), 10.0)
            if status == MAP_OK:
                held.append(blocks)
            else:
                assert status == MAP_ERROR and "ENOMEM: injected" in message, message
                failures += 1
        elif op < 0.9 and held:
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            barrier = pool.trim(time.monotonic() + 10.0)
            if barrier:
                assert wait_completion(pool, barrier, 10.0)[0] == MAP_OK
        if step % 20 == 19:
            stats = wait_idle(pool)
            in_use = sorted({b // BLOCKS_PER_PAGE for blocks in held for b in blocks})
            for rank in processes:
                mapped = rank.ask("status")["mapped"]
                # Exactly as many pages as the pool has mapped, every page in use among them.
                assert len(mapped) == stats["mapped_pages"], (mapped, stats)
                assert set(in_use) <= set(mapped)
                assert rank.ask("touch")["pages"] == mapped
    assert failures > 0  # the failure path ran
    for rank in processes:
        rank.ask("release")
    for blocks in held:
        pool.free(blocks)
    close_all(pool, group)
    for rank in processes:
        assert rank.ask("wait_left 10")["mapped"] == []


def test_tensor_parallel_group_geometry_is_the_schedulers(name: str) -> None:
    with open_group(name, 3, local_backend()):
        assert group_geometry(name, 1.0) == {
            "num_ranks": 3,
            "num_ranges": NUM_RANGES,
            "num_pages": NUM_PAGES,
            "page_size": PAGE_SIZE,
        }
    with pytest.raises(KVAsyncError, match="no group file"):
        group_geometry(name, 0.0)


def test_tensor_parallel_forked_child_closing_the_group_and_rank_touches_nothing(
    name: str,
) -> None:
    group = open_group(name, 1, local_backend())
    rank_backend = local_backend()
    mapper = RankMapper(name, 0, rank_backend, timeout=5.0)  # this process is rank 0 as well
    group.wait_ready(5.0)
    pool = open_pool(group)
    status, blocks, _message = alloc_and_wait(pool, BLOCKS_PER_PAGE, 10.0)
    assert status == MAP_OK

    child = os.fork()
    if child == 0:  # the child: close everything it inherited, as its exit would
        code = 0
        try:
            group.close()
            code = 0 if mapper.close(1.0) is False else 1
        finally:
            os._exit(code)
    _, wait_status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0

    assert os.path.exists(group_path(name))
    assert [r["state"] for r in group.ranks()] == ["joined"]
    assert not mapper.left and mapper.mapped_page_ids() == pages_of(blocks)
    status, more, _message = alloc_and_wait(pool, 2 * BLOCKS_PER_PAGE, 10.0)
    assert status == MAP_OK  # the parent's group still maps on its rank
    assert mapper.mapped_page_ids() == pages_of(blocks + more)
    close_all(pool, group)
    assert mapper.wait_left(5.0) and mapper.mapped_pages == 0
    mapper.close()


async def test_tensor_parallel_allocator_open_fails_naming_ranks_that_never_join(name: str) -> None:
    layout = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    config = kvasync.Config(
        backend="host", tensor_parallel=TensorParallel(name, 2, ready_timeout=0.2)
    )
    with pytest.raises(KVAsyncError, match=r"ranks 0, 1 never joined group .* within 0\.2 s"):
        async with kvasync.open_allocator(layout, config):
            pass
    assert not os.path.exists(group_path(name))


def test_tensor_parallel_rank_maps_while_its_python_holds_the_gil(
    name: str, processes: list[Process]
) -> None:
    # The rank's side of seed 000: its mapper thread needs nothing from its Python. The rank's
    # main thread keeps the GIL for 3 s; the map completes while it still does.
    group = open_group(name, 1, local_backend(), map_timeout=10.0)
    processes += start_ranks(name, 1)
    group.wait_ready(EVENT_TIMEOUT)
    pool = open_pool(group)
    assert processes[0].ask("hold_gil 3")["event"] == "holding"

    status, _blocks, message = alloc_and_wait(pool, 2 * BLOCKS_PER_PAGE, 10.0)

    assert (status, message) == (MAP_OK, "")
    assert [r["mapped_pages"] for r in group.ranks()] == [2]
    assert not processes[0].has_output()  # it still holds the GIL: "held" is not out yet
    assert processes[0].read(30.0)["event"] == "held"
    close_all(pool, group)


def test_tensor_parallel_rank_holds_a_page_committed_only_once_every_rank_mapped_it(
    name: str,
) -> None:
    # vLLM's worker writes the null block's page as soon as its rank may: a page a rank mapped
    # while the group's map is pending, or failed elsewhere, is not that (a rollback unmaps it;
    # test_vllm_plugin's worker processes faulted writing it). The two ranks are threads of this
    # process here: rank 1's backend hangs, or fails, on cue.
    group = open_group(name, 2, local_backend(), map_local=False, map_timeout=30.0)
    faults = _core.FaultState()
    ranks = [
        RankMapper(name, 0, local_backend(), timeout=EVENT_TIMEOUT),
        RankMapper(name, 1, _core.with_faults(local_backend(), faults), timeout=EVENT_TIMEOUT),
    ]
    pool = open_pool(group)
    faults.hang()

    request = pool.alloc(BLOCKS_PER_PAGE, time.monotonic() + 30.0)
    assert isinstance(request, int)  # nothing mapped yet: a waiter
    deadline = time.monotonic() + 10.0
    while ranks[0].mapped_page_ids() != [0]:  # rank 0's map runs on its own thread
        assert time.monotonic() < deadline, f"rank 0 holds {ranks[0].mapped_page_ids()}"
        select.select([], [], [], 0.01)
    assert ranks[0].committed_page_ids() == []  # rank 1 has not mapped: it may still be undone
    faults.release()
    status, blocks, message = wait_completion(pool, request, 30.0)

    assert (status, message) == (MAP_OK, "")
    assert [rank.committed_page_ids() for rank in ranks] == [[0], [0]]
    faults.fail(1)
    status, _blocks, message = alloc_and_wait(pool, BLOCKS_PER_PAGE, 10.0)
    assert status == MAP_ERROR and "rank 1" in message
    # Page 1's map was rolled back on rank 0 before the failure was reported; page 0 stays.
    assert [(rank.mapped_page_ids(), rank.committed_page_ids()) for rank in ranks] == [
        ([0], [0]),
        ([0], [0]),
    ]
    pool.free(blocks)
    close_all(pool, group)
    for rank in ranks:
        assert rank.wait_left(10.0)
        assert rank.mapped_page_ids() == rank.committed_page_ids() == []
        rank.close()
