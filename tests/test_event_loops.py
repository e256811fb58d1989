"""The allocator under the event loops serving stacks run: asyncio's own and uvloop (vLLM, SGLang).

uvloop keeps its own clock (libuv's, in milliseconds, cached per iteration) and its own reader
and timer machinery, so deadlines, eventfd completions and cancellation are checked again on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from conftest import wait_until

import kvasync
from kvasync.testing import FaultInjector

# Installed by `make test`; the GPU machine's image has no uvloop (nor a way to install it).
uvloop = pytest.importorskip("uvloop")

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
LAYOUT = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
PER_PAGE = 512


def run_on(loop_name: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(asyncio.wait_for(main(), 30.0))


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_waits_deadlines_and_cancellation_on_each_event_loop(loop_name):
    async def main() -> None:
        faults = FaultInjector()
        cfg = kvasync.Config(backend="host", reserve_pages=(0, 0), faults=faults)
        async with kvasync.open_allocator(LAYOUT, cfg) as kv:
            hot = await kv.alloc(1)  # maps page 0 (a wait), then ...
            faster = kv.alloc(1)
            with pytest.raises(StopIteration) as done:  # ... the next fits without suspending
                faster.send(None)
            hot += done.value.value
            faults.delay(0.02)
            mapped = await kv.alloc(PER_PAGE, timeout=5.0)  # an eventfd completion
            faults.release()
            faults.hang()
            try:
                loop = asyncio.get_running_loop()
                started = loop.time()
                with pytest.raises(kvasync.AllocTimeout, match="mapping"):
                    await kv.alloc(PER_PAGE, timeout=0.1)
                assert 0.09 <= loop.time() - started < 2.0
                task = asyncio.create_task(kv.alloc(PER_PAGE, timeout=5.0))
                await wait_until(lambda: kv.stats().waiters == 1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                faults.release()
            kv.free(hot + mapped + kv.alloc_nowait(1))
            await wait_until(lambda: kv.stats().inflight_pages == 0)
            stats = kv.stats()
            assert (stats.used_blocks, stats.waiters, stats.timeouts) == (0, 0, 1)

    run_on(loop_name, main)
