"""Paged attention for the engine: write a batch's new K/V into its blocks, then attend.

The batch's K/V go into the cache only through the views ``kv.layer(i)`` returns and only at the
blocks kvasync allocated for each sequence. Then each query attends over its sequence's blocks:
the Triton kernel (kvasync.kernels.paged_attention, Note [Paged attention kernel]) on a GPU, or
the torch reference below on a CPU. Both read the blocks through the same block table. Triton is
the ``kvasync[gpu]`` extra: without it, asking for the kernel is a ``KVAsyncError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._block_ops import installed_kernels
from .._errors import KVAsyncError

__all__ = [
    "PagedBatch",
    "attend_paged",
    "paged_attention_kernel",
    "reference_paged_attention",
    "write_kv",
]


@dataclass(frozen=True)
class PagedBatch:
    """Where a batch's new tokens go and what they attend to.

    ``T`` new tokens of ``S`` sequences; sequence ``s`` owns queries ``query_ranges[s]``.
    """

    slot_blocks: torch.Tensor  # [T] int64: the block each new token's K/V is written to
    slot_offsets: torch.Tensor  # [T] int64: its row in that block
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with each row's first block
    query_seqs: torch.Tensor  # [T] int32
    query_positions: torch.Tensor  # [T] int32
    query_ranges: tuple[tuple[int, int], ...]  # per sequence: [start, end) of its queries
    seq_lens: tuple[int, ...]  # per sequence: tokens in the cache after this batch
    num_blocks: tuple[int, ...]  # per sequence: blocks its table row lists

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        starts: list[int],
        ends: list[int],
        block_size: int,
        device: torch.device,
    ) -> PagedBatch:
        """The batch where sequence s computes positions ``starts[s] .. ends[s] - 1``.

        Args:
            tables: each sequence's block ids, in order (at least ``ceil(end / block_size)``).
            starts: the first new position of each sequence (tokens before it are cached).
            ends: one past the last new position.
            block_size: tokens per block.
            device: where the index tensors go.
        """
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        blocks: list[int] = []
        offsets: list[int] = []
        seqs: list[int] = []
        positions: list[int] = []
        ranges = []
        for s, (ids, start, end) in enumerate(zip(tables, starts, ends, strict=True)):
            assert len(ids) * block_size >= end, "bug: a sequence has too few blocks for its tokens"
            table[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            # NOTE: padded with the row's own first block, never block 0: a block the sequence
            # does not own may be unmapped, and reading it faults (the batched reference path
            # reads the padding and masks it).
            table[s, len(ids) :] = ids[0]
            ranges.append((len(positions), len(positions) + end - start))
            for p in range(start, end):
                blocks.append(ids[p // block_size])
                offsets.append(p % block_size)
                seqs.append(s)
                positions.append(p)
        return cls(
            slot_blocks=torch.tensor(blocks, dtype=torch.int64).to(device, non_blocking=True),
            slot_offsets=torch.tensor(offsets, dtype=torch.int64).to(device, non_blocking=True),
            block_tables=table.to(device, non_blocking=True),
            query_seqs=torch.tensor(seqs, dtype=torch.int32).to(device, non_blocking=True),
            query_positions=torch.tensor(positions, dtype=torch.int32).to(
                device, non_blocking=True
            ),
            query_ranges=tuple(ranges),
            seq_lens=tuple(ends),
            num_blocks=tuple(len(t) for t in tables),
        )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Writes the batch's new ``k``, ``v`` (``[T, KVH, D]``) into their blocks' slots."""
    k_cache[batch.slot_blocks, batch.slot_offsets] = k.to(k_cache.dtype)
    v_cache[batch.slot_blocks, batch.slot_offsets] = v.to(v_cache.dtype)


def reference_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch
) -> torch.Tensor:
    """The torch path: read each sequence's blocks through the table and attend causally.

    Decoding sequences (one query each) go together in one batched computation; a sequence
    with several queries (a prefill) goes alone.

    Returns:
        ``[T, H, D]`` in ``q``'s dtype.
    """
    out = torch.empty_like(q)
    single = [s for s, (a, b) in enumerate(batch.query_ranges) if b - a == 1]
    if single:
        rows = torch.tensor([batch.query_ranges[s][0] for s in single], device=q.device)
        out[rows] = _attend(q[rows].unsqueeze(1), k_cache, v_cache, batch, single).squeeze(1)
    for s, (start, end) in enumerate(batch.query_ranges):
        if end - start > 1:
            out[start:end] = _attend(q[start:end].unsqueeze(0), k_cache, v_cache, batch, [s])[0]
    return out


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    seqs: list[int],
) -> torch.Tensor:
    # q: [S, n, H, D], the queries of sequences `seqs` (n each); returns the same shape.
    num_seqs, n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    width = max(batch.num_blocks[s] for s in seqs)
    index = torch.tensor(seqs, device=q.device)
    ids = batch.block_tables[index, :width].long()  # [S, W]; padding is read, then masked
    length = width * block_size
    keys = k_cache[ids].reshape(num_seqs, length, num_kv_heads, head_dim).float()
    values = v_cache[ids].reshape(num_seqs, length, num_kv_heads, head_dim).float()
    queries = q.float().view(num_seqs, n, num_kv_heads, group, head_dim)
    scores = torch.einsum("snkgd,slkd->skgnl", queries, keys) * head_dim**-0.5
    first = torch.tensor([batch.query_ranges[s][0] for s in seqs], device=q.device)
    positions = batch.query_positions[first[:, None] + torch.arange(n, device=q.device)].long()
    key_pos = torch.arange(length, device=q.device)
    allowed = key_pos[None, None, :] <= positions[:, :, None]  # [S, n, L]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    mixed = torch.einsum("skgnl,slkd->snkgd", scores.softmax(-1), values)
    return mixed.reshape(num_seqs, n, num_heads, head_dim).to(q.dtype)


def paged_attention_kernel() -> Callable[..., torch.Tensor]:
    """The Triton kernel's launcher, ``kvasync.kernels.paged_attention``.

    Returns:
        The launcher (the kernels are imported once, by ``_block_ops.installed_kernels``).

    Raises:
        KVAsyncError: Triton is not installed (the ``kvasync[gpu]`` extra).
    """
    kernels = installed_kernels()
    if kernels is None:
        raise KVAsyncError(
            "the serve engine's paged attention on a CUDA device runs a Triton kernel, and Triton "
            'is not installed: pip install "kvasync[gpu]" (or EngineConfig(attention="torch") '
            "for the torch reference, much slower)"
        )
    launcher: Callable[..., torch.Tensor] = kernels.paged_attention
    return launcher


def attend_paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: tuple[torch.Tensor, ...],
    batch: PagedBatch,
    use_kernel: bool,
) -> torch.Tensor:
    """One layer's attention for the batch: write its K/V into the blocks, then attend.

    Args:
        q: ``[T, H, D]``; k, v: ``[T, KVH, D]``: the batch's new tokens.
        caches: ``kv.layer(i)``: the layer's ``(k_cache, v_cache)``.
        batch: where the tokens go and what they attend to.
        use_kernel: the Triton kernel (else the torch reference).

    Raises:
        KVAsyncError: ``use_kernel`` without Triton installed (the ``kvasync[gpu]`` extra).
    """
    k_cache, v_cache = caches
    write_kv(k_cache, v_cache, batch, k, v)
    if use_kernel:
        result: torch.Tensor = paged_attention_kernel()(
            q.contiguous(),
            k_cache,
            v_cache,
            batch.block_tables,
            batch.query_seqs,
            batch.query_positions,
        )
        return result
    return reference_paged_attention(q, k_cache, v_cache, batch)
