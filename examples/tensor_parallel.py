"""Tensor parallel: one scheduler decides the pages, two rank processes map them.

Host backends here, so it runs on a CPU; on GPUs each rank builds a cuda backend of the same
geometry (the vLLM plugin's workers do).
"""

import asyncio
import multiprocessing
import os

import torch

import kvasync
from kvasync.tensor_parallel import RankMapper, TensorParallel, group_geometry, host_backend


def rank(group: str, index: int, done) -> None:
    geometry = group_geometry(group, timeout=30.0)  # waits for the scheduler to open the group
    with RankMapper(group, index, host_backend(geometry), timeout=30.0) as mapper:
        done.wait(30.0)  # map what the scheduler decides until it is done
        print(f"rank {index}: {mapper.jobs_done} map and unmap jobs done")


async def schedule(group: str) -> None:
    layout = kvasync.KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
    )
    config = kvasync.Config(
        backend="host", max_blocks=1024, page_size=64 << 10,
        tensor_parallel=TensorParallel(group, num_ranks=2, ready_timeout=30.0),
    )  # fmt: skip
    async with kvasync.open_allocator(layout, config) as kv:
        ids = await kv.alloc(64, timeout=5.0)  # completes once both ranks have mapped
        print(f"scheduler: {len(ids)} blocks, mapped on every rank")
        kv.free(ids)


if __name__ == "__main__":
    group = f"example-{os.getpid()}"
    spawn = multiprocessing.get_context("spawn")
    done = spawn.Event()
    ranks = [spawn.Process(target=rank, args=(group, index, done)) for index in range(2)]
    for process in ranks:
        process.start()
    asyncio.run(schedule(group))
    done.set()
    for process in ranks:
        process.join(30.0)
        assert process.exitcode == 0, f"{process.name} ended with {process.exitcode}"
