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
        page_size: the unit of mapping, in bytes, on every backend (a multiple of the driver's
            granularity on cuda, of the OS page on host).
        reserve_pages: (low, high) watermarks of mapped-free pages kept ready; (0, 0) = none.
        default_timeout: seconds a call waits when it is given no timeout or deadline.
        zero_on_alloc: hand out blocks that read as zeros.
        faults: a ``kvasync.testing.FaultInjector`` acting inside the mapper thread.
        device: CUDA device ordinal (cuda backend).
        gpu_utilization: the share of the device's memory the reserve refill may fill up to
            (cuda backend).
        share: the name of a device share (``kvasync.ledger.default_share(device)`` for the
            common case) that this allocator joins: allocators of every process on that share
            keep their mapped bytes together within ``device_budget``, see each other in
            ``kvasync top``, and take limits set with ``kvasync limit``. None: no share.
        device_budget: bytes all allocators of the share may map together (the smallest budget
            among them applies). None: on cuda, ``gpu_utilization`` of the device's memory; on
            host, no budget of this allocator's own. Needs ``share``.
        name: this allocator's name in the share's ledger; None = the program's name.

    Raises:
        ValueError: any value out of range.
    """

    backend: str = "auto"
    max_blocks: int = 4096
    memory_limit: int | None = None
    page_size: int = 2 << 20
    reserve_pages: tuple[int, int] = (1, 4)
    default_timeout: float = 5.0
    zero_on_alloc: bool = False
    faults: FaultInjector | None = None
    device: int = 0
    gpu_utilization: float = 0.95
    share: str | None = None
    device_budget: int | None = None
    name: str | None = None

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
        if type(self.page_size) is not int or self.page_size <= 0 or self.page_size % 4096:
            raise ValueError(
                f"Config.page_size must be a positive multiple of 4096, got {self.page_size!r}"
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
        self._check_share()

    def _check_share(self) -> None:
        from ._share import check_share

        if self.share is not None:
            check_share(self.share, "Config.share")
        if self.device_budget is not None:
            if type(self.device_budget) is not int or self.device_budget <= 0:
                raise ValueError(
                    f"Config.device_budget must be a positive int or None, "
                    f"got {self.device_budget!r}"
                )
            if self.share is None:
                raise ValueError("Config.device_budget needs Config.share (the share it budgets)")
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(f"Config.name must be a non-empty str or None, got {self.name!r}")
