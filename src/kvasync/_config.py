"""Config: how an allocator maps memory (backend, capacity, budget, reserve, deadlines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import _validate
from ._share_names import check_share

if TYPE_CHECKING:
    from ._group import TensorParallel
    from .testing import FaultInjector

__all__ = ["Config"]

BACKENDS = ("auto", "host", "cuda")


@dataclass(frozen=True)
class Config:
    """Settings of one allocator.

    Args:
        backend: ``"host"`` (memfd + mmap), ``"cuda"`` (CUDA virtual memory) or ``"auto"`` (cuda
            when a driver and a GPU are there, else host).
        max_blocks: virtual capacity, in blocks. Reserving it costs address space, not KV
            memory; the pool's bookkeeping costs about 1 byte of host RAM per block and 65 per
            page, and is bounded at 256 MiB (a larger capacity is refused with ValueError at
            open: lower max_blocks or raise page_size).
        memory_limit: bytes of physical KV memory the allocator may map; None = up to capacity.
        page_size: the unit of mapping: bytes of each virtual range that one page id maps (a
            multiple of the driver's granularity on cuda, of 4096 on host). None picks it for
            the backend: on cuda one granularity page (2 MiB) of every layer and buffer per page
            id, on host 2 MiB per range. It need not be a multiple of the block: a block id
            across a page boundary is never handed out, and where that would lose more than 1/32
            of it, a page maps the smallest multiple of page_size that loses less
            (``KVLayout.page_unit``; Note [Blocks across page boundaries]).
        reserve_pages: (low, high) watermarks of mapped-free pages kept ready; (0, 0) = none.
        linger: seconds the pages in use at a recent peak stay mapped after use falls, so that
            a load in bursts with short gaps does not map again at each burst what it gave back
            at the gap (Note [Limit policy], the linger); 0 = none: the reserve goes down to its
            high watermark at once. Nothing lingers under a share's pressure, over a lowered
            limit, or through ``trim()``.
        default_timeout: seconds a call waits when it is given no timeout or deadline.
        zero_on_alloc: hand out blocks that read as zeros.
        faults: a ``kvasync.testing.FaultInjector`` acting inside the mapper thread.
        device: CUDA device ordinal (cuda backend).
        gpu_utilization: the share of the device's memory the reserve refill may fill up to
            (cuda backend).
        stall_warning: seconds a mapper op may run before the ``kvasync`` logger warns of it.
        share: the name of a device share (``kvasync.share.default_share(device)`` for the
            common case) that this allocator joins: allocators of every process on that share
            keep their mapped bytes together within ``device_budget``, see each other in
            ``kvasync top``, and take limits set with ``kvasync limit``. None: no share.
        device_budget: bytes all allocators of the share may map together (the smallest budget
            among them applies). None: on cuda, ``gpu_utilization`` of the device's memory; on
            host, no budget of this allocator's own. Needs ``share``.
        name: this allocator's name in the share's ledger; None = the program's name.
        tensor_parallel: a ``kvasync._group.TensorParallel``: this allocator is the scheduler
            of a tensor-parallel group, and every page is mapped on each rank too. None: no
            group.

    Raises:
        TypeError: a value of the wrong type (a bool is not a number here).
        ValueError: a value out of range.
    """

    backend: str = "auto"
    max_blocks: int = 4096
    memory_limit: int | None = None
    page_size: int | None = None
    reserve_pages: tuple[int, int] = (1, 4)
    linger: float = 0.0
    default_timeout: float = 5.0
    zero_on_alloc: bool = False
    faults: FaultInjector | None = None
    device: int = 0
    gpu_utilization: float = 0.95
    stall_warning: float = 1.0
    share: str | None = None
    device_budget: int | None = None
    name: str | None = None
    tensor_parallel: TensorParallel | None = None

    def __post_init__(self) -> None:
        # Note [Argument errors] in _validate.py: a wrong type is a TypeError, a wrong value a
        # ValueError, each naming the field. Numbers are stored as plain int/float (a numpy
        # integer or a 0-d tensor passes the check, and must not travel further as itself).
        from . import _group, testing

        def store(name: str, value: object) -> None:
            object.__setattr__(self, name, value)  # a frozen dataclass, still being built

        if not isinstance(self.backend, str):
            raise TypeError(
                f"Config.backend must be a str, one of {BACKENDS}, got "
                f"{_validate.type_name(self.backend)} ({self.backend!r})"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"Config.backend must be one of {BACKENDS}, got {self.backend!r}")
        store("max_blocks", _validate.integer(self.max_blocks, "Config.max_blocks", minimum=1))
        if self.memory_limit is not None:
            store(
                "memory_limit",
                _validate.integer(self.memory_limit, "Config.memory_limit", minimum=1),
            )
        if self.page_size is not None:
            store("page_size", _validate.integer(self.page_size, "Config.page_size", minimum=1))
        if self.page_size is not None and self.page_size % 4096:
            raise ValueError(
                f"Config.page_size must be None or a positive multiple of 4096, "
                f"got {self.page_size!r}"
            )
        store("reserve_pages", self._check_reserve_pages())
        linger = _validate.seconds(self.linger, "Config.linger")
        if linger > 86400.0:
            raise ValueError(f"Config.linger must be at most 86400 seconds, got {self.linger!r}")
        store("linger", linger)
        timeout = _validate.seconds(self.default_timeout, "Config.default_timeout", positive=True)
        store("default_timeout", timeout)
        stall = _validate.seconds(self.stall_warning, "Config.stall_warning", positive=True)
        store("stall_warning", stall)
        _validate.flag(self.zero_on_alloc, "Config.zero_on_alloc")
        _validate.instance(self.faults, "Config.faults", testing.FaultInjector, optional=True)
        _validate.instance(
            self.tensor_parallel, "Config.tensor_parallel", _group.TensorParallel, optional=True
        )
        if self.zero_on_alloc and self.tensor_parallel and not self.tensor_parallel.map_local:
            raise ValueError(
                "Config.zero_on_alloc needs KV memory in this process; with "
                "TensorParallel(map_local=False) it holds none: zero the blocks on the ranks"
            )
        # The ordinal goes to the driver as a C int.
        store(
            "device", _validate.integer(self.device, "Config.device", minimum=0, maximum=2**31 - 1)
        )
        utilization = _validate.number(self.gpu_utilization, "Config.gpu_utilization")
        if not 0.0 < utilization <= 1.0:
            raise ValueError(
                f"Config.gpu_utilization must be in (0, 1], got {self.gpu_utilization!r}"
            )
        store("gpu_utilization", utilization)
        self._check_share()

    def _check_share(self) -> None:
        if self.share is not None:
            check_share(self.share, "Config.share")
        if self.device_budget is not None:
            budget = _validate.integer(self.device_budget, "Config.device_budget", minimum=1)
            object.__setattr__(self, "device_budget", budget)
            if self.share is None:
                raise ValueError("Config.device_budget needs Config.share (the share it budgets)")
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(
                f"Config.name must be a non-empty str or None, got "
                f"{_validate.type_name(self.name)} ({self.name!r})"
            )
        if self.name is not None and not self.name:
            raise ValueError(f"Config.name must be a non-empty str or None, got {self.name!r}")

    def _check_reserve_pages(self) -> tuple[int, int]:
        pair = self.reserve_pages
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"Config.reserve_pages must be a (low, high) tuple, got {pair!r}")
        low = _validate.integer(pair[0], "Config.reserve_pages[0] (low)", minimum=0)
        high = _validate.integer(pair[1], "Config.reserve_pages[1] (high)", minimum=0)
        if low > high:
            raise ValueError(
                f"Config.reserve_pages must be (low, high) with 0 <= low <= high, got {pair!r}"
            )
        return low, high
