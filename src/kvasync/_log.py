"""Logging under the ``kvasync`` logger: one line at open, a warning when the mapper stalls.

Nothing is logged per allocation at INFO or above: an alloc is a microsecond-scale hot path, and
a serving engine makes thousands a second.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from ._config import Config
from ._layout import KVLayout
from ._stats import AllocatorStats

__all__ = ["OpenedAllocator", "StallWatch", "log_open", "logger"]

logger = logging.getLogger("kvasync")


def _mib(size: float) -> str:
    return f"{size / (1 << 20):g} MiB"


class OpenedAllocator(Protocol):
    """What the open line reads of an allocator (an ``Allocator``, without importing it)."""

    @property
    def layout(self) -> KVLayout: ...

    @property
    def config(self) -> Config: ...

    @property
    def backend(self) -> str: ...

    def stats(self) -> AllocatorStats: ...


def log_open(allocator: OpenedAllocator) -> None:
    """The INFO line of an open: layout, backend, page size, capacity, limits, and the capacity
    a geometry loses to blocks across page boundaries (Note [Blocks and pages])."""
    if not logger.isEnabledFor(logging.INFO):
        return
    layout, config, stats = allocator.layout, allocator.config, allocator.stats()
    limit = "none" if config.memory_limit is None else _mib(config.memory_limit)
    low, high = config.reserve_pages
    usable = stats.num_blocks - stats.unusable_blocks
    logger.info(
        "kvasync: opened a %s allocator: %d layers x %d buffer(s), %d tokens/block, %d kv heads "
        "x %d, %s, %s layout; page %s x %d range(s); capacity %d blocks; %d block id(s) across "
        "page boundaries never used (%s, %.2f%%); memory limit %s; reserve %d..%d pages; "
        "default timeout %g s",
        allocator.backend,
        layout.num_layers,
        layout.kv_buffers,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
        str(layout.dtype).removeprefix("torch."),
        "contiguous" if layout.contiguous else "per-layer",
        _mib(stats.page_bytes // layout.num_ranges),
        layout.num_ranges,
        usable,
        stats.unusable_blocks,
        _mib(stats.unusable_bytes),
        100.0 * stats.unusable_blocks / stats.num_blocks,
        limit,
        low,
        high,
        config.default_timeout,
    )


class StallWatch:
    """Warns once per mapper op that runs past ``threshold`` seconds.

    Fed the pool's raw stats by a timer of the allocator's loop (or its trio drain task), so it
    adds no wait of its own; an op is known by its start time, so a long one warns once.
    """

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self._warned_start: float | None = None

    def check(self, raw: dict[str, Any]) -> None:
        op, age = raw["mapper_op"], float(raw["mapper_op_age_s"])
        if op is None or age < self.threshold:
            return
        started = time.monotonic() - age
        if self._warned_start is not None and abs(started - self._warned_start) < 0.01:
            return
        self._warned_start = started
        logger.warning(
            "kvasync: the mapper has been inside %s for %.3f s (stall threshold %g s); "
            "%d request(s) waiting, %d page(s) mapping, %d unmapping",
            op,
            age,
            self.threshold,
            raw["waiters"],
            raw["mapping_pages"],
            raw["unmapping_pages"],
        )
