"""Zero the GPU code for other architectures out of a shared library's CUDA fat binaries.

A CUDA library carries its kernels in the ELF section ``.nv_fatbin``: a run of fat binary
containers (magic 0xBA55ED50), each a list of entries, one cubin (ELF) or PTX text per
architecture. The driver picks one entry per container for the GPU at hand and reads no other
(NCCL's ``__nv_relfatbin``, relocatable device code it links at run time, has the same layout).
This keeps, in each container, the cubins for the architectures named (``--keep 90``: sm_90 and
sm_90a) and, in a container that has none of them, the PTX entries the driver could JIT for
them (the newest whose architecture is at most the highest kept); every other entry's payload
is overwritten with zeros in place. Headers, offsets and the file's size stay as they were, so
nothing else in the library moves; the zeros compress to almost nothing, which is the point
(a library packed with xz for the device shrinks by the share of its code for other GPUs).

Usage: ``python3 keep_arch.py --keep 90 LIB.so [LIB.so ...]`` (edits in place; prints what
it zeroed). Pure Python, no CUDA tools needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import struct
import sys
from collections.abc import Iterable

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1
KIND_ELF = 2
# A container's header: magic, version, header size, size of the entries after the header.
_CONTAINER = struct.Struct("<IHHQ")
# An entry's header (its first 32 bytes): kind, version, header size, payload size,
# compressed size, unknown, minor, major, architecture.
_ENTRY = struct.Struct("<HHIQIIHHI")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of a fat binary container: where its payload lies in the section's bytes."""

    kind: int
    arch: int
    payload_offset: int
    payload_size: int


@dataclasses.dataclass
class Stats:
    """What one library's trim found and did."""

    containers: int = 0
    entries: int = 0
    kept: int = 0
    zeroed_bytes: int = 0
    kept_bytes: int = 0


FATBIN_SECTIONS = (b".nv_fatbin", b"__nv_relfatbin")


def fatbin_sections(data: bytes | bytearray) -> list[tuple[int, int]]:
    """The file offset and size of each fat binary section (``.nv_fatbin``, and NCCL's
    ``__nv_relfatbin`` of relocatable device code) in a 64-bit little-endian ELF."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0:
        return []

    def header(i: int) -> tuple[int, int, int, int]:
        base = shoff + i * shentsize
        name, kind = struct.unpack_from("<II", data, base)
        offset, size = struct.unpack_from("<QQ", data, base + 0x18)
        return name, kind, offset, size

    _, _, stroff, strsize = header(shstrndx)
    names = bytes(data[stroff : stroff + strsize])
    found = []
    for i in range(shnum):
        name, kind, offset, size = header(i)
        end = names.index(b"\0", name)
        if names[name:end] in FATBIN_SECTIONS and kind != 8:  # 8: SHT_NOBITS
            found.append((offset, size))
    return found


def containers(data: bytes | bytearray, start: int, size: int) -> Iterable[list[Entry]]:
    """Each fat binary container in ``data[start:start+size]``, as its entries."""
    pos, end = start, start + size
    while pos + _CONTAINER.size <= end:
        magic, _version, header_size, fat_size = _CONTAINER.unpack_from(data, pos)
        if magic != FATBIN_MAGIC:
            # Containers are 8-byte aligned; anything between them is padding (zeros).
            if any(data[pos : pos + 8]):
                raise ValueError(f"no fat binary container at section offset {pos - start:#x}")
            pos += 8
            continue
        entries: list[Entry] = []
        epos, eend = pos + header_size, pos + header_size + fat_size
        if eend > end:
            raise ValueError(f"container at {pos - start:#x} runs past the section")
        while epos < eend:
            kind, _v, eheader, payload, _c, _u, _minor, _major, arch = _ENTRY.unpack_from(
                data, epos
            )
            if kind not in (KIND_PTX, KIND_ELF) or eheader < _ENTRY.size:
                raise ValueError(f"unexpected entry kind {kind} at {epos - start:#x}")
            entries.append(Entry(kind, arch, epos + eheader, payload))
            epos += eheader + payload
        if epos != eend:
            raise ValueError(f"container at {pos - start:#x}: entries do not fill it")
        yield entries
        pos = eend


def chosen(entries: list[Entry], keep: set[int]) -> set[int]:
    """Indices of the entries the driver may pick on a GPU of an architecture in ``keep``."""
    cubins = {i for i, e in enumerate(entries) if e.kind == KIND_ELF and e.arch in keep}
    if cubins:
        return cubins
    top = max(keep)
    ptx = [(e.arch, i) for i, e in enumerate(entries) if e.kind == KIND_PTX and e.arch <= top]
    if ptx:
        newest = max(a for a, _ in ptx)
        return {i for a, i in ptx if a == newest}
    # Nothing usable for these GPUs (a kernel built only for others): keep it all, zero nothing.
    return set(range(len(entries)))


def trim(data: bytearray, keep: set[int]) -> Stats:
    """Zero, in place, every payload of ``data``'s fat binaries the ``keep`` GPUs cannot use."""
    stats = Stats()
    for entries in (e for section in fatbin_sections(data) for e in containers(data, *section)):
        stats.containers += 1
        stats.entries += len(entries)
        kept = chosen(entries, keep)
        for i, e in enumerate(entries):
            if i in kept:
                stats.kept += 1
                stats.kept_bytes += e.payload_size
            else:
                data[e.payload_offset : e.payload_offset + e.payload_size] = bytes(e.payload_size)
                stats.zeroed_bytes += e.payload_size
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", default="90", help="architectures to keep, comma-separated")
    parser.add_argument("libs", nargs="+")
    args = parser.parse_args(argv)
    keep = {int(a) for a in args.keep.split(",")}
    for path in args.libs:
        with open(path, "rb") as f:
            data = bytearray(f.read())
        stats = trim(data, keep)
        if stats.zeroed_bytes:
            with open(path, "wb") as f:
                f.write(data)
        print(
            f"{path}: {stats.containers} containers, {stats.entries} entries, kept {stats.kept} "
            f"({stats.kept_bytes / 2**20:.1f} MiB), zeroed {stats.zeroed_bytes / 2**20:.1f} MiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
