"""The share ledger: every allocator on one device, seen and limited from any process.

Allocators join a share with ``Config(share=..., device_budget=...)``; together they never map
more than the budget (csrc/ledger/ledger.h, Note [Share ledger]). This module reads the ledger and
sets limits from outside: it is what ``kvasync top``, ``kvasync ls`` and ``kvasync limit`` use.

    >>> from kvasync import share
    >>> for entry in share.snapshot(share.default_share(0)):
    ...     print(entry.pid, entry.name, entry.mapped_bytes, entry.limit_bytes)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .. import _core
from .._share_names import check_share, default_share, existing_shares, ledger_path, share_group

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

DEFAULT_TIMEOUT = 2.0  # seconds to wait for the ledger's lock


@dataclass(frozen=True)
class LedgerEntry:
    """One allocator of a share, as its watcher last published it (every 100 ms or sooner).

    ``committed_bytes`` is exact (what counts against the budget: pages mapping, mapped and
    unmapping); the other byte figures are the allocator's last published view.
    """

    pid: int
    name: str
    mapped_bytes: int
    reserved_bytes: int
    used_bytes: int
    committed_bytes: int
    limit_bytes: int
    budget_bytes: int  # this allocator's device_budget; 0 = none of its own
    page_bytes: int
    waiters: int
    blocked: int  # waiters short of the share's budget
    # What it wants now (Allocator.set_demand; an engine's running and waiting need): the share
    # divides its budget by these (Note [Fair share under pressure] in csrc/ledger/ledger.h).
    demand_bytes: int
    op: str  # what its mapper is doing ("" when idle)
    op_age_s: float
    serial: int  # tells apart allocators of one process
    # The owner's pid namespace (inode of /proc/self/ns/pid). ``foreign``: not the reader's, so
    # ``pid`` is not a pid of the reader's (another container); such an entry is judged alive by
    # its heartbeat, ``heartbeat_age_s`` old.
    pid_namespace: int = 0
    foreign: bool = False
    heartbeat_age_s: float = 0.0
    # What the allocator holds with every page id mapped: ``limit_bytes`` equal to it means no
    # limit in force. 0 until its first publication (or from a writer older than this field).
    capacity_bytes: int = 0

    @property
    def limited(self) -> bool:
        """Whether a limit below the allocator's capacity is in force (its own, one set from
        outside, or its fair share of a share under pressure)."""
        return self.capacity_bytes == 0 or self.limit_bytes < self.capacity_bytes

    def as_dict(self) -> dict[str, Any]:
        """The entry as a JSON-ready dict."""
        return asdict(self)


def path(share: str) -> str:
    """The file behind share ``share`` (in /dev/shm).

    Raises:
        TypeError, ValueError: ``share`` is not a valid share name.
    """
    return ledger_path(share)


def snapshot(share: str, *, timeout: float = DEFAULT_TIMEOUT) -> list[LedgerEntry]:
    """Every live allocator of ``share``; the entries of dead processes are reclaimed first.

    Args:
        share: the share's name.
        timeout: seconds to wait for the ledger's lock.

    Returns:
        The entries, in ledger slot order.

    Raises:
        ValueError, TypeError: a bad share name or timeout.
        KVAsyncError: no ledger for the share, or its file is corrupt, of another version,
            truncated, or its lock stayed taken past the timeout.
    """
    check_share(share)
    rows = _core.ledger_snapshot(ledger_path(share), _check_timeout(timeout), share_group())
    return [
        LedgerEntry(
            pid=row["pid"],
            name=row["name"],
            mapped_bytes=row["mapped_bytes"],
            reserved_bytes=row["reserved_bytes"],
            used_bytes=row["used_bytes"],
            committed_bytes=row["committed_bytes"],
            limit_bytes=row["limit_bytes"],
            budget_bytes=row["budget_bytes"],
            page_bytes=row["page_bytes"],
            waiters=row["waiters"],
            blocked=row["blocked"],
            demand_bytes=row["demand_bytes"],
            op=row["op"],
            op_age_s=row["op_age_s"],
            serial=row["serial"],
            pid_namespace=row["pid_namespace"],
            foreign=row["foreign"],
            heartbeat_age_s=row["heartbeat_age_s"],
            capacity_bytes=row["capacity_bytes"],
        )
        for row in rows
    ]


def budget(entries: list[LedgerEntry]) -> int | None:
    """The share's budget as the allocators of ``entries`` set it (the smallest), or None."""
    budgets = [e.budget_bytes for e in entries if e.budget_bytes > 0]
    return min(budgets) if budgets else None


def set_limit(share: str, pid: int, limit: int | None, *, timeout: float = DEFAULT_TIMEOUT) -> int:
    """Sets the memory limit of every allocator of process ``pid`` on ``share``.

    The allocators apply it in the background within about 100 ms: above it, they map nothing
    more, unmap their free pages at once and give back pages as blocks are freed; blocks in use
    are never touched. Raised again, they grow again.

    Args:
        share: the share's name.
        pid: the process.
        limit: bytes (rounded down to whole pages), or None to go back to each allocator's
            configured limit.
        timeout: seconds to wait for the ledger's lock.

    Returns:
        How many allocators took the limit.

    Raises:
        ValueError: ``pid`` has no allocator on the share, or ``limit`` is below one page.
        KVAsyncError: the ledger is unusable (see ``snapshot``).
    """
    check_share(share)
    if type(pid) is not int or pid <= 0:
        raise ValueError(f"pid must be a positive int, got {pid!r}")
    if limit is not None and (type(limit) is not int or limit <= 0):
        raise ValueError(f"limit must be a positive int of bytes or None, got {limit!r}")
    count = _core.ledger_set_limit(
        ledger_path(share), pid, limit or 0, _check_timeout(timeout), share_group()
    )
    if count == 0:
        raise ValueError(f"process {pid} has no allocator on share {share!r}")
    return count


def shares() -> list[str]:
    """The shares with a ledger file on this machine (``/dev/shm/kvasync-ledger.*``), sorted."""
    return existing_shares()


def prune(share: str, *, timeout: float = DEFAULT_TIMEOUT) -> bool:
    """Removes ``share``'s ledger file when no live allocator is left in it.

    The entries of dead processes are reclaimed first, under the ledger's lock; the file is
    removed under that lock too, so an allocator joining meanwhile opens a new file instead.

    Returns:
        Whether the file was removed (False: a live allocator still uses it).

    Raises:
        ValueError, TypeError: a bad share name or timeout.
        KVAsyncError: no ledger for the share, or it is unusable (see ``snapshot``).
    """
    check_share(share)
    return bool(_core.ledger_prune(ledger_path(share), _check_timeout(timeout), share_group()))


def _check_timeout(timeout: float) -> float:
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
    return float(timeout)


# Re-exported: the documented way to name a device's share.
default_share = default_share
