"""The worker side: vLLM's KV cache tensors as views over a kvasync allocator's virtual ranges."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..._config import Config
from ..._layout import KVLayout
from ..._sync import open_allocator_sync
from .._settings import PluginSettings
from ._engine import EngineKV, hold_null_block, register_engine, take_engine

__all__ = [
    "KVGeometry",
    "allocate_kv_cache_tensors",
    "kv_layout_for",
    "one_backing_geometry",
    "one_backing_layout",
    "per_layer_geometry",
    "rebase",
    "reserve_pages_for",
    "step_blocks",
]

logger = logging.getLogger("kvasync.vllm")

# Opening the allocator and mapping the null block's page: a driver call or two, but on a busy
# GPU in a share it may wait for budget another engine gives back.
_OPEN_TIMEOUT = 30.0


def kv_layout_for(kv_cache_config: Any) -> KVLayout:
    """The kvasync layout whose ranges are vLLM's per-layer KV tensors, byte for byte.

    vLLM 0.26 gives each attention layer one int8 tensor of ``num_blocks * page_size_bytes``,
    block ``b`` at byte ``b * page_size_bytes`` (its K and V together, in whatever order the
    attention backend reshapes them to). A kvasync layout of one buffer per layer with a block of
    exactly ``page_size_bytes`` puts kvasync block ``b`` at the same byte of each range.

    Raises:
        ValueError: a KV cache this plugin does not lay out (packed cross-layer backing, tensors
            of different sizes, several block sizes): the message names what differs.
    """
    tensors = list(kv_cache_config.kv_cache_tensors)
    num_blocks = int(kv_cache_config.num_blocks)
    if not tensors or num_blocks <= 0:
        raise ValueError("kvasync's vLLM plugin: the KV cache config has no tensors")
    if any(getattr(t, "block_stride", 0) for t in tensors):
        raise ValueError(
            "kvasync's vLLM plugin lays out one tensor per layer; this KV cache packs every "
            "layer into one backing (block_stride > 0), which it does not support yet"
        )
    sizes = {int(t.size) for t in tensors}
    if len(sizes) != 1:
        raise ValueError(
            f"kvasync's vLLM plugin needs KV tensors of one size, got sizes {sorted(sizes)} "
            "(a hybrid model with several KV cache specs)"
        )
    size = sizes.pop()
    block_sizes = {int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups}
    if len(block_sizes) != 1 or size % num_blocks:
        raise ValueError(
            f"kvasync's vLLM plugin needs one block size and tensors of whole blocks, got block "
            f"sizes {sorted(block_sizes)} and {size} bytes for {num_blocks} blocks"
        )
    block_size = block_sizes.pop()
    block_bytes = size // num_blocks
    if block_bytes % block_size:
        raise ValueError(
            f"kvasync's vLLM plugin: a block of {block_bytes} bytes is not {block_size} tokens "
            "of whole bytes"
        )
    return KVLayout(
        num_layers=len(tensors),
        num_kv_heads=1,
        head_dim=block_bytes // block_size,
        block_size=block_size,
        dtype=torch.int8,
        kv_buffers=1,
    )


@dataclass(frozen=True)
class KVGeometry:
    """kvasync's side of one vLLM KV allocation: the layout of the allocator's ranges, and what
    vLLM's allocation returns, built from views over them (``build(ranges)``: one int8 tensor of
    ``num_blocks * range_block_bytes`` per range). The worker and rank paths are written against
    this alone; each allocation shape of vLLM has its own (Note [vLLM seams])."""

    layout: KVLayout
    num_blocks: int
    build: Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]


def per_layer_geometry(
    kv_cache_config: Any,
    *,
    skip_layers: frozenset[str] = frozenset(),
    shared_layers: frozenset[str] = frozenset(),
) -> KVGeometry:
    """The per-layer shape (vLLM 0.26-0.28): an int8 tensor per layer, range ``i`` the bytes of
    ``kv_cache_tensors[i]``. Layers in ``skip_layers`` (the V1 runner's runner-only layers) and
    ``shared_layers`` (layers reading another layer's cache) get no tensor, as in vLLM.

    Raises:
        ValueError: a KV cache this plugin does not lay out (``kv_layout_for``); from ``build``,
            tensors that do not cover the attention layers.
    """
    layout = kv_layout_for(kv_cache_config)
    tensors = list(kv_cache_config.kv_cache_tensors)
    expected = {
        name
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
        if name not in skip_layers
    }

    def build(ranges: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        raw: dict[str, torch.Tensor] = {}
        for tensor, view in zip(tensors, ranges, strict=True):
            if view.numel() != int(tensor.size):  # a bug here, never a silent misfit
                raise RuntimeError(
                    f"kvasync range holds {view.numel()} bytes, vLLM expects {tensor.size}"
                )
            for layer_name in tensor.shared_by:
                raw[layer_name] = view
        if expected != set(raw) | shared_layers:
            raise ValueError(
                "kvasync's vLLM plugin: the KV tensors do not cover the attention layers "
                f"(missing {sorted(expected - set(raw))}, extra {sorted(set(raw) - expected)})"
            )
        return raw

    return KVGeometry(layout, int(kv_cache_config.num_blocks), build)


def one_backing_layout(kv_cache_config: Any) -> KVLayout:
    """The kvasync layout of the one-backing shape (vLLM 0.29-): one range, a block of
    ``block_stride`` bytes, which holds block ``b`` of every layer when the KV cache layout puts
    blocks outermost.

    Raises:
        ValueError: a layout whose layers keep their blocks in regions of their own, or tensors
            of several block strides or sizes: the message names what differs and the setting.
    """
    tensors = list(kv_cache_config.kv_cache_tensors)
    num_blocks = int(kv_cache_config.num_blocks)
    if not tensors or num_blocks <= 0:
        raise ValueError("kvasync's vLLM plugin: the KV cache config has no tensors")
    strides = {int(t.block_stride) for t in tensors}
    sizes = {int(t.size) for t in tensors}
    stride = max(strides)
    inside = all(
        int(t.offset) + (len(t.layers) - 1) * int(t.layer_stride) < int(t.block_stride)
        for t in tensors
    )
    if len(strides) != 1 or sizes != {num_blocks * stride} or not inside:
        raise ValueError(
            "kvasync's vLLM plugin maps a block of every layer as one run of bytes, and this "
            f"KV cache keeps them apart (block strides {sorted(strides)}, sizes {sorted(sizes)} "
            f"for {num_blocks} blocks, layer strides "
            f"{sorted({int(t.layer_stride) for t in tensors})}): set "
            "VLLM_KV_CACHE_LAYOUT=BLNHC (a block-outermost layout), or run without kvasync"
        )
    block_sizes = {int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups}
    block_size = min(block_sizes) if block_sizes else 1
    if stride % block_size:
        block_size = 1  # kvasync's block_size only counts tokens for the reserve's headroom
    return KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=stride // block_size,
        block_size=block_size,
        dtype=torch.int8,
        kv_buffers=1,
    )


def rebase(views: dict[str, torch.Tensor], backing: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each of ``views`` (vLLM's, over a backing of its own: here on the meta device) as the same
    view of ``backing`` (int8, contiguous): same dtype, shape, strides and storage offset, so the
    same bytes. A name whose view is another's (a shared layer) stays so."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, view in views.items():
        if id(view) in done:
            out[name] = done[id(view)]
            continue
        base = typed.get(view.dtype)
        if base is None:
            base = typed[view.dtype] = backing.view(view.dtype)
        out[name] = done[id(view)] = torch.as_strided(
            base, view.shape, view.stride(), view.storage_offset()
        )
    return out


def one_backing_geometry(
    kv_cache_config: Any,
    stock_allocate: Callable[..., dict[str, torch.Tensor]],
    layout: Any,
    kernel_block_sizes: Any,
) -> KVGeometry:
    """The one-backing shape (vLLM 0.29-): vLLM's own ``allocate_kv_cache`` runs on the meta
    device, and its views are rebased onto kvasync's one range (``rebase``), so every view has
    the shape, strides and dtype vLLM gives it.

    Raises:
        ValueError: a KV cache this plugin does not lay out (``one_backing_layout``).
    """
    kv_layout = one_backing_layout(kv_cache_config)
    size = int(kv_cache_config.kv_cache_tensors[0].size)

    def build(ranges: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        (backing,) = ranges
        if backing.numel() < size:  # a bug here, never a silent misfit
            raise RuntimeError(f"kvasync range holds {backing.numel()} bytes, vLLM needs {size}")
        meta = stock_allocate(kv_cache_config, torch.device("meta"), layout, kernel_block_sizes)
        return rebase(meta, backing[:size])

    return KVGeometry(kv_layout, int(kv_cache_config.num_blocks), build)


def step_blocks(vllm_config: Any, block_size: int) -> int:
    """The most blocks one scheduler step allocates: the longest request's, or a full batch of
    new tokens, and one more per running sequence (a partly filled block each). The reserve
    keeps that many mapped ahead (Note [Count only what is mapped] in _pool)."""
    scheduler = vllm_config.scheduler_config
    tokens = max(int(vllm_config.model_config.max_model_len), int(scheduler.max_num_batched_tokens))
    return math.ceil(tokens / block_size) + int(scheduler.max_num_seqs)


def reserve_pages_for(layout: KVLayout, page_size: int, headroom_blocks: int) -> tuple[int, int]:
    """The reserve that keeps ``headroom_blocks`` mapped ahead of the scheduler (low watermark),
    and twice that before unmapping freed pages (high), so that a step's pages are mapped before
    it asks and a burst of frees does not unmap what the next burst maps again."""
    per_page = max(1, page_size // layout.range_block_bytes)
    low = max(1, math.ceil(headroom_blocks / per_page))
    return low, 2 * low


def allocate_kv_cache_tensors(
    geometry: KVGeometry,
    *,
    device: torch.device,
    vllm_config: Any,
    settings: PluginSettings,
) -> dict[str, torch.Tensor]:
    """What vLLM's KV allocation returns (either shape, ``geometry``), over a kvasync allocator.

    The allocator reserves the virtual ranges of all ``num_blocks`` (the capacity the budget
    gave vLLM) and maps nothing but the null block's page; the scheduler's pool hands out blocks
    only on mapped pages. The allocator is registered for this process's block pool.

    Raises:
        ValueError: a KV cache this plugin does not lay out (from ``geometry.build``).
        KVAsyncError: the cuda backend cannot be used here.
    """
    from ..._backends import page_size_for

    layout = geometry.layout
    previous = take_engine()
    if previous is not None:
        # vLLM sizes a minimal KV cache to profile CUDA graphs, then the real one: the minimal
        # one's views are dropped by then, and its allocator goes with them.
        previous.allocator.close()
    # vLLM's GPU worker passes a cuda device; a CPU device (the worker-seam test) gets the host
    # backend, the same allocator over host memory.
    cuda = device.type == "cuda"
    ordinal = (
        (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0
    )
    backend = "cuda" if cuda else "host"
    headroom = step_blocks(vllm_config, layout.block_size)
    name = settings.name or f"vllm:{vllm_config.model_config.served_model_name}"
    base = Config(
        backend=backend,
        device=ordinal,
        max_blocks=geometry.num_blocks,
        memory_limit=settings.memory_limit,
        share=settings.share,
        device_budget=settings.device_budget,
        name=name,
        default_timeout=_OPEN_TIMEOUT,
    )
    page_size = layout.page_unit(page_size_for(layout, base))
    reserve = reserve_pages_for(layout, page_size, headroom)
    config = Config(
        backend=backend,
        device=ordinal,
        max_blocks=base.max_blocks,
        memory_limit=settings.memory_limit,
        share=settings.share,
        device_budget=settings.device_budget,
        name=name,
        default_timeout=_OPEN_TIMEOUT,
        reserve_pages=reserve,
        linger=settings.linger,
    )
    kv = open_allocator_sync(layout, config)
    try:
        hold_null_block(kv, _OPEN_TIMEOUT)
        kv.zero([0])  # vLLM's own tensors start as zeros; padded reads land in block 0
        raw = geometry.build([kv.layer(i)[0].view(-1) for i in range(layout.num_ranges)])
        stream_device = torch.device("cuda", ordinal)
        register_engine(
            EngineKV(
                allocator=kv,
                fence=(lambda: torch.cuda.current_stream(stream_device)) if cuda else None,
                prefix_cache_blocks=(
                    None
                    if settings.prefix_cache_bytes is None
                    else settings.prefix_cache_bytes
                    // (layout.range_block_bytes * layout.num_layers)
                ),
            )
        )
    except BaseException:
        kv.close()
        raise
    logger.info(
        "kvasync: %d KV blocks reserved (%d layers x %d bytes a block), page %d bytes a layer, "
        "reserve %s pages, share=%s, budget=%s, limit=%s, name=%s",
        config.max_blocks,
        layout.num_layers,
        layout.range_block_bytes,
        page_size,
        reserve,
        settings.share,
        settings.device_budget,
        settings.memory_limit,
        name,
    )
    return raw
