"""A ``kvasync.Allocator`` as a tensor-parallel group's scheduler, in its own process, never closed
(tests/test_tensor_parallel.py): the process exits with the allocator still open, as an engine
that returns without closing its KV cache does.

Opens an allocator of layout ``--layout`` (layers, KV heads, head dim, block size) on the host
backend with ``Config(tensor_parallel=TensorParallel(--group, --ranks))``, waits for its ranks,
allocates ``--blocks`` blocks (mapped on every rank) and prints
``{"event": "ready", "blocks": [...]}``. At end of input it exits normally, the allocator open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import kvasync
from kvasync._group import TensorParallel

# The allocator and its loop stay referenced until the interpreter exits, never closed.
KEPT: list[object] = []


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def open_and_alloc(args: argparse.Namespace) -> tuple[kvasync.Allocator, list[int]]:
    layers, heads, head_dim, block_size = (int(x) for x in args.layout.split(","))
    layout = kvasync.KVLayout(
        num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size
    )
    config = kvasync.Config(
        backend="host",
        max_blocks=args.max_blocks,
        reserve_pages=(0, 0),
        tensor_parallel=TensorParallel(args.group, args.ranks, ready_timeout=30.0),
    )
    kv = await kvasync.Allocator.open(layout, config)
    return kv, await kv.alloc(args.blocks, timeout=30.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--max-blocks", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    args = parser.parse_args()

    loop = asyncio.new_event_loop()
    kv, blocks = loop.run_until_complete(open_and_alloc(args))
    KEPT.extend([loop, kv])
    say("ready", blocks=blocks)
    sys.stdin.read()  # until end of input; then exit, the allocator still open


if __name__ == "__main__":
    main()
