"""``kvasync.ledger``: the name the share ledger's API had before it moved to ``kvasync.share``.

Kept so that code written against it keeps working; new code imports ``kvasync.share``.
"""

from .share import LedgerEntry as LedgerEntry
from .share import budget as budget
from .share import default_share as default_share
from .share import path as path
from .share import set_limit as set_limit
from .share import snapshot as snapshot

__all__ = ["LedgerEntry", "budget", "default_share", "path", "set_limit", "snapshot"]
