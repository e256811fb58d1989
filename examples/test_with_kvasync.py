"""Testing your own code with kvasync's pytest plugin (installed with kvasync; no conftest).

The sync test needs only pytest; the async one needs pytest-asyncio (or anyio's plugin).
Run: pytest examples/test_with_kvasync.py
"""

import pytest

import kvasync


def test_a_hung_map_ends_at_the_deadline(kv_allocator_sync, kv_faults):
    with kv_allocator_sync(max_blocks=256, reserve_pages=(0, 0)) as kv:  # overrides Config fields
        kv_faults.hang()  # the FaultInjector of the allocators this test opens
        with pytest.raises(kvasync.AllocTimeout):
            kv.alloc(8, timeout=0.05)


def test_a_failed_map_is_an_error_and_the_allocator_keeps_serving(kv_allocator_sync, kv_faults):
    with kv_allocator_sync(max_blocks=256, reserve_pages=(0, 0)) as kv:
        kv_faults.fail(count=1)
        with pytest.raises(kvasync.MapError):
            kv.alloc(8, timeout=1.0)
        assert len(kv.alloc(8, timeout=1.0)) == 8


@pytest.mark.asyncio
async def test_a_slow_map_delays_the_alloc_but_it_completes(kv_allocator, kv_faults):
    async with kv_allocator(max_blocks=256, reserve_pages=(0, 0)) as kv:
        kv_faults.delay(0.05)
        ids = await kv.alloc(8, timeout=2.0)
        assert len(set(ids)) == 8
        kv.free(ids)
