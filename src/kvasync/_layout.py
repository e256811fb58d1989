"""KVLayout: the shape of the KV cache, and how its blocks sit in the virtual ranges.

Per-layer layout (``contiguous=False``): one virtual range per (layer, K/V) buffer::

    range r = layer * kv_buffers + buffer
    | block 0 | block 1 | ... |        block = [block_size, num_kv_heads, head_dim]

Contiguous layout (``contiguous=True``): one range, block-major across layers and K/V, so that one
page id is one physical allocation::

    | block 0: L0K L0V L1K L1V ... | block 1: L0K L0V ... | ...

Either way a page id covers the same blocks in every buffer, and ``kv.layer(i)`` returns views of
shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided in the contiguous layout).

Note [Blocks across page boundaries]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Block ``i`` sits at byte ``i * range_block_bytes`` of each range: one fixed stride, as paged
attention kernels expect. A page need not be a multiple of the block (MLA's 18432-byte blocks,
head_dim 80 or 96, any odd head count): a block that would straddle a page boundary is never
handed out (it would need two pages mapped at once and would pin both), so at most one block id per
page boundary is lost; its id stays in ``range(num_blocks)`` and is refused like any unallocated id.
Over a whole period of pages that loses ``range_block_bytes - gcd(page, range_block_bytes)`` bytes
a page. When that is more than 1/32 of the page (large blocks: the contiguous layout's block holds
every layer), the unit of mapping is the smallest multiple of ``page_size`` that loses at most
1/32 (``page_unit``); it is also the unit when one block is larger than ``page_size``. The
capacity lost shows in ``stats().unusable_blocks`` and in the log line at open.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _validate

__all__ = ["SUPPORTED_DTYPES", "KVLayout"]

# Note [Blocks across page boundaries]: the unit of mapping loses at most 1/_MAX_LOST_SHARE of
# itself to blocks across its boundaries.
_MAX_LOST_SHARE = 32

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

    def page_unit(self, page_size: int) -> int:
        """The bytes per range that one page id maps, for a requested ``page_size``.

        ``page_size`` itself when its blocks lose at most 1/32 of it to page boundaries (always
        when it is a multiple of ``range_block_bytes``), else the smallest multiple of it that
        does (Note [Blocks across page boundaries]).

        Raises:
            TypeError: ``page_size`` is not an int (or is a bool).
            ValueError: ``page_size`` is not positive.
        """
        page_size = _validate.count(page_size, "page_size")
        block = self.range_block_bytes
        multiple = max(1, -(-block // page_size))
        while (block - math.gcd(multiple * page_size, block)) * _MAX_LOST_SHARE > (
            multiple * page_size
        ):
            multiple += 1  # ends by ceil(32 * block / page_size): the loss is below one block
        return multiple * page_size

    def unusable_blocks(self, page_size: int, num_blocks: int) -> int:
        """Block ids of ``range(num_blocks)`` that straddle a boundary of pages of ``page_size``
        bytes per range (a unit from ``page_unit``), and so are never handed out.

        Raises:
            TypeError: ``page_size`` or ``num_blocks`` is not an int (or is a bool).
            ValueError: ``page_size`` is not positive, or ``num_blocks`` is negative.
        """
        page_size = _validate.count(page_size, "page_size")
        num_blocks = _validate.integer(num_blocks, "num_blocks", minimum=0)
        block = self.range_block_bytes
        ends = num_blocks * block
        # A boundary k * page_size inside (0, ends) cuts a block unless it is a block boundary.
        boundaries = (ends - 1) // page_size
        step = page_size * block // math.gcd(page_size, block)  # boundaries on block boundaries
        return boundaries - (ends - 1) // step

    def blocks_per_page(self, page_size: int) -> int:
        """Blocks that one page id holds, where ``page_size`` is a multiple of the block.

        Other page sizes work too (an allocator maps ``page_unit(page_size)``), but their pages
        do not all hold the same number of blocks.

        Raises:
            TypeError: ``page_size`` is not an int (or is a bool).
            ValueError: ``page_size`` is not a positive multiple of the block's bytes in a range.
        """
        page_size = _validate.count(page_size, "page_size")
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
