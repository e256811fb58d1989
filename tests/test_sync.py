"""Synchronous schedulers: alloc_nowait that grows the cache, available_blocks, the blocking
facade from many threads, and one allocator shared by a loop and threads."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import anyio
import pytest
from conftest import calls_after_close, public_methods, wait_until

import kvasync
from kvasync.testing import FaultInjector

LAYOUT = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
PER_PAGE = 512
PAGE_BYTES = (2 << 20) * LAYOUT.num_ranges


def test_a_synchronous_loop_grows_the_cache_to_the_limit_with_alloc_nowait_alone():
    cfg = kvasync.Config(
        backend="host", max_blocks=16 * PER_PAGE, memory_limit=4 * PAGE_BYTES, reserve_pages=(0, 0)
    )
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        assert kv.stats().mapped_pages == 0
        assert kv.available_blocks() == 4 * PER_PAGE  # nothing mapped, all of it mappable
        got: list[int] = []
        misses = 0
        errors: list[BaseException] = []

        def scheduler() -> None:  # a plain thread: no event loop, no await
            nonlocal misses
            give_up = time.monotonic() + 10.0
            try:
                while kv.available_blocks() >= 100 and time.monotonic() < give_up:
                    try:
                        got.extend(kv.alloc_nowait(100))
                    except kvasync.WouldBlock:
                        misses += 1
                        time.sleep(0.0005)  # a scheduler's next step, not a wait for an event
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=scheduler)
        thread.start()
        thread.join(15.0)
        assert not thread.is_alive() and errors == []
        assert len(got) == len(set(got)) == 20 * 100  # 2048 blocks under the limit: 20 x 100
        stats = kv.stats()
        assert stats.mapped_pages == 4 and stats.used_blocks == 2000
        assert misses > 0  # it did have to wait for maps: they were started by the misses
        assert kv.available_blocks() == 48
        with pytest.raises(kvasync.WouldBlock):
            kv.alloc_nowait(100)  # at the limit: nothing more to map
        assert kv.stats().mapping_pages == 0
        kv.free(got)


def test_pages_mapped_for_a_caller_that_never_returns_are_trimmed_as_usual():
    cfg = kvasync.Config(backend="host", max_blocks=16 * PER_PAGE, reserve_pages=(0, 0))
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        with pytest.raises(kvasync.WouldBlock):
            kv.alloc_nowait(3 * PER_PAGE)
        assert kv.stats().mapping_pages + kv.stats().mapped_pages == 3  # started, held by nobody
        give_up = time.monotonic() + 10.0
        while kv.stats().mapped_pages + kv.stats().inflight_pages > 0:
            assert time.monotonic() < give_up, kv.stats()
            time.sleep(0.01)
        assert kv.stats().unmaps_done == 3


def test_available_blocks_counts_free_mapped_and_mappable_less_waiters():
    cfg = kvasync.Config(
        backend="host", max_blocks=4 * PER_PAGE + 100, reserve_pages=(0, 0)
    )  # a short last page
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        assert kv.available_blocks() == 4 * PER_PAGE + 100
        blocks = kv.alloc(PER_PAGE + 1, timeout=5.0)
        assert kv.available_blocks() == 3 * PER_PAGE + 99
        kv.free(blocks)
    with pytest.raises(kvasync.AllocatorClosed):
        kv.available_blocks()


def test_the_blocking_facade_serves_many_threads_at_once_and_leaks_nothing():
    faults = FaultInjector()
    cfg = kvasync.Config(
        backend="host", max_blocks=8 * PER_PAGE, memory_limit=4 * PAGE_BYTES, faults=faults
    )
    faults.delay(0.001)
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        errors: list[BaseException] = []
        timeouts = 0

        def worker(seed: int) -> None:
            nonlocal timeouts
            rng = random.Random(seed)
            try:
                for _ in range(40):
                    try:
                        blocks = kv.alloc(rng.randint(1, 700), timeout=0.5)
                    except kvasync.AllocTimeout:
                        timeouts += 1
                        continue
                    kv.free(blocks)
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30.0)
        assert not any(thread.is_alive() for thread in threads) and errors == []
        stats = kv.stats()
        assert (stats.used_blocks, stats.waiters) == (0, 0)
        assert stats.timeouts == timeouts


async def test_threads_and_the_loop_share_one_allocator_under_stress_with_zero_leaks():
    cfg = kvasync.Config(
        backend="host", max_blocks=8 * PER_PAGE, memory_limit=3 * PAGE_BYTES, reserve_pages=(0, 2)
    )
    async with kvasync.open_allocator(LAYOUT, cfg) as kv:
        shared = kvasync.SyncAllocator(kv)
        stop = time.monotonic() + 1.0
        errors: list[BaseException] = []

        def thread_worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while time.monotonic() < stop:
                    try:
                        if rng.random() < 0.5:
                            blocks = shared.alloc(rng.randint(1, 400), timeout=0.2)
                        else:
                            blocks = shared.alloc_nowait(rng.randint(1, 400))
                    except (kvasync.AllocTimeout, kvasync.WouldBlock):
                        continue
                    shared.free(blocks)
            except BaseException as error:
                errors.append(error)

        async def task_worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                try:
                    with anyio.move_on_after(rng.choice([0.001, 0.05, 1.0])):  # cancels too
                        blocks = await kv.alloc(rng.randint(1, 400), timeout=0.2)
                        kv.free(blocks)
                except kvasync.AllocTimeout:
                    pass
                await asyncio.sleep(0)

        threads = [threading.Thread(target=thread_worker, args=(s,)) for s in range(4)]
        for thread in threads:
            thread.start()
        await asyncio.wait_for(asyncio.gather(*(task_worker(s) for s in range(4))), 20.0)
        for thread in threads:
            await asyncio.to_thread(thread.join, 20.0)
        assert not any(thread.is_alive() for thread in threads) and errors == []
        await wait_until(lambda: kv.stats().inflight_pages == 0 and kv.stats().waiters == 0)
        stats = kv.stats()
        assert stats.used_blocks == 0
        assert kv._slots.slots == {} and kv._pending == {}


async def test_a_blocking_call_on_the_loop_thread_raises_instead_of_deadlocking():
    cfg = kvasync.Config(backend="host", reserve_pages=(0, 0))
    async with kvasync.open_allocator(LAYOUT, cfg) as kv:
        shared = kvasync.SyncAllocator(kv)
        with pytest.raises(RuntimeError, match="wait for itself"):
            shared.alloc(1, timeout=1.0)
        with pytest.raises(RuntimeError, match="close it there"):
            shared.close()
        with pytest.raises(TypeError, match=r"kvasync\.Allocator"):
            kvasync.SyncAllocator(shared)  # type: ignore[arg-type]


def test_the_facade_rejects_bad_arguments_and_closed_use():
    with kvasync.open_allocator_sync(LAYOUT, kvasync.Config(backend="host")) as kv:
        with pytest.raises(ValueError, match="positive"):
            kv.alloc(0)
        with pytest.raises(ValueError, match="timeout"):
            kv.alloc(1, timeout=-1.0)
        with pytest.raises(ValueError, match="not both"):
            kv.alloc(1, timeout=1.0, deadline=time.monotonic() + 1)
        blocks = kv.alloc(3, deadline=time.monotonic() + 5.0)
        kv.free(blocks)
    kv.close()  # idempotent
    with pytest.raises(kvasync.AllocatorClosed):
        kv.alloc(1, timeout=1.0)


def test_threads_share_an_allocator_opened_under_trio():
    import trio

    async def main() -> None:
        cfg = kvasync.Config(backend="host", reserve_pages=(0, 0))
        async with kvasync.open_allocator(LAYOUT, cfg) as kv:
            shared = kvasync.SyncAllocator(kv)
            with pytest.raises(RuntimeError, match="wait for itself"):
                shared.alloc(1, timeout=1.0)  # on trio's own thread

            def in_thread() -> int:
                blocks = shared.alloc(PER_PAGE + 1, timeout=5.0)  # waits for maps
                shared.free(blocks)
                return len(blocks)

            with trio.fail_after(10):
                assert await trio.to_thread.run_sync(in_thread) == PER_PAGE + 1
            assert kv.stats().used_blocks == 0 and kv._slots.slots == {}

    trio.run(main)


def test_the_facade_has_every_public_method_and_property_of_allocator():
    # The README promises "the same methods": every public name of Allocator, with the same
    # parameters, except the async constructor (open_allocator_sync is the facade's).
    import inspect

    for name, member in vars(kvasync.Allocator).items():
        if name.startswith("_") or name == "open":
            continue
        mine = inspect.getattr_static(kvasync.SyncAllocator, name, None)
        assert mine is not None, f"SyncAllocator lacks {name}"
        assert isinstance(mine, property) == isinstance(member, property), name
        if callable(member):
            assert inspect.signature(mine) == inspect.signature(member), name


def test_the_facade_lists_the_free_blocks_the_next_alloc_takes():
    cfg = kvasync.Config(backend="host", max_blocks=8 * PER_PAGE, reserve_pages=(0, 0))
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        blocks = kv.alloc(PER_PAGE, timeout=5.0)  # page 0, every block in use
        kv.free(blocks[10:13])
        listed = kv.free_block_ids()
        assert sorted(listed) == sorted(blocks[10:13]) and kv.free_block_ids(limit=1) == listed[:1]
        assert kv.alloc_nowait(3) == listed
        with pytest.raises(ValueError, match="limit must be"):
            kv.free_block_ids(-1)
        kv.free(blocks)


def test_the_facade_reports_the_page_size_and_the_first_draining_block():
    cfg = kvasync.Config(backend="host", max_blocks=8 * PER_PAGE, reserve_pages=(0, 0))
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        assert kv.page_size == 2 << 20 == kv.allocator.page_size
        blocks = kv.alloc(3 * PER_PAGE, timeout=5.0)  # pages 0, 1 and 2, every block in use
        assert kv.drain_from() is None
        kv.resize(memory_limit=2 * PAGE_BYTES, timeout=5.0)
        assert kv.drain_from() == 2 * PER_PAGE  # page 2 drains: a scheduler frees from here
        kv.free([b for b in blocks if b >= 2 * PER_PAGE])
        deadline = time.monotonic() + 5.0
        while kv.drain_from() is not None:  # unmapped once its last block is freed
            assert time.monotonic() < deadline, "page 2 was not given back within 5 s"
            time.sleep(0.001)
        assert kv.stats().mapped_pages == 2
        kv.free([b for b in blocks if b < 2 * PER_PAGE])
        kv.trim(timeout=5.0, release_handles=False)
        assert kv.stats().mapped_pages == 0
        with pytest.raises(TypeError, match="release_handles"):
            kv.trim(release_handles=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("contiguous", [False, True])
def test_a_memory_limit_below_one_page_says_what_a_page_costs_and_why(contiguous):
    # Issue 18: "below one page (16777216 bytes across 8 ranges)" left a user guessing why a
    # page costs 8 times the page size.
    layout = kvasync.KVLayout(
        num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, contiguous=contiguous
    )
    with kvasync.open_allocator_sync(layout, kvasync.Config(backend="host")) as kv:
        page = kv.page_size * layout.num_ranges
        with pytest.raises(ValueError) as refused:
            kv.resize(memory_limit=page - 1, timeout=5.0)
        message = str(refused.value)
        assert f"memory_limit {page - 1} bytes" in message
        assert f"costs {page} bytes" in message
        if contiguous:
            assert "one range (contiguous=True" in message
        else:
            assert "each of the layout's 8 ranges (one per layer and K/V buffer: 4 x 2)" in message
            assert "same offset of every range" in message
        assert "Raise memory_limit to at least that" in message
        kv.resize(memory_limit=page, timeout=5.0)  # one page is enough
        assert kv.stats().memory_limit_pages == 1


def test_alloc_observers_see_the_allocs_of_the_facades_threads():
    cfg = kvasync.Config(backend="host", max_blocks=8 * PER_PAGE, reserve_pages=(0, 0))
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        seen: list[bool] = []
        remove = kv.add_alloc_observer(lambda waited, seconds: seen.append(waited))
        held: list[int] = []

        def allocate() -> None:
            held.extend(kv.alloc(PER_PAGE, timeout=5.0))

        threads = [threading.Thread(target=allocate) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10.0)
        assert not any(thread.is_alive() for thread in threads)
        assert len(seen) == 4 and len(set(held)) == 4 * PER_PAGE  # each alloc observed once
        assert seen.count(True) >= 1  # the first at least waited for its map
        assert len(kv.take_map_seconds()) >= 1
        remove()
        kv.free(kv.alloc(1, timeout=5.0))
        assert len(seen) == 4
        kv.free(held)


@pytest.mark.parametrize(
    ("limit", "error"),
    [("8MiB", TypeError), (2.5e6, TypeError), (True, TypeError), (0, ValueError)],
)
def test_resize_refuses_a_bad_limit_with_the_same_error_as_the_async_allocator(limit, error):
    # The facade raised ValueError for a limit of the wrong type where Allocator.resize raises
    # TypeError; a caller switching between them saw a different exception for one mistake.
    cfg = kvasync.Config(backend="host", max_blocks=8 * PER_PAGE, reserve_pages=(0, 0))
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        before = kv.stats().memory_limit_pages
        with pytest.raises(error, match="memory_limit"):
            kv.resize(memory_limit=limit, timeout=5.0)
        assert kv.stats().memory_limit_pages == before

    async def resize_async() -> None:
        async with kvasync.open_allocator(LAYOUT, cfg) as kv_async:
            with pytest.raises(error, match="memory_limit"):
                await kv_async.resize(memory_limit=limit, timeout=5.0)

    asyncio.run(resize_async())


def test_every_public_method_raises_allocator_closed_after_close():
    # Issue 27: some calls after close returned 0, None or [] or raised ValueError. The walk covers
    # every public method; one added later without an entry here fails the first assertion.
    cfg = kvasync.Config(backend="host", max_blocks=4 * PER_PAGE, reserve_pages=(0, 0))
    kv = kvasync.open_allocator_sync(LAYOUT, cfg)
    held = kv.alloc(4, timeout=5.0)
    data = kv.gather(held[:1])
    kv.close()
    kv.close()  # idempotent
    calls = {**calls_after_close(kv, held, data), "__enter__": kv.__enter__}
    public = public_methods(kvasync.SyncAllocator)
    still_served = {"close", "stats", "take_map_seconds"}
    assert public == set(calls) - {"__enter__"} | still_served
    served = []
    for name, call in calls.items():
        try:
            result = call()
        except kvasync.AllocatorClosed:
            continue
        except Exception as error:
            served.append(f"{name}: {type(error).__name__}: {error}")
        else:
            served.append(f"{name}: returned {type(result).__name__} {result!r:.40}")
    assert not served, served
    # Documented to work after close: the final counters, and the one map's duration, once.
    assert kv.stats().mapped_pages == 0
    durations = kv.take_map_seconds()
    assert len(durations) == 1 and durations[0] > 0
    assert kv.take_map_seconds() == []
    assert (kv.num_blocks, kv.layout, kv.backend) == (4 * PER_PAGE, LAYOUT, "host")


def test_close_on_the_facades_own_loop_thread_raises_and_closes_nothing():
    # A failed call changes nothing (issue 27): close() there used to mark the facade closed,
    # then wait for its own loop until the timeout and stop that loop, leaving the allocator open
    # with nothing to drain its completions.
    cfg = kvasync.Config(backend="host", max_blocks=4 * PER_PAGE, reserve_pages=(0, 0))
    with kvasync.open_allocator_sync(LAYOUT, cfg) as kv:
        loop = kv.allocator._loop
        assert loop is not None

        async def close_there() -> None:
            kv.close(timeout=0.2)

        attempt = asyncio.run_coroutine_threadsafe(close_there(), loop)
        with pytest.raises(RuntimeError, match="would wait for itself"):
            attempt.result(10.0)
        blocks = kv.alloc(PER_PAGE + 1, timeout=5.0)  # a map: the loop still drains
        kv.free(blocks)
    with pytest.raises(kvasync.AllocatorClosed):  # and the with block's close did close it
        kv.alloc(1, timeout=1.0)
