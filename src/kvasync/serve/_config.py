"""The engine's settings, and the kvasync allocator settings and view they give.

``EngineConfig`` is what ``kvasync serve`` and ``open_engine`` take; ``kv_config`` turns it into
the allocator's ``Config``; ``AllocatorView`` is what the scheduler reads of that allocator
(``KVView`` in _scheduler.py).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._allocator import Allocator
from .._config import Config
from .._errors import AllocTimeout
from .._layout import KVLayout
from ._model import ModelConfig, preset

__all__ = ["AllocatorView", "EngineConfig", "kv_config", "map_everything"]


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine.

    Args:
        preset: the model (``"tiny"`` or ``"small"``).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda when available).
        dtype: the model's and the cache's dtype; fp32 on a CPU, bf16 on a GPU when None.
        backend: the kvasync backend (``"auto"``, ``"host"``, ``"cuda"``).
        max_blocks: the KV cache's virtual capacity in blocks.
        memory_limit: bytes of KV memory it may map; None = the whole capacity.
        page_size: kvasync's unit of mapping; 64 KiB on host, 2 MiB on cuda when None.
        reserve_pages: kvasync's reserve watermarks (mapped-free pages kept ready).
        static: map the whole capacity (or memory_limit) at start and never give it back: the
            baseline of an engine without an elastic allocator.
        max_batch: requests running at once.
        max_batch_tokens: new tokens one step computes at most (prefill budget).
        alloc_timeout: how long an admission's alloc may stall the running batch, and how long a
            request waits for a block to grow into before the youngest is preempted (see Note
            [Engine scheduling]).
        share_wait: in a share, how long a request waits for a block to grow into (memory the
            other engines give back) before the youngest is preempted.
        request_timeout: a request's deadline, in seconds after submission, when it gives none.
        step_target: seconds a step may take before the engine stops admitting requests
            (compute, as memory: Note [Engine scheduling]); a fraction of the TPOT SLO, so that
            co-located engines sharing a GPU do not admit more than its compute carries. None:
            admission counts memory only.
        compute_min_batch: the step target holds admission only for a batch of at least this
            many requests (a smaller one is slow because of the other engines on the device).
        attention: ``"triton"``, ``"torch"`` or ``"auto"`` (triton on a GPU).
        share: kvasync device share to join (co-located engines); None = none.
        device_budget: bytes the share's allocators may map together.
        name: this engine's name (in the share's ledger and in metrics).

    Raises:
        ValueError: a value out of range.
    """

    preset: str = "tiny"
    device: str = "auto"
    dtype: torch.dtype | None = None
    backend: str = "auto"
    max_blocks: int = 2048
    memory_limit: int | None = None
    page_size: int | None = None
    reserve_pages: tuple[int, int] = (1, 4)
    static: bool = False
    max_batch: int = 64
    max_batch_tokens: int = 4096
    alloc_timeout: float = 0.05
    share_wait: float = 0.5
    request_timeout: float = 60.0
    step_target: float | None = None
    compute_min_batch: int = 4
    attention: str = "auto"
    share: str | None = None
    device_budget: int | None = None
    name: str = "kvasync-engine"

    def __post_init__(self) -> None:
        preset(self.preset)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"EngineConfig.device must be auto, cpu or cuda, got {self.device!r}")
        if self.attention not in ("auto", "triton", "torch"):
            raise ValueError(
                f"EngineConfig.attention must be auto, triton or torch, got {self.attention!r}"
            )
        for name in ("max_blocks", "max_batch", "max_batch_tokens", "compute_min_batch"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        for name in ("alloc_timeout", "share_wait", "request_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"EngineConfig.{name} must be positive seconds, got {value!r}")
        target = self.step_target
        if target is not None and not (
            isinstance(target, (int, float)) and math.isfinite(target) and target > 0
        ):
            raise ValueError(
                f"EngineConfig.step_target must be positive seconds or None, got {target!r}"
            )

    @property
    def model(self) -> ModelConfig:
        """The model's shape."""
        return preset(self.preset)

    def resolved_device(self) -> torch.device:
        """The torch device the model runs on."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def kv_config(config: EngineConfig, layout: KVLayout, device: torch.device) -> Config:
    backend = config.backend
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" else "host"
    page_size = config.page_size or ((2 << 20) if backend == "cuda" else (64 << 10))
    extra: dict[str, Any] = {}
    if config.share is not None:  # co-location (Config.share / device_budget)
        extra = {"share": config.share, "device_budget": config.device_budget, "name": config.name}
    kv_config = Config(
        backend=backend,
        max_blocks=config.max_blocks,
        memory_limit=config.memory_limit,
        page_size=page_size,
        reserve_pages=config.reserve_pages,
        default_timeout=max(5.0, config.alloc_timeout),
        device=(device.index or 0) if device.type == "cuda" else 0,
        **extra,
    )
    if config.static:
        # Map everything the engine may use, up front, and keep it: the reserve's watermarks at
        # the whole budget (so nothing is ever unmapped).
        per_page = layout.blocks_per_page(page_size)
        pages = -(-config.max_blocks // per_page)
        if config.memory_limit is not None:
            pages = min(pages, config.memory_limit // (page_size * layout.num_ranges))
        kv_config = replace(kv_config, reserve_pages=(pages, pages))
    return kv_config


class AllocatorView:
    """The scheduler's view of an engine's allocator (``KVView``).

    ``capacity_blocks`` is the most blocks the cache can ever hold at once: the pool's memory
    limit (its capacity when unlimited; a resize moves it), and in a share the least of the
    capacity, the configured limit and the share's budget. A share's pool limit is not used:
    it is lowered to the fair share while another member waits, which is temporary.
    """

    def __init__(self, kv: Allocator, config: EngineConfig) -> None:
        self._kv = kv
        self._share_bound: int | None = None
        if config.share is not None:
            page_bytes = kv.page_size * kv.layout.num_ranges
            # A page holds at most this many whole blocks (some lie across page boundaries).
            per_page = kv.page_size // kv.layout.range_block_bytes
            budgets = [b for b in (config.memory_limit, config.device_budget) if b is not None]
            bound = kv.num_blocks - kv.stats().unusable_blocks
            for budget in budgets:
                bound = min(bound, (budget // page_bytes) * per_page)
            self._share_bound = bound

    def available_blocks(self) -> int:
        return self._kv.available_blocks()

    def drain_from(self) -> int | None:
        return self._kv.drain_from()

    def set_demand(self, blocks: int) -> None:
        self._kv.set_demand(blocks)

    def capacity_blocks(self) -> int:
        if self._share_bound is not None:
            return self._share_bound
        return self._kv.stats().memory_limit_blocks


async def map_everything(kv: Allocator, timeout: float = 60.0) -> None:
    """Waits (at most ``timeout``) until a static engine's reserve holds its whole budget."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    target = kv.config.reserve_pages[0]
    while kv.stats().mapped_pages < target:
        if loop.time() > deadline:
            raise AllocTimeout(
                f"the static KV pool mapped {kv.stats().mapped_pages} of {target} pages in "
                f"{timeout} s"
            )
        await asyncio.sleep(0.005)
