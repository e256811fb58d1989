"""Share names and ledger paths (csrc/ledger/ledger.h, Note [Share ledger]).

Private: the allocator joins a share through here; the public face is ``kvasync.share``. It knows
names and files, not the allocator's settings: ``Config`` checks a share name with ``check_share``,
so this module imports nothing of the config (no cycle).
"""

from __future__ import annotations

import glob
import grp
import os
import re
import sys

from . import _core

__all__ = [
    "SHARE_GROUP_ENV",
    "check_share",
    "default_name",
    "default_share",
    "existing_shares",
    "join",
    "ledger_path",
    "share_group",
]

LEDGER_DIR = "/dev/shm"
LEDGER_PREFIX = "kvasync-ledger."
# Note [Ledger access] (csrc/ledger/ledger.h): a group whose members share a device's ledger.
SHARE_GROUP_ENV = "KVASYNC_SHARE_GROUP"
_SHARE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_share(share: object, what: str = "share") -> str:
    """Returns ``share`` when it is a valid share name.

    Raises:
        TypeError: ``share`` is not a str.
        ValueError: it is not 1-100 of ``A-Z a-z 0-9 . _ -``, starting with a letter or digit.
    """
    if not isinstance(share, str):
        raise TypeError(f"{what} must be a str, got {type(share).__name__}")
    if not _SHARE_NAME.fullmatch(share):
        raise ValueError(
            f"{what} must be 1-100 characters of A-Z a-z 0-9 . _ - starting with a letter or "
            f"digit, got {share!r}"
        )
    return share


def ledger_path(share: str) -> str:
    """The file in /dev/shm behind share ``share``.

    Raises:
        TypeError, ValueError: ``share`` is not a valid share name.
    """
    return os.path.join(LEDGER_DIR, f"{LEDGER_PREFIX}{check_share(share)}")


def existing_shares() -> list[str]:
    """The names of the shares that have a ledger file on this machine, sorted."""
    names = []
    for path in glob.glob(os.path.join(LEDGER_DIR, f"{LEDGER_PREFIX}*")):
        name = os.path.basename(path)[len(LEDGER_PREFIX) :]
        if ".tmp." not in name and _SHARE_NAME.fullmatch(name):  # not a file being created
            names.append(name)
    return sorted(names)


def share_group() -> int:
    """The gid named by ``KVASYNC_SHARE_GROUP`` (a group name or number), or -1 when unset.

    Unset, a share's ledger file is its user's alone (mode 0600, and a file owned by anyone else
    is refused). Set, the file is created with that group and mode 0660, and a file of that group
    owned by one of its members is accepted: the way to share a device between users.

    Raises:
        ValueError: the variable names no group of this machine.
    """
    value = os.environ.get(SHARE_GROUP_ENV, "").strip()
    if not value:
        return -1
    try:
        return grp.getgrgid(int(value)).gr_gid if value.isdigit() else grp.getgrnam(value).gr_gid
    except KeyError:
        raise ValueError(f"{SHARE_GROUP_ENV}={value!r} names no group of this machine") from None


def default_share(device: int | str = 0) -> str:
    """The share name of a device, the same in every process that uses that device.

    ``"host"`` for the host backend; for CUDA device ordinal ``device``, ``"cuda<N>"`` with N the
    device's index as the machine numbers it: the ordinal is translated through
    ``CUDA_VISIBLE_DEVICES`` (so two processes that see the same GPU under different ordinals
    share it), or ``"cuda-<UUID>"`` when that variable names devices by UUID.

    Raises:
        ValueError: ``device`` is negative, or beyond the devices ``CUDA_VISIBLE_DEVICES`` lists.
        TypeError: ``device`` is neither an int nor ``"host"``.
    """
    if device == "host":
        return "host"
    if type(device) is not int:
        raise TypeError(f"device must be a CUDA ordinal (int) or 'host', got {device!r}")
    if device < 0:
        raise ValueError(f"device must be >= 0, got {device}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return f"cuda{device}"
    listed = [item.strip() for item in visible.split(",") if item.strip()]
    if device >= len(listed):
        raise ValueError(
            f"device {device} is not among CUDA_VISIBLE_DEVICES={visible!r} ({len(listed)} listed)"
        )
    item = listed[device]
    if item.isdigit():
        return f"cuda{int(item)}"
    return check_share(f"cuda-{re.sub(r'[^A-Za-z0-9._-]', '-', item)}", "device UUID")


def default_name() -> str:
    """An allocator's name in the ledger when its Config gives none: the program's name."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return program or "python"


def join(share: str, name: str, budget_bytes: int, page_bytes: int) -> _core.ShareMember:
    """Takes an entry in the share's ledger (creating the file if needed).

    Raises:
        KVAsyncError: the ledger file is unusable (corrupt, another version, full, no rights), or
            its owner or mode is not the one ``KVASYNC_SHARE_GROUP`` asks for (``share_group``).
        ValueError: ``KVASYNC_SHARE_GROUP`` names no group.
    """
    return _core.ShareMember(ledger_path(share), name, budget_bytes, page_bytes, share_group())
