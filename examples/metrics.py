"""Prometheus metrics of an allocator (needs the metrics extra: prometheus-client)."""

import asyncio

import torch
from prometheus_client import CollectorRegistry, generate_latest

import kvasync
from kvasync.integrations import metrics


async def main() -> None:
    layout = kvasync.KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
    )
    config = kvasync.Config(backend="host", max_blocks=1024, page_size=64 << 10, name="chat")
    registry = CollectorRegistry()
    async with kvasync.open_allocator(layout, config) as kv:
        registration = metrics.register(kv, registry=registry)
        ids = await kv.alloc(8)
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith(("kvasync_used_blocks", "kvasync_maps_total")):
                print(line)
        kv.free(ids)
        registration.unregister()


asyncio.run(main())
