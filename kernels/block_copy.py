"""Triton kernels that move whole KV blocks across every layer and buffer in one launch.

Note [Block copy kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~
Rationale: a serving engine moves KV blocks for offload, migration, prefix copy and copy-on-write.
Done per layer from Python that is 2 * num_layers launches (index_select / index_copy_ each) and
index_fill_ reaches a fraction of the memory bandwidth. One launch over all buffers does the same
work at the copy peak.

Approach: the KV memory is a list of buffers, layer-major (layer 0 K, layer 0 V, layer 1 K, ...).
Every buffer has the same geometry: block b of buffer j starts at

    base[j] + b * block_stride_bytes                    (block_stride_bytes >= block_bytes)

and its block_bytes are contiguous. The kernels read the bases from an int64 pointer table, so
one launch reaches every buffer, wherever the allocator put it. A gathered tensor is laid out

    out[i, j, :] = block ids[i] of buffer j         [len(ids), num_buffers, block_bytes]

which, viewed with the buffers' dtype, is [len(ids), num_layers, kv_buffers, block_size,
num_kv_heads, head_dim]: buffer j is layer j // kv_buffers, K or V j % kv_buffers.

Implementation:
- The kernels move raw bits, never values: every dtype (fp16, bf16, fp32, fp8, int8) is moved as
  the widest integer unit (int32, int16 or int8) that divides the block size, the block stride and
  every address. fp8 and bf16 need nothing special, and nothing is ever converted.
- Grid (num_buffers, len(ids)): one program per (buffer, block id), looping over the block in
  BLOCK-unit chunks; with 32 KiB blocks that is thousands of programs, enough to fill the GPU.
  Buffers are the fastest axis, so programs running side by side work on the same block id: in
  the contiguous (block-major) layout that is one contiguous stretch of memory, which fewer pages
  and TLB entries cover than len(ids) scattered blocks (gather at 1024 blocks there was 0.84x the
  copy peak with ids fastest; see bench/RESULTS.md). Ids are sliced into launches of at most
  65535, the limit of grid axis 1.
- Offsets are int64 throughout: a block id times the block stride overflows int32 on a large
  cache (and an int32 overflow makes Triton's interpreter read wild memory and segfault).
- 16-byte vectors: a pointer loaded from a table carries no alignment information, so Triton
  emits 4-byte accesses for it. When every base address, the block size and the block stride are
  multiples of 16 bytes, the launcher says so (ALIGN=16) and the kernels assert it with
  tl.multiple_of; sizes are passed in VEC-unit "vectors" and multiplied by the constexpr VEC, so
  Triton also knows every offset is a multiple of 16 bytes. The main loop is then
  ld.global.v4.b32 / st.global.v4.b32 (tests/test_kernels_ptx.py checks it).

Limitations: nothing is validated here (kvasync._block_ops does that before any launch); ids must
be in range; scatter and copy destinations must be distinct, or programs race. A launch runs on
the current CUDA device and stream. The chunk count
is a constexpr (Triton 3.6's interpreter cannot loop to a runtime bound under numpy 2.4), so each
block geometry compiles once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

# NOTE: decided when the kernels below are defined, exactly as triton.jit decides it.
INTERPRETED: bool = bool(knobs.runtime.interpret)

# Bytes one program moves per loop iteration: 4 KiB, one 16-byte vector per thread at 8 warps.
# On an H200 (bench/RESULTS.md) 8 KiB chunks were 2-4% slower on 32 KiB blocks; 2-4 KiB chunks
# at 4-16 warps were all within 1%.
_CHUNK_BYTES = 4096
# Below this many bytes a chunk is too small to be worth avoiding a mask for.
_MIN_EVEN_CHUNK_BYTES = 1024
_NUM_WARPS = 8  # at most
# The gather alone: 8 KiB chunks at 16 warps (still one 16-byte vector per thread), half the loop
# iterations per program. On the H200 its interleaved (contiguous-layout) case measured 0.95 of
# the copy peak this way against 0.93 at 4 KiB / 8 warps; two buffers per program and streaming
# cache hints (evict_first / .cs) did not help (bench/RESULTS.md).
_GATHER_CHUNK_BYTES = 8192
_GATHER_NUM_WARPS = 16
_MAX_GRID_Y = 65535  # CUDA's limit on grid axis 1 (axis 0 takes up to 2**31 - 1)
_MAX_ALIGN = 16
_UNIT_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.int8}
_UNIT_TL = {4: tl.int32, 2: tl.int16, 1: tl.int8}


@triton.jit
def _block_start(table_ptr, buf, block_id, block_stride_vecs, UNIT, VEC, ALIGN):
    """Address of block `block_id` of buffer `buf`: its base from the table, 16-byte aligned
    when the launcher says so (ALIGN), plus the block's offset in VEC-unit vectors."""
    base = tl.load(table_ptr + buf).to(tl.pointer_type(UNIT))
    base = tl.multiple_of(base, ALIGN)
    return base + block_id * block_stride_vecs * VEC


@triton.jit
def _gather_kernel(
    table_ptr,  # *int64 [num_buffers]: base address of every buffer, layer-major
    ids_ptr,  # *int64 [n]: block ids to read
    out_ptr,  # *UNIT [n, num_buffers, VEC * vecs_per_block]: contiguous destination
    num_buffers,  # buffers per block id (num_layers * kv_buffers)
    vecs_per_block,  # block size in VEC-unit vectors
    block_stride_vecs,  # distance between consecutive blocks of a buffer, in vectors
    UNIT: tl.constexpr,  # integer type the bits are moved as (tl.int32 / int16 / int8)
    VEC: tl.constexpr,  # units per vector: every address and size is a multiple of it
    ALIGN: tl.constexpr,  # VEC * unit bytes: guaranteed alignment of every address
    BLOCK: tl.constexpr,  # units per loop iteration (a power of two)
    EVEN: tl.constexpr,  # BLOCK divides the block: no mask
    NUM_CHUNKS: tl.constexpr,  # loop iterations per block: cdiv(VEC * vecs_per_block, BLOCK)
):
    buf = tl.program_id(0).to(tl.int64)  # fastest: a block's buffers run side by side
    i = tl.program_id(1).to(tl.int64)
    block_id = tl.load(ids_ptr + i)
    units = vecs_per_block * VEC
    src = _block_start(table_ptr, buf, block_id, block_stride_vecs, UNIT, VEC, ALIGN)
    dst = out_ptr + (i * num_buffers + buf) * units
    for chunk in range(0, NUM_CHUNKS):
        offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        if EVEN:
            tl.store(dst + offs, tl.load(src + offs))
        else:
            mask = offs < units
            tl.store(dst + offs, tl.load(src + offs, mask=mask, other=0), mask=mask)


@triton.jit
def _scatter_kernel(
    table_ptr,  # *int64 [num_buffers]: base address of every buffer, layer-major
    ids_ptr,  # *int64 [n]: block ids to write (distinct)
    src_ptr,  # *UNIT [n, num_buffers, VEC * vecs_per_block]: contiguous source
    num_buffers,  # buffers per block id (num_layers * kv_buffers)
    vecs_per_block,  # block size in VEC-unit vectors
    block_stride_vecs,  # distance between consecutive blocks of a buffer, in vectors
    UNIT: tl.constexpr,  # integer type the bits are moved as (tl.int32 / int16 / int8)
    VEC: tl.constexpr,  # units per vector: every address and size is a multiple of it
    ALIGN: tl.constexpr,  # VEC * unit bytes: guaranteed alignment of every address
    BLOCK: tl.constexpr,  # units per loop iteration (a power of two)
    EVEN: tl.constexpr,  # BLOCK divides the block: no mask
    NUM_CHUNKS: tl.constexpr,  # loop iterations per block: cdiv(VEC * vecs_per_block, BLOCK)
):
    buf = tl.program_id(0).to(tl.int64)  # fastest: a block's buffers run side by side
    i = tl.program_id(1).to(tl.int64)
    block_id = tl.load(ids_ptr + i)
    units = vecs_per_block * VEC
    dst = _block_start(table_ptr, buf, block_id, block_stride_vecs, UNIT, VEC, ALIGN)
    src = src_ptr + (i * num_buffers + buf) * units
    for chunk in range(0, NUM_CHUNKS):
        offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        if EVEN:
            tl.store(dst + offs, tl.load(src + offs))
        else:
            mask = offs < units
            tl.store(dst + offs, tl.load(src + offs, mask=mask, other=0), mask=mask)


@triton.jit
def _zero_kernel(
    table_ptr,  # *int64 [num_buffers]: base address of every buffer, layer-major
    ids_ptr,  # *int64 [n]: block ids to zero
    vecs_per_block,  # block size in VEC-unit vectors
    block_stride_vecs,  # distance between consecutive blocks of a buffer, in vectors
    UNIT: tl.constexpr,  # integer type the bits are written as (tl.int32 / int16 / int8)
    VEC: tl.constexpr,  # units per vector: every address and size is a multiple of it
    ALIGN: tl.constexpr,  # VEC * unit bytes: guaranteed alignment of every address
    BLOCK: tl.constexpr,  # units per loop iteration (a power of two)
    EVEN: tl.constexpr,  # BLOCK divides the block: no mask
    NUM_CHUNKS: tl.constexpr,  # loop iterations per block: cdiv(VEC * vecs_per_block, BLOCK)
):
    buf = tl.program_id(0).to(tl.int64)  # fastest: a block's buffers run side by side
    i = tl.program_id(1).to(tl.int64)
    block_id = tl.load(ids_ptr + i)
    units = vecs_per_block * VEC
    dst = _block_start(table_ptr, buf, block_id, block_stride_vecs, UNIT, VEC, ALIGN)
    zeros = tl.zeros([BLOCK], dtype=UNIT)
    for chunk in range(0, NUM_CHUNKS):
        offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        if EVEN:
            tl.store(dst + offs, zeros)
        else:
            tl.store(dst + offs, zeros, mask=offs < units)


@triton.jit
def _copy_kernel(
    table_ptr,  # *int64 [num_buffers]: base address of every buffer, layer-major
    src_ids_ptr,  # *int64 [n]: block ids to read
    dst_ids_ptr,  # *int64 [n]: block ids to write (distinct, none of them in src_ids)
    vecs_per_block,  # block size in VEC-unit vectors
    block_stride_vecs,  # distance between consecutive blocks of a buffer, in vectors
    UNIT: tl.constexpr,  # integer type the bits are moved as (tl.int32 / int16 / int8)
    VEC: tl.constexpr,  # units per vector: every address and size is a multiple of it
    ALIGN: tl.constexpr,  # VEC * unit bytes: guaranteed alignment of every address
    BLOCK: tl.constexpr,  # units per loop iteration (a power of two)
    EVEN: tl.constexpr,  # BLOCK divides the block: no mask
    NUM_CHUNKS: tl.constexpr,  # loop iterations per block: cdiv(VEC * vecs_per_block, BLOCK)
):
    buf = tl.program_id(0).to(tl.int64)  # fastest: a block's buffers run side by side
    i = tl.program_id(1).to(tl.int64)
    src_id = tl.load(src_ids_ptr + i)
    dst_id = tl.load(dst_ids_ptr + i)
    units = vecs_per_block * VEC
    src = _block_start(table_ptr, buf, src_id, block_stride_vecs, UNIT, VEC, ALIGN)
    dst = _block_start(table_ptr, buf, dst_id, block_stride_vecs, UNIT, VEC, ALIGN)
    for chunk in range(0, NUM_CHUNKS):
        offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        if EVEN:
            tl.store(dst + offs, tl.load(src + offs))
        else:
            mask = offs < units
            tl.store(dst + offs, tl.load(src + offs, mask=mask, other=0), mask=mask)


@dataclass(frozen=True)
class BlockTable:
    """Where every buffer's blocks live: the pointer table and the geometry all buffers share.

    Build it with `block_table`; it stays valid as long as the buffers' memory does (cache it).

    Attributes:
        pointers: int64 tensor [num_buffers] of base addresses, on the buffers' device.
        num_buffers: number of buffers (num_layers * kv_buffers).
        block_bytes: bytes of one block of one buffer (contiguous).
        block_stride_bytes: bytes from one block of a buffer to the next (>= block_bytes).
        alignment: largest power of two <= 16 dividing every base address, block_bytes and
            block_stride_bytes.
    """

    pointers: torch.Tensor
    num_buffers: int
    block_bytes: int
    block_stride_bytes: int
    alignment: int


def _alignment(*values: int) -> int:
    """Largest power of two <= 16 that divides every value."""
    g = math.gcd(_MAX_ALIGN, *values)
    return g & -g


def block_table(buffers: Sequence[torch.Tensor]) -> BlockTable:
    """Build the pointer table of `buffers` (layer-major, each [num_blocks, ...] with contiguous
    blocks and the same block stride); they are not validated here."""
    first = buffers[0]
    block_bytes = first[0].numel() * first.element_size()
    stride_bytes = first.stride(0) * first.element_size()
    addresses = [b.data_ptr() for b in buffers]
    pointers = torch.tensor(addresses, dtype=torch.int64).to(first.device)
    return BlockTable(
        pointers=pointers,
        num_buffers=len(buffers),
        block_bytes=block_bytes,
        block_stride_bytes=stride_bytes,
        alignment=_alignment(block_bytes, stride_bytes, *addresses),
    )


@dataclass(frozen=True)
class _Launch:
    """Compile-time choices and sizes of one launch."""

    unit_bytes: int
    vec: int
    block: int
    even: bool
    vecs_per_block: int
    block_stride_vecs: int
    num_chunks: int
    num_warps: int

    @property
    def constexprs(self) -> dict[str, object]:
        return {
            "UNIT": _UNIT_TL[self.unit_bytes],
            "VEC": self.vec,
            "ALIGN": self.vec * self.unit_bytes,
            "BLOCK": self.block,
            "EVEN": self.even,
            "NUM_CHUNKS": self.num_chunks,
        }


def _plan(
    table: BlockTable,
    *tensors: torch.Tensor,
    chunk_bytes: int | None = None,
    max_warps: int | None = None,
) -> _Launch:
    """Pick the unit, vector width and chunk size for `table` and the contiguous `tensors`."""
    align = _alignment(table.alignment, *(t.data_ptr() for t in tensors))
    unit_bytes = min(align, 4)
    vec = align // unit_bytes
    units = table.block_bytes // unit_bytes
    max_block = (chunk_bytes or _CHUNK_BYTES) // unit_bytes
    if units <= max_block:
        block = triton.next_power_of_2(units)
    else:
        # The largest power of two dividing the block, if not too small: no mask in the loop.
        block = min(max_block, units & -units)
        if block * unit_bytes < _MIN_EVEN_CHUNK_BYTES:
            block = max_block
    return _Launch(
        unit_bytes=unit_bytes,
        vec=vec,
        block=block,
        even=units % block == 0,
        vecs_per_block=units // vec,
        block_stride_vecs=table.block_stride_bytes // (unit_bytes * vec),
        num_chunks=triton.cdiv(units, block),
        # Few enough threads that each one moves a whole vector (a small block, fewer warps).
        num_warps=max(1, min(max_warps or _NUM_WARPS, block // (32 * vec))),
    )


def _as_units(t: torch.Tensor, unit_bytes: int) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8).view(_UNIT_DTYPES[unit_bytes])


def _id_slices(n: int) -> list[slice]:
    """Ids go on grid axis 1, which holds at most 65535 programs: one launch per slice."""
    return [slice(start, min(start + _MAX_GRID_Y, n)) for start in range(0, n, _MAX_GRID_Y)]


def gather_blocks(table: BlockTable, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[i, j] = block ids[i] of buffer j, for every buffer j, in one launch.

    `ids` is int64 on the buffers' device, `out` contiguous with len(ids) * num_buffers blocks.
    """
    plan = _plan(table, out, chunk_bytes=_GATHER_CHUNK_BYTES, max_warps=_GATHER_NUM_WARPS)
    units = _as_units(out, plan.unit_bytes).view(ids.numel(), -1)
    for part in _id_slices(ids.numel()):
        _gather_kernel[(table.num_buffers, part.stop - part.start)](
            table.pointers,
            ids[part],
            units[part],
            table.num_buffers,
            plan.vecs_per_block,
            plan.block_stride_vecs,
            num_warps=plan.num_warps,
            **plan.constexprs,
        )


def scatter_blocks(table: BlockTable, ids: torch.Tensor, src: torch.Tensor) -> None:
    """Block ids[i] of buffer j = src[i, j], for every buffer j, in one launch (the reverse of
    `gather_blocks`; ids must be distinct)."""
    plan = _plan(table, src)
    units = _as_units(src, plan.unit_bytes).view(ids.numel(), -1)
    for part in _id_slices(ids.numel()):
        _scatter_kernel[(table.num_buffers, part.stop - part.start)](
            table.pointers,
            ids[part],
            units[part],
            table.num_buffers,
            plan.vecs_per_block,
            plan.block_stride_vecs,
            num_warps=plan.num_warps,
            **plan.constexprs,
        )


def zero_blocks(table: BlockTable, ids: torch.Tensor) -> None:
    """Zero blocks `ids` (int64, on the buffers' device) of every buffer, in one launch."""
    plan = _plan(table)
    for part in _id_slices(ids.numel()):
        _zero_kernel[(table.num_buffers, part.stop - part.start)](
            table.pointers,
            ids[part],
            plan.vecs_per_block,
            plan.block_stride_vecs,
            num_warps=plan.num_warps,
            **plan.constexprs,
        )


def copy_blocks(table: BlockTable, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Block dst_ids[i] = block src_ids[i] in every buffer, in one launch (dst_ids distinct and
    disjoint from src_ids)."""
    plan = _plan(table)
    for part in _id_slices(src_ids.numel()):
        _copy_kernel[(table.num_buffers, part.stop - part.start)](
            table.pointers,
            src_ids[part],
            dst_ids[part],
            plan.vecs_per_block,
            plan.block_stride_vecs,
            num_warps=plan.num_warps,
            **plan.constexprs,
        )
