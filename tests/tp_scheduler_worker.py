"""The scheduler of a tensor-parallel group, in its own process (tests/test_tensor_parallel.py).

Opens group ``--group`` with a host backend of its own, waits for its ranks, builds a page pool on
the group's backend and prints ``{"event": "ready"}``. Then, per stdin line:

- ``alloc N``: asks the pool for N blocks: ``{"event": "allocated", "blocks": [...]}`` when they
  are mapped already, else ``{"event": "posted", "request": id}`` (the ranks are mapping);
- ``wait ID S``: waits up to S seconds for that request: ``{"event": "completed", ...}``.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time

from kvasync import _core
from kvasync._group import open_group


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--ranges", type=int, required=True)
    parser.add_argument("--pages", type=int, required=True)
    parser.add_argument("--page-size", type=int, required=True)
    parser.add_argument("--blocks-per-page", type=int, required=True)
    args = parser.parse_args()

    local = _core.HostBackend(args.ranges, args.pages, args.page_size)
    group = open_group(args.group, args.ranks, local, ready_timeout=10.0, map_timeout=10.0)
    pages, per_page = args.pages, args.blocks_per_page
    pool = _core.PagePool(group.backend, pages * per_page, per_page, pages, 0, 0, 10.0)
    say("ready")
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "alloc":
            result = pool.alloc(int(rest[0]), time.monotonic() + 10.0)
            if isinstance(result, list):
                say("allocated", blocks=result)
            else:
                say("posted", request=result)
        elif command == "wait":
            request, deadline = int(rest[0]), time.monotonic() + float(rest[1])
            while time.monotonic() < deadline:
                records = {r[0]: r for r in pool.drain()}
                if request in records:
                    _, status, blocks, message = records[request]
                    say("completed", status=status, blocks=blocks, message=message)
                    break
                select.select([pool.completion_fd], [], [], deadline - time.monotonic())
            else:
                say("timeout")


if __name__ == "__main__":
    main()
