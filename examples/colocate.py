"""Two processes, one device budget: the second waits for memory the first gives back.

Each process opens its own allocator in the same share. The share's ledger (a file in /dev/shm)
keeps their mapped memory together within `device_budget`; `kvasync ls --share NAME` shows it.
"""

import asyncio
import multiprocessing
import os
import time

import torch

import kvasync
from kvasync import share

BUDGET = 4 << 20  # 4 MiB of KV memory for both processes together
LAYOUT = kvasync.KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
)
BUDGET_BLOCKS = BUDGET // (LAYOUT.block_bytes * LAYOUT.num_ranges)  # 16 KiB a block: 256


def config(share_name: str, name: str) -> kvasync.Config:
    return kvasync.Config(
        backend="host", max_blocks=4096, page_size=64 << 10, reserve_pages=(0, 0),
        share=share_name, device_budget=BUDGET, name=name,
    )  # fmt: skip


async def hold(share_name: str, holding, release) -> None:
    async with kvasync.open_allocator(LAYOUT, config(share_name, "first")) as kv:
        ids = await kv.alloc(BUDGET_BLOCKS * 3 // 4)  # three quarters of the budget
        holding.set()
        await asyncio.to_thread(release.wait, 30.0)  # until the parent saw the second one wait
        kv.free(ids)  # the pages go back to the share; the waiting process is woken
        await kv.trim()


def first(share_name: str, holding, release) -> None:
    asyncio.run(hold(share_name, holding, release))


async def take_half(share_name: str) -> None:
    async with kvasync.open_allocator(LAYOUT, config(share_name, "second")) as kv:
        ids = await kv.alloc(BUDGET_BLOCKS // 2, timeout=20.0)  # half: more than is free now
        print(f"second: {len(ids)} blocks, once the first gave its pages back")
        kv.free(ids)


def second(share_name: str) -> None:
    asyncio.run(take_half(share_name))


def show(share_name: str) -> list[share.LedgerEntry]:
    entries = share.snapshot(share_name)
    for entry in entries:
        print(
            f"  {entry.name:6} committed {entry.committed_bytes >> 10:4} KiB, "
            f"waiters {entry.waiters}, demand {entry.demand_bytes >> 10} KiB"
        )
    return entries


if __name__ == "__main__":
    share_name = f"example-{os.getpid()}"
    spawn = multiprocessing.get_context("spawn")
    holding, release = spawn.Event(), spawn.Event()
    holder = spawn.Process(target=first, args=(share_name, holding, release))
    holder.start()
    assert holding.wait(30.0), "the first process did not allocate within 30 s"
    waiter = spawn.Process(target=second, args=(share_name,))
    waiter.start()
    deadline = time.monotonic() + 30.0
    # The ledger's entries are what each allocator's watcher last published (every 100 ms).
    while not any(e.name == "second" and e.waiters for e in share.snapshot(share_name)):
        assert time.monotonic() < deadline, "the second process never waited"
        time.sleep(0.05)
    print("the share while the second waits:")
    show(share_name)
    release.set()
    for process in (holder, waiter):
        process.join(30.0)
        assert process.exitcode == 0, f"{process.name} ended with {process.exitcode}"
