"""Every error kvasync raises, in one place.

A caller's mistake (bad arguments, freeing a block that is not allocated) is a plain
``ValueError`` and changes nothing. The classes here are the allocator's own outcomes.
"""

from __future__ import annotations

__all__ = [
    "AllocTimeout",
    "AllocatorClosed",
    "KVAsyncError",
    "MapError",
    "OutOfBlocks",
    "WouldBlock",
]


class KVAsyncError(Exception):
    """Base class of kvasync's errors.

    Raised as itself when a backend cannot be used at all (for example ``backend="cuda"`` on a
    machine without a CUDA driver).
    """


class AllocTimeout(KVAsyncError, TimeoutError):
    """Raised by ``Allocator.alloc`` (and ``trim``/``resize``) when the deadline passes first.

    The message says what the request was waiting for (pages mapping, blocks being freed, earlier
    requests) and for how long. Nothing is leaked: blocks that arrive later go back to the pool.
    """


class OutOfBlocks(KVAsyncError):
    """Raised at once when a request can never fit.

    That is: more blocks than the virtual capacity (``max_blocks``) or than the memory limit
    allows. Not raised for "not enough free right now": that waits, up to the deadline.
    """


class WouldBlock(KVAsyncError):
    """Raised by ``Allocator.alloc_nowait`` when the blocks are not mapped and free right now."""


class MapError(KVAsyncError):
    """Raised in the requests a failed backend map affected.

    The message carries the driver's error name (``CUDA_ERROR_OUT_OF_MEMORY``, ``ENOMEM``, ...).
    The allocator keeps serving afterwards.
    """


class AllocatorClosed(KVAsyncError):
    """Raised by every call on a closed allocator, and in requests still waiting at close."""
