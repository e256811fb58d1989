"""kvasync: an elastic, virtual-memory-backed paged KV-cache allocator with an asyncio API.

Physical pages are mapped into a reserved virtual range on demand (CUDA virtual memory on a GPU,
memfd + mmap on a CPU) by a dedicated C++ mapper thread; every alloc is a deadline-bound future.

The public names are loaded on first use (PEP 562): ``import kvasync`` alone imports neither
torch nor the C++ extension, so ``kvasync --version`` and ``--help`` start at once.
"""

# Private aliases: the module's namespace holds the public names alone (test_public_api).
import importlib as _importlib
import sys as _sys
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
    "Allocator": "kvasync._allocator",
    "open_allocator": "kvasync._allocator",
    "Config": "kvasync._config",
    "AllocatorClosed": "kvasync._errors",
    "AllocTimeout": "kvasync._errors",
    "KVAsyncError": "kvasync._errors",
    "MapError": "kvasync._errors",
    "OutOfBlocks": "kvasync._errors",
    "WouldBlock": "kvasync._errors",
    "KVLayout": "kvasync._layout",
    "AllocatorStats": "kvasync._stats",
    "SyncAllocator": "kvasync._sync",
    "open_allocator_sync": "kvasync._sync",
}


# NOTE: hidden from type checkers, which then see the imports above and nothing else: a module
# __getattr__ would make every misspelt attribute of kvasync type-check.
if not _typing.TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'kvasync' has no attribute {name!r}")
        # NOTE: not cached in this module's namespace: the answer stays whatever module
        # sys.modules holds now, also after a test harness (pytester) drops and re-imports
        # kvasync's modules, where a cached class would no longer be the one kvasync checks.
        module = _sys.modules.get(home) or _importlib.import_module(home)
        return getattr(module, name)

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
