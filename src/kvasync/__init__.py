"""kvasync: an elastic, virtual-memory-backed paged KV-cache allocator with an asyncio API.

Physical pages are mapped into a reserved virtual range on demand (CUDA virtual memory on a GPU,
memfd + mmap on a CPU) by a dedicated C++ mapper thread; every alloc is a deadline-bound future.

The public names are loaded on first use (PEP 562): ``import kvasync`` alone imports neither
torch nor the C++ extension, so ``kvasync --version`` and ``--help`` start at once.
"""

# Private aliases: the module's namespace holds the public names alone (test_public_api).
import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
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

# public name -> the private module that defines it
_HOMES = {
    "Allocator": "._allocator",
    "open_allocator": "._allocator",
    "Config": "._config",
    "AllocatorClosed": "._errors",
    "AllocTimeout": "._errors",
    "KVAsyncError": "._errors",
    "MapError": "._errors",
    "OutOfBlocks": "._errors",
    "WouldBlock": "._errors",
    "KVLayout": "._layout",
    "AllocatorStats": "._stats",
    "SyncAllocator": "._sync",
    "open_allocator_sync": "._sync",
}


# NOTE: hidden from type checkers, which then see the imports above and nothing else: a module
# __getattr__ would make every misspelt attribute of kvasync type-check.
if not _typing.TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'kvasync' has no attribute {name!r}")
        value = getattr(_importlib.import_module(home, __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
