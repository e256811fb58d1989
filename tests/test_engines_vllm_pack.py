"""bench/engines/vllm's pure helpers: keep_arch.py (zero other GPUs' code in a library's fat
binaries) on a hand-built ELF, and pins.py (a wheel's pin of a requirement) on metadata text."""

from __future__ import annotations

import importlib.util
import pathlib
import struct
import sys
from types import ModuleType

import pytest

HERE = pathlib.Path(__file__).resolve().parents[1] / "bench" / "engines" / "vllm"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_vllm_pack_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


keep_arch = load("keep_arch")
pins = load("pins")


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = struct.pack("<HHIQIIHHI", kind, 0x101, 64, len(payload), 0, 0, 0, 0, arch)
    return header + bytes(64 - len(header)) + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", keep_arch.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(sections: dict[str, bytes]) -> bytes:
    """A 64-bit little-endian ELF with the named PROGBITS sections and nothing else."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    data, offsets = bytearray(64), []
    for payload in sections.values():
        offsets.append(len(data))
        data += payload + bytes(-len(payload) % 8)
    stroff = len(data)
    data += names + bytes(-len(names) % 8)
    shoff = len(data)
    headers = [bytes(64)]
    for i, (name, payload) in enumerate(sections.items()):
        at = names.index(name.encode() + b"\0")
        headers.append(
            struct.pack("<IIQQQQIIQQ", at, 1, 2, 0, offsets[i], len(payload), 0, 0, 8, 0)
        )
    at = names.index(b".shstrtab\0")
    headers.append(struct.pack("<IIQQQQIIQQ", at, 3, 0, 0, stroff, len(names), 0, 0, 1, 0))
    data += b"".join(headers)
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    data[:64] = ident + struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(headers), len(headers) - 1
    )
    return bytes(data)


def test_keeps_sm90_cubins_and_zeroes_the_rest() -> None:
    first = container(
        entry(keep_arch.KIND_ELF, 80, b"A" * 40),
        entry(keep_arch.KIND_ELF, 90, b"B" * 24),
        entry(keep_arch.KIND_PTX, 80, b"C" * 16),
    )
    # No sm_90 cubin: the newest PTX at most 90 is what the driver would JIT.
    second = container(
        entry(keep_arch.KIND_PTX, 75, b"D" * 8),
        entry(keep_arch.KIND_PTX, 86, b"E" * 8),
        entry(keep_arch.KIND_ELF, 100, b"F" * 32),
    )
    data = bytearray(elf({".text": b"\x90" * 8, ".nv_fatbin": first + bytes(8) + second}))
    before = len(data)
    stats = keep_arch.trim(data, {90})
    assert len(data) == before
    assert (stats.containers, stats.entries, stats.kept) == (2, 6, 2)
    assert stats.kept_bytes == 24 + 8
    assert stats.zeroed_bytes == 40 + 16 + 8 + 32
    for kept in (b"B" * 24, b"E" * 8, b"\x90" * 8):
        assert kept in data
    for gone in (b"A" * 2, b"C" * 2, b"D" * 2, b"F" * 2):
        assert gone not in data
    # Headers stay: a second pass finds the same structure and zeroes nothing more.
    again = keep_arch.trim(data, {90})
    assert (again.containers, again.entries, again.kept) == (2, 6, 2)


def test_relocatable_fatbin_and_libraries_without_one() -> None:
    nccl = bytearray(
        elf({"__nv_relfatbin": container(entry(2, 90, b"G" * 8), entry(2, 80, b"H" * 8))})
    )
    stats = keep_arch.trim(nccl, {90})
    assert (stats.kept, stats.zeroed_bytes) == (1, 8)
    assert b"G" * 8 in nccl and b"H" * 8 not in nccl
    plain = bytearray(elf({".text": b"\x90" * 16}))
    assert keep_arch.trim(plain, {90}).containers == 0
    with pytest.raises(ValueError, match="ELF"):
        keep_arch.trim(bytearray(b"not an elf" * 8), {90})


def test_a_container_with_nothing_for_the_gpu_is_left_whole() -> None:
    data = bytearray(
        elf({".nv_fatbin": container(entry(2, 100, b"I" * 8), entry(2, 120, b"J" * 8))})
    )
    stats = keep_arch.trim(data, {90})
    assert (stats.kept, stats.zeroed_bytes) == (2, 0)


def test_damaged_fatbin_is_refused() -> None:
    body = container(entry(2, 90, b"K" * 8))
    damaged = body[:16] + struct.pack("<H", 7) + body[18:]  # an unknown entry kind
    with pytest.raises(ValueError, match="entry kind"):
        keep_arch.trim(bytearray(elf({".nv_fatbin": damaged})), {90})


def test_main_edits_in_place(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    lib = tmp_path / "lib.so"
    lib.write_bytes(elf({".nv_fatbin": container(entry(2, 90, b"L" * 8), entry(2, 80, b"M" * 8))}))
    assert keep_arch.main(["--keep", "90", str(lib)]) == 0
    assert b"M" * 8 not in lib.read_bytes()
    assert "kept 1" in capsys.readouterr().out


METADATA = """\
Metadata-Version: 2.4
Name: vllm
Requires-Dist: regex
Requires-Dist: torch==2.14.0
Requires-Dist: torchvision==0.29.0
Requires-Dist: triton~=3.8.0; platform_system == "Linux" and python_version < "3.15"
Requires-Dist: tilelang==0.1.12; platform_system == "Darwin"
Requires-Dist: nvidia-nccl-cu13==2.30.7; platform_system == "Linux"
Requires-Dist: pytest==9.0; extra == "test"
Requires-Dist: old-thing==1.0; python_version < "3.10"
Requires-Dist: Compressed_Tensors [extra]==0.17.0
"""


@pytest.mark.parametrize(
    ("package", "version"),
    [
        ("torch", "2.14.0"),
        ("torchvision", "0.29.0"),
        ("triton", "3.8.0"),
        ("nvidia_nccl_cu13", "2.30.7"),
        ("compressed-tensors", "0.17.0"),
        ("regex", None),
        ("tilelang", None),
        ("pytest", None),
        ("old-thing", None),
        ("absent", None),
    ],
)
def test_pins(package: str, version: str | None) -> None:
    assert pins.pin(METADATA, package) == version


def test_pins_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(METADATA))
    assert pins.main(["pins.py", "torch"]) == 0
    assert capsys.readouterr().out.strip() == "2.14.0"
    monkeypatch.setattr(sys, "stdin", io.StringIO(METADATA))
    assert pins.main(["pins.py", "regex"]) == 1
