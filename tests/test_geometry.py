"""Real models' KV geometries: blocks that do not tile a page (Note [Blocks across page
boundaries] in src/kvasync/_layout.py).

Every expectation here is worked out from byte offsets, independently of the pool's bookkeeping:
a block id is usable when its bytes in a range lie inside one page. Without a GPU, gather and
scatter run under Triton's interpreter (tests/conftest.py), so these also check the kernels'
alignment assumptions on 18432- and 81920-byte blocks.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import select
import time

import pytest
import torch
from conftest import whole_blocks

import kvasync
from kvasync import _core

PAGE = 2 << 20  # the default page size

# name: (num_kv_heads, head_dim, block_size, dtype, kv_buffers); two layers keep them fast.
GEOMETRIES = {
    "mla576-bf16": (1, 576, 16, torch.bfloat16, 1),  # DeepSeek-V3/R1 latent: 18432 bytes
    "phi2-32x80": (32, 80, 16, torch.float16, 2),  # 81920 bytes
    "phi3-32x96": (32, 96, 16, torch.float16, 2),  # 98304 bytes
    "odd-5x40-bs3": (5, 40, 3, torch.float16, 2),  # 1200 bytes: nothing a power of two
}


def make_layout(name: str, contiguous: bool, num_layers: int = 2) -> kvasync.KVLayout:
    heads, head_dim, block_size, dtype, kv_buffers = GEOMETRIES[name]
    return kvasync.KVLayout(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        kv_buffers=kv_buffers,
        contiguous=contiguous,
    )


def straddlers(block_bytes: int, page_bytes: int, num_blocks: int) -> list[int]:
    """Ids whose bytes cross a page boundary, by brute force."""
    return [
        i
        for i in range(num_blocks)
        if i * block_bytes // page_bytes != ((i + 1) * block_bytes - 1) // page_bytes
    ]


# -- the unit of mapping and the capacity lost -----------------------------------------------


REAL_MODELS = {
    # name: (layers, geometry): the layer counts of the models themselves
    "DeepSeek-V3": (61, "mla576-bf16"),
    "Phi-2": (32, "phi2-32x80"),
    "Phi-3-mini": (32, "phi3-32x96"),
}


@pytest.mark.parametrize("contiguous", [False, True], ids=["per-layer", "contiguous"])
@pytest.mark.parametrize("model", list(REAL_MODELS))
def test_real_models_lose_at_most_a_32nd_of_their_pages(model: str, contiguous: bool) -> None:
    layers, geometry = REAL_MODELS[model]
    layout = make_layout(geometry, contiguous, num_layers=layers)
    unit = layout.page_unit(PAGE)
    block = layout.range_block_bytes
    assert unit % PAGE == 0 and unit >= block
    # Over a whole period of pages (lcm(unit, block) bytes) the straddlers' bytes are the loss.
    period = unit * block // math.gcd(unit, block)
    lost = len(straddlers(block, unit, period // block)) * block
    assert lost * 32 <= period
    if unit > PAGE:  # grown only where the requested page loses more, or holds no block
        lost_at_page = (block - math.gcd(PAGE, block)) * (period // PAGE)
        assert block > PAGE or lost_at_page * 32 > period


def test_per_layer_real_models_map_the_default_page() -> None:
    for layers, geometry in REAL_MODELS.values():
        assert make_layout(geometry, False, num_layers=layers).page_unit(PAGE) == PAGE


def test_unusable_blocks_matches_the_byte_offsets() -> None:
    rng = random.Random(8)
    for _ in range(300):
        layout = kvasync.KVLayout(
            num_layers=rng.randint(1, 5),
            num_kv_heads=rng.randint(1, 9),
            head_dim=rng.randint(1, 300),
            block_size=rng.randint(1, 33),
            contiguous=rng.random() < 0.5,
        )
        page = 4096 * rng.randint(1, 64)
        num_blocks = rng.randint(1, 3000)
        unit = layout.page_unit(page)
        expected = straddlers(layout.range_block_bytes, unit, num_blocks)
        assert layout.unusable_blocks(unit, num_blocks) == len(expected)


def wait_for_blocks(pool: _core.PagePool, timeout: float = 5.0) -> list[int]:
    """The blocks of the first completion record, waiting for it at most ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = pool.drain()
        if records:
            (_, status, blocks, message), *_ = records
            assert status == 0, message
            return blocks
        select.select([pool.completion_fd], [], [], 0.01)
    raise AssertionError(f"no completion within {timeout} s")


# -- the pool on its own: any block and page size, in bytes ----------------------------------


@pytest.mark.parametrize(
    ("block_bytes", "page_bytes", "num_blocks"),
    [(300, 1000, 50), (18432, PAGE, 400), (81920, PAGE, 200), (7, 64, 101), (5, 40, 33)],
)
def test_the_pool_hands_out_exactly_the_whole_blocks(
    block_bytes: int, page_bytes: int, num_blocks: int
) -> None:
    num_pages = -(-num_blocks * block_bytes // page_bytes)
    backend = _core.HostBackend(1, num_pages, 4096)  # the pool only counts bytes here
    pool = _core.PagePool(
        backend, num_blocks, 0, num_pages, 0, 0, 5.0, block_bytes=block_bytes, page_bytes=page_bytes
    )
    try:
        bad = straddlers(block_bytes, page_bytes, num_blocks)
        usable = num_blocks - len(bad)
        stats = pool.stats()
        assert stats["unusable_blocks"] == len(bad)
        assert stats["limit_blocks"] == usable
        request = pool.alloc(usable, -1.0)  # a waiter: it maps every page, then is served
        assert isinstance(request, int)
        got = wait_for_blocks(pool)
        assert sorted(got) == sorted(set(range(num_blocks)) - set(bad))
        with pytest.raises(kvasync.OutOfBlocks, match="can never fit"):
            pool.alloc(usable + 1, -1.0)
        if bad:
            with pytest.raises(ValueError, match="lies across a page boundary"):
                pool.free([bad[0]])
        pool.free(got)
    finally:
        pool.close(5.0)


def test_a_memory_limit_promises_the_fewest_blocks_of_its_pages() -> None:
    # 1000-byte pages of 300-byte blocks hold 3, 2, 3, 3, 2, ... whole blocks.
    backend = _core.HostBackend(1, 30, 4096)
    pool = _core.PagePool(backend, 100, 0, 4, 0, 0, 5.0, block_bytes=300, page_bytes=1000)
    try:
        assert pool.stats()["limit_blocks"] == 4 * 2
        with pytest.raises(kvasync.OutOfBlocks, match="memory limit allows 8"):
            pool.alloc(9, -1.0)
        pool.set_limit_pages(30, -1.0)
        assert pool.stats()["limit_blocks"] == 100 - len(straddlers(300, 1000, 100))
    finally:
        pool.close(5.0)


def test_random_operations_on_uneven_pages_keep_the_accounting() -> None:
    # 1000-byte pages of 300-byte blocks: pages of 2 or 3 blocks, a straddler at most boundaries.
    rng = random.Random(576)
    num_blocks, num_pages = 120, 36
    bad = set(straddlers(300, 1000, num_blocks))
    backend = _core.HostBackend(1, num_pages, 4096)
    pool = _core.PagePool(backend, num_blocks, 0, 20, 1, 3, 5.0, block_bytes=300, page_bytes=1000)
    held: list[list[int]] = []
    waiting: set[int] = set()

    def check() -> None:
        s = pool.stats()
        ids = [b for blocks in held for b in blocks]
        assert len(set(ids)) == len(ids) and not set(ids) & bad
        assert all(0 <= b < num_blocks for b in ids)
        # More when the mapper served a waiter whose completion is not drained yet.
        assert s["used_blocks"] >= len(ids)
        states = s["mapped_pages"] + s["mapping_pages"] + s["unmapping_pages"]
        assert states + s["unmapped_pages"] == num_pages
        mapped_blocks = s["used_blocks"] + s["free_blocks"]
        assert 2 * s["mapped_pages"] - 1 <= mapped_blocks <= 3 * s["mapped_pages"]

    try:
        for _ in range(2000):
            op = rng.random()
            if op < 0.45:
                result = pool.alloc(rng.randint(1, 12), time.monotonic() + 5.0)
                if isinstance(result, int):
                    waiting.add(result)
                else:
                    held.append(result)
            elif op < 0.85 and held:
                pool.free(held.pop(rng.randrange(len(held))))
            elif op < 0.9:
                pool.set_limit_pages(rng.randint(8, 36), time.monotonic() + 5.0)
            elif op < 0.93:
                pool.trim(time.monotonic() + 5.0)
            elif waiting:
                request = rng.choice(sorted(waiting))
                waiting.discard(request)
                pool.cancel(request, False)
            for request, status, blocks, _ in pool.drain():
                if request in waiting:
                    waiting.discard(request)
                    if status == 0:
                        held.append(blocks)
                elif blocks:
                    pool.free(blocks)  # cancelled after its completion was queued
            check()
        for request in waiting:
            pool.cancel(request, False)
        for blocks in held:
            pool.free(blocks)
        held.clear()
        for _, _, blocks, _ in pool.drain():
            if blocks:
                pool.free(blocks)
        check()
        assert pool.stats()["used_blocks"] == 0
    finally:
        assert pool.close(5.0)


# -- the allocator: every geometry, both layouts ---------------------------------------------


def block_offsets(kv: kvasync.Allocator, block: int) -> list[tuple[int, int]]:
    """(range, byte offset in that range) of block ``block`` in every buffer."""
    layout = kv.layout
    views = [v for layer in range(layout.num_layers) for v in kv.layer(layer)]
    out = []
    for b, view in enumerate(views):
        if layout.contiguous:
            base, rng = views[0].data_ptr(), 0
        else:
            base, rng = view.data_ptr(), b
        out.append((rng, view[block].data_ptr() - base))
    return out


@pytest.mark.parametrize("contiguous", [False, True], ids=["per-layer", "contiguous"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
async def test_every_geometry_works_to_its_memory_limit(geometry: str, contiguous: bool) -> None:
    layout = make_layout(geometry, contiguous)
    unit = layout.page_unit(PAGE)
    max_blocks = max(3 * unit // layout.range_block_bytes, 40)
    cfg = kvasync.Config(
        backend="host",
        max_blocks=max_blocks,
        memory_limit=2 * unit * layout.num_ranges,
        reserve_pages=(1, 2),
    )
    async with kvasync.open_allocator(layout, cfg) as kv:
        stats = kv.stats()
        assert stats.page_bytes == unit * layout.num_ranges
        bad = straddlers(layout.range_block_bytes, unit, max_blocks)
        assert stats.unusable_blocks == len(bad) == layout.unusable_blocks(unit, max_blocks)
        assert stats.unusable_bytes == len(bad) * layout.block_bytes * layout.num_buffers

        # Up to the memory limit: what it promises at once, then the rest of its two pages.
        ids = await kv.alloc(stats.memory_limit_blocks, timeout=5.0)
        while kv.stats().free_blocks:
            ids += kv.alloc_nowait(1)
        with pytest.raises(kvasync.AllocTimeout, match="memory limit"):
            await kv.alloc(1, timeout=0.05)
        two_pages = [
            i
            for i in whole_blocks(layout, PAGE, max_blocks)
            if i * layout.range_block_bytes < 2 * unit
        ]
        assert sorted(ids) == two_pages
        assert not set(ids) & set(bad) and all(0 <= i < kv.num_blocks for i in ids)
        for i in ids:  # no block spans two pages, in any buffer
            for _, offset in block_offsets(kv, i):
                assert offset // unit == (offset + layout.block_bytes - 1) // unit
        for layer in range(layout.num_layers):
            assert all(v.shape[0] == max_blocks for v in kv.layer(layer))
            assert len({v.stride() for v in kv.layer(layer)}) == 1

        # Every block through kv.layer (torch indexing), read back by kv.layer. The kernels
        # (Triton's interpreter: ~1 ms a program and chunk) take the blocks beside each page
        # boundary, the first and the last: where a wrong stride or page mapping shows.
        shape = (len(ids), layout.block_size, layout.num_kv_heads, layout.head_dim)
        views = [v for layer in range(layout.num_layers) for v in kv.layer(layer)]
        written = [torch.randn(shape).to(layout.dtype) for _ in views]
        for view, data in zip(views, written, strict=True):
            view[ids] = data
        for view, data in zip(views, written, strict=True):
            assert torch.equal(view[ids].view(torch.uint8), data.view(torch.uint8))
        ordered = sorted(ids)
        edges = {ordered[0], ordered[-1]}
        gaps = [(a, b) for a, b in itertools.pairwise(ordered) if b != a + 1]
        edges |= {a for a, _ in gaps} | {b for _, b in gaps}
        probe = sorted(edges)[:6]
        where = [ids.index(i) for i in probe]
        gathered = kv.gather(probe)
        expected = torch.stack([data[where] for data in written], dim=1).view(gathered.shape)
        assert torch.equal(gathered.view(torch.uint8), expected.view(torch.uint8))
        src = torch.randn(gathered.shape).to(layout.dtype)
        kv.scatter(probe, src)
        flat = src.view(len(probe), layout.num_buffers, *shape[1:])
        for b, view in enumerate(views):
            assert torch.equal(view[probe].view(torch.uint8), flat[:, b].view(torch.uint8))

        # A block across a page boundary is refused like any block not allocated.
        if bad:
            with pytest.raises(ValueError, match="lies across a page boundary"):
                kv.free([bad[0]])
            with pytest.raises(ValueError, match="not allocated"):
                kv.gather([bad[0]])

        # resize, then trim.
        await kv.resize(memory_limit=unit * layout.num_ranges)
        kv.free(ids[stats.memory_limit_blocks // 2 :])
        one = kv.stats().memory_limit_blocks
        assert kv.stats().mapped_pages == 1
        with pytest.raises(kvasync.OutOfBlocks):
            await kv.alloc(one + 1)
        kv.free(ids[: stats.memory_limit_blocks // 2])
        await kv.trim()
        assert (kv.stats().mapped_pages, kv.stats().used_blocks) == (0, 0)


async def test_zero_on_alloc_across_a_page_boundary() -> None:
    # One layer of one buffer: both layouts are the same single range here.
    layout = make_layout("mla576-bf16", False, num_layers=1)
    unit = layout.page_unit(PAGE)
    # A reserve keeps page 1 mapped once its blocks are freed: the same blocks come back.
    cfg = kvasync.Config(backend="host", max_blocks=300, zero_on_alloc=True, reserve_pages=(1, 2))
    async with kvasync.open_allocator(layout, cfg) as kv:
        first_page = len(
            [i for i in whole_blocks(layout, PAGE, 300) if i * layout.range_block_bytes < unit]
        )
        held = await kv.alloc(first_page - 2)
        blocks = await kv.alloc(4)  # the last two of page 0 and the first two of page 1
        pages = {i * layout.range_block_bytes // unit for i in blocks}
        assert pages == {0, 1}
        for layer in range(layout.num_layers):
            for view in kv.layer(layer):
                view[blocks] = 7
        kv.free(blocks)
        again = await kv.alloc(4)
        assert sorted(again) == sorted(blocks)
        for layer in range(layout.num_layers):
            for view in kv.layer(layer):
                assert torch.count_nonzero(view[again]).item() == 0
        kv.free(held + again)


async def test_the_open_log_line_shows_the_capacity_lost(caplog: pytest.LogCaptureFixture) -> None:
    layout = make_layout("mla576-bf16", False)
    with caplog.at_level(logging.INFO, logger="kvasync"):
        async with kvasync.open_allocator(layout, kvasync.Config(backend="host", max_blocks=1000)):
            pass
    lost = layout.unusable_blocks(PAGE, 1000)
    (line,) = [r.getMessage() for r in caplog.records if "opened a" in r.getMessage()]
    assert "per-layer layout" in line and "a host allocator" in line
    assert f"page {PAGE / (1 << 20):g} MiB" in line
    assert f"capacity {1000 - lost} blocks" in line
    assert f"{lost} block id(s) across page boundaries" in line


@pytest.mark.parametrize("contiguous", [False, True], ids=["per-layer", "contiguous"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
async def test_the_kernels_alignment_hints_hold_for_every_geometry(
    geometry: str, contiguous: bool
) -> None:
    # The kernels assert 16-byte alignment (tl.multiple_of) only when every base address, block
    # size and block stride is a multiple of 16: check what they are told against the memory.
    from kvasync import kernels  # type: ignore[attr-defined]

    layout = make_layout(geometry, contiguous)
    async with kvasync.open_allocator(layout, kvasync.Config(backend="host", max_blocks=64)) as kv:
        views = [v for layer in range(layout.num_layers) for v in kv.layer(layer)]
        table = kernels.block_table(views)
        assert table.block_bytes == layout.block_bytes
        assert table.block_stride_bytes == layout.range_block_bytes
        assert table.alignment == 16  # every listed geometry's blocks are 16-byte multiples
        for value in (table.block_bytes, table.block_stride_bytes, *table.pointers.tolist()):
            assert value % table.alignment == 0
        plan = kernels.block_copy._plan(table)
        assert plan.vec * plan.unit_bytes == table.alignment
        assert plan.vecs_per_block * plan.vec * plan.unit_bytes == layout.block_bytes
        assert plan.block_stride_vecs * plan.vec * plan.unit_bytes == layout.range_block_bytes


def test_the_pool_rejects_an_inconsistent_geometry() -> None:
    backend = _core.HostBackend(1, 8, 4096)
    with pytest.raises(ValueError, match="not both"):
        _core.PagePool(backend, 10, 4, 8, 0, 0, 1.0, block_bytes=300, page_bytes=1000)
    with pytest.raises(ValueError, match="holds no whole block"):
        _core.PagePool(backend, 10, 0, 8, 0, 0, 1.0, block_bytes=300, page_bytes=400)
    with pytest.raises(ValueError, match="empty pool"):
        _core.PagePool(backend, 10, 0, 8, 0, 0, 1.0, block_bytes=300, page_bytes=0)
