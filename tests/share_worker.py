"""One process of a device share, run as a child by tests/test_ledger.py and bench_colocate.py.

Protocol: one JSON object per line. The worker prints ``{"ready": true, "pid": PID}`` once kvasync
is imported, then answers each command read from stdin with one JSON line, and exits on
``{"cmd": "quit"}`` or at the end of stdin (so that it never outlives its parent). Every answer
carries ``"t"``: the worker's ``time.monotonic()`` (CLOCK_MONOTONIC, comparable across processes
of the machine) when it answered.

Commands (``cmd``):
  open     {share, budget, name, max_blocks, reserve, map_delay, memory_limit, small}: opens an
           allocator (``small``: 8 KiB blocks in 64 KiB pages, so that maps cost little)
  alloc    {n, timeout}: allocates and holds; answers {ok, got, took_s, error, t}
  free     {count}: frees the ``count`` oldest holdings (all when absent); answers {freed_at}
  stats    : the allocator's stats (pages) and the page size in bytes
  hang     {n}: makes maps hang, starts an alloc of ``n`` that needs a map, answers once it hangs
  churn    {max_n, hold_s, trim_every}: allocates, holds and frees in the background until stop
  stop     : stops the churn; answers with how many rounds it ran
  rounds   {count, share, budget, sizes, timeout, reserve, map_delay}: ``count`` times: open an
           allocator, allocate ``sizes`` with ``timeout`` each, free, close; answers per round
  close    : closes the allocator
  hold_lock {share, seconds}: takes the share's ledger lock and keeps it (test hook)

Usage: python share_worker.py BACKEND
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from typing import Any

import kvasync
from kvasync import _core
from kvasync import share as ledger
from kvasync.testing import FaultInjector

LAYOUT = kvasync.KVLayout(
    num_layers=4, num_kv_heads=8, head_dim=128, block_size=32, contiguous=True
)
PAGE_SIZE = 2 << 20  # 4 blocks of 512 KiB: one page id is 2 MiB
# For timing wake-ups rather than page zeroing: 8 KiB blocks, 8 to a 64 KiB page.
SMALL_LAYOUT = kvasync.KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=64, block_size=16, contiguous=True
)
SMALL_PAGE_SIZE = 64 << 10


class Worker:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.kv: kvasync.Allocator | None = None
        self.faults = FaultInjector()
        self.held: list[list[int]] = []
        self.churn_task: asyncio.Task[int] | None = None
        self.hung_task: asyncio.Task[Any] | None = None

    def config(self, command: dict[str, Any]) -> kvasync.Config:
        return kvasync.Config(
            backend=self.backend,
            max_blocks=command.get("max_blocks", 64),
            page_size=PAGE_SIZE,
            reserve_pages=tuple(command.get("reserve", (1, 2))),  # type: ignore[arg-type]
            default_timeout=command.get("default_timeout", 2.0),
            memory_limit=command.get("memory_limit"),
            faults=self.faults,
            share=command.get("share"),
            device_budget=command.get("budget"),
            name=command.get("name"),
        )

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        name = command["cmd"]
        if name == "open":
            self.faults.release()
            if command.get("map_delay"):
                self.faults.delay(command["map_delay"])
            small = command.get("small", False)
            config = self.config(command)
            if small:
                config = dataclasses.replace(config, page_size=SMALL_PAGE_SIZE)
            self.kv = await kvasync.Allocator.open(SMALL_LAYOUT if small else LAYOUT, config)
            return {"ok": True}
        if name == "alloc":
            return await self.alloc(command["n"], command.get("timeout", 2.0))
        if name == "free":
            count = command.get("count", len(self.held))
            freed_at = time.monotonic()
            for blocks in self.held[:count]:
                self.kv.free(blocks)  # type: ignore[union-attr]
            del self.held[:count]
            return {"ok": True, "freed_at": freed_at}
        if name == "stats":
            stats = self.kv.stats()  # type: ignore[union-attr]
            return {"ok": True, "stats": stats.__dict__, "page_bytes": stats.page_bytes}
        if name == "hang":
            self.faults.hang()
            self.hung_task = asyncio.ensure_future(self.alloc(command["n"], 60.0))
            deadline = time.monotonic() + 5.0
            while self.faults.hung_maps == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
            return {"ok": self.faults.hung_maps > 0}
        if name == "churn":
            self.churn_task = asyncio.ensure_future(self.churn(command))
            return {"ok": True}
        if name == "stop":
            task, self.churn_task = self.churn_task, None
            rounds = await task if task is not None else 0
            return {"ok": True, "rounds": rounds}
        if name == "rounds":
            return {
                "ok": True,
                "rounds": [await self.round(command, i) for i in range(command["count"])],
            }
        if name == "close":
            # Back to no allocator, so that the parent can reuse this process for another test.
            self.churn_task = None
            if self.hung_task is not None:
                self.hung_task.cancel()
                self.hung_task = None
            self.faults.release()
            if self.kv is not None:
                await self.kv.close(timeout=2.0)
            self.kv = None
            self.held = []
            return {"ok": True}
        if name == "hold_lock":
            # Blocks this process (on purpose: the test kills it while it holds the lock).
            path = ledger.path(command["share"])
            print(json.dumps({"holding": True, "t": time.monotonic()}), flush=True)
            return {"ok": _core.ledger_hold_lock_for_test(path, command["seconds"])}
        raise ValueError(f"unknown command {name!r}")

    async def alloc(self, n: int, timeout: float) -> dict[str, Any]:
        assert self.kv is not None
        start = time.monotonic()
        try:
            blocks = await self.kv.alloc(n, timeout=timeout)
        except kvasync.KVAsyncError as error:
            return {
                "ok": False,
                "error": f"{type(error).__name__}: {error}",
                "took_s": time.monotonic() - start,
            }
        self.held.append(blocks)
        return {"ok": True, "got": len(blocks), "took_s": time.monotonic() - start}

    async def churn(self, command: dict[str, Any]) -> int:
        # Engine 1 of seed A: maps and unmaps all the time (a trim every few rounds).
        assert self.kv is not None
        rng = random.Random(os.getpid())
        rounds = 0
        while self.churn_task is not None:
            try:
                blocks = await self.kv.alloc(rng.randint(1, command["max_n"]), timeout=1.0)
            except kvasync.AllocTimeout:
                continue
            await asyncio.sleep(command.get("hold_s", 0.002))
            self.kv.free(blocks)
            rounds += 1
            if rounds % command.get("trim_every", 5) == 0:
                await self.kv.trim(timeout=2.0)
        return rounds

    async def round(self, command: dict[str, Any], index: int) -> dict[str, Any]:
        # Engine 2 of seed A: starts (joins the share), serves a few allocations, stops.
        self.faults.release()
        if command.get("map_delay"):
            self.faults.delay(command["map_delay"])
        report: dict[str, Any] = {"round": index, "ok": False, "error": None, "allocs": []}
        start = time.monotonic()
        kv = await kvasync.Allocator.open(LAYOUT, self.config(command))
        try:
            held = []
            for n in command["sizes"]:
                began = time.monotonic()
                held.append(await kv.alloc(n, timeout=command["timeout"]))
                report["allocs"].append(time.monotonic() - began)
            for blocks in held:
                kv.free(blocks)
            report["ok"] = True
        except kvasync.KVAsyncError as error:
            report["error"] = f"{type(error).__name__}: {error}"
        finally:
            self.faults.release()
            await kv.close(timeout=2.0)
        report["took_s"] = time.monotonic() - start
        return report


async def main() -> None:
    worker = Worker(sys.argv[1])
    loop = asyncio.get_running_loop()
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        try:
            answer = await worker.handle(command)
        except Exception as error:  # reported to the parent, which fails the test with it
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        answer["t"] = time.monotonic()
        print(json.dumps(answer), flush=True)
    if worker.kv is not None:
        worker.faults.release()
        await worker.kv.close(timeout=2.0)


if __name__ == "__main__":
    asyncio.run(main())
