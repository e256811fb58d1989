"""The blocking facade: a synchronous scheduler, several threads, no event loop of yours."""

import threading

import torch

import kvasync

layout = kvasync.KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
)
config = kvasync.Config(backend="host", max_blocks=1024, page_size=64 << 10)

with kvasync.open_allocator_sync(layout, config) as kv:
    ids = kv.alloc(8, timeout=0.5)  # blocks this thread at most 0.5 s
    held: list[list[int]] = []

    def worker() -> None:
        # Any thread may call it; each waiting alloc waits on its own request, with a deadline.
        held.append(kv.alloc(4, timeout=1.0))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=5.0)
    print("main thread:", ids, "workers:", sorted(len(blocks) for blocks in held))
    kv.free(ids)
    for blocks in held:
        kv.free(blocks)
    print("used after free:", kv.stats().used_blocks)
