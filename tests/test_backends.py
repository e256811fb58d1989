"""The unit of mapping: Config(page_size=None) picks it per backend (src/kvasync/_backends.py)."""

from __future__ import annotations

import pytest

import kvasync
from kvasync._backends import HOST_PAGE_SIZE, default_page_size, pooled_handle_pages

MIB = 1 << 20
GRANULARITY = 2 * MIB
# The reference geometry: 32 layers, K and V, 16 tokens x 8 heads x 128 x fp16 (32 KiB blocks).
REFERENCE = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "per-layer"])
def test_cuda_default_page_id_holds_one_granularity_page_of_every_buffer(contiguous):
    layout = kvasync.KVLayout(**REFERENCE, contiguous=contiguous)
    page_size = default_page_size(layout, "cuda", GRANULARITY)
    assert page_size == (128 * MIB if contiguous else 2 * MIB)
    assert page_size * layout.num_ranges == 128 * MIB  # one page id, either layout
    assert layout.blocks_per_page(page_size) == 64


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "per-layer"])
def test_cuda_default_page_holds_at_least_one_block(contiguous):
    # 4 MiB blocks per buffer: larger than the granularity.
    layout = kvasync.KVLayout(
        num_layers=2, num_kv_heads=8, head_dim=128, block_size=2048, contiguous=contiguous
    )
    page_size = default_page_size(layout, "cuda", GRANULARITY)
    assert page_size == layout.range_block_bytes
    assert layout.blocks_per_page(page_size) == 1


def test_host_default_page_size_is_2_mib_per_range():
    layout = kvasync.KVLayout(**REFERENCE, contiguous=True)
    assert default_page_size(layout, "host", 0) == HOST_PAGE_SIZE == 2 * MIB


@pytest.mark.asyncio
async def test_an_allocator_uses_the_default_or_the_explicit_page_size():
    layout = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    async with kvasync.open_allocator(layout, kvasync.Config(backend="host")) as kv:
        assert kv.page_size == HOST_PAGE_SIZE
    config = kvasync.Config(backend="host", page_size=4 * MIB)
    async with kvasync.open_allocator(layout, config) as kv:
        assert kv.page_size == 4 * MIB
        assert kv.stats().mapped_pages >= 0


@pytest.mark.parametrize("bad", [0, -4096, 1000, 4096.0, "2M"])
def test_page_size_must_be_none_or_a_positive_multiple_of_4096(bad):
    with pytest.raises((ValueError, TypeError), match="page_size"):
        kvasync.Config(page_size=bad)


def test_page_size_default_is_none():
    assert kvasync.Config().page_size is None


def test_pooled_handles_are_the_reserve_high_watermark_unless_memory_is_bounded():
    """A pooled handle is device memory nothing maps: a memory limit or a share's budget counts
    mapped pages only, so under either the cuda backend pools none (bench/RESULTS.md: 1 GiB of
    pooled handles beside a 1 GiB limit under vLLM on an H200)."""
    free = kvasync.Config(reserve_pages=(2, 5))
    assert pooled_handle_pages(free) == 5
    assert pooled_handle_pages(kvasync.Config(reserve_pages=(2, 5), memory_limit=1 << 30)) == 0
    assert pooled_handle_pages(kvasync.Config(reserve_pages=(2, 5), share="cuda0")) == 0
