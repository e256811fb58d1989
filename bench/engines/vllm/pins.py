"""The version a wheel's METADATA pins a requirement to: ``== X`` or ``~= X`` gives X.

Reads METADATA on stdin; prints the pin of the package named on the command line and exits 0, or
exits 1 when it has none. Requirements under an extra are ignored, and so are those whose marker
cannot hold on the device (Linux, x86_64, CPython 3.12): pack.sh takes torch's pin from vLLM's
metadata, and Triton's and NCCL's from torch's, so that a newer release brings its own pins.
"""

from __future__ import annotations

import re
import sys

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")
_PIN = re.compile(r"(?:===?|~=)\s*([0-9][0-9A-Za-z.+!-]*)")
# The facts a marker is checked against on the device machine.
_DEVICE = {
    "platform_system": "Linux",
    "sys_platform": "linux",
    "platform_machine": "x86_64",
    "python_version": "3.12",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
}


def normalize(name: str) -> str:
    """A distribution name as the registry compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def _clause(clause: str) -> bool:
    m = re.match(r"""\s*(\w+)\s*(==|!=|<=|>=|<|>)\s*["']([^"']*)["']\s*$""", clause)
    if m is None:
        return True  # a clause this does not understand is taken to hold
    key, op, value = m.groups()
    if key == "extra":
        return False
    if key not in _DEVICE:
        return True
    have = _DEVICE[key]
    if key == "python_version":
        a, b = _version(have), _version(value)
        return {
            "==": a == b,
            "!=": a != b,
            "<=": a <= b,
            ">=": a >= b,
            "<": a < b,
            ">": a > b,
        }[op]
    return {"==": have == value, "!=": have != value}.get(op, True)


def marker_holds(marker: str) -> bool:
    """Whether a requirement's environment marker holds on the device (``and``/``or``, no
    parentheses beyond a plain group)."""
    marker = marker.strip().strip("()")
    if not marker:
        return True
    return any(
        all(_clause(c.strip("() ")) for c in re.split(r"\band\b", alt))
        for alt in re.split(r"\bor\b", marker)
    )


def pin(metadata: str, package: str) -> str | None:
    """The version ``package`` is pinned to by ``metadata``'s Requires-Dist, or None."""
    want = normalize(package)
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line[len("Requires-Dist:") :].partition(";")
        m = _NAME.match(spec)
        if m is None or normalize(m.group(1)) != want or not marker_holds(marker):
            continue
        found = _PIN.search(m.group(3))
        if found:
            return found.group(1)
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: pins.py PACKAGE < METADATA", file=sys.stderr)
        return 2
    version = pin(sys.stdin.read(), argv[1])
    if version is None:
        print(f"no pin for {argv[1]}", file=sys.stderr)
        return 1
    print(version)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
