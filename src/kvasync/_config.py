"""Config: how an allocator maps memory (backend, capacity, budget, reserve, deadlines)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .testing import FaultInjector

__all__ = ["Config"]

BACKENDS = ("auto", "host", "cuda")


@dataclass(frozen=True)
class Config:
    """Settings of one allocator.

    Args:
        backend: ``"host"`` (memfd + mmap), ``"cuda"`` (CUDA virtual memory) or ``"auto"`` (cuda
            when a driver and a GPU are there, else host).
        max_blocks: virtual capacity, in blocks. Reserving it costs address space, not memory.
        memory_limit: bytes of physical KV memory the allocator may map; None = up to capacity.
        page_size: the unit of mapping: bytes of each virtual range that one page id maps (a
            multiple of the driver's granularity on cuda, of 4096 on host). None picks it for
            the backend: on cuda one granularity page (2 MiB)
            of every layer and buffer per page id, on host 2 MiB per range.
        reserve_pages: (low, high) watermarks of mapped-free pages kept ready; (0, 0) = none.
        default_timeout: seconds a call waits when it is given no timeout or deadline.
        zero_on_alloc: hand out blocks that read as zeros.
        faults: a ``kvasync.testing.FaultInjector`` acting inside the mapper thread.
        device: CUDA device ordinal (cuda backend).
        gpu_utilization: the share of the device's memory the reserve refill may fill up to
            (cuda backend).

    Raises:
        ValueError: any value out of range.
    """

    backend: str = "auto"
    max_blocks: int = 4096
    memory_limit: int | None = None
    page_size: int | None = None
    reserve_pages: tuple[int, int] = (1, 4)
    default_timeout: float = 5.0
    zero_on_alloc: bool = False
    faults: FaultInjector | None = None
    device: int = 0
    gpu_utilization: float = 0.95

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"Config.backend must be one of {BACKENDS}, got {self.backend!r}")
        if type(self.max_blocks) is not int or self.max_blocks <= 0:
            raise ValueError(f"Config.max_blocks must be a positive int, got {self.max_blocks!r}")
        if self.memory_limit is not None and (
            type(self.memory_limit) is not int or self.memory_limit <= 0
        ):
            raise ValueError(
                f"Config.memory_limit must be a positive int or None, got {self.memory_limit!r}"
            )
        if self.page_size is not None and (
            type(self.page_size) is not int or self.page_size <= 0 or self.page_size % 4096
        ):
            raise ValueError(
                f"Config.page_size must be None or a positive multiple of 4096, "
                f"got {self.page_size!r}"
            )
        low, high = self.reserve_pages
        if not (type(low) is int and type(high) is int and 0 <= low <= high):
            raise ValueError(
                f"Config.reserve_pages must be (low, high) with 0 <= low <= high, "
                f"got {self.reserve_pages!r}"
            )
        if not (math.isfinite(self.default_timeout) and self.default_timeout > 0):
            raise ValueError(
                f"Config.default_timeout must be a finite positive number of "
                f"seconds, got {self.default_timeout!r}"
            )
        if not 0.0 < self.gpu_utilization <= 1.0:
            raise ValueError(
                f"Config.gpu_utilization must be in (0, 1], got {self.gpu_utilization!r}"
            )
