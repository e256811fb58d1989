"""The command line: ``python -m kvasync demo`` (or the ``kvasync`` script)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from ._demo import DemoOptions, format_report, run_demo
from ._errors import KVAsyncError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvasync", description=__doc__)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    defaults = DemoOptions()
    demo = commands.add_parser(
        "demo",
        help="simulate an LLM server's KV cache on the host backend",
        description="Hundreds of concurrent requests grow their KV caches block by block under a "
        "memory limit, on the host backend (memfd + mmap); prints live progress, then a table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--requests", type=int, default=defaults.requests, help="requests in all")
    demo.add_argument(
        "--concurrency", type=int, default=defaults.concurrency, help="requests in flight at most"
    )
    demo.add_argument(
        "--memory-limit-mib",
        type=int,
        default=defaults.memory_limit_mib,
        help="physical KV memory the allocator may map",
    )
    demo.add_argument("--seconds", type=float, default=defaults.seconds, help="overall time cap")
    demo.add_argument(
        "--alloc-timeout", type=float, default=defaults.alloc_timeout, help="seconds per alloc"
    )
    demo.add_argument(
        "--retries", type=int, default=defaults.retries, help="restarts of a preempted request"
    )
    demo.add_argument(
        "--token-time-ms", type=float, default=defaults.token_time_ms, help="one decode step"
    )
    demo.add_argument("--seed", type=int, default=defaults.seed, help="random seed")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line.

    Args:
        argv: the arguments after the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit status: 0 on success, 1 when the demo leaked or corrupted blocks, 2 on a usage
        error or an unusable backend.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "demo":
        parser.print_help(sys.stderr)
        return 2
    try:
        options = DemoOptions(
            requests=args.requests,
            concurrency=args.concurrency,
            memory_limit_mib=args.memory_limit_mib,
            seconds=args.seconds,
            alloc_timeout=args.alloc_timeout,
            retries=args.retries,
            token_time_ms=args.token_time_ms,
            seed=args.seed,
        )
    except ValueError as error:
        parser.error(str(error))
    print(
        f"kvasync demo: {options.requests} requests, up to {options.concurrency} in flight, "
        f"memory limit {options.memory_limit_mib} MiB, host backend, cap {options.seconds:g} s"
    )
    try:
        report = asyncio.run(run_demo(options, sys.stdout))
    except KVAsyncError as error:
        print(f"kvasync demo: {error}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0 if report.leaked_blocks == 0 and report.corrupt_blocks == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
