"""The kvasync logger: a line at open, a warning for a stalled mapper op, nothing per alloc."""

from __future__ import annotations

import logging

import anyio
import pytest


async def test_open_logs_one_line_and_allocs_log_nothing_at_info(kv_allocator, caplog):
    caplog.set_level(logging.DEBUG, logger="kvasync")
    async with kv_allocator(reserve_pages=(0, 0), memory_limit=8 << 20) as kv:
        opened = [r for r in caplog.records if r.name == "kvasync"]
        assert len(opened) == 1 and opened[0].levelno == logging.INFO
        message = opened[0].getMessage()
        for part in (
            "host allocator",
            "2 layers",
            "page 2 MiB x 4 range(s)",
            "0 block id(s) across page boundaries never used",
            "capacity 2048 blocks",
            "memory limit 8 MiB",
            "reserve 0..0 pages",
        ):
            assert part in message, (part, message)
        caplog.clear()
        for _ in range(20):
            kv.free(await kv.alloc(3))
        assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_a_stalled_map_is_warned_once_with_its_op_pages_and_age(
    anyio_backend, kv_allocator, kv_faults, caplog
):
    caplog.set_level(logging.WARNING, logger="kvasync")
    async with kv_allocator(reserve_pages=(0, 0), stall_warning=0.1) as kv:
        kv_faults.hang()
        try:
            with anyio.move_on_after(0.5):
                await kv.alloc(1, timeout=5.0)
        finally:
            kv_faults.release()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "the mapper has been inside map of 1 page(s) for" in warnings[0]
        assert "stall threshold 0.1 s" in warnings[0]
        await wait_until_idle(kv)


async def wait_until_idle(kv) -> None:
    with anyio.fail_after(5):
        while kv.stats().inflight_pages:
            await anyio.sleep(0.001)
