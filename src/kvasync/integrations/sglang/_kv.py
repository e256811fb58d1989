"""The KV memory: SGLang's per-layer K and V buffers (MHA), or its per-layer latent buffer
(MLA), as views over a kvasync allocator's ranges.

Note [SGLang's KV buffers over kvasync]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
SGLang's ``MHATokenToKVPool`` (NHD layout) keeps, per layer, a K and a V tensor of
``[size + page_size, head_num, head_dim]``: token slot ``s`` is row ``s``, and page ``p`` (the
unit its paged allocator hands out) is rows ``[p * page_size, (p + 1) * page_size)``. Page 0 is
the padded page: SGLang never hands it out, and its dummy (padded) tokens write their KV there.

kvasync's per-layer layout with ``block_size = page_size`` has one range per (layer, K/V), block
``b`` at ``b * page_size`` rows of ``[head_num, head_dim]``: the same bytes. So
``kv.layer(i)[0].view(-1, head_num, head_dim)`` is layer ``i``'s K buffer, row for row, SGLang
page ``p`` is kvasync block ``p``, and the attention kernels run unchanged. Block 0 is allocated
at open and held for the engine's life (zeroed, as SGLang's ``torch.zeros`` buffers start), so
its page is always mapped. Beyond it the allocator maps only its reserve (a scheduler step's
pages, mapped ahead by the mapper thread; within the limit) and what SGLang allocates.

SGLang's ``MLATokenToKVPool`` keeps, per layer, one latent tensor ``kv_buffer[i]`` of
``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]`` (``get_key_buffer`` is all of it,
``get_value_buffer`` its first ``kv_lora_rank`` columns, a view), with the same slots, pages and
padded page 0. It is kvasync's per-layer layout with ``kv_buffers=1``, one head of
``kv_lora_rank + qk_rope_head_dim``: one range per layer, ``kv.layer(i)[0].view(-1, 1, row)``,
the plugin's hook replacing ``_create_buffers`` (only for ``MLATokenToKVPool`` itself: DSA's
subclass inherits it and keeps SGLang's buffers, and is refused). SGLang takes ``data_ptrs``
(what the attention backends and CUDA graphs read) after the buffers are made, so they point
into the ranges. A page of MLA rows (18 KiB for DeepSeek-V2's 576 bf16 columns, 16 tokens) does
not divide kvasync's 2 MiB pages: the block ids that straddle a boundary are never handed out
(Note [Blocks across page boundaries] in _layout: 1 block in 128 here, 1 in 32 at 64 tokens a
page), and ``available_size()`` never counts them: SGLang's total (``max_total_num_tokens``) is
that much above what kvasync can ever hand out, and its own bookkeeping (the idle check) counts
its total.

Capacity is the virtual range kvasync reserves for ``size`` tokens: SGLang's configurator sizes
``size`` from ``_profile_available_bytes``, which the plugin answers with kvasync's limit
(``KVASYNC_MEMORY_LIMIT``, else ``KVASYNC_DEVICE_BUDGET``) less one SGLang page of tokens (page
0), in SGLang's own bytes a token (its configurator's cell size: K and V of every KV head, or
MLA's one latent row, a layer), not with a profile of the device's free memory: a start never
fails, nor sizes itself wrong, because a neighbour allocated or freed memory meanwhile.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._config import Config
from ..._layout import KVLayout
from ..._sync import SyncAllocator, open_allocator_sync
from .._settings import PluginSettings
from ..vllm._engine import hold_null_block
from ..vllm._worker import reserve_pages_for
from ._seams import UnsupportedSGLang

__all__ = [
    "HOST_POOL",
    "EngineKV",
    "attach",
    "capacity_bytes",
    "detach",
    "engine_of",
    "is_mla",
    "kv_layout",
    "open_bookkeeping_engine",
    "open_kv_buffers",
]

logger = logging.getLogger("kvasync.sglang")

# Opening the allocator and mapping page 0: a driver call or two, but in a share it may wait for
# budget another engine gives back.
_OPEN_TIMEOUT = 30.0
# The tokens one scheduler step allocates at most, for the reserve the mapper keeps mapped ahead:
# SGLang's default chunked prefill on a large GPU (--chunked-prefill-size 8192), plus one page per
# running request of a full decode batch.
_STEP_TOKENS = 8192
_STEP_REQUESTS = 256
HOST_POOL = "KVASYNC_SGLANG_HOST_POOL"
# The attribute of SGLang's KV pool that holds its EngineKV (set by the plugin's buffer hook).
_POOL_ENGINE = "kvasync_engine"


@dataclass
class EngineKV:
    """The kvasync allocator behind one SGLang KV pool, and what the token allocator needs.

    Args:
        allocator: the pool's allocator; SGLang page ``p`` is kvasync block ``p``.
        fence: what a free waits for before its pages may be unmapped (the CUDA stream the
            scheduler's forward passes run on), or None on the host backend.
        settings: the environment's settings.
        page_tokens: SGLang's page size (tokens a block).
    """

    allocator: SyncAllocator
    fence: Any
    settings: PluginSettings
    page_tokens: int
    closed: bool = field(default=False)

    def fence_now(self) -> object:
        return None if self.fence is None else self.fence()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.allocator.close()


def attach(pool: Any, engine: EngineKV) -> None:
    """Records ``engine`` as the allocator behind SGLang's KV ``pool``."""
    setattr(pool, _POOL_ENGINE, engine)


def engine_of(pool: Any) -> EngineKV | None:
    """The allocator behind SGLang's KV ``pool``, or None (a pool the plugin did not open)."""
    engine = getattr(pool, _POOL_ENGINE, None)
    return engine if isinstance(engine, EngineKV) else None


def detach(pool: Any) -> EngineKV | None:
    """``engine_of(pool)``, no longer recorded on the pool."""
    engine = engine_of(pool)
    if engine is not None:
        delattr(pool, _POOL_ENGINE)
    return engine


def is_mla(pool: Any) -> bool:
    """Whether ``pool`` is shaped as SGLang's ``MLATokenToKVPool`` (one latent buffer a layer,
    ``kv_buffer``) rather than ``MHATokenToKVPool`` (``k_buffer`` and ``v_buffer``)."""
    return hasattr(pool, "kv_lora_rank") and hasattr(pool, "kv_cache_dim")


def kv_layout(pool: Any) -> KVLayout:
    """The kvasync layout whose ranges are ``pool``'s buffers, byte for byte: K and V a layer
    (MHA), or the one latent buffer a layer (MLA, ``kv_buffers=1``).

    Raises:
        UnsupportedSGLang: a pool this plugin does not lay out (HND or ROCm's 5-D layout, K and
            V of different head sizes, DSA's latent buffer with its scales, a page of one
            token), the message naming what differs.
    """
    if is_mla(pool):
        return _mla_layout(pool)
    if getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        raise UnsupportedSGLang(
            f"kvasync's SGLang plugin lays out SGLang's NHD KV pool, not {pool.kv_cache_layout!r} "
            "(unset SGLANG_USE_HND_KVCACHE)"
        )
    if pool.v_head_dim != pool.head_dim:
        raise UnsupportedSGLang(
            f"kvasync's SGLang plugin needs K and V heads of one size, got {pool.head_dim} and "
            f"{pool.v_head_dim}"
        )
    return KVLayout(
        num_layers=int(pool.layer_num),
        num_kv_heads=int(pool.head_num),
        head_dim=int(pool.head_dim),
        block_size=_whole_pages(pool),
        dtype=_range_dtype(pool),
        kv_buffers=2,
    )


def _mla_layout(pool: Any) -> KVLayout:
    # Note [SGLang's KV buffers over kvasync]: a layer's latent buffer is one range.
    if getattr(pool, "use_dsa", False):
        raise UnsupportedSGLang(
            "kvasync's SGLang plugin does not lay out DSA's MLA pool (its indexer cache and "
            "fp8 latent rows with scales)"
        )
    width = int(pool.kv_lora_rank) + int(pool.qk_rope_head_dim)
    if int(pool.kv_cache_dim) != width:
        raise UnsupportedSGLang(
            f"kvasync's SGLang plugin lays out MLA rows of kv_lora_rank + qk_rope_head_dim = "
            f"{width} elements, got {pool.kv_cache_dim}"
        )
    return KVLayout(
        num_layers=int(pool.layer_num),
        num_kv_heads=1,
        head_dim=width,
        block_size=_whole_pages(pool),
        dtype=_range_dtype(pool),
        kv_buffers=1,
    )


def _whole_pages(pool: Any) -> int:
    page = int(pool.page_size)
    if page < 2:
        raise UnsupportedSGLang(
            "kvasync's SGLang plugin maps KV memory a page of tokens at a time: run SGLang with "
            "--page-size 16 (or another size above 1); SGLang's default of 1 token a page would "
            "make every token its own block"
        )
    if pool.size % page:
        raise UnsupportedSGLang(
            f"kvasync's SGLang plugin needs a pool of whole pages, got {pool.size} tokens for a "
            f"page of {page}"
        )
    return page


def _range_dtype(pool: Any) -> torch.dtype:
    store = pool.store_dtype
    # fp8 KV is stored as uint8 by SGLang (index_put has no fp8 kernel); kvasync's int8 range
    # holds the same bytes.
    return torch.int8 if store == torch.uint8 else store


def _config(settings: PluginSettings, backend: str, ordinal: int, num_blocks: int) -> Config:
    return Config(
        backend=backend,
        device=ordinal,
        max_blocks=num_blocks,
        memory_limit=settings.memory_limit,
        share=settings.share,
        device_budget=settings.device_budget,
        name=settings.name or "sglang",
        default_timeout=_OPEN_TIMEOUT,
    )


def capacity_bytes(settings: PluginSettings, configurator: Any) -> int:
    """The KV bytes to give SGLang's configurator: kvasync's limit, else the share's budget, less
    one page of tokens: page 0 (SGLang's padded page, which its count leaves out) is kvasync's
    block 0 and counts against the limit, so SGLang's token count is what kvasync can hand out.

    Raises:
        ValueError: neither is set (the message names the variables).
    """
    import importlib

    total = settings.capacity_bytes
    model = configurator.model_config
    if getattr(configurator, "use_mla_backend", False):
        # One latent row a token a layer, as SGLang's MLATokenToKVPool and its configurator's
        # cell size count it (a DSA model's pool is refused when the allocator is built).
        elements = int(model.kv_lora_rank) + int(model.qk_rope_head_dim)
    else:
        parallel = importlib.import_module(type(configurator).__module__).get_parallel()
        heads = int(model.get_num_kv_heads(parallel.attn_tp_size))
        elements = heads * (int(model.head_dim) + int(model.v_head_dim or model.head_dim))
    itemsize = torch.empty((), dtype=configurator.kv_cache_dtype).element_size()
    token = int(configurator.layer_info.num_effective_layers) * elements * itemsize
    page = int(configurator.server_args.page_size or 1)
    return max(0, total - page * token)


def open_kv_buffers(pool: Any, settings: PluginSettings) -> EngineKV:
    """Opens the allocator behind ``pool`` and sets its ``k_buffer``/``v_buffer`` (MHA) or its
    ``kv_buffer`` (MLA) to views over the allocator's ranges (Note [SGLang's KV buffers over
    kvasync]).

    Raises:
        UnsupportedSGLang: a pool this plugin does not lay out.
        KVAsyncError: the backend cannot be used here, or page 0 could not be mapped.
    """
    layout = kv_layout(pool)
    device = torch.device(pool.device)
    cuda = device.type == "cuda"
    ordinal = (
        (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0
    )
    backend = "cuda" if cuda else "host"
    num_blocks = pool.size // layout.block_size + 1  # + page 0, the padded page
    base = _config(settings, backend, ordinal, num_blocks)
    from ..._backends import page_size_for

    page_bytes = layout.page_unit(page_size_for(layout, base))
    headroom = math.ceil(_STEP_TOKENS / layout.block_size) + _STEP_REQUESTS
    config = Config(
        backend=base.backend,
        device=base.device,
        max_blocks=base.max_blocks,
        memory_limit=base.memory_limit,
        share=base.share,
        device_budget=base.device_budget,
        name=base.name,
        default_timeout=base.default_timeout,
        reserve_pages=reserve_pages_for(layout, page_bytes, headroom),
        linger=settings.linger,
    )
    kv = open_allocator_sync(layout, config)
    try:
        hold_null_block(kv, _OPEN_TIMEOUT)
        kv.zero([0])  # SGLang's buffers start as zeros; padded tokens write and read page 0
        view_dtype = pool.store_dtype
        rows = num_blocks * layout.block_size
        views = [
            [
                buffer.view(view_dtype).view(rows, layout.num_kv_heads, -1)
                for buffer in kv.layer(index)
            ]
            for index in range(layout.num_layers)
        ]
        if layout.kv_buffers == 1:
            pool.kv_buffer = [latent for (latent,) in views]
        else:
            pool.k_buffer = [k for k, _ in views]
            pool.v_buffer = [v for _, v in views]
    except BaseException:
        kv.close()
        raise
    fence = (lambda: torch.cuda.current_stream(device)) if cuda else None
    engine = EngineKV(allocator=kv, fence=fence, settings=settings, page_tokens=layout.block_size)
    logger.info(
        "kvasync: SGLang %s KV pool of %d pages of %d tokens reserved (%d layers, %d bytes a "
        "block), page 0 mapped; share=%s budget=%s limit=%s name=%s",
        "MLA" if layout.kv_buffers == 1 else "MHA",
        num_blocks,
        layout.block_size,
        layout.num_layers,
        layout.block_bytes,
        settings.share,
        settings.device_budget,
        settings.memory_limit,
        config.name,
    )
    return engine


def open_bookkeeping_engine(size: int, page_size: int) -> EngineKV:
    """A host allocator that only keeps page ids, for an allocator built over a pool that is not
    kvasync's: SGLang's own unit tests do that, and run with ``KVASYNC_SGLANG_HOST_POOL=1``.

    Raises:
        TypeError: the variable is not set (a real engine's pool is always kvasync's: an
            allocator over another is a bug, and would hand out pages nothing maps).
    """
    import os

    from .._settings import SGLANG_ENABLE, read_settings

    if os.environ.get(HOST_POOL) != "1":
        raise TypeError(
            "kvasync's SGLang allocator needs a KV pool opened over kvasync (or "
            f"{HOST_POOL}=1, for SGLang's own unit tests)"
        )
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=page_size)
    settings = read_settings(switch=SGLANG_ENABLE)
    config = Config(backend="host", max_blocks=size // page_size + 1, default_timeout=_OPEN_TIMEOUT)
    kv = open_allocator_sync(layout, config)
    try:
        hold_null_block(kv, _OPEN_TIMEOUT)
    except BaseException:
        kv.close()
        raise
    return EngineKV(allocator=kv, fence=None, settings=settings, page_tokens=page_size)
