"""The soak run behind ``make soak`` (not in CI): a serving load with random faults, for a set time.

Note [Soak]
~~~~~~~~~~~
Workers act as a serving engine's requests on the host backend: each allocates a prompt's blocks,
grows them block by block, writes a signature into every block it holds and checks it before
freeing (some frees from another thread), and sometimes gives up on an alloc by cancelling it.
Meanwhile a fault task injects map delays, failures and hangs (each hang released within a bound),
and a memory task trims and resizes. Every ``EPOCH_S`` the epoch ends the hard way: every worker
is cancelled wherever it is, the blocks they held are freed, the pool must then hold no block and
no waiter, and the allocator is closed (bounded) and reopened, so that an fd or memory leak per
open/close shows too.

It fails (exit status 1) on: a block that lost its data or is held twice, a block left allocated
at the end of an epoch, a mapped page left after close, a wait that overran its deadline by more
than ``LATE_S``, an unexpected exception, or growth of RSS (beyond ``RSS_GROWTH_MIB``, measured
from the end of the first epoch, once torch and the allocator are warm) or of open fds (beyond
``FD_GROWTH``) between the start and the end; and on the whole run overrunning SOAK_SECONDS by
``RUN_GRACE_S`` (every thread's stack is printed then).

It ends with a table of what it did (operations, faults injected) and saw (double handouts,
leaks, RSS and fds, deadlines).

Usage: ``SOAK_SECONDS=120 python tests/soak.py`` (default 600).
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

import kvasync
from kvasync.testing import FaultInjector

LAYOUT = kvasync.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)
PAGE_SIZE = 256 << 10  # 64 blocks of 4 KiB per page, 2 MiB per page id across 8 ranges
BLOCKS_PER_PAGE = PAGE_SIZE // LAYOUT.block_bytes
NUM_PAGES = 64
PAGE_BYTES = PAGE_SIZE * LAYOUT.num_ranges
WORKERS = 48
EPOCH_S = 30.0
LATE_S = 0.5  # a wait may end this long after its deadline (a loaded 2-core machine), no more
CLOSE_TIMEOUT_S = 2.0
RSS_GROWTH_MIB = 32.0
FD_GROWTH = 2
REPORT_EVERY_S = 10.0
LAG_PROBE_S = 0.01
RUN_GRACE_S = 120.0  # the run's deadline past SOAK_SECONDS (an epoch's unwinding and close)


@dataclass
class Figures:
    """What the soak counted; ``problems`` fail it."""

    allocs: int = 0
    blocks: int = 0
    timeouts: int = 0
    map_errors: int = 0
    out_of_blocks: int = 0
    would_block: int = 0
    cancelled: int = 0
    thread_frees: int = 0
    frees: int = 0
    injected: dict[str, int] = field(
        default_factory=lambda: {"map delays": 0, "map failures": 0, "map hangs": 0, "releases": 0}
    )
    double_handouts: int = 0
    lost_data: int = 0
    leaked_blocks: int = 0  # allocated at the end of an epoch, every request ended
    leaked_pages: int = 0  # mapped after close
    trims: int = 0
    resizes: int = 0
    epochs: int = 0
    max_overrun_s: float = 0.0
    max_loop_lag_s: float = 0.0  # the loop itself late to wake (this process starved of CPU)
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)


def rss_mib() -> float:
    gc.collect()  # what cycles still hold (cancelled tasks and their frames) is not a leak
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def open_fds() -> int:
    gc.collect()  # an allocator's fds go with the object: after the collector finds its cycles
    return len(os.listdir("/proc/self/fd"))


class Epoch:
    """One allocator's life: workers, faults and memory changes until cancelled."""

    def __init__(self, kv: kvasync.Allocator, faults: FaultInjector, figures: Figures) -> None:
        self.kv = kv
        self.faults = faults
        self.figures = figures
        self.loop = asyncio.get_running_loop()
        self.held: dict[int, float] = {}  # every block held by a worker -> its signature
        self.rng = random.Random()
        self.lag_s = 0.0  # the loop's largest lateness in the last second
        self.probe_due = self.loop.time()  # when the lag probe should wake next
        # Frees running on other threads: a worker cancelled while it waits for one does not
        # stop it, so the end of the epoch waits for them before counting the blocks.
        self.free_threads: list[threading.Thread] = []
        self.side_tasks: set[asyncio.Task[list[int]]] = set()  # allocs being cancelled

    async def watch_loop_lag(self) -> None:
        window: list[float] = []
        while True:
            self.probe_due = self.loop.time() + LAG_PROBE_S
            await asyncio.sleep(LAG_PROBE_S)
            lag = self.loop.time() - self.probe_due
            window = [*window[-int(1 / LAG_PROBE_S) :], lag]
            self.lag_s = max(window)
            self.figures.max_loop_lag_s = max(self.figures.max_loop_lag_s, lag)

    async def timed(self, what: str, call: object, timeout: float) -> object:
        """Awaits ``call`` (an alloc, trim or resize given ``timeout``); checks its deadline."""
        started = self.loop.time()
        try:
            return await call  # type: ignore[misc]
        finally:
            overrun = self.loop.time() - started - timeout
            self.figures.max_overrun_s = max(self.figures.max_overrun_s, overrun)
            # The allocator cannot answer sooner than the loop runs: what the loop lagged (the
            # machine starved this process) is not the allocator's overrun.
            # A call that completes in the same loop iteration as the end of a stall runs before
            # the probe has measured it: how late the probe is now counts too.
            lag = max(self.lag_s, self.loop.time() - self.probe_due)
            if overrun > LATE_S + lag:
                self.figures.problem(
                    f"{what} returned {overrun:.3f} s after its {timeout} s deadline "
                    f"(the loop lagged {lag:.3f} s)"
                )

    async def alloc(self, n: int) -> list[int]:
        timeout = self.rng.choice([0.0, 0.01, 0.05, 0.2, 0.5])
        try:
            blocks: list[int] = await self.timed(  # type: ignore[assignment]
                f"alloc of {n}", self.kv.alloc(n, timeout=timeout), timeout
            )
        except kvasync.AllocTimeout:
            self.figures.timeouts += 1
            return []
        except kvasync.MapError:
            self.figures.map_errors += 1
            return []
        except kvasync.OutOfBlocks:
            self.figures.out_of_blocks += 1
            return []
        self.figures.allocs += 1
        self.figures.blocks += n
        self.claim(blocks)
        return blocks

    def claim(self, blocks: list[int]) -> None:
        twice = [b for b in blocks if b in self.held]
        if twice:
            self.figures.double_handouts += len(twice)
            self.figures.problem(f"blocks {twice[:4]} handed out while held")
        for b in blocks:
            signature = float(self.rng.randrange(1, 2000))  # exact in fp16
            for buffer in self.buffers():
                buffer[b].fill_(signature)
            self.held[b] = signature

    def buffers(self) -> list[torch.Tensor]:
        return [t for i in range(LAYOUT.num_layers) for t in self.kv.layer(i)]

    def verify(self, blocks: list[int]) -> None:
        for b in blocks:
            for buffer in self.buffers():
                block = buffer[b]
                if (
                    block[0, 0, 0].item() != self.held[b]
                    or block[-1, -1, -1].item() != self.held[b]
                ):
                    self.figures.lost_data += 1
                    self.figures.problem(f"block {b} lost its data")
                    return

    async def release(self, blocks: list[int]) -> None:
        if not blocks:
            return
        self.verify(blocks)
        for b in blocks:
            del self.held[b]
        self.figures.frees += 1
        if self.rng.random() < 0.2:
            self.figures.thread_frees += 1
            thread = threading.Thread(target=self.kv.free, args=(blocks,))
            thread.start()
            self.free_threads.append(thread)
            await asyncio.to_thread(thread.join, 5.0)
        else:
            self.kv.free(blocks)

    async def worker(self) -> None:
        mine: list[int] = []
        try:
            while True:
                mine += await self.alloc(self.rng.randint(1, 2 * BLOCKS_PER_PAGE))
                for _ in range(self.rng.randint(0, 8)):  # decode: one block at a time
                    await asyncio.sleep(self.rng.uniform(0, 0.01))
                    if self.rng.random() < 0.1:
                        mine += self.alloc_nowait()
                    else:
                        mine += await self.alloc(1)
                if self.rng.random() < 0.05:
                    await self.cancelled_alloc()
                done, mine = mine, []
                await self.release(done)
        finally:
            # Cancelled at the end of the epoch: give back what this request held.
            for b in mine:
                self.held.pop(b, None)
            if mine:
                self.kv.free(mine)

    def alloc_nowait(self) -> list[int]:
        try:
            blocks = self.kv.alloc_nowait(1)
        except kvasync.WouldBlock:
            self.figures.would_block += 1
            return []
        except kvasync.OutOfBlocks:
            self.figures.out_of_blocks += 1
            return []
        self.figures.allocs += 1
        self.figures.blocks += 1
        self.claim(blocks)
        return blocks

    async def cancelled_alloc(self) -> None:
        """An alloc given up on: its task is cancelled after a few loop iterations.

        Not ``await task`` after the cancel: if this worker were cancelled at the same moment, the
        await would raise CancelledError even when the task had returned blocks, and they would
        be lost (to this driver, not to the allocator). The task's end is settled by a callback.
        """
        task = asyncio.ensure_future(self.kv.alloc(self.rng.randint(1, 64), timeout=1.0))
        self.side_tasks.add(task)
        task.add_done_callback(self.settle_cancelled)
        for _ in range(self.rng.randint(0, 3)):
            await asyncio.sleep(0)
        task.cancel()

    def settle_cancelled(self, task: asyncio.Task[list[int]]) -> None:
        self.side_tasks.discard(task)
        if task.cancelled():
            self.figures.cancelled += 1
        elif task.exception() is None:  # it completed before the cancel reached it
            self.kv.free(task.result())

    async def inject_faults(self) -> None:
        while True:
            await asyncio.sleep(self.rng.uniform(0.05, 0.6))
            choice = self.rng.random()
            if choice < 0.3:
                self.figures.injected["map delays"] += 1
                self.faults.delay(self.rng.choice([0.001, 0.005, 0.02]))
            elif choice < 0.55:
                count = self.rng.randint(1, 8)
                self.figures.injected["map failures"] += count
                self.faults.fail(count)
            elif choice < 0.7:
                self.figures.injected["map hangs"] += 1
                self.faults.hang()
                await asyncio.sleep(self.rng.uniform(0.05, 0.3))
                self.faults.release()
            else:
                self.figures.injected["releases"] += 1
                self.faults.release()

    async def change_memory(self) -> None:
        while True:
            await asyncio.sleep(self.rng.uniform(0.5, 3.0))
            timeout = 0.5
            try:
                if self.rng.random() < 0.5:
                    self.figures.trims += 1
                    await self.timed("trim", self.kv.trim(timeout=timeout), timeout)
                else:
                    self.figures.resizes += 1
                    pages = self.rng.choice([None, 8, 16, 32, 48])
                    limit = None if pages is None else pages * PAGE_BYTES
                    await self.timed(
                        "resize", self.kv.resize(memory_limit=limit, timeout=timeout), timeout
                    )
            except (kvasync.AllocTimeout, kvasync.MapError):
                pass


async def run_epoch(seconds: float, figures: Figures) -> None:
    faults = FaultInjector()
    config = kvasync.Config(
        backend="host",
        max_blocks=NUM_PAGES * BLOCKS_PER_PAGE,
        memory_limit=48 * PAGE_BYTES,
        page_size=PAGE_SIZE,
        reserve_pages=(1, 4),
        default_timeout=2.0,
        faults=faults,
    )
    kv = await kvasync.Allocator.open(LAYOUT, config)
    epoch = Epoch(kv, faults, figures)
    tasks = [asyncio.ensure_future(epoch.worker()) for _ in range(WORKERS)]
    tasks += [
        asyncio.ensure_future(epoch.inject_faults()),
        asyncio.ensure_future(epoch.change_memory()),
        asyncio.ensure_future(epoch.watch_loop_lag()),
    ]
    try:
        done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:  # a task ended by itself: only an unexpected exception does that
            figures.problem(f"a task ended: {task.exception()!r}")
        for task in tasks:
            task.cancel()
        _, stuck = await asyncio.wait(tasks, timeout=5.0)
        if epoch.side_tasks:
            _, stuck_allocs = await asyncio.wait(set(epoch.side_tasks), timeout=5.0)
            stuck |= stuck_allocs  # type: ignore[arg-type]
        if stuck:
            figures.problem(f"{len(stuck)} tasks did not unwind within 5 s of being cancelled")
        faults.release()
        for thread in epoch.free_threads:
            thread.join(5.0)  # NOTE: blocks the loop, which has nothing else to do now
            if thread.is_alive():
                figures.problem("free() from another thread did not return within 5 s")
        stats = kv.stats()
        if stats.used_blocks or stats.waiters or epoch.held:
            figures.leaked_blocks += stats.used_blocks
            figures.problem(
                f"after every request ended: {stats.used_blocks} blocks allocated, "
                f"{stats.waiters} waiters, {len(epoch.held)} blocks in the workers' books"
            )
    finally:
        faults.release()
        started = asyncio.get_running_loop().time()
        await kv.close(timeout=CLOSE_TIMEOUT_S)
        took = asyncio.get_running_loop().time() - started
        if took > CLOSE_TIMEOUT_S + 1.0 + LATE_S:  # close waits at least 1 s for an idle mapper
            figures.problem(f"close took {took:.3f} s")
        if kv.stats().mapped_pages:
            figures.leaked_pages += kv.stats().mapped_pages
            figures.problem(f"{kv.stats().mapped_pages} pages still mapped after close")
    figures.epochs += 1


async def soak(total_s: float) -> int:
    figures = Figures()
    start_rss, start_fds = rss_mib(), open_fds()
    warm_rss: float | None = None
    print(f"soak: {total_s:.0f} s, {WORKERS} workers, epochs of {EPOCH_S:.0f} s, host backend")
    print(f"start: RSS {start_rss:.1f} MiB, {start_fds} open fds")
    began = time.monotonic()
    next_report = began + REPORT_EVERY_S
    while (left := total_s - (time.monotonic() - began)) > 1.0:
        epoch_s = min(EPOCH_S, left)
        await run_epoch(epoch_s, figures)
        if warm_rss is None:
            warm_rss = rss_mib()
        if time.monotonic() >= next_report:
            next_report = time.monotonic() + REPORT_EVERY_S
            print(
                f"  {time.monotonic() - began:6.0f} s: {figures.allocs} allocs, "
                f"{figures.timeouts} timeouts, {figures.map_errors} map errors, "
                f"RSS {rss_mib():.1f} MiB, {open_fds()} fds, {len(figures.problems)} problems",
                flush=True,
            )
    end_rss, end_fds = rss_mib(), open_fds()
    warm_rss = end_rss if warm_rss is None else warm_rss
    if end_rss - warm_rss > RSS_GROWTH_MIB:
        figures.problem(f"RSS grew {end_rss - warm_rss:.1f} MiB after the first epoch")
    if end_fds - start_fds > FD_GROWTH:
        figures.problem(f"open fds grew from {start_fds} to {end_fds}")
    print_report(figures, (start_rss, warm_rss, end_rss), (start_fds, end_fds))
    return 1 if figures.problems else 0


def print_report(figures: Figures, rss: tuple[float, float, float], fds: tuple[int, int]) -> None:
    f = figures
    failed = f.timeouts + f.map_errors + f.out_of_blocks + f.would_block
    operations = f.allocs + failed + f.cancelled + f.frees + f.trims + f.resizes
    table = Table(title="random operations soak", title_justify="left")
    table.add_column("what")
    table.add_column("seen", justify="right")
    table.add_row("operations", f"{operations}")
    table.add_row("  allocs served (blocks)", f"{f.allocs} ({f.blocks})")
    table.add_row("  allocs timed out", f"{f.timeouts}")
    table.add_row("  allocs failed: map error", f"{f.map_errors}")
    table.add_row("  allocs refused: out of blocks", f"{f.out_of_blocks}")
    table.add_row("  alloc_nowait: would block", f"{f.would_block}")
    table.add_row("  allocs cancelled", f"{f.cancelled}")
    table.add_row("  frees (from another thread)", f"{f.frees} ({f.thread_frees})")
    table.add_row("  trims / resizes", f"{f.trims} / {f.resizes}")
    table.add_row("faults injected", f"{sum(f.injected.values())}")
    for kind, count in f.injected.items():
        table.add_row(f"  {kind}", f"{count}")
    table.add_row("epochs (open..close)", f"{f.epochs}")
    table.add_row("double handouts", f"{f.double_handouts}")
    table.add_row("blocks whose data changed", f"{f.lost_data}")
    table.add_row("leak: blocks after an epoch", f"{f.leaked_blocks}")
    table.add_row("leak: pages mapped after close", f"{f.leaked_pages}")
    table.add_row("RSS: start / epoch 1 / end", f"{rss[0]:.0f} / {rss[1]:.0f} / {rss[2]:.0f} MiB")
    table.add_row("open fds: start / end", f"{fds[0]} / {fds[1]}")
    table.add_row("largest deadline overrun", f"{f.max_overrun_s * 1e3:.1f} ms")
    table.add_row("largest loop lag", f"{f.max_loop_lag_s * 1e3:.1f} ms")
    table.add_row("problems", f"{len(f.problems)}")
    console = Console()
    console.print(table)
    for problem in f.problems:
        console.print(f"PROBLEM: {problem}", markup=False)
    console.print("soak: FAILED" if f.problems else "soak: passed")


def main() -> int:
    seconds = float(os.environ.get("SOAK_SECONDS", "600"))
    # The soak's own deadline: past it, every thread's stack is printed and it exits 1.
    faulthandler.dump_traceback_later(seconds + RUN_GRACE_S, exit=True)
    return asyncio.run(soak(seconds))


if __name__ == "__main__":
    sys.exit(main())
