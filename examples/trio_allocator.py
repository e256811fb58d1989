"""The same allocator under trio (or anyio on either loop). Needs the trio extra."""

import torch
import trio

import kvasync


async def main() -> None:
    layout = kvasync.KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
    )
    config = kvasync.Config(backend="host", max_blocks=1024, page_size=64 << 10)
    async with kvasync.open_allocator(layout, config) as kv:
        # An enclosing cancel scope's deadline bounds the wait as well as timeout=.
        with trio.move_on_after(1.0):
            ids = await kv.alloc(8)
            print("trio:", ids)
            kv.free(ids)


trio.run(main)
