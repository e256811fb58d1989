"""Sizes in bytes as people write them: ``12GiB`` in, ``1.5 GiB`` out.

Core, with no command-line library: the share verbs (``kvasync limit``), ``kvasync serve
--device-budget`` and environment variables of integrations all read sizes with ``parse_size``.
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_size"]

# Binary units have a bare or an "i" spelling (k, kib); "kb", "mb", ... are decimal, as on a disk.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes from ``"12GiB"``, ``"512MiB"``, ``"1.5G"`` (binary), ``"2GB"`` (decimal), ``"4096"``.

    Args:
        text: a number, optionally followed by a unit (case-insensitive).

    Returns:
        The size in bytes, rounded down to a whole byte.

    Raises:
        ValueError: not a size, or a size below one byte.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 12GiB, 512MiB, 1.5G, 4096)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"a size must be at least one byte, got {text!r}")
    return value


def format_bytes(value: int | None) -> str:
    """``1.5 GiB``, ``512 MiB``, ``0 B``; ``-`` for None."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
