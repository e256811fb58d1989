"""Paged attention: queries attend over K/V held in blocks, found through a block table.

Note [Paged attention kernel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rationale: a serving engine keeps each sequence's K/V in fixed-size blocks scattered across the
cache (the blocks kvasync handed out); attention must read them in place, in the order the
sequence's block table lists them, without first copying them into one tensor.

Approach: one program per (query token, query head). A batch mixes prefill and decode freely:
every query carries the index of its sequence (a row of the block table) and its position in that
sequence, and attends causally to the keys at positions ``0 .. position`` of that sequence. So a
decode step is one query per sequence and a prefill is one query per prompt token, in one launch.
The engine writes the batch's new K/V into their blocks before the launch (serve/_attention.py).

Implementation:
- The program walks the sequence's blocks in order: it loads the block id from the table, loads
  that block's ``[block_size, head_dim]`` K and V for its KV head (grouped-query attention: query
  head h reads KV head h // group), and keeps an online softmax (running max, running sum, running
  weighted V) in fp32, so no score matrix is ever stored.
- The cache tensors are the views ``kv.layer(i)`` returns, ``[num_blocks, block_size,
  num_kv_heads, head_dim]``, strided in any way with a contiguous head_dim: the strides are
  arguments, so the per-layer and the contiguous (block-major) layouts both work.
- Offsets are int64 (a block id times a block stride overflows int32 on a large cache).
- Triton's interpreter cannot loop to a bound loaded from memory, so under TRITON_INTERPRET the
  loop runs over a constexpr MAX_BLOCKS (the table's width) with the tail masked; compiled, it
  stops at the query's last block.

Limitations: one query head per program reads its KV head's blocks again for every head of the
group, and prefill queries each walk their own prefix (O(prompt^2) work, as any attention): a
reference kernel, correct and simple, not a tuned FlashAttention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_copy import INTERPRETED

__all__ = ["paged_attention"]


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, H, D] queries of the batch's new tokens
    k_ptr,  # [num_blocks, block_size, KVH, D] one layer's K cache
    v_ptr,  # the same layer's V cache
    out_ptr,  # [T, H, D]
    table_ptr,  # [S, max_blocks] int32 block ids of each sequence, in order
    seq_ptr,  # [T] int32: the sequence (table row) of each query
    pos_ptr,  # [T] int32: each query's position; it attends to keys 0 .. pos
    scale,  # softmax scale, 1 / sqrt(D)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # tokens per block
    HEAD_DIM: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,  # the table's width (the loop bound when interpreted)
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    kv_head = h // GROUP
    dims = tl.arange(0, HEAD_DIM)
    tokens = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + dims).to(tl.float32) * scale
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    if INTERPRET:  # noqa: SIM108 (a constexpr branch reads more plainly in a kernel)
        num_blocks = MAX_BLOCKS
    else:
        num_blocks = pos // BLOCK_SIZE + 1
    for b in range(0, num_blocks):
        key_pos = b * BLOCK_SIZE + tokens
        live = key_pos <= pos
        block_mask = b * BLOCK_SIZE <= pos
        block = tl.load(table_ptr + seq * stride_table + b, mask=block_mask, other=0).to(tl.int64)
        k_off = (
            block * stride_kb + tokens[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        )
        v_off = (
            block * stride_vb + tokens[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        )
        k = tl.load(k_ptr + k_off, mask=live[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1)
        scores = tl.where(live, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        # A fully masked block (interpreted tail) leaves everything as it was: its weights are 0
        # and, as the first block always has a live key, new_max is finite.
        weights = tl.exp(scores - new_max)
        correction = tl.exp(running_max - new_max)
        v = tl.load(v_ptr + v_off, mask=live[:, None], other=0.0).to(tl.float32)
        running_sum = running_sum * correction + tl.sum(weights, axis=0)
        acc = acc * correction + tl.sum(weights[:, None] * v, axis=0)
        running_max = new_max
    out = acc / running_sum
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seqs: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a batch of queries over their sequences' paged K/V.

    Args:
        q: ``[T, num_heads, head_dim]`` queries (head_dim contiguous, a power of two).
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a ``kv.layer(i)`` view).
        v_cache: the same shape as ``k_cache``.
        block_tables: ``[S, max_blocks]`` int32: row s lists sequence s's block ids in order;
            entries past a sequence's last block are ignored.
        query_seqs: ``[T]`` int32: the row of ``block_tables`` each query belongs to.
        query_positions: ``[T]`` int32: each query's position; it attends to keys ``0..pos``,
            which must already be written into the blocks.
        scale: the softmax scale; ``1 / sqrt(head_dim)`` when None.
        out: where to write (``q``'s shape and dtype); a new tensor when None.

    Returns:
        ``[T, num_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit together.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be [T, H, D] and the caches [blocks, block_size, kv_heads, D] alike, got "
            f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads or head_dim & (head_dim - 1):
        raise ValueError(
            f"head_dim {head_dim} (a power of two) and heads {num_heads} (a multiple of "
            f"{num_kv_heads} KV heads) do not fit the cache {tuple(k_cache.shape)}"
        )
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q and the caches need a contiguous head_dim")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be a 2-D int32 tensor, got {block_tables.dtype}")
    for name, t in (("query_seqs", query_seqs), ("query_positions", query_positions)):
        if t.shape != (num_tokens,) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be [{num_tokens}] int32, got {t.dtype} {tuple(t.shape)}")
    tensors = (k_cache, v_cache, block_tables, query_seqs, query_positions)
    if any(t.device != q.device for t in tensors):
        raise ValueError("q, the caches and the index tensors must be on one device")
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    block_tables = block_tables.contiguous()
    grid = (num_tokens, num_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, query_seqs.contiguous(), query_positions.contiguous(),
        float(scale if scale is not None else head_dim**-0.5),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        MAX_BLOCKS=block_tables.shape[1],
        INTERPRET=INTERPRETED,
    )  # fmt: skip
    return out
