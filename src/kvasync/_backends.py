"""Choosing and building the virtual-memory backend, and torch views over its ranges."""

from __future__ import annotations

import numpy as np
import torch

from . import _core, _cuda
from ._config import Config
from ._errors import KVAsyncError
from ._layout import KVLayout

__all__ = [
    "buffer_views",
    "create_backend",
    "default_page_size",
    "make_fence",
    "page_size_for",
    "range_tensor",
    "resolve_backend",
]

# The host backend's unit when none is given: its cost is per byte (fallocate and populate), with
# no per-call cost to amortise, so a small unit only makes it more elastic.
HOST_PAGE_SIZE = 2 << 20


_MAX_RANGE_BYTES = 2**63 - 1  # int64: the size type of every backend's range


def pooled_handle_pages(config: Config) -> int:
    """How many page ids of unmapped physical handles the cuda backend may keep for reuse.

    The reserve's high watermark; none on a share or under a memory limit. A pooled handle is
    device memory that nothing maps: a share's budget and a memory limit count mapped pages only,
    so handles pooled beside them would hold memory past what they promise (measured on an H200
    under vLLM with a 1 GiB limit: 1.0 GiB of pooled handles beside 1.0 GiB mapped;
    bench/RESULTS.md).
    Without them each map creates its handles (about 13 us each, DESIGN.md's table).
    """
    if config.share is not None or config.memory_limit is not None:
        return 0
    return config.reserve_pages[1]


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


def default_page_size(layout: KVLayout, backend: str, granularity: int) -> int:
    """The unit of mapping ``Config(page_size=None)`` picks, in bytes per virtual range.

    On cuda the driver's cost is per physical handle, nearly independent of its size up to
    128 MiB (DESIGN.md, "Measured limits"), so a page id holds one ``granularity`` page of every
    layer and buffer: on the contiguous layout one handle of ``granularity * num_buffers`` bytes
    (128 MiB for 32 layers of K and V), on the per-layer layout ``granularity`` in each range. It
    is rounded up to hold at least one block. On host, ``HOST_PAGE_SIZE`` per range.

    Args:
        layout: the KV cache's geometry.
        backend: "cuda" or "host".
        granularity: the driver's allocation granularity (cuda), in bytes.
    """
    if backend != "cuda":
        return HOST_PAGE_SIZE
    unit = granularity * (layout.num_buffers if layout.contiguous else 1)
    stride = layout.range_block_bytes
    return max(unit, -(-stride // granularity) * granularity)


def page_size_for(layout: KVLayout, config: Config) -> int:
    """``config.page_size``, or the default for the backend ``config`` resolves to.

    Raises:
        KVAsyncError: the backend cannot be used here.
    """
    if config.page_size is not None:
        return config.page_size
    backend = resolve_backend(config)
    granularity = _core.cuda_granularity(config.device) if backend == "cuda" else 0
    return default_page_size(layout, backend, granularity)


def create_backend(
    layout: KVLayout, config: Config, num_pages: int, page_size: int
) -> _core.Backend:
    """Reserves the virtual ranges for ``layout``, wrapped by ``config.faults`` if any.

    ``page_size``: bytes per range of a page id (``page_size_for``, grown by
    ``KVLayout.page_unit``).

    Raises:
        ValueError: the range's size does not fit in 64 bits (``max_blocks`` far too large).
        KVAsyncError: the backend cannot be used here (or cannot reserve that much).
    """
    range_bytes = num_pages * page_size
    if range_bytes > _MAX_RANGE_BYTES:
        # The backends compute this size in int64: refuse here, before any overflow there.
        raise ValueError(
            f"Config.max_blocks={config.max_blocks} needs {num_pages} pages of "
            f"{page_size} bytes, a {range_bytes}-byte range per buffer, beyond 64-bit "
            "sizes; lower max_blocks"
        )
    name = resolve_backend(config)
    backend: _core.Backend
    if name == "host":
        backend = _core.HostBackend(layout.num_ranges, num_pages, page_size)
    else:
        backend = _core.CudaBackend(
            config.device,
            layout.num_ranges,
            num_pages,
            page_size,
            pooled_handle_pages(config),
            config.gpu_utilization,
        )
    if config.faults is not None:
        backend = _core.with_faults(backend, config.faults._state)
    if config.tensor_parallel is not None:  # outermost: the group maps on its ranks too
        backend = config.tensor_parallel.open_scheduler(backend)
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

    The pool takes ownership of the handle (Note [Unmap safety] in csrc/pool/page_pool.h).

    Raises:
        TypeError: (cuda) ``after`` is neither a stream nor an event.
        ValueError: ``after`` is given on a backend without device work, or is a stream or event
            of another device.
    """
    if after is None:
        return 0
    if backend.name == "cuda":
        return _cuda.make_fence(backend, after)
    raise ValueError(
        f"free(after=...) needs the cuda backend; this allocator uses {backend.name!r}, "
        "where memory is never in use by device work"
    )
