"""One rank of a tensor-parallel group, in its own process (tests/test_tensor_parallel.py).

Joins group ``--group`` as ``--rank`` with a host backend (wrapped in fault injection), prints one
JSON line ``{"event": "joined", ...}``, then answers commands read from stdin, one JSON line each:

- ``touch``: writes then reads back a pattern in every page this rank holds, in every range
  (an unmapped page would fault and kill the process): ``{"event": "touched", "pages": [...]}``;
- ``status``: ``{"event": "status", "mapped": [...], "jobs_done", "hung_maps", "left", ...}``;
- ``delay S`` / ``hang`` / ``fail N`` / ``release``: fault injection in this rank's backend;
- ``hold_gil S``: prints ``holding``, keeps the GIL for S seconds (busy), prints ``held``;
- ``wait_left S``: waits (bounded) until the rank left: ``{"event": "left", "ok": bool, ...}``;
- ``write_blocks [ids]``: with ``--layout``, fills those blocks of every KV buffer (torch views
  over this rank's ranges, as an engine's worker holds them) and reads them back;
- ``close`` (or end of input): leaves the group and exits.

With ``--layout L,H,D,B`` (layers, KV heads, head dim, block size) and ``--max-blocks``, the
geometry is the one ``kvasync.Allocator`` computes for that layout on the host backend, instead of
``--ranges``/``--pages``/``--page-size``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from kvasync import _core
from kvasync._group import RankMapper


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def touch(mapper: RankMapper, backend: _core.Backend, rank: int) -> list[int]:
    pages = mapper.mapped_page_ids()
    size = backend.page_size
    for index in range(backend.num_ranges):
        view = np.asarray(_core.range_view(backend, index))
        for page in pages:
            value = (rank * 31 + page * 7 + index) % 251 + 1
            chunk = view[page * size : (page + 1) * size]
            chunk[0] = value
            chunk[-1] = value
            assert chunk[0] == value and chunk[-1] == value
    return pages


def layout_geometry(spec: str, max_blocks: int) -> tuple[Any, int, int]:
    """The layout, page size and page count an Allocator uses for it (host backend)."""
    import kvasync
    from kvasync._backends import page_size_for

    layers, heads, head_dim, block_size = (int(x) for x in spec.split(","))
    layout = kvasync.KVLayout(
        num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size
    )
    config = kvasync.Config(backend="host", max_blocks=max_blocks)
    page_size = layout.page_unit(page_size_for(layout, config))
    return layout, page_size, -(-max_blocks * layout.range_block_bytes // page_size)


def write_blocks(buffers: list[Any], blocks: list[int], rank: int) -> bool:
    import torch

    ids = torch.tensor(blocks, dtype=torch.long)
    for index, buffer in enumerate(buffers):
        value = float(rank * 10 + index + 1)
        buffer[ids] = value
        if not bool((buffer[ids] == value).all()):
            return False
    return True


def hold_gil(seconds: float) -> None:
    """Keeps this thread busy in Python, never letting go of the GIL, for ``seconds``.

    A thread that needs the GIL asks for it, and gets it only at the switch interval: set far
    beyond ``seconds``, so that it gets it only after.
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 60.0)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(previous)


def status(mapper: RankMapper, faults: _core.FaultState) -> dict[str, object]:
    return {
        "mapped": mapper.mapped_page_ids(),
        "jobs_done": mapper.jobs_done,
        "hung_maps": faults.hung_maps,
        "left": mapper.left,
        "reason": mapper.left_reason,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ranges", type=int)
    parser.add_argument("--pages", type=int)
    parser.add_argument("--page-size", type=int)
    parser.add_argument("--layout")
    parser.add_argument("--max-blocks", type=int)
    parser.add_argument("--join-timeout", type=float, default=10.0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()

    faults = _core.FaultState()
    faults.delay(args.delay)
    if args.hang:
        faults.hang()
    buffers: list[Any] = []
    if args.layout:
        layout, page_size, num_pages = layout_geometry(args.layout, args.max_blocks)
        host = _core.HostBackend(layout.num_ranges, num_pages, page_size)
        from kvasync._backends import buffer_views

        buffers = buffer_views(layout, host, args.max_blocks)
    else:
        host = _core.HostBackend(args.ranges, args.pages, args.page_size)
    backend = _core.with_faults(host, faults)
    mapper = RankMapper(args.group, args.rank, backend, timeout=args.join_timeout)
    say("joined", rank=args.rank, pid=os.getpid())
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "touch":
            say("touched", pages=touch(mapper, host, args.rank))
        elif command == "write_blocks":
            say("written", ok=write_blocks(buffers, json.loads(" ".join(rest)), args.rank))
        elif command == "status":
            say("status", **status(mapper, faults))
        elif command == "delay":
            faults.delay(float(rest[0]))
            say("faults")
        elif command == "hang":
            faults.hang()
            say("faults")
        elif command == "fail":
            faults.fail(int(rest[0]))
            say("faults")
        elif command == "release":
            faults.release()
            say("faults")
        elif command == "wait_left":
            ok = mapper.wait_left(float(rest[0]))
            say("left", ok=ok, **status(mapper, faults))
        elif command == "hold_gil":
            say("holding")
            hold_gil(float(rest[0]))
            say("held")
        elif command == "close":
            break
        else:
            say("error", message=f"unknown command {command!r}")
    faults.release()  # a map blocked by a hang must not hold up close
    mapper.close(5.0)
    say("closed", mapped=mapper.mapped_page_ids())


if __name__ == "__main__":
    main()
