"""The first example: open an allocator, take blocks, give them back."""

import asyncio

import torch

import kvasync


async def main() -> None:
    layout = kvasync.KVLayout(
        num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
    )
    config = kvasync.Config(backend="auto", max_blocks=4096)  # auto: cuda on a GPU, else host
    async with kvasync.open_allocator(layout, config) as kv:
        ids = await kv.alloc(8, timeout=1.0)  # 8 block ids, mapped before they are handed out
        k, v = kv.layer(0)  # views over the virtual range: [blocks, block_size, heads, head_dim]
        k[ids], v[ids] = 1.0, -1.0  # write the blocks' keys and values in layer 0
        print(f"{kv.backend}: {len(ids)} blocks written, {kv.stats().used_blocks} in use")
        kv.free(ids)
        await kv.trim()  # give the free pages back now instead of keeping a reserve
        stats = kv.stats()
        print(f"after free and trim: {stats.used_blocks} in use, {stats.mapped_pages} pages mapped")


asyncio.run(main())
