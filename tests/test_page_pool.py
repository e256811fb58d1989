"""kvasync._core.PagePool on its own: page-state accounting under random operations."""

from __future__ import annotations

import random
import select
import time

import pytest

from kvasync import _core

BLOCKS_PER_PAGE = 8
NUM_PAGES = 12


def open_pool(limit_pages: int = NUM_PAGES, reserve: tuple[int, int] = (1, 3)) -> _core.PagePool:
    backend = _core.HostBackend(2, NUM_PAGES, 4096)
    return _core.PagePool(
        backend, NUM_PAGES * BLOCKS_PER_PAGE, BLOCKS_PER_PAGE, limit_pages, *reserve, 5.0
    )


def check_accounting(pool: _core.PagePool) -> dict[str, int]:
    """Every page is in exactly one state; blocks add up to what the mapped pages hold."""
    s = pool.stats()
    states = s["mapped_pages"] + s["mapping_pages"] + s["unmapping_pages"] + s["unmapped_pages"]
    assert states == NUM_PAGES, s
    assert s["used_blocks"] + s["free_blocks"] == s["mapped_pages"] * BLOCKS_PER_PAGE, s
    assert 0 <= s["reserve_pages"] <= s["mapped_pages"], s
    assert s["mapped_pages"] + s["mapping_pages"] <= s["limit_pages"] + s["unmapping_pages"], s
    return s


def wait_idle(pool: _core.PagePool, timeout: float = 5.0) -> dict[str, int]:
    """Waits (bounded) until the mapper has no job queued or running."""
    deadline = time.monotonic() + timeout
    while True:
        s = pool.stats()
        busy = s["queued_jobs"] + s["mapping_pages"] + s["unmapping_pages"]
        if busy == 0 and s["mapper_op"] is None:
            return s
        assert time.monotonic() < deadline, f"mapper still busy after {timeout} s: {s}"
        select.select([pool.completion_fd], [], [], 0.005)  # wake on completions, else poll


def test_random_alloc_free_cancel_keeps_every_page_in_exactly_one_state():
    rng = random.Random(1234)
    pool = open_pool(limit_pages=8)
    held: list[list[int]] = []
    waiting: set[int] = set()
    try:
        for _ in range(3000):
            op = rng.random()
            if op < 0.45:
                result = pool.alloc(rng.randint(1, 20), time.monotonic() + 5.0)
                if isinstance(result, int):
                    waiting.add(result)
                else:
                    held.append(result)
            elif op < 0.85 and held:
                pool.free(held.pop(rng.randrange(len(held))))
            elif waiting:
                request = rng.choice(sorted(waiting))
                waiting.discard(request)
                pool.cancel(request, False)
            for request, status, blocks, _message in pool.drain():
                assert status == 0
                if request in waiting:
                    waiting.discard(request)
                    held.append(blocks)
                else:
                    pool.free(blocks)  # cancelled after its completion was queued
            check_accounting(pool)
        for request in waiting:
            pool.cancel(request, False)
        for blocks in held:
            pool.free(blocks)
        wait_idle(pool)
        for _request, _status, blocks, _message in pool.drain():
            pool.free(blocks)
        s = check_accounting(pool)
        assert (s["used_blocks"], s["waiters"]) == (0, 0)
        assert s["reserve_pages"] <= 3  # the excess above the high watermark went back
    finally:
        assert pool.close(5.0)


def test_every_handed_out_block_is_distinct_and_allocated():
    pool = open_pool()
    try:
        first = pool.alloc_nowait(1)
        assert first is None or len(first) == 1  # the reserve may not be mapped yet
        blocks = pool.alloc(50, time.monotonic() + 5.0)
        if isinstance(blocks, int):
            select.select([pool.completion_fd], [], [], 5.0)
            ((_, status, blocks, _),) = pool.drain()
            assert status == 0
        everything = blocks + (first or [])
        assert len(set(everything)) == len(everything)
        assert pool.unallocated(everything) == []
        pool.free(everything)
        assert pool.unallocated(everything) == everything
    finally:
        pool.close(5.0)


def test_constructor_rejects_inconsistent_settings():
    backend = _core.HostBackend(1, 4, 4096)
    with pytest.raises(ValueError, match="more pages"):
        _core.PagePool(backend, 5 * BLOCKS_PER_PAGE, BLOCKS_PER_PAGE, 4, 0, 0, 1.0)
    with pytest.raises(ValueError, match="watermarks"):
        _core.PagePool(backend, BLOCKS_PER_PAGE, BLOCKS_PER_PAGE, 4, 3, 1, 1.0)
    with pytest.raises(ValueError, match="page size"):
        _core.HostBackend(1, 4, 1000)


def test_lowest_pages_are_used_first_and_highest_unmapped_first_across_thousands_of_pages():
    # One block per page and more than 4096 pages: every level of the pool's page bitmaps.
    num_pages = 9000
    backend = _core.HostBackend(1, num_pages, 4096)
    pool = _core.PagePool(backend, num_pages, 1, num_pages, 0, num_pages, 5.0)
    try:
        everything = pool.alloc(num_pages, time.monotonic() + 10.0)
        assert isinstance(everything, int)
        select.select([pool.completion_fd], [], [], 10.0)
        ((_, status, everything, _),) = pool.drain()
        assert status == 0 and sorted(everything) == list(range(num_pages))
        pool.free([8500, 100, 5000, 4097, 4095])
        # Mapped free pages are reused lowest first, whatever the order they were freed in.
        assert [pool.alloc_nowait(1) for _ in range(5)] == [[100], [4095], [4097], [5000], [8500]]
        pool.free([8500, 5000, 4097, 64, 0])
        request = pool.trim(time.monotonic() + 10.0)
        assert request > 0
        select.select([pool.completion_fd], [], [], 10.0)
        ((done, status, _, _),) = pool.drain()
        assert (done, status) == (request, 0)
        s = wait_idle(pool)
        assert (s["unmapped_pages"], s["mapped_pages"], s["unmaps_done"]) == (5, 8995, 5)
        # The lowest unmapped page is mapped first when blocks are needed again.
        again = pool.alloc(2, time.monotonic() + 10.0)
        assert isinstance(again, int)
        select.select([pool.completion_fd], [], [], 10.0)
        ((_, status, blocks, _),) = pool.drain()
        assert status == 0 and sorted(blocks) == [0, 64]
    finally:
        assert pool.close(10.0)
