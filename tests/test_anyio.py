"""anyio on asyncio and trio: cancel scopes' deadlines and cancellation around every wait.

These tests use kvasync's own pytest plugin (kv_allocator, kv_faults) under anyio's plugin.
"""

from __future__ import annotations

import anyio
import pytest

import kvasync

PER_PAGE = 512  # blocks per page of kv_allocator's default layout

pytestmark = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])


async def wait_for(predicate, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.001)


@pytest.mark.anyio
async def test_an_enclosing_scope_deadline_ends_the_wait_when_it_is_earlier(
    anyio_backend, kv_allocator, kv_faults
):
    faults = kv_faults
    async with kv_allocator(reserve_pages=(0, 0)) as kv:
        faults.hang()
        try:
            started = anyio.current_time()
            with anyio.move_on_after(0.1) as scope:
                await kv.alloc(PER_PAGE, timeout=10.0)
            assert scope.cancelled_caught
            assert 0.09 <= anyio.current_time() - started < 2.0
            with pytest.raises(TimeoutError):
                with anyio.fail_after(0.1):
                    await kv.alloc(PER_PAGE)  # the default timeout (5 s) is the later one
            # The earlier of the two wins the other way round too, with kvasync's own error.
            with anyio.fail_after(10.0), pytest.raises(kvasync.AllocTimeout, match="mapping"):
                await kv.alloc(PER_PAGE, timeout=0.1)
            assert kv.stats().waiters == 0
        finally:
            faults.release()
        await wait_for(lambda: kv.stats().inflight_pages == 0)
        stats = kv.stats()
        assert (stats.used_blocks, stats.waiters, stats.timeouts) == (0, 0, 1)


@pytest.mark.anyio
async def test_the_scope_deadline_also_bounds_the_mappers_job(
    anyio_backend, kv_allocator, kv_faults
):
    faults = kv_faults
    async with kv_allocator(reserve_pages=(0, 0)) as kv:
        faults.hang()
        try:
            with pytest.raises(kvasync.WouldBlock):
                kv.alloc_nowait(1)  # the mapper now sticks in the map this miss started
            await wait_for(lambda: faults.hung_maps == 1)
            with anyio.move_on_after(0.05):
                await kv.alloc(PER_PAGE, timeout=10.0)  # its map is queued, due in 0.05 s
            assert kv.stats().queued_jobs == 1
        finally:
            faults.release()
        # Reached after its scope's deadline, the queued map is dropped instead of run.
        await wait_for(lambda: kv.stats().queued_jobs == 0 and kv.stats().inflight_pages == 0)
        stats = kv.stats()
        assert (stats.dropped_jobs, stats.used_blocks, stats.waiters) == (1, 0, 0)


@pytest.mark.anyio
async def test_cancelling_waits_of_every_kind_leaks_nothing(anyio_backend, kv_allocator, kv_faults):
    faults = kv_faults
    async with kv_allocator(reserve_pages=(0, 0)) as kv:
        for delay in (0.0, 0.001, 0.003, 0.01):  # before, during and after the map lands
            faults.delay(0.003)
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(kv.alloc, 3 * PER_PAGE)
                    group.start_soon(kv.alloc, 7)
                    await anyio.sleep(delay)
                    scope.cancel()
            faults.release()
            await wait_for(lambda: kv.stats().inflight_pages == 0)
        stats = kv.stats()
        assert (stats.used_blocks, stats.waiters) == (0, 0)
        blocks = await kv.alloc(PER_PAGE)
        kv.free(blocks)
