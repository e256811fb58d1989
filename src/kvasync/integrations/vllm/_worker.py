"""The worker side: vLLM's KV cache tensors as views over a kvasync allocator's virtual ranges."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ..._config import Config
from ..._layout import KVLayout
from ..._sync import open_allocator_sync
from ._engine import EngineKV, hold_null_block, register_engine, take_engine
from ._settings import PluginSettings

__all__ = ["allocate_kv_cache_tensors", "kv_layout_for", "reserve_pages_for", "step_blocks"]

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
    kv_cache_config: Any,
    *,
    device: torch.device,
    vllm_config: Any,
    settings: PluginSettings,
    skip_layers: frozenset[str] = frozenset(),
    shared_layers: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """What vLLM's KV allocation returns (``GPUModelRunner._allocate_kv_cache_tensors`` in the
    V1 runner, ``gpu.attn_utils._allocate_kv_cache`` in the V2 one), over a kvasync allocator.

    The allocator reserves the virtual ranges of all ``num_blocks`` (the capacity the budget
    gave vLLM) and maps nothing but the null block's page; the scheduler's pool hands out blocks
    only on mapped pages. The allocator is registered for this process's block pool. Layers in
    ``skip_layers`` (the V1 runner's runner-only layers) and ``shared_layers`` (layers reading
    another layer's cache) get no tensor, as in vLLM.

    Raises:
        ValueError: a KV cache this plugin does not lay out (``kv_layout_for``).
        KVAsyncError: the cuda backend cannot be used here.
    """
    from ..._backends import page_size_for

    layout = kv_layout_for(kv_cache_config)
    previous = take_engine()
    if previous is not None:
        # vLLM sizes a minimal KV cache to profile CUDA graphs, then the real one: the minimal
        # one's views are dropped by then, and its allocator goes with them.
        previous.allocator.close()
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    headroom = step_blocks(vllm_config, layout.block_size)
    name = settings.name or f"vllm:{vllm_config.model_config.served_model_name}"
    base = Config(
        backend="cuda",
        device=ordinal,
        max_blocks=int(kv_cache_config.num_blocks),
        memory_limit=settings.memory_limit,
        share=settings.share,
        device_budget=settings.device_budget,
        name=name,
        default_timeout=_OPEN_TIMEOUT,
    )
    page_size = layout.page_unit(page_size_for(layout, base))
    reserve = reserve_pages_for(layout, page_size, headroom)
    config = Config(
        backend="cuda",
        device=ordinal,
        max_blocks=base.max_blocks,
        memory_limit=settings.memory_limit,
        share=settings.share,
        device_budget=settings.device_budget,
        name=name,
        default_timeout=_OPEN_TIMEOUT,
        reserve_pages=reserve,
    )
    kv = open_allocator_sync(layout, config)
    try:
        hold_null_block(kv, _OPEN_TIMEOUT)
        kv.zero([0])  # vLLM's own tensors start as zeros; padded reads land in block 0
        raw: dict[str, torch.Tensor] = {}
        for index, tensor in enumerate(kv_cache_config.kv_cache_tensors):
            view = kv.layer(index)[0].view(-1)
            if view.numel() != int(tensor.size):  # a bug here, never a silent misfit
                raise RuntimeError(
                    f"kvasync range {index} holds {view.numel()} bytes, vLLM expects {tensor.size}"
                )
            for layer_name in tensor.shared_by:
                raw[layer_name] = view
        expected = {
            name
            for group in kv_cache_config.kv_cache_groups
            for name in group.layer_names
            if name not in skip_layers
        }
        if expected != set(raw) | shared_layers:
            raise ValueError(
                "kvasync's vLLM plugin: the KV tensors do not cover the attention layers "
                f"(missing {sorted(expected - set(raw))}, extra {sorted(set(raw) - expected)})"
            )
        stream_device = torch.device("cuda", ordinal)
        register_engine(
            EngineKV(
                allocator=kv,
                fence=lambda: torch.cuda.current_stream(stream_device),
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
