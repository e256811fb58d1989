"""Choosing and building the virtual-memory backend, and torch views over its ranges."""

from __future__ import annotations

import numpy as np
import torch

from . import _core
from ._config import Config
from ._errors import KVAsyncError
from ._layout import KVLayout

__all__ = ["buffer_views", "create_backend", "make_fence", "range_tensor", "resolve_backend"]


def cuda_driver_error() -> str | None:
    """Why the cuda backend cannot be used here, or None when it can."""
    return "no CUDA driver found (the cuda backend is not built into this kvasync yet)"


def resolve_backend(config: Config) -> str:
    """The backend ``config`` asks for: "auto" becomes cuda when usable, else host.

    Raises:
        KVAsyncError: ``backend="cuda"`` on a machine where it cannot be used.
    """
    if config.backend == "host":
        return "host"
    problem = cuda_driver_error()
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
    else:  # pragma: no cover - resolve_backend refuses cuda until it exists
        raise KVAsyncError("the cuda backend is not available")
    if config.faults is not None:
        backend = _core.with_faults(backend, config.faults._state)
    return backend


def range_tensor(backend: _core.Backend, index: int) -> torch.Tensor:
    """A uint8 tensor over the whole of range ``index`` (it keeps the reservation alive)."""
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
    raise ValueError(
        f"free(after=...) needs the cuda backend; this allocator uses {backend.name!r}, "
        "where memory is never in use by device work"
    )
