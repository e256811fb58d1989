"""Whole-block operations across every layer of the KV cache: gather, scatter, zero, copy.

The allocator's `gather`, `scatter`, `zero` and `copy` call these. They validate everything first
(a caller's mistake is a ValueError that names it, raised before any launch), then make one
launch of a Triton kernel for all layers and both K and V (see Note [Block copy kernels] in
kernels/block_copy.py).

The KV memory is a list of buffers, layer-major, each [num_blocks, block_size, num_kv_heads,
head_dim] with contiguous blocks and the same block stride (which may exceed a block: the
interleaved layout puts all layers' blocks of one block id next to each other)::

    buffers = [layer 0 K, layer 0 V, layer 1 K, layer 1 V, ...]    (kv_buffers = 2)

    gathered[i, layer, kv] = buffers[layer * kv_buffers + kv][ids[i]]
    gathered: [len(ids), num_layers, kv_buffers, block_size, num_kv_heads, head_dim], contiguous

NOTE: on CPU buffers, Triton's kernels run only under its interpreter (TRITON_INTERPRET=1, as in
the tests); otherwise the same operations run as torch indexing, one call per buffer. Triton is
the ``kvasync[gpu]`` extra (torch's CUDA build brings it on Linux), so the kernels are imported
only when they are about to run: a CPU install without Triton uses torch alone, and a CUDA device
without it gets an error that names the extra.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ._errors import KVAsyncError

Ids = Sequence[int] | torch.Tensor
"""Block ids: a sequence of ints or a 1-D integer tensor (on CPU or the buffers' device)."""

IsAllocated = Callable[[list[int]], list[int]]
"""Given block ids, returns those among them that are NOT allocated (empty: all are)."""

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8)

# Ids named in an error message, at most.
_SHOWN_IDS = 8
# Integer type of each element size: the torch fallback moves raw bits, like the kernels.
_RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class _Layout:
    """Geometry shared by every buffer, checked by `_check_layout`."""

    num_layers: int
    kv_buffers: int
    num_blocks: int
    block_shape: tuple[int, ...]  # (block_size, num_kv_heads, head_dim)
    dtype: torch.dtype
    device: torch.device

    def blocks_shape(self, n: int) -> tuple[int, ...]:
        """Shape of `n` gathered blocks."""
        return (n, self.num_layers, self.kv_buffers, *self.block_shape)


def _show(ids: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:_SHOWN_IDS])
    more = f", ... ({len(ids)} in all)" if len(ids) > _SHOWN_IDS else ""
    return f"[{shown}{more}]"


def _check_layout(buffers: Sequence[torch.Tensor], kv_buffers: int) -> _Layout:
    if kv_buffers not in (1, 2):
        raise ValueError(f"kv_buffers must be 1 (K only) or 2 (K and V), got {kv_buffers}")
    if len(buffers) == 0 or len(buffers) % kv_buffers != 0:
        raise ValueError(
            f"expected num_layers * kv_buffers buffers (kv_buffers={kv_buffers}), "
            f"got {len(buffers)}"
        )
    first = buffers[0]
    for j, buf in enumerate(buffers):
        _check_buffer(j, buf, first)
    return _Layout(
        num_layers=len(buffers) // kv_buffers,
        kv_buffers=kv_buffers,
        num_blocks=first.shape[0],
        block_shape=tuple(first.shape[1:]),
        dtype=first.dtype,
        device=first.device,
    )


def _check_buffer(j: int, buf: torch.Tensor, first: torch.Tensor) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dim() != 4:
        raise ValueError(
            f"buffers[{j}] must be a 4-D tensor [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {_describe(buf)}"
        )
    if buf.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"buffers[{j}] has dtype {buf.dtype}; supported: {names}")
    for name, mine, theirs in (
        ("shape", tuple(buf.shape), tuple(first.shape)),
        ("dtype", buf.dtype, first.dtype),
        ("device", buf.device, first.device),
        ("block stride", buf.stride(0), first.stride(0)),
    ):
        if mine != theirs:
            raise ValueError(f"buffers[{j}] has {name} {mine}, buffers[0] has {theirs}")
    if buf.shape[0] == 0 or buf[0].numel() == 0:
        raise ValueError(f"buffers[{j}] is empty: shape {tuple(buf.shape)}")
    if not buf[0].is_contiguous() or buf.stride(0) < buf[0].numel():
        raise ValueError(
            f"buffers[{j}] must hold each block contiguously with a block stride >= the block "
            f"size ({buf[0].numel()} elements), got strides {buf.stride()}"
        )


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"a {type(x).__name__}"


def _check_ids(ids: Ids, layout: _Layout, what: str) -> list[int]:
    """The ids as a list, checked for type, device and range."""
    # Note [Argument errors] in _validate: a wrong type (or dtype) is a TypeError, a wrong value
    # (shape, device, range) a ValueError.
    if isinstance(ids, torch.Tensor):
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"{what} must be a 1-D integer tensor, got {_describe(ids)}")
        if ids.dim() != 1:
            raise ValueError(f"{what} must be a 1-D integer tensor, got {_describe(ids)}")
        if ids.device not in (torch.device("cpu"), layout.device):
            raise ValueError(
                f"{what} is on {ids.device}, the KV buffers on {layout.device}: "
                f"pass ids on the CPU or on {layout.device}"
            )
        values: list[int] = ids.tolist()
    elif isinstance(ids, Sequence) and not isinstance(ids, str | bytes):
        values = [_as_int(x, what, k) for k, x in enumerate(ids)]
    else:
        raise TypeError(f"{what} must be a sequence of ints or a 1-D tensor, got {_describe(ids)}")
    bad = [i for i in values if not 0 <= i < layout.num_blocks]
    if bad:
        raise ValueError(f"{what} out of range [0, {layout.num_blocks}): {_show(bad)}")
    return values


def _as_int(x: object, what: str, k: int) -> int:
    if isinstance(x, bool):
        raise TypeError(f"{what}[{k}] is a bool, not a block id")
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what}[{k}] is {x!r}, not an int") from None


def _check_allocated(values: list[int], is_allocated: IsAllocated, what: str) -> None:
    missing = is_allocated(values)
    if missing:
        raise ValueError(
            f"{what} names blocks that are not allocated: {_show(sorted(set(missing)))}; "
            "only allocated blocks can be read or written"
        )


def _check_distinct(values: list[int], what: str) -> None:
    repeated = sorted(i for i, count in Counter(values).items() if count > 1)
    if repeated:
        raise ValueError(f"{what} repeats blocks {_show(repeated)}: each can be written only once")


def _check_blocks_tensor(t: object, layout: _Layout, n: int, what: str) -> None:
    expected = layout.blocks_shape(n)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a tensor of shape {expected}, got {_describe(t)}")
    if t.dtype != layout.dtype:
        raise TypeError(
            f"{what} must be a {layout.dtype} tensor of shape {expected} on {layout.device}, "
            f"got {_describe(t)}"
        )
    if tuple(t.shape) != expected or t.device != layout.device:
        raise ValueError(
            f"{what} must be a {layout.dtype} tensor of shape {expected} on {layout.device}, "
            f"got {_describe(t)}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (strides {t.stride()}): pass .contiguous()")


def _ids_tensor(ids: Ids, values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ids on `device`, without a copy when they already are."""
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.int64).contiguous()
    return torch.tensor(values, dtype=torch.int64).to(device)


@functools.cache
def installed_kernels() -> ModuleType | None:
    """``kvasync.kernels``, or None when Triton is not installed (imported once; the serve
    engine's paged attention asks here too)."""
    try:
        from . import kernels  # type: ignore[attr-defined]
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != "triton":
            raise  # a broken install of kvasync itself: not ours to hide
        return None
    return kernels  # type: ignore[no-any-return]


def _kernels() -> Any:
    """``kvasync.kernels``, for a launch.

    Raises:
        KVAsyncError: Triton is not installed (the ``kvasync[gpu]`` extra).
    """
    kernels = installed_kernels()
    if kernels is None:
        raise KVAsyncError(
            "the block ops (gather, scatter, zero, copy) on a CUDA device run Triton kernels, "
            'and Triton is not installed: pip install "kvasync[gpu]"'
        )
    return kernels


def _use_kernels(device: torch.device) -> bool:
    """Triton runs on CUDA compiled, and on CPU tensors only under its interpreter."""
    kernels = installed_kernels()
    interpreted = kernels is not None and bool(kernels.INTERPRETED)
    return (device.type == "cuda") != interpreted


def block_table(buffers: Sequence[torch.Tensor]) -> object | None:
    """The buffers' pointer table for the kernels, or None where the kernels do not run.

    Building it copies it to the device (a host synchronization), so callers build it once and
    pass it to every op as ``table=``.

    Raises:
        KVAsyncError: the buffers are on a CUDA device and Triton is not installed.
    """
    if not buffers or not _use_kernels(buffers[0].device):
        return None
    return _kernels().block_table(buffers)  # type: ignore[no-any-return]


def _on(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Launch on `device` (Triton launches on the current CUDA device)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of the same width: indexing then moves bits (fp8 included)."""
    return t.view(_RAW_DTYPES[t.element_size()])


def _raw_buffers(buffers: Sequence[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    return enumerate(_raw(b) for b in buffers)


def gather(
    buffers: Sequence[torch.Tensor],
    ids: Ids,
    out: torch.Tensor | None = None,
    *,
    kv_buffers: int,
    is_allocated: IsAllocated,
    table: object | None = None,
) -> torch.Tensor:
    """Copy blocks `ids` of every layer and buffer into one contiguous tensor.

    Args:
        buffers: the KV buffers, layer-major ([layer 0 K, layer 0 V, layer 1 K, ...]), each
            [num_blocks, block_size, num_kv_heads, head_dim], same dtype, device and block stride.
        ids: block ids to read (repeats allowed), a sequence of ints or a 1-D integer tensor.
        out: where to write, a contiguous tensor of the buffers' dtype and device, shape
            [len(ids), num_layers, kv_buffers, block_size, num_kv_heads, head_dim]; allocated
            when None.
        kv_buffers: buffers per layer: 2 (K and V) or 1.
        is_allocated: returns the ids among those given that are not allocated.
        table: the buffers' pointer table (``block_table(buffers)``), cached by the
            caller: building it copies it to the device, which synchronizes with the host.

    Returns:
        `out`, or the new tensor: out[i, layer, kv] = buffers[layer * kv_buffers + kv][ids[i]].

    Raises:
        TypeError: `ids` not ints or an integer tensor, or an `out` that is not a tensor of
            the buffers' dtype.
        ValueError: a malformed buffer list, an id out of range or not allocated, an `out` of
            the wrong shape or device, or not contiguous. Nothing is launched then.
    """
    layout = _check_layout(buffers, kv_buffers)
    values = _check_ids(ids, layout, "ids")
    if out is not None:
        _check_blocks_tensor(out, layout, len(values), "out")
    _check_allocated(values, is_allocated, "ids")
    if out is None:
        out = torch.empty(
            layout.blocks_shape(len(values)), dtype=layout.dtype, device=layout.device
        )
    if not values:
        return out
    index = _ids_tensor(ids, values, layout.device)
    if _use_kernels(layout.device):
        with _on(layout.device):
            kernels = _kernels()
            kernels.gather_blocks(table or kernels.block_table(buffers), index, out)
    else:
        flat = _raw(out).view(len(values), len(buffers), *layout.block_shape)
        for j, buf in _raw_buffers(buffers):
            flat[:, j] = buf.index_select(0, index)
    return out


def scatter(
    buffers: Sequence[torch.Tensor],
    ids: Ids,
    src: torch.Tensor,
    *,
    kv_buffers: int,
    is_allocated: IsAllocated,
    table: object | None = None,
) -> None:
    """Write `src` into blocks `ids` of every layer and buffer: the reverse of `gather`.

    Args:
        buffers: the KV buffers, layer-major, as for `gather`.
        ids: block ids to write, distinct, a sequence of ints or a 1-D integer tensor.
        src: a contiguous tensor of the buffers' dtype and device, shape
            [len(ids), num_layers, kv_buffers, block_size, num_kv_heads, head_dim].
        kv_buffers: buffers per layer: 2 (K and V) or 1.
        is_allocated: returns the ids among those given that are not allocated.
        table: the buffers' pointer table (``block_table(buffers)``), cached by the
            caller: building it copies it to the device, which synchronizes with the host.

    Raises:
        TypeError: `ids` not ints or an integer tensor, or a `src` that is not a tensor of
            the buffers' dtype.
        ValueError: a malformed buffer list, an id out of range, repeated or not allocated, a
            `src` of the wrong shape or device, or not contiguous. Nothing is launched then.
    """
    layout = _check_layout(buffers, kv_buffers)
    values = _check_ids(ids, layout, "ids")
    _check_distinct(values, "ids")
    _check_blocks_tensor(src, layout, len(values), "src")
    _check_allocated(values, is_allocated, "ids")
    if not values:
        return
    index = _ids_tensor(ids, values, layout.device)
    if _use_kernels(layout.device):
        with _on(layout.device):
            kernels = _kernels()
            kernels.scatter_blocks(table or kernels.block_table(buffers), index, src)
    else:
        flat = _raw(src).view(len(values), len(buffers), *layout.block_shape)
        for j, buf in _raw_buffers(buffers):
            buf.index_copy_(0, index, flat[:, j])


def zero(
    buffers: Sequence[torch.Tensor],
    ids: Ids,
    *,
    kv_buffers: int,
    is_allocated: IsAllocated,
    table: object | None = None,
) -> None:
    """Zero blocks `ids` in every layer and buffer.

    Args:
        buffers: the KV buffers, layer-major, as for `gather`.
        ids: block ids to zero (repeats allowed), a sequence of ints or a 1-D integer tensor.
        kv_buffers: buffers per layer: 2 (K and V) or 1.
        is_allocated: returns the ids among those given that are not allocated.
        table: the buffers' pointer table (``block_table(buffers)``), cached by the
            caller: building it copies it to the device, which synchronizes with the host.

    Raises:
        TypeError: `ids` not ints or an integer tensor.
        ValueError: a malformed buffer list, an id out of range or not allocated. Nothing is
            launched then.
    """
    layout = _check_layout(buffers, kv_buffers)
    values = _check_ids(ids, layout, "ids")
    _check_allocated(values, is_allocated, "ids")
    if not values:
        return
    index = _ids_tensor(ids, values, layout.device)
    if _use_kernels(layout.device):
        with _on(layout.device):
            kernels = _kernels()
            kernels.zero_blocks(table or kernels.block_table(buffers), index)
    else:
        for _, buf in _raw_buffers(buffers):
            buf.index_fill_(0, index, 0)


def copy(
    buffers: Sequence[torch.Tensor],
    src_ids: Ids,
    dst_ids: Ids,
    *,
    kv_buffers: int,
    is_allocated: IsAllocated,
    table: object | None = None,
) -> None:
    """Copy block src_ids[i] to block dst_ids[i] in every layer and buffer (copy-on-write).

    Args:
        buffers: the KV buffers, layer-major, as for `gather`.
        src_ids: block ids to read (repeats allowed).
        dst_ids: block ids to write, as many as `src_ids`, distinct and none in `src_ids`.
        kv_buffers: buffers per layer: 2 (K and V) or 1.
        is_allocated: returns the ids among those given that are not allocated.
        table: the buffers' pointer table (``block_table(buffers)``), cached by the
            caller: building it copies it to the device, which synchronizes with the host.

    Raises:
        TypeError: id lists that are not ints or integer tensors.
        ValueError: a malformed buffer list, ids out of range or not allocated, id lists of
            different lengths, a repeated destination or one that is also a source. Nothing is
            launched then.
    """
    layout = _check_layout(buffers, kv_buffers)
    src_values = _check_ids(src_ids, layout, "src_ids")
    dst_values = _check_ids(dst_ids, layout, "dst_ids")
    if len(src_values) != len(dst_values):
        raise ValueError(
            f"src_ids and dst_ids differ in length: {len(src_values)} vs {len(dst_values)}"
        )
    _check_distinct(dst_values, "dst_ids")
    both = sorted(set(src_values) & set(dst_values))
    if both:
        raise ValueError(f"blocks {_show(both)} are both in src_ids and in dst_ids")
    _check_allocated(src_values, is_allocated, "src_ids")
    _check_allocated(dst_values, is_allocated, "dst_ids")
    if not src_values:
        return
    src_index = _ids_tensor(src_ids, src_values, layout.device)
    dst_index = _ids_tensor(dst_ids, dst_values, layout.device)
    if _use_kernels(layout.device):
        with _on(layout.device):
            kernels = _kernels()
            kernels.copy_blocks(table or kernels.block_table(buffers), src_index, dst_index)
    else:
        for _, buf in _raw_buffers(buffers):
            buf.index_copy_(0, dst_index, buf.index_select(0, src_index))
