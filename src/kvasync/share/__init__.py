"""kvasync.share: the share ledger of a device, read and limited from any process.

Co-located allocators of one device join a *share*: a ledger in shared memory (its C++ half is
``csrc/ledger/``) that holds their budget and every member's committed bytes. This subpackage is
its consumer-side face: ``snapshot`` and ``set_limit`` for programs, and the ``kvasync top``,
``kvasync ls`` and ``kvasync limit`` verbs (``kvasync.share._cli``). The allocator joins a share
through the core (``Config(share=...)``), never through here.

    >>> from kvasync import share
    >>> for entry in share.snapshot("cuda0"):
    ...     print(entry.pid, entry.name, entry.committed_bytes)
"""

from ._ledger import LedgerEntry as LedgerEntry
from ._ledger import budget as budget
from ._ledger import default_share as default_share
from ._ledger import path as path
from ._ledger import prune as prune
from ._ledger import set_limit as set_limit
from ._ledger import shares as shares
from ._ledger import snapshot as snapshot

__all__ = [
    "LedgerEntry",
    "budget",
    "default_share",
    "path",
    "prune",
    "set_limit",
    "shares",
    "snapshot",
]
