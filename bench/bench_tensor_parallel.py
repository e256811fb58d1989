#!/usr/bin/env python3
"""Map and unmap latency per page through a tensor-parallel group, against a local map (issue 17).

A tensor-parallel scheduler decides page ids; each rank maps them on its own device, and an alloc
completes only when every rank has mapped (kvasync._group, Note [Tensor parallel group]). This
measures what that costs per page id, in the same run:

  local    TP=1 in one process: the page pool maps on its own backend (kvasync without a group).
  TP=k     the scheduler's pool (map_local=False: it holds no KV memory, as vLLM's EngineCore)
           posts each map to k rank processes through the group's shared-memory ring; each rank's
           C++ mapper maps the page on its backend; the alloc completes when all k have.

For each, ``--pages`` page ids are mapped by one alloc (a cold map: ``spare 0``, every handle is
created; a pooled map: handles kept by the backend between rounds) and unmapped by a free and a
trim, ``--repeats`` times; the table gives the median per page id and the per-handle floor
(``--ranges`` handles per page id: one per layer's K and V, as an engine's layout has).

On one GPU (``--device cuda``) every rank maps on the same device: the ranks are real processes
with their own CUDA contexts, so this measures the group's transport and each rank's driver calls,
but the ranks contend for one device's driver where a TP group has one GPU each (a two-GPU machine
is the real measurement). On ``--device cpu`` the backends are memfd + mmap.

With ``--gpus 2`` (a two-GPU machine) rank r maps on GPU r % 2, as a TP group's ranks do, and
the scheduler's pool holds no KV memory (the local backend stays on GPU 0, unused for maps).

Usage: python bench/bench_tensor_parallel.py --device cuda --ranks 0 1 2 4 --pages 1 16
       python bench/bench_tensor_parallel.py --device cuda --gpus 2 --ranks 0 1 2 --pages 1 16
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from typing import Any

from _tables import markdown

from kvasync import _core
from kvasync._group import RankMapper, group_geometry, open_group

US = 1e6
RANK_JOIN_S = 60.0  # a rank process's import, CUDA context and join
ROUND_S = 30.0  # the deadline of one map or unmap round


def make_backend(
    device: str, ranges: int, pages: int, page_size: int, spare: int, gpu: int = 0
) -> _core.Backend:
    if device == "cpu":
        return _core.HostBackend(ranges, pages, page_size)
    return _core.CudaBackend(gpu, ranges, pages, page_size, spare, 0.95)


def rank_main(args: argparse.Namespace) -> None:
    """One rank: the group's geometry, its own backend, a RankMapper until stdin closes."""
    geometry = group_geometry(args.group, RANK_JOIN_S)
    backend = make_backend(
        args.device,
        geometry["num_ranges"],
        geometry["num_pages"],
        geometry["page_size"],
        args.spare,
        args.rank % args.gpus,
    )
    with RankMapper(args.group, args.rank, backend, timeout=RANK_JOIN_S):
        print(json.dumps({"event": "joined", "rank": args.rank}), flush=True)
        deadline = time.monotonic() + args.rank_lifetime
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sys.stdin], [], [], deadline - time.monotonic())
            if readable and not sys.stdin.readline():
                break  # the scheduler closed our stdin: done


def wait_request(pool: Any, request: int, deadline: float) -> list[int]:
    """The blocks of request ``request``, waiting on the pool's completion fd until ``deadline``."""
    while True:
        for record in pool.drain():
            if record[0] == request:
                _, status, blocks, message = record
                if status != 0:
                    raise RuntimeError(f"request {request} failed: {message}")
                return list(blocks)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request {request} not done within its deadline")
        select.select([pool.completion_fd], [], [], left)


def run_completion(pool: Any, result: object, deadline: float) -> list[int]:
    if isinstance(result, list):
        return result
    assert isinstance(result, int)
    return wait_request(pool, result, deadline)


def measure(args: argparse.Namespace, ranks: int, pages: int, spare: int) -> dict[str, float]:
    """Median seconds per page id to map and to unmap, with ``ranks`` rank processes (0: local)."""
    total_pages = max(pages, 1) * 2
    local = make_backend(args.device, args.ranges, total_pages, args.page_size, spare)
    group = None
    children: list[subprocess.Popen[str]] = []
    backend = local
    try:
        if ranks:
            name = f"kvasync-bench-tp-{os.getpid()}-{ranks}-{pages}-{spare}"
            group = open_group(
                name, ranks, local, map_timeout=ROUND_S, unmap_timeout=ROUND_S, map_local=False
            )
            for rank in range(ranks):
                children.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "--as-rank",
                            str(rank),
                            "--group",
                            name,
                            "--device",
                            args.device,
                            "--spare",
                            str(spare),
                            "--gpus",
                            str(args.gpus),
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            group.wait_ready(RANK_JOIN_S)
            backend = group.backend
        blocks_per_page = 1
        pool = _core.PagePool(backend, total_pages, blocks_per_page, total_pages, 0, 0, ROUND_S)
        maps: list[float] = []
        unmaps: list[float] = []
        for round_index in range(args.repeats + 1):  # the first round warms up
            start = time.perf_counter()
            deadline = time.monotonic() + ROUND_S
            blocks = run_completion(pool, pool.alloc(pages, deadline), deadline)
            mapped = time.perf_counter()
            pool.free(blocks)
            run_completion(pool, pool.trim(time.monotonic() + ROUND_S, spare == 0), deadline)
            done = time.perf_counter()
            if round_index:
                maps.append((mapped - start) / pages)
                unmaps.append((done - mapped) / pages)
        pool.close(ROUND_S)
        return {"map": statistics.median(maps), "unmap": statistics.median(unmaps)}
    finally:
        if group is not None:
            group.close()
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
        for child in children:
            try:
                child.wait(timeout=ROUND_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=ROUND_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--ranges", type=int, default=64, help="handles per page id")
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="cuda: rank r maps on GPU r %% GPUS (1: every rank on GPU 0, as on one H200)",
    )
    parser.add_argument("--page-size", type=int, default=2 << 20)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=str)
    # A rank process (this file, started by the scheduler's side).
    parser.add_argument("--as-rank", dest="rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--group", help=argparse.SUPPRESS)
    parser.add_argument("--spare", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank-lifetime", type=float, default=600.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    if args.gpus < 1:
        sys.exit(f"--gpus must be at least 1, got {args.gpus}")
    if args.device == "cuda":
        for gpu in range(args.gpus):
            problem = _core.cuda_problem(gpu)
            if problem:
                sys.exit(
                    f"bench_tensor_parallel --device cuda --gpus {args.gpus}: GPU {gpu}: {problem}"
                )
    rows: list[list[str]] = []
    results: list[dict[str, Any]] = []
    for pages in args.pages:
        for pooled in (False, True):
            spare = 2 * pages if pooled and args.device == "cuda" else 0
            if pooled and args.device == "cpu":
                continue  # memfd pages have no handle to keep
            base: dict[str, float] | None = None
            for ranks in args.ranks:
                got = measure(args, ranks, pages, spare)
                base = base or got
                results.append({"ranks": ranks, "pages": pages, "pooled": pooled, **got})
                rows.append(
                    [
                        "local (TP=1)" if ranks == 0 else f"TP={ranks} group",
                        str(pages),
                        "pooled" if pooled else "cold",
                        f"{got['map'] * US:.1f}",
                        f"{got['unmap'] * US:.1f}",
                        f"{got['map'] * US / args.ranges:.2f}",
                        f"{got['map'] / base['map']:.2f}",
                    ]
                )
    print(
        f"Per page id ({args.ranges} handles of {args.page_size >> 10} KiB), device "
        f"{args.device}"
        + (f", rank r on GPU r % {args.gpus}" if args.device == "cuda" else "")
        + f", median of {args.repeats} rounds:"
    )
    print(
        markdown(
            [
                "mapping",
                "pages per alloc",
                "handles",
                "map us/page",
                "unmap us/page",
                "map us/handle",
                "map x local",
            ],
            rows,
        )
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
