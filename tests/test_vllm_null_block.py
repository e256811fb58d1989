"""vLLM's null block (block 0) from a fresh allocator, also when page 0 is not the first page
mapped (kvasync.integrations.vllm._engine.hold_null_block). Needs no vLLM.

Seen on the H200 (seed A, 2 of 10 starts): a second engine starting beside a busy one in an 8 GiB
share got its first 64 blocks from another page and refused to start.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import wait_until_sync

from kvasync import Config, KVLayout, open_allocator_sync
from kvasync.integrations.vllm._engine import hold_null_block
from kvasync.testing import FaultInjector

DEADLINE = 10.0
# 4 KiB blocks.
LAYOUT = KVLayout(1, 1, 256, 16, dtype=torch.int8, kv_buffers=1)
BLOCK = 4 << 10


@pytest.mark.parametrize(
    ("blocks_per_page", "limit_pages"),
    [
        (128, None),  # more blocks on the higher page than the first tries take
        (16, 3),  # a memory limit of 48 blocks: fewer than a whole try takes
    ],
)
def test_the_null_block_comes_when_page_0_maps_after_a_higher_page(
    blocks_per_page: int, limit_pages: int | None
) -> None:
    faults = FaultInjector()
    # The reserve's first refill (pages 0 and 1) is slow inside the mapper; its delay is cut
    # short below, once a failure is armed for it.
    faults.delay(DEADLINE)
    config = Config(
        backend="host",
        max_blocks=8 * blocks_per_page,
        page_size=blocks_per_page * BLOCK,
        memory_limit=None if limit_pages is None else limit_pages * blocks_per_page * BLOCK,
        reserve_pages=(2, 2),
        faults=faults,
        default_timeout=DEADLINE,
    )
    with open_allocator_sync(LAYOUT, config) as kv:
        wait_until_sync(
            lambda: kv.stats().mapper_op == "refill of 2 page(s)", "the refill's map", DEADLINE
        )
        errors: list[BaseException] = []

        def hold() -> None:
            try:
                hold_null_block(kv, DEADLINE)
            except BaseException as error:
                errors.append(error)

        holder = threading.Thread(target=hold)
        holder.start()
        # The null block's alloc waits, and asks for a page of its own (page 2).
        wait_until_sync(
            lambda: kv.stats().waiters == 1 and kv.stats().queued_jobs == 1,
            "the null block's alloc to wait, its page's map queued",
            DEADLINE,
        )
        faults.fail(1)  # the refill fails: pages 0 and 1 go back unmapped
        faults.delay(0)  # ends the refill's delay at once; page 2 maps next, for the alloc
        wait_until_sync(lambda: kv.stats().map_errors == 1, "the refill's failure", DEADLINE)
        holder.join(DEADLINE)
        assert not holder.is_alive()
        assert errors == []
        # Block 0 is held, and nothing else: the blocks taken on the way were given back.
        assert kv.stats().used_blocks == 1
        with pytest.raises(ValueError, match="not allocated"):
            kv.free([1])
        kv.free([0])
        assert kv.stats().used_blocks == 0
