"""Choosing and building the virtual-memory backend, and torch views over its ranges."""

from __future__ import annotations

import numpy as np
import torch

from . import _core, _cuda
from ._config import Config
from ._errors import KVAsyncError
from ._layout import KVLayout

__all__ = ["buffer_views", "create_backend", "make_fence", "range_tensor", "resolve_backend"]


def cuda_driver_error(device: int = 0) -> str | None:
    """Why the cuda backend cannot be used on ``device`` here, or None when it can."""
    return _cuda.driver_problem(device)


def resolve_backend(config: Config) -> str:
    """The backend ``config`` asks for: "auto" becomes cuda when usable, else host.

    Raises:
        KVAsyncError: ``backend="cuda"`` on a machine where it cannot be used.
    """
    if config.backend == "host":
        return "host"
    problem = cuda_driver_error(config.device)
    if config.backend == "cuda" and problem is not None:
        raise KVAsyncError(
            f'backend="cuda" cannot be used: {problem}; use backend="host" or "auto"'
        )
    return "host" if problem is not None else "cuda"


def create_backend(layout: KVLayout, config: Config, num_pages: int) -> _core.Backend:
    """Reserves the virtual ranges for ``layout``, wrapped by ``config.faults`` if any.

    Raises:
        KVAsyncError: the backend cannot be used here.
    """
    name = resolve_backend(config)
    backend: _core.Backend
    if name == "host":
        backend = _core.HostBackend(layout.num_ranges, num_pages, config.page_size)
    else:
        # The handle pool keeps up to the reserve's high watermark of unmapped handles; none on
        # a share, whose budget counts mapped pages only (a pooled handle is memory too).
        backend = _core.CudaBackend(
            config.device,
            layout.num_ranges,
            num_pages,
            config.page_size,
            0 if config.share is not None else config.reserve_pages[1],
            config.gpu_utilization,
        )
    if config.faults is not None:
        backend = _core.with_faults(backend, config.faults._state)
    return backend


def range_tensor(backend: _core.Backend, index: int) -> torch.Tensor:
    """A uint8 tensor over the whole of range ``index`` (it keeps the reservation alive)."""
    if backend.name == "cuda":
        return _cuda.range_tensor(backend, index)
    return torch.from_numpy(np.asarray(_core.range_view(backend, index)))


def buffer_views(layout: KVLayout, backend: _core.Backend, num_blocks: int) -> list[torch.Tensor]:
    """Views ``[num_blocks, block_size, num_kv_heads, head_dim]`` of every buffer, layer-major.

    The order is layer 0's K, layer 0's V, layer 1's K, ... (K only when ``kv_buffers == 1``).
    """
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    inner = (layout.num_kv_heads * layout.head_dim, layout.head_dim, 1)
    if layout.contiguous:
        whole = range_tensor(backend, 0).view(layout.dtype)
        stride = layout.block_elements * layout.num_buffers
        return [
            whole.as_strided(shape, (stride, *inner), b * layout.block_elements)
            for b in range(layout.num_buffers)
        ]
    views = []
    for b in range(layout.num_buffers):
        flat = range_tensor(backend, b).view(layout.dtype)
        views.append(flat.as_strided(shape, (layout.block_elements, *inner), 0))
    return views


def make_fence(backend: _core.Backend, after: object) -> int:
    """A fence handle for ``free(ids, after=...)``: device work that still uses the blocks.

    The pool takes ownership of the handle (Note [Unmap safety] in csrc/page_pool.h).

    Raises:
        ValueError: ``after`` is given on a backend without device work, or is not a stream or
            event of this allocator's device.
    """
    if after is None:
        return 0
    if backend.name == "cuda":
        return _cuda.make_fence(backend, after)
    raise ValueError(
        f"free(after=...) needs the cuda backend; this allocator uses {backend.name!r}, "
        "where memory is never in use by device work"
    )
