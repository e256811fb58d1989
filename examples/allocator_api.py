"""The allocator's calls, one by one, on the host backend (runs on any Linux machine)."""

import asyncio

import torch

import kvasync
from kvasync.testing import FaultInjector


async def main() -> None:
    layout = kvasync.KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
    )
    faults = FaultInjector()  # acts inside the mapper thread: delay, hang, fail
    config = kvasync.Config(
        backend="host",
        max_blocks=1024,
        memory_limit=4 << 20,  # at most 4 MiB of physical KV memory mapped
        page_size=64 << 10,  # the unit of mapping: 64 KiB of each range
        reserve_pages=(0, 2),  # keep at most 2 mapped-free pages ready
        default_timeout=2.0,
        faults=faults,
    )
    async with kvasync.open_allocator(layout, config) as kv:
        print("capacity", kv.num_blocks, "blocks; a page holds", kv.page_size, "bytes of a range")

        # An alloc completes at once when mapped free blocks are there, else it waits for the
        # mapper, until its deadline.
        first = await kv.alloc(16, timeout=1.0)
        loop = asyncio.get_running_loop()
        second = await kv.alloc(16, deadline=loop.time() + 1.0)

        # The non-waiting form: WouldBlock when the blocks are not mapped and free now. It starts
        # the map, so the same call retried succeeds once the pages are mapped.
        try:
            third = kv.alloc_nowait(64)
        except kvasync.WouldBlock as error:
            print("alloc_nowait:", error)
            third = await kv.alloc(64)

        print("available now or by mapping:", kv.available_blocks(), "blocks")

        # A request that can never fit fails at once, whatever its deadline.
        try:
            await kv.alloc(kv.num_blocks + 1)
        except kvasync.OutOfBlocks as error:
            print("OutOfBlocks:", error)

        # A map that hangs in the driver: the alloc ends at its deadline and says what it waited
        # for; nothing leaks when the map completes later.
        await kv.trim()  # no mapped free page left, so the next alloc must map
        faults.hang()
        try:
            await kv.alloc(32, timeout=0.1)
        except kvasync.AllocTimeout as error:
            print("AllocTimeout:", error)
        faults.release()

        # Block data: one launch for every layer and buffer (Triton on a GPU, torch on a CPU).
        kv.zero(first)
        data = kv.gather(first)  # [blocks, layers, kv_buffers, block_size, heads, head_dim]
        kv.scatter(second, data)
        kv.copy(first[:4], second[:4])

        # A lower limit drains the pages above it that hold blocks in use: no block is handed
        # out there any more, and each goes back as soon as its last block is freed.
        kv.free(first)
        await kv.resize(memory_limit=512 << 10)  # two page ids of 64 KiB in each of 4 ranges
        print("limit lowered: blocks from", kv.drain_from(), "on are to be given back")
        kv.free(second + third)
        stats = kv.stats()
        print(
            f"used {stats.used_blocks} blocks, {stats.mapped_pages} page(s) mapped, "
            f"{stats.maps_done} maps, {stats.timeouts} timeout(s)"
        )


asyncio.run(main())
