"""Triton kernels of kvasync, shipped inside the package as `kvasync.kernels`.

See Note [Block copy kernels] in block_copy.py and Note [Paged attention kernel] in
paged_attention.py.
"""

from .block_copy import INTERPRETED as INTERPRETED
from .block_copy import BlockTable as BlockTable
from .block_copy import block_table as block_table
from .block_copy import copy_blocks as copy_blocks
from .block_copy import gather_blocks as gather_blocks
from .block_copy import scatter_blocks as scatter_blocks
from .block_copy import zero_blocks as zero_blocks
from .paged_attention import paged_attention as paged_attention

__all__ = [
    "INTERPRETED",
    "BlockTable",
    "block_table",
    "copy_blocks",
    "gather_blocks",
    "paged_attention",
    "scatter_blocks",
    "zero_blocks",
]
