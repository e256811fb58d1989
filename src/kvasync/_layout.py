"""KVLayout: the shape of the KV cache, and how its blocks sit in the virtual ranges.

Per-layer layout (``contiguous=False``): one virtual range per (layer, K/V) buffer::

    range r = layer * kv_buffers + buffer
    | block 0 | block 1 | ... |        block = [block_size, num_kv_heads, head_dim]

Contiguous layout (``contiguous=True``): one range, block-major across layers and K/V, so that one
page id is one physical allocation::

    | block 0: L0K L0V L1K L1V ... | block 1: L0K L0V ... | ...

Either way a page id covers the same blocks in every buffer, and ``kv.layer(i)`` returns views of
shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided in the contiguous layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _validate

__all__ = ["SUPPORTED_DTYPES", "KVLayout"]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.int8,
)


@dataclass(frozen=True)
class KVLayout:
    """The geometry of one model's KV cache.

    Args:
        num_layers: attention layers that keep a KV cache.
        num_kv_heads: KV heads per layer (on this rank).
        head_dim: elements per head.
        block_size: tokens per block.
        dtype: element type: fp16, bf16, fp32, fp8 (e4m3) or int8.
        kv_buffers: 2 for separate K and V, 1 for a single latent buffer (MLA).
        contiguous: one block-major range across all layers instead of one range per buffer.

    Raises:
        TypeError: a field of the wrong type (a count that is not an int, a bool as a count).
        ValueError: a count is not positive, kv_buffers is not 1 or 2, or the dtype is not
            supported.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float16
    kv_buffers: int = 2
    contiguous: bool = False

    def __post_init__(self) -> None:
        # Note [Argument errors] in _validate.py. Sizes are bounded so that a block's bytes and
        # offsets stay well inside int64 whatever the capacity.
        # Stored as plain ints: a numpy integer passes the check but must not travel further.
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = _validate.integer(
                getattr(self, name), f"KVLayout.{name}", minimum=1, maximum=1 << 31
            )
            object.__setattr__(self, name, value)  # a frozen dataclass, still being built
        kv_buffers = _validate.integer(self.kv_buffers, "KVLayout.kv_buffers")
        if kv_buffers not in (1, 2):
            raise ValueError(f"KVLayout.kv_buffers must be 1 or 2, got {self.kv_buffers!r}")
        object.__setattr__(self, "kv_buffers", kv_buffers)
        _validate.instance(self.dtype, "KVLayout.dtype", torch.dtype)
        if self.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise ValueError(f"KVLayout.dtype {self.dtype} is not supported; use one of {names}")
        _validate.flag(self.contiguous, "KVLayout.contiguous")

    @property
    def num_buffers(self) -> int:
        """Buffers across all layers: ``num_layers * kv_buffers``."""
        return self.num_layers * self.kv_buffers

    @property
    def block_elements(self) -> int:
        """Elements of one block in one buffer."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one buffer."""
        return self.block_elements * self.dtype.itemsize

    @property
    def num_ranges(self) -> int:
        """Virtual ranges the backend reserves: 1 (contiguous) or one per buffer."""
        return 1 if self.contiguous else self.num_buffers

    @property
    def range_block_bytes(self) -> int:
        """Bytes one block takes in each range (its stride there)."""
        return self.block_bytes * (self.num_buffers if self.contiguous else 1)

    def blocks_per_page(self, page_size: int) -> int:
        """Blocks that one page id holds.

        Raises:
            ValueError: ``page_size`` is not a multiple of the block's bytes in a range.
        """
        stride = self.range_block_bytes
        if page_size < stride or page_size % stride:
            fitting = (page_size // stride + 1) * stride if page_size < stride else None
            hint = f"; e.g. page_size={fitting}" if fitting else ""
            raise ValueError(
                f"page_size {page_size} must be a multiple of the block's {stride} bytes per "
                f"range (block_size * num_kv_heads * head_dim * itemsize"
                f"{' * num_layers * kv_buffers' if self.contiguous else ''}){hint}"
            )
        return page_size // stride
