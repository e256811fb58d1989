"""kvasync: an elastic, virtual-memory-backed paged KV-cache allocator with an asyncio API.

Physical pages are mapped into a reserved virtual range on demand (CUDA virtual memory on a GPU,
memfd + mmap on a CPU) by a dedicated C++ mapper thread; every alloc is a deadline-bound future.
"""

from ._allocator import Allocator as Allocator
from ._allocator import open_allocator as open_allocator
from ._config import Config as Config
from ._errors import AllocatorClosed as AllocatorClosed
from ._errors import AllocTimeout as AllocTimeout
from ._errors import KVAsyncError as KVAsyncError
from ._errors import MapError as MapError
from ._errors import OutOfBlocks as OutOfBlocks
from ._errors import WouldBlock as WouldBlock
from ._layout import KVLayout as KVLayout
from ._stats import AllocatorStats as AllocatorStats
from ._sync import SyncAllocator as SyncAllocator
from ._sync import open_allocator_sync as open_allocator_sync

__all__ = [
    "AllocTimeout",
    "Allocator",
    "AllocatorClosed",
    "AllocatorStats",
    "Config",
    "KVAsyncError",
    "KVLayout",
    "MapError",
    "OutOfBlocks",
    "SyncAllocator",
    "WouldBlock",
    "open_allocator",
    "open_allocator_sync",
]

__version__ = "0.1.0"
