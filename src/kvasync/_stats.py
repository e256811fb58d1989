"""AllocatorStats: a consistent snapshot of an allocator's state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["AllocatorStats", "percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated linearly (numpy's default).

    The one definition of a percentile in kvasync: the serving report, the simulation and the
    benchmarks all use it, so their p50 and p99 mean the same thing.

    Args:
        values: the samples, in any order.
        q: the percentile, from 0 to 100.

    Returns:
        The percentile, or NaN when there are no samples.

    Raises:
        ValueError: ``q`` is outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    return float(np.percentile(values, q)) if len(values) else float("nan")


@dataclass(frozen=True)
class AllocatorStats:
    """One snapshot, taken under the pool's lock (so the counts agree with each other).

    Pages are page ids: one page id is ``page_size`` bytes in every virtual range.
    ``inflight_pages`` are the pages the mapper owns right now (mapping + unmapping); they are
    never counted as free or as missing. ``mapper_batches`` counts the backend batches the mapper
    ran: the maps queued by many requests at once go to the backend together. ``mapper_op`` names
    the backend call the mapper is inside (None when idle) and ``mapper_op_age`` how long it has
    been there: a stuck driver shows here. ``unusable_blocks`` are the block ids that lie across a
    page boundary (Note [Blocks across page boundaries] in _layout.py): never handed out, they
    are the capacity the geometry loses, ``unusable_bytes`` of it across all ranges.
    ``memory_limit_blocks`` is what the memory limit promises: any alloc up to it is served.
    ``last_error`` is the backend's last error (a failed map or unmap), or its last warning: a
    tensor-parallel rank that kept pages the others unmapped (the unmap went through here).
    """

    num_blocks: int
    used_blocks: int
    free_blocks: int
    mapped_pages: int
    reserve_pages: int
    inflight_pages: int
    mapping_pages: int
    unmapping_pages: int
    waiters: int
    queued_jobs: int
    mapper_batches: int
    maps_done: int
    unmaps_done: int
    map_errors: int
    dropped_jobs: int
    timeouts: int
    memory_limit_pages: int
    page_bytes: int
    mapper_op: str | None
    mapper_op_age: float
    last_error: str
    unusable_blocks: int = 0
    unusable_bytes: int = 0
    memory_limit_blocks: int = 0

    @property
    def mapped_bytes(self) -> int:
        """Physical memory mapped now, in bytes."""
        return self.mapped_pages * self.page_bytes

    @classmethod
    def from_core(
        cls, raw: dict[str, Any], page_bytes: int, block_bytes: int = 0
    ) -> AllocatorStats:
        """Builds a snapshot from ``_core.PagePool.stats()``; ``block_bytes`` is one block's
        bytes across all ranges."""
        return cls(
            num_blocks=raw["num_blocks"],
            used_blocks=raw["used_blocks"],
            free_blocks=raw["free_blocks"],
            mapped_pages=raw["mapped_pages"],
            reserve_pages=raw["reserve_pages"],
            inflight_pages=raw["mapping_pages"] + raw["unmapping_pages"],
            mapping_pages=raw["mapping_pages"],
            unmapping_pages=raw["unmapping_pages"],
            waiters=raw["waiters"],
            queued_jobs=raw["queued_jobs"],
            mapper_batches=raw["mapper_batches"],
            maps_done=raw["maps_done"],
            unmaps_done=raw["unmaps_done"],
            map_errors=raw["map_errors"],
            dropped_jobs=raw["dropped_jobs"],
            timeouts=raw["timeouts"],
            memory_limit_pages=raw["limit_pages"],
            page_bytes=page_bytes,
            mapper_op=raw["mapper_op"],
            mapper_op_age=raw["mapper_op_age_s"],
            last_error=raw["last_error"],
            unusable_blocks=raw["unusable_blocks"],
            unusable_bytes=raw["unusable_blocks"] * block_bytes,
            memory_limit_blocks=raw["limit_blocks"],
        )
