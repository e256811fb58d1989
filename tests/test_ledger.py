"""The share ledger (csrc/ledger/ledger.h, Note [Share ledger]) with real processes on one budget.

Each worker is a child process (tests/share_worker.py) driven over JSON lines; the test reads the
ledger from outside, as ``kvasync top`` does. Nothing sleeps to let things settle: each step waits
for the event it expects (an answer, a ledger figure), with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from conftest import ledger_lock_taken, wait_until

import kvasync
from kvasync import _core
from kvasync import share as ledger
from kvasync.cli import main as cli
from kvasync.share._cli import format_bytes, parse_size

WORKER = Path(__file__).with_name("share_worker.py")
PAGE = 2 << 20  # share_worker.PAGE_SIZE: 4 blocks per page
BLOCKS_PER_PAGE = 4
LAYOUT = kvasync.KVLayout(
    num_layers=4, num_kv_heads=8, head_dim=128, block_size=32, contiguous=True
)
# A correctness bound, not a performance claim: dead entries are reclaimed within 1 s (+ a tick).
RECLAIM_BOUND_S = 1.5


class Worker:
    """A share_worker.py child: send a command, read its answer with a deadline."""

    def __init__(self, backend: str = "host", prefix: tuple[str, ...] = ()) -> None:
        # `prefix`: a command the worker runs under (e.g. unshare, for another pid namespace).
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(WORKER), backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = self.read(timeout=60.0)["pid"]

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"worker {self.proc.pid} did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"worker {self.proc.pid} exited ({self.proc.poll()})")
        return dict(json.loads(line))

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def call(self, wait_s: float = 10.0, **command: Any) -> dict[str, Any]:
        self.send(**command)
        answer = self.read(wait_s)
        assert answer.get("ok"), answer
        return answer

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def workers() -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(backend: str = "host", prefix: tuple[str, ...] = ()) -> Worker:
        started.append(Worker(backend, prefix))
        return started[-1]

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture(scope="module")
def host_workers() -> Iterator[list[Worker]]:
    # Starting a worker costs seconds (it imports torch): tests that kill none share these two.
    started = [Worker(), Worker()]
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture
def pair(host_workers: list[Worker]) -> Iterator[tuple[Worker, Worker]]:
    """Two host workers with no allocator open; each is left so again after the test."""
    yield host_workers[0], host_workers[1]
    for worker in host_workers:
        worker.call(cmd="close")


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Polls ``predicate`` (every 2 ms) until it holds; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not reached within {timeout} s")
        time.sleep(0.002)
    return time.monotonic() - start


def entry_of(share: str, pid: int) -> ledger.LedgerEntry | None:
    return next((e for e in ledger.snapshot(share) if e.pid == pid), None)


def blocked(share: str, pid: int) -> bool:
    entry = entry_of(share, pid)
    return entry is not None and entry.blocked > 0


def committed_pages(stats: dict[str, Any]) -> int:
    return int(stats["mapped_pages"] + stats["mapping_pages"] + stats["unmapping_pages"])


# -- seed A: a second engine starts next to a busy first one ----------------------------------


def run_seed_a(share: str, engine1: Worker, engine2: Worker, rounds: int) -> None:
    budget = 16 * PAGE
    engine1.call(
        cmd="open", share=share, budget=budget, name="engine1", reserve=(1, 2), map_delay=0.002
    )
    engine1.call(cmd="churn", max_n=24, hold_s=0.002, trim_every=4)
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(sum(e.committed_bytes for e in ledger.snapshot(share)))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        answer = engine2.call(
            wait_s=60.0,
            cmd="rounds",
            count=rounds,
            share=share,
            budget=budget,
            name="engine2",
            sizes=[6, 10, 12, 8],
            timeout=2.0,
            reserve=(2, 4),
            map_delay=0.005,
        )
    finally:
        stop.set()
        sampler.join(timeout=10)
    churned = engine1.call(cmd="stop")["rounds"]
    failed = [r for r in answer["rounds"] if not r["ok"]]
    assert not failed, failed[:3]
    assert max(max(r["allocs"]) for r in answer["rounds"]) < 2.0
    assert churned > 0
    # The budget held at every sample.
    assert samples and max(samples) <= budget, max(samples)
    # Engine 2 left (its entry is gone). Engine 1's entry is what it has mapped once its mapper
    # is idle: its reserve policy may still refill or trim after the churn stopped, and the
    # ledger and the stats are two reads, so they are compared while no job runs or waits.
    assert [e.name for e in ledger.snapshot(share)] == ["engine1"]
    seen: list[tuple[int, int]] = []

    def ledger_matches_an_idle_mapper() -> bool:
        before = engine1.call(cmd="stats")["stats"]
        entries = ledger.snapshot(share)
        after = engine1.call(cmd="stats")
        idle = [before["mapper_op"], after["stats"]["mapper_op"]] == [None, None] and not (
            before["queued_jobs"] or after["stats"]["queued_jobs"]
        )
        if not idle or before["maps_done"] != after["stats"]["maps_done"]:
            return False  # a job ran between the reads
        if before["unmaps_done"] != after["stats"]["unmaps_done"]:
            return False
        seen.append((entries[0].committed_bytes, committed_pages(before) * after["page_bytes"]))
        return seen[-1][0] == seen[-1][1]

    try:
        wait_for(
            ledger_matches_an_idle_mapper,
            10.0,
            "engine 1's ledger entry equal to its mapped pages while its mapper is idle",
        )
    except AssertionError as error:
        raise AssertionError(f"{error}; (ledger, pages) bytes, last reads: {seen[-3:]}") from None


def test_seed_a_second_engine_starts_next_to_a_mapping_one(
    share: str, pair: tuple[Worker, Worker]
) -> None:
    run_seed_a(share, *pair, rounds=50)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_seed_a_on_one_gpu(share: str, workers: Callable[..., Worker]) -> None:
    run_seed_a(share, workers("cuda"), workers("cuda"), rounds=50)


# -- the budget, across processes -------------------------------------------------------------


def test_waiter_is_served_when_another_process_frees(
    share: str, pair: tuple[Worker, Worker]
) -> None:
    budget = 8 * PAGE
    a, b = pair
    a.call(cmd="open", share=share, budget=budget, name="a", reserve=(0, 0))
    b.call(cmd="open", share=share, budget=budget, name="b", reserve=(0, 0))
    a.call(cmd="alloc", n=8 * BLOCKS_PER_PAGE, timeout=2.0)  # the whole budget, in use
    # Seed B across processes: B's alloc ends at its deadline with a clear timeout.
    b.send(cmd="alloc", n=4, timeout=0.3)
    answer = b.read(timeout=5.0)
    assert not answer["ok"] and answer["error"].startswith("AllocTimeout")
    assert "share's device budget" in answer["error"]
    assert 0.25 < answer["took_s"] < 1.0
    # Now B waits, A frees: B is served, woken by the release (not by a poll).
    b.send(cmd="alloc", n=4 * BLOCKS_PER_PAGE, timeout=5.0)
    wait_for(lambda: blocked(share, b.pid), 5.0, "B blocked on the budget")
    freed_at = a.call(cmd="free")["freed_at"]
    served = b.read(timeout=5.0)
    assert served["ok"], served
    assert served["t"] - freed_at < 1.0  # generous: a correctness bound, not a timing claim
    assert sum(e.committed_bytes for e in ledger.snapshot(share)) <= budget


def test_cross_process_wake_latency(share: str, pair: tuple[Worker, Worker]) -> None:
    # Small pages (64 KiB), so that the figure is the wake-up path (A's unmap, the release, the
    # futex wake, B's watcher, B's map of 4 small pages, B's loop), not the zeroing of 2 MiB pages.
    small_page, per_page = 64 << 10, 8
    budget = 8 * small_page
    a, b = pair
    a.call(cmd="open", share=share, budget=budget, name="a", reserve=(0, 0), small=True)
    b.call(cmd="open", share=share, budget=budget, name="b", reserve=(0, 0), small=True)
    latencies = []
    for _ in range(10):
        a.call(cmd="alloc", n=8 * per_page, timeout=2.0)
        b.send(cmd="alloc", n=4 * per_page, timeout=5.0)
        wait_for(lambda: blocked(share, b.pid), 5.0, "B blocked on the budget")
        freed_at = a.call(cmd="free")["freed_at"]
        served = b.read(timeout=5.0)
        assert served["ok"], served
        latencies.append(served["t"] - freed_at)
        b.call(cmd="free")
    latencies.sort()
    print(
        f"\ncross-process wake: B served after A freed: median {latencies[5] * 1e3:.2f} ms, "
        f"max {latencies[-1] * 1e3:.2f} ms (10 rounds)"
    )
    assert latencies[-1] < 1.0  # a generous correctness bound; the figure is printed above


def test_reserve_is_given_back_to_a_process_short_of_budget(
    share: str, pair: tuple[Worker, Worker]
) -> None:
    budget = 8 * PAGE
    a, b = pair
    # A keeps a big reserve; B needs memory the reserve holds.
    a.call(cmd="open", share=share, budget=budget, name="a", reserve=(6, 6))
    wait_for(lambda: a.call(cmd="stats")["stats"]["reserve_pages"] == 6, 5.0, "A's reserve filled")
    b.call(cmd="open", share=share, budget=budget, name="b", reserve=(0, 0))
    answer = b.call(cmd="alloc", n=6 * BLOCKS_PER_PAGE, timeout=3.0)
    assert answer["took_s"] < 3.0
    assert sum(e.committed_bytes for e in ledger.snapshot(share)) <= budget


# -- dead processes ---------------------------------------------------------------------------


def test_kill_mid_map_gives_its_share_back(
    share: str, workers: Callable[..., Worker], pair: tuple[Worker, Worker]
) -> None:
    budget = 8 * PAGE
    a, b = workers(), pair[0]
    a.call(cmd="open", share=share, budget=budget, name="a", reserve=(0, 0))
    assert a.call(cmd="hang", n=6 * BLOCKS_PER_PAGE)["ok"]  # 6 pages charged, mapper hung
    assert (entry_of(share, a.pid) or pytest.fail("no entry")).committed_bytes == 6 * PAGE
    b.call(cmd="open", share=share, budget=budget, name="b", reserve=(0, 0))
    b.send(cmd="alloc", n=5 * BLOCKS_PER_PAGE, timeout=5.0)  # needs A's pages
    wait_for(lambda: blocked(share, b.pid), 5.0, "B blocked on the budget")
    killed_at = time.monotonic()
    a.kill()
    served = b.read(timeout=5.0)
    assert served["ok"], served
    assert served["t"] - killed_at < RECLAIM_BOUND_S
    assert [e.name for e in ledger.snapshot(share)] == ["b"]


def test_kill_while_holding_the_lock_blocks_nobody(
    share: str, workers: Callable[..., Worker], pair: tuple[Worker, Worker]
) -> None:
    budget = 8 * PAGE
    holder, b = workers(), pair[0]
    b.call(cmd="open", share=share, budget=budget, name="b", reserve=(0, 0))
    holder.send(cmd="hold_lock", share=share, seconds=60.0)
    assert holder.read(timeout=10.0)["holding"]

    wait_for(lambda: ledger_lock_taken(share), 5.0, "the helper holds the ledger lock")
    b.send(cmd="alloc", n=4 * BLOCKS_PER_PAGE, timeout=5.0)  # its grant waits for the lock
    killed_at = time.monotonic()
    holder.kill()
    served = b.read(timeout=6.0)
    assert served["ok"], served
    assert served["t"] - killed_at < RECLAIM_BOUND_S
    # The lock is usable again, repaired by whoever took it first.
    assert [e.name for e in ledger.snapshot(share, timeout=1.0)] == ["b"]


# -- limits set from outside ------------------------------------------------------------------


def test_limit_from_outside_shrinks_then_regrows(share: str, pair: tuple[Worker, Worker]) -> None:
    a = pair[0]
    a.call(cmd="open", share=share, budget=64 * PAGE, name="a", reserve=(4, 4), max_blocks=128)
    a.call(cmd="alloc", n=5 * BLOCKS_PER_PAGE, timeout=2.0)  # 5 pages in use, one holding
    a.call(cmd="alloc", n=1, timeout=2.0)  # a second holding, on a 6th page
    wait_for(lambda: a.call(cmd="stats")["stats"]["reserve_pages"] >= 3, 5.0, "reserve filled")

    def mapped() -> int:
        return int(a.call(cmd="stats")["stats"]["mapped_pages"])

    assert ledger.set_limit(share, a.pid, 4 * PAGE) == 1
    # Above the limit: the free pages go at once; the 6 pages in use stay.
    wait_for(lambda: mapped() == 6, 5.0, "free pages unmapped")
    assert (entry_of(share, a.pid) or pytest.fail("no entry")).limit_bytes == 4 * PAGE
    a.call(cmd="free", count=1)  # 5 pages' blocks freed: given back down to the limit
    wait_for(lambda: mapped() <= 4, 5.0, "pages given back as blocks are freed")
    answer = a.call(cmd="alloc", n=1, timeout=2.0)
    assert answer["ok"]
    assert mapped() <= 4  # it stops growing above the limit
    # Raised again: it regrows.
    ledger.set_limit(share, a.pid, 32 * PAGE)
    # Applied in the background: an alloc above the old limit before then can never fit.
    wait_for(
        lambda: getattr(entry_of(share, a.pid), "limit_bytes", 0) == 32 * PAGE,
        5.0,
        "the raised limit applied",
    )
    a.call(cmd="alloc", n=20 * BLOCKS_PER_PAGE, timeout=3.0)
    assert mapped() >= 21


def test_set_limit_rejects_bad_input(share: str, pair: tuple[Worker, Worker]) -> None:
    a = pair[0]
    a.call(cmd="open", share=share, budget=8 * PAGE, name="a")
    with pytest.raises(ValueError, match="below one page"):
        ledger.set_limit(share, a.pid, PAGE - 1)
    with pytest.raises(ValueError, match="no allocator"):
        ledger.set_limit(share, os.getpid(), 4 * PAGE)
    with pytest.raises(ValueError, match="limit must be"):
        ledger.set_limit(share, a.pid, -5)
    # Nothing changed: the published limit is still the configured one (64 blocks, 16 pages).
    wait_for(
        lambda: getattr(entry_of(share, a.pid), "limit_bytes", 0) == 16 * PAGE,
        5.0,
        "the limit published",
    )


# -- the file itself --------------------------------------------------------------------------


async def test_corrupt_or_truncated_ledger_is_a_clear_error(share: str) -> None:
    path = ledger.path(share)
    config = kvasync.Config(backend="host", max_blocks=16, share=share, device_budget=8 * PAGE)
    async with kvasync.open_allocator(LAYOUT, config) as kv:
        await kv.alloc(4)
        good = Path(path).read_bytes()
    cases = {
        "not a kvasync ledger": b"\x00" * len(good),
        "truncated": good[:100],
        "layout version 7": good[:8] + (7).to_bytes(4, "little") + good[12:],
        "corrupt": good[:16] + b"\xff" * 8 + good[24:],
    }
    for message, content in cases.items():
        if os.path.exists(path):  # the last member to leave removed it
            os.unlink(path)
        Path(path).write_bytes(content)
        os.chmod(path, 0o600)  # its owner and mode are right: only its content is wrong
        with pytest.raises(kvasync.KVAsyncError, match=message):
            ledger.snapshot(share)
        with pytest.raises(kvasync.KVAsyncError, match=message):
            await kvasync.Allocator.open(LAYOUT, config)


def test_snapshot_of_a_share_nobody_joined_is_a_clear_error(share: str) -> None:
    with pytest.raises(kvasync.KVAsyncError, match="no allocator has joined"):
        ledger.snapshot(share)


def test_share_names_and_config_are_checked() -> None:
    with pytest.raises(ValueError, match=r"Config\.share"):
        kvasync.Config(share="../etc")
    with pytest.raises(ValueError, match=r"needs Config\.share"):
        kvasync.Config(device_budget=1 << 30)
    with pytest.raises(ValueError, match="device_budget"):
        kvasync.Config(share="x", device_budget=0)
    with pytest.raises(TypeError):
        ledger.path(5)  # type: ignore[arg-type]
    assert ledger.path("cuda0") == "/dev/shm/kvasync-ledger.cuda0"


def test_default_share_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert ledger.default_share(1) == "cuda1"
    assert ledger.default_share("host") == "host"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    assert ledger.default_share(1) == "cuda2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8e2a0c1f-aaaa")
    assert ledger.default_share(0) == "cuda-GPU-8e2a0c1f-aaaa"
    with pytest.raises(ValueError, match="not among"):
        ledger.default_share(1)


def no_reserve_config(share: str, budget: int) -> kvasync.Config:
    """A host allocator of the share without a reserve: pages map only for requests."""
    return kvasync.Config(
        backend="host", max_blocks=64, reserve_pages=(0, 0), share=share, device_budget=budget
    )


async def test_two_allocators_of_one_process_share_one_budget(share: str) -> None:
    config = no_reserve_config(share, 4 * PAGE)
    async with (
        kvasync.open_allocator(LAYOUT, config) as first,
        kvasync.open_allocator(LAYOUT, config) as second,
    ):
        held = await first.alloc(3 * BLOCKS_PER_PAGE)
        with pytest.raises(kvasync.AllocTimeout, match="budget"):
            await second.alloc(2 * BLOCKS_PER_PAGE, timeout=0.2)
        waiting = asyncio.ensure_future(second.alloc(2 * BLOCKS_PER_PAGE, timeout=3.0))
        await asyncio.sleep(0)
        first.free(held)
        assert len(await waiting) == 2 * BLOCKS_PER_PAGE
        entries = ledger.snapshot(share)
        assert len(entries) == 2
        assert sum(e.committed_bytes for e in entries) <= 4 * PAGE


async def test_an_allocator_above_its_fair_share_gives_memory_back_to_one_short_of_budget(
    share: str,
) -> None:
    # Note [Fair share under pressure]: without it, `first` recycles the blocks it frees for its
    # own next request (they are still mapped) and `second` waits for memory that never comes.
    config = no_reserve_config(share, 8 * PAGE)
    loop = asyncio.get_running_loop()
    async with (
        kvasync.open_allocator(LAYOUT, config) as first,
        kvasync.open_allocator(LAYOUT, config) as second,
    ):
        held = await first.alloc(8 * BLOCKS_PER_PAGE)  # the whole budget, in use
        waiting = asyncio.ensure_future(second.alloc(4 * BLOCKS_PER_PAGE, timeout=5.0))
        # `first` is held to half the budget while `second` waits (its watcher's next tick).
        deadline = loop.time() + 5.0
        while first.stats().memory_limit_blocks != 4 * BLOCKS_PER_PAGE:
            assert loop.time() < deadline, "the fair-share limit was not applied"
            await asyncio.sleep(0.005)
        first.free(held[: 4 * BLOCKS_PER_PAGE])
        with pytest.raises(kvasync.WouldBlock):  # the freed pages went back to the share
            first.alloc_nowait(4 * BLOCKS_PER_PAGE)
        assert len(await waiting) == 4 * BLOCKS_PER_PAGE
        assert sum(e.committed_bytes for e in ledger.snapshot(share)) <= 8 * PAGE
        # Nobody waits any more: `first`'s own limit comes back, and it can grow again.
        second.free(await asyncio.wait_for(asyncio.shield(waiting), 1.0))
        regrown = await first.alloc(4 * BLOCKS_PER_PAGE, timeout=5.0)
        assert len(regrown) == 4 * BLOCKS_PER_PAGE
        first.free(held[4 * BLOCKS_PER_PAGE :] + regrown)


async def test_an_allocator_over_its_fair_share_drains_and_the_other_counts_on_its_share(
    share: str,
) -> None:
    # Note [Limit policy] (the drain) with Note [Fair share under pressure]: `first` holds the whole
    # budget with blocks in use on every page, so the fair-share limit alone would give nothing
    # back.
    config = no_reserve_config(share, 8 * PAGE)
    async with (
        kvasync.open_allocator(LAYOUT, config) as first,
        kvasync.open_allocator(LAYOUT, config) as second,
    ):
        held = sorted(await first.alloc(8 * BLOCKS_PER_PAGE))
        first.free(held[::2])  # half of every page
        kept = held[1::2]
        # The budget is taken, yet `second` can count on budget / members (first gives it back).
        assert second.available_blocks() == 4 * BLOCKS_PER_PAGE
        waiting = asyncio.ensure_future(second.alloc(2 * BLOCKS_PER_PAGE, timeout=5.0))
        await wait_until(lambda: first.drain_from() is not None)
        drain = first.drain_from()
        # Demands: first 4 pages (its blocks in use), second 2 (its waiter): the slack of 2 is
        # split evenly, so first's fair share is 5 pages and the three highest drain.
        assert _core.share_fair_shares([4 * PAGE, 2 * PAGE], 8 * PAGE) == [5 * PAGE, 3 * PAGE]
        assert drain == held[5 * BLOCKS_PER_PAGE]
        assert first.available_blocks() == 5 * BLOCKS_PER_PAGE // 2  # free halves below it
        # What a scheduler does with drain_from(): free the blocks at and above it.
        first.free([b for b in kept if b >= drain])
        assert len(await waiting) == 2 * BLOCKS_PER_PAGE
        assert sum(e.committed_bytes for e in ledger.snapshot(share)) <= 8 * PAGE
        first.free([b for b in kept if b < drain])


async def test_an_alloc_larger_than_the_whole_budget_of_the_share_fails_at_once(
    share: str,
) -> None:
    config = no_reserve_config(share, 4 * PAGE)
    loop = asyncio.get_running_loop()
    async with kvasync.open_allocator(LAYOUT, config) as kv:
        start = loop.time()
        with pytest.raises(kvasync.OutOfBlocks, match="whole budget of the share"):
            await kv.alloc(4 * BLOCKS_PER_PAGE + 1, timeout=30.0)
        assert loop.time() - start < 10.0  # at once, not at its deadline (a correctness bound)
        assert kv.stats().used_blocks == 0
        kv.free(await kv.alloc(4 * BLOCKS_PER_PAGE))  # the whole budget still fits


# -- the command line -------------------------------------------------------------------------


def test_sizes_parse_and_print() -> None:
    assert parse_size("12GiB") == 12 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("4096") == 4096
    for bad in ("", "12XB", "-1GiB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_bytes(0) == "0 B"
    assert format_bytes(3 << 29) == "1.5 GiB"


async def test_ls_and_limit_commands(share: str) -> None:
    config = kvasync.Config(
        backend="host", max_blocks=64, share=share, device_budget=32 * PAGE, name="cli-engine"
    )
    async with kvasync.open_allocator(LAYOUT, config) as kv:
        await kv.alloc(8)
        runner = CliRunner(env={"COLUMNS": "160"})  # rich sizes its table to the terminal
        listed = runner.invoke(cli, ["ls", "--share", share, "--json"])
        assert listed.exit_code == 0, listed.output
        data = json.loads(listed.output)
        assert data["budget_bytes"] == 32 * PAGE
        assert [a["name"] for a in data["allocators"]] == ["cli-engine"]
        table = runner.invoke(cli, ["ls", "--share", share])
        assert "cli-engine" in table.output and "budget of 64.0 MiB" in table.output
        limited = runner.invoke(cli, ["limit", "--share", share, str(os.getpid()), "8MiB"])
        assert limited.exit_code == 0, limited.output
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while kv.stats().memory_limit_pages != 4:
            assert loop.time() < deadline, "the limit was not applied"
            await asyncio.sleep(0.005)
        top = await asyncio.to_thread(
            runner.invoke, cli, ["top", "--share", share, "--count", "2", "--interval", "0.05"]
        )
        assert top.exit_code == 0, top.output
        assert "cli-engine" in top.output and "8.0 MiB" in top.output  # the new limit
        bad = runner.invoke(cli, ["limit", "--share", share, str(os.getpid()), "8XB"])
        assert bad.exit_code != 0 and "not a size" in bad.output
    missing = CliRunner().invoke(cli, ["ls", "--share", share + "-none"])
    assert missing.exit_code == 1 and "no allocator has joined" in missing.output


def test_python_dash_m_kvasync_ls(share: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvasync", "ls", "--share", share],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "no allocator has joined" in done.stderr
