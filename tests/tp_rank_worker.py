"""One rank of a tensor-parallel group, in its own process (tests/test_tensor_parallel.py).

Joins group ``--group`` as ``--rank`` with a host backend (wrapped in fault injection), prints one
JSON line ``{"event": "joined", ...}``, then answers commands read from stdin, one JSON line each:

- ``touch``: writes then reads back a pattern in every page this rank holds, in every range
  (an unmapped page would fault and kill the process): ``{"event": "touched", "pages": [...]}``;
- ``status``: ``{"event": "status", "mapped": [...], "jobs_done", "hung_maps", "left", ...}``;
- ``delay S`` / ``hang`` / ``fail N`` / ``release``: fault injection in this rank's backend;
- ``wait_left S``: waits (bounded) until the rank left: ``{"event": "left", "ok": bool, ...}``;
- ``close`` (or end of input): leaves the group and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

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
    parser.add_argument("--ranges", type=int, required=True)
    parser.add_argument("--pages", type=int, required=True)
    parser.add_argument("--page-size", type=int, required=True)
    parser.add_argument("--join-timeout", type=float, default=10.0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()

    faults = _core.FaultState()
    faults.delay(args.delay)
    if args.hang:
        faults.hang()
    host = _core.HostBackend(args.ranges, args.pages, args.page_size)
    backend = _core.with_faults(host, faults)
    mapper = RankMapper(args.group, args.rank, backend, timeout=args.join_timeout)
    say("joined", rank=args.rank, pid=os.getpid())
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "touch":
            say("touched", pages=touch(mapper, host, args.rank))
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
        elif command == "close":
            break
        else:
            say("error", message=f"unknown command {command!r}")
    faults.release()  # a map blocked by a hang must not hold up close
    mapper.close(5.0)
    say("closed", mapped=mapper.mapped_page_ids())


if __name__ == "__main__":
    main()
