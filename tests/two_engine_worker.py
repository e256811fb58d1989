"""One "engine" of the two-engine startup scenario (seed 001), run as a child process.

tests/test_seed_scenarios.py starts two of these once and then releases both at the same moment,
round after round. In each round a worker opens an allocator with the reserve on and its maps
delayed, awaits a few allocations with a deadline, frees them and closes the allocator.

Protocol: one JSON object per line. The worker prints ``{"ready": true}`` once kvasync is
imported, then answers each ``{"round": i}`` read from stdin with one report line, and exits on
``{"quit": true}`` or at the end of stdin (so that it never outlives its parent).

Usage: python two_engine_worker.py BACKEND
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import kvasync
from kvasync.testing import FaultInjector

# 4 layers x K/V x 32 tokens x 8 heads x 128 x fp16, one block-major range: 512 KiB per block in
# the range, so 4 blocks per 2 MiB page (the cuda granularity too).
LAYOUT = kvasync.KVLayout(
    num_layers=4, num_kv_heads=8, head_dim=128, block_size=32, contiguous=True
)
PAGE_SIZE = 2 << 20
MAP_DELAY_S = 0.015  # every map stalls this long, as under driver contention
ALLOC_TIMEOUT_S = 1.0
ALLOC_SIZES = (6, 10, 12, 8)  # 36 blocks: 9 of the 16 pages, more than the reserve holds


async def run_round(backend: str, index: int) -> dict[str, Any]:
    faults = FaultInjector()
    faults.delay(MAP_DELAY_S)
    config = kvasync.Config(
        backend=backend,
        max_blocks=64,
        page_size=PAGE_SIZE,
        reserve_pages=(2, 4),
        default_timeout=2.0,
        faults=faults,
    )
    loop = asyncio.get_running_loop()
    report: dict[str, Any] = {"round": index, "ok": False, "error": None, "allocs": []}
    kv = await kvasync.Allocator.open(LAYOUT, config)
    try:
        # The reserve refill was queued by open(); with maps delayed it is still in flight here,
        # which is the window in which the reference allocator parked forever.
        report["refill_in_flight_at_first_alloc"] = kv.stats().mapping_pages > 0
        held = []
        for n in ALLOC_SIZES:
            start = loop.time()
            blocks = await kv.alloc(n, timeout=ALLOC_TIMEOUT_S)
            report["allocs"].append(
                {
                    "n": n,
                    "got": len(blocks),
                    "took_s": loop.time() - start,
                    "timeout_s": ALLOC_TIMEOUT_S,
                }
            )
            held.append(blocks)
        for blocks in held:
            kv.free(blocks)
        report["used_blocks_after_free"] = kv.stats().used_blocks
        report["ok"] = True
    except Exception as error:  # reported to the parent, which fails the test with it
        report["error"] = f"{type(error).__name__}: {error}"
    finally:
        faults.release()  # close() unmaps through the same backend: no need to wait for delays
        await kv.close(timeout=2.0)
    return report


def main() -> None:
    backend = sys.argv[1]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            return
        report = asyncio.run(run_round(backend, command["round"]))
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
