"""The core contract, once for each way of driving an allocator: asyncio, trio (both through
anyio) and the blocking facade (``open_allocator_sync``, called from worker threads).

Each scenario is written once against ``Api``; the ``driver`` fixture runs it under each kind.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

import kvasync
from kvasync.testing import FaultInjector

LAYOUT = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
PER_PAGE = 512  # blocks per 2 MiB page of LAYOUT
PAGE_BYTES = (2 << 20) * LAYOUT.num_ranges


class Api:
    """The allocator's methods as awaitables, whatever drives them."""

    def __init__(self, kv: kvasync.Allocator | kvasync.SyncAllocator) -> None:
        self.kv = kv

    async def alloc(self, n: int, timeout: float | None = None) -> list[int]:
        assert isinstance(self.kv, kvasync.Allocator)
        return await self.kv.alloc(n, timeout=timeout)

    async def trim(self, timeout: float | None = None) -> None:
        assert isinstance(self.kv, kvasync.Allocator)
        await self.kv.trim(timeout=timeout)

    async def resize(self, memory_limit: int | None) -> None:
        assert isinstance(self.kv, kvasync.Allocator)
        await self.kv.resize(memory_limit=memory_limit, timeout=5.0)

    def alloc_nowait(self, n: int) -> list[int]:
        return self.kv.alloc_nowait(n)

    def free(self, ids: list[int]) -> None:
        self.kv.free(ids)

    def stats(self) -> kvasync.AllocatorStats:
        return self.kv.stats()


class BlockingApi(Api):
    """The facade's blocking calls, each made from a worker thread."""

    async def _in_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

    async def alloc(self, n: int, timeout: float | None = None) -> list[int]:
        return await self._in_thread(self.kv.alloc, n, timeout=timeout)  # type: ignore[no-any-return]

    async def trim(self, timeout: float | None = None) -> None:
        assert isinstance(self.kv, kvasync.SyncAllocator)
        await self._in_thread(self.kv.trim, timeout=timeout)

    async def resize(self, memory_limit: int | None) -> None:
        assert isinstance(self.kv, kvasync.SyncAllocator)
        await self._in_thread(self.kv.resize, memory_limit=memory_limit, timeout=5.0)


@dataclass
class Driver:
    kind: str  # "asyncio", "trio" or "blocking"

    @property
    def library(self) -> str:
        return "trio" if self.kind == "trio" else "asyncio"

    @asynccontextmanager
    async def open(self, config: kvasync.Config) -> AsyncIterator[Api]:
        if self.kind != "blocking":
            async with kvasync.open_allocator(LAYOUT, config) as kv:
                yield Api(kv)
            return
        blocking = await anyio.to_thread.run_sync(kvasync.open_allocator_sync, LAYOUT, config)
        try:
            yield BlockingApi(blocking)
        finally:
            await anyio.to_thread.run_sync(blocking.close)

    def run(self, scenario: Callable[[Driver], Awaitable[None]]) -> None:
        async def bounded() -> None:
            with anyio.fail_after(30):
                await scenario(self)

        anyio.run(bounded, backend=self.library)


@pytest.fixture(params=["asyncio", "trio", "blocking"])
def driver(request: pytest.FixtureRequest) -> Driver:
    """Drives a scenario under asyncio, trio, or the blocking facade from threads."""
    return Driver(str(request.param))


def host(**overrides: Any) -> kvasync.Config:
    settings: dict[str, Any] = {"backend": "host", "max_blocks": 16 * PER_PAGE}
    settings.update(overrides)
    return kvasync.Config(**settings)


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.001)


def test_alloc_maps_on_demand_and_free_returns_everything(driver: Driver) -> None:
    async def scenario(d: Driver) -> None:
        async with d.open(host(reserve_pages=(0, 0))) as kv:
            blocks = await kv.alloc(3 * PER_PAGE)
            more = kv.alloc_nowait(1) if kv.stats().free_blocks else []
            every = blocks + more
            assert len(set(every)) == len(every) and all(0 <= b < 16 * PER_PAGE for b in every)
            assert kv.stats().mapped_pages == 3
            kv.free(every)
            await wait_for(lambda: kv.stats().mapped_pages == 0 and kv.stats().inflight_pages == 0)
            assert kv.stats().used_blocks == 0

    driver.run(scenario)


def test_a_hung_map_times_out_and_says_what_it_waited_for(driver: Driver) -> None:
    async def scenario(d: Driver) -> None:
        faults = FaultInjector()
        async with d.open(host(reserve_pages=(0, 0), faults=faults)) as kv:
            faults.hang()
            try:
                started = anyio.current_time()
                with pytest.raises(kvasync.AllocTimeout, match="alloc of 5 blocks timed out"):
                    await kv.alloc(5, timeout=0.1)
                assert 0.09 <= anyio.current_time() - started < 2.0
            finally:
                faults.release()
            await wait_for(lambda: kv.stats().inflight_pages == 0)
            stats = kv.stats()
            assert (stats.used_blocks, stats.waiters, stats.timeouts) == (0, 0, 1)

    driver.run(scenario)


def test_waiters_are_served_in_order_as_blocks_are_freed(driver: Driver) -> None:
    async def scenario(d: Driver) -> None:
        async with d.open(host(memory_limit=PAGE_BYTES, reserve_pages=(0, 0))) as kv:
            held = await kv.alloc(PER_PAGE)  # the whole memory limit
            got: list[list[int]] = []

            async def take(n: int) -> None:
                got.append(await kv.alloc(n, timeout=5.0))

            async with anyio.create_task_group() as group:
                group.start_soon(take, 300)
                await wait_for(lambda: kv.stats().waiters == 1)
                with pytest.raises(kvasync.WouldBlock):
                    kv.alloc_nowait(10)  # no jumping the queue at the limit
                kv.free(held)
            assert [len(blocks) for blocks in got] == [300]
            kv.free(got[0])
            assert kv.stats().used_blocks == 0

    driver.run(scenario)


def test_a_failed_map_raises_map_error_and_the_allocator_keeps_serving(driver: Driver) -> None:
    async def scenario(d: Driver) -> None:
        faults = FaultInjector()
        async with d.open(host(reserve_pages=(0, 0), faults=faults)) as kv:
            faults.fail(1)
            with pytest.raises(kvasync.MapError):
                await kv.alloc(4, timeout=5.0)
            blocks = await kv.alloc(4, timeout=5.0)
            kv.free(blocks)
            assert kv.stats().map_errors == 1 and kv.stats().used_blocks == 0

    driver.run(scenario)


def test_out_of_blocks_is_raised_at_once(driver: Driver) -> None:
    async def scenario(d: Driver) -> None:
        async with d.open(host(memory_limit=2 * PAGE_BYTES)) as kv:
            with pytest.raises(kvasync.OutOfBlocks, match="memory limit"):
                await kv.alloc(2 * PER_PAGE + 1, timeout=10.0)
            assert kv.stats().waiters == 0

    driver.run(scenario)


def test_trim_and_resize_give_memory_back(driver: Driver) -> None:
    async def scenario(d: Driver) -> None:
        async with d.open(host(reserve_pages=(2, 4))) as kv:
            await wait_for(lambda: kv.stats().reserve_pages == 4)
            await kv.trim(timeout=5.0)
            assert kv.stats().mapped_pages == 0
            blocks = await kv.alloc(3 * PER_PAGE)
            kv.free(blocks)
            await kv.resize(memory_limit=PAGE_BYTES)
            assert kv.stats().mapped_pages <= 1 and kv.stats().memory_limit_pages == 1

    driver.run(scenario)


def test_close_fails_a_waiting_alloc_with_allocator_closed(driver: Driver) -> None:
    async def scenario(d: Driver) -> None:
        faults = FaultInjector()
        failures: list[BaseException] = []

        async def wait_closed(kv: Api) -> None:
            try:
                await kv.alloc(5, timeout=20.0)
            except kvasync.AllocatorClosed as error:
                failures.append(error)

        try:
            async with anyio.create_task_group() as group:
                # default_timeout bounds the close: the mapper is stuck in the hung map.
                cfg = host(reserve_pages=(0, 0), faults=faults, default_timeout=0.3)
                async with d.open(cfg) as kv:
                    faults.hang()
                    group.start_soon(wait_closed, kv)
                    await wait_for(lambda: faults.hung_maps == 1 and kv.stats().waiters == 1)
        finally:
            faults.release()
        assert len(failures) == 1

    driver.run(scenario)
