"""Bandwidth of the block kernels (gather, scatter, zero, copy) against torch, on one GPU.

Prints one table: bytes moved per second by each kernel on a realistic layout, the torch
baseline for the same work (index_select / index_copy_ / index_fill_, one call per buffer in a
Python loop, as an engine without these kernels does it), and the ratio to the peak measured in
the same run: a contiguous device-to-device copy_ for gather, scatter and copy (goal >= 0.9), a
contiguous zero_ for zero (goal >= 0.9). Every kernel result is first checked bitwise against the
torch baseline. Bytes moved: read + written (written only, for zero).

    python3 bench/bench_kernels.py [--blocks 1024 8192] [--layouts per-layer interleaved]

Runs from a checkout without building kvasync: the kernels are loaded from kernels/ as
kvasync.kernels when the package is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import _tables as tables
import torch

REPO = Path(__file__).resolve().parent.parent
DEVICE = "cuda"


def load_kernels() -> ModuleType:
    """kvasync.kernels, installed or straight from kernels/ (without kvasync's C++ core)."""
    try:
        import kvasync.kernels as installed

        return installed
    except ImportError:
        pass
    init = REPO / "kernels" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "kvasync.kernels", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Cache:
    """A KV cache of `num_blocks` blocks: buffers layer-major, as the allocator hands them out."""

    buffers: list[torch.Tensor]
    kv_buffers: int

    @property
    def block_bytes(self) -> int:
        b = self.buffers[0]
        return b[0].numel() * b.element_size()


def make_cache(layout: str, args: argparse.Namespace) -> Cache:
    num_buffers = args.layers * 2
    block = (args.block_size, args.heads, args.head_dim)
    dtype = getattr(torch, args.dtype)
    if layout == "per-layer":
        buffers = [
            torch.empty(args.num_blocks, *block, dtype=dtype, device=DEVICE)
            for _ in range(num_buffers)
        ]
    else:  # interleaved: block-major, then layer, then K/V (the allocator's contiguous layout)
        big = torch.empty(args.num_blocks, args.layers, 2, *block, dtype=dtype, device=DEVICE)
        buffers = [big[:, j // 2, j % 2] for j in range(num_buffers)]
    for b in buffers:
        b.view(torch.int16).random_()
    return Cache(buffers, kv_buffers=2)


def time_ms(fn: Callable[[], object], reps: int = 5, trials: int = 5) -> float:
    """Median over `trials` of the mean time of `reps` back-to-back calls, in ms."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(trials):
        if DEVICE == "cpu":  # a smoke run under Triton's interpreter
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / reps)
            continue
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


@dataclass
class Row:
    op: str
    layout: str
    blocks: int
    gib: float
    ms: float
    baseline: str
    baseline_ms: float
    peak: float  # bytes per second the ratio is taken against

    def cells(self) -> list[str]:
        tbps = self.gib * 2**30 / self.ms / 1e9
        cells = [self.op, self.layout, str(self.blocks), f"{self.gib:.2f}"]
        cells += [f"{self.ms:.3f}", f"{tbps:.2f}"]
        if self.baseline_ms:
            base = self.gib * 2**30 / self.baseline_ms / 1e9
            cells += [self.baseline, f"{base:.2f}", f"{self.baseline_ms / self.ms:.2f}x"]
        else:
            cells += [self.baseline, "", ""]
        cells.append(f"{tbps * 1e12 / self.peak:.2f}" if self.peak else "")
        return cells


HEADER = [
    "op",
    "layout",
    "blocks",
    "GiB moved",
    "ms",
    "TB/s",
    "torch baseline",
    "baseline TB/s",
    "speedup",
    "/ peak",
]


def peaks() -> tuple[Row, Row]:
    """Contiguous copy_ and zero_ of 4 GiB: the ceilings the kernels are compared to."""
    src = torch.empty(2**31 if DEVICE == "cuda" else 2**20, dtype=torch.int16, device=DEVICE)
    src.random_()
    dst = torch.empty_like(src)
    gib = src.numel() * 2 / 2**30
    copy_ms = time_ms(lambda: dst.copy_(src))
    zero_ms = time_ms(lambda: dst.zero_())
    copy = Row("copy_ (peak)", "contiguous", 0, 2 * gib, copy_ms, "", 0.0, 0.0)
    zero = Row("zero_ (peak)", "contiguous", 0, gib, zero_ms, "", 0.0, 0.0)
    return copy, zero


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def bench_layout(
    kernels: ModuleType, layout: str, args: argparse.Namespace, copy_peak: float, zero_peak: float
) -> list[Row]:
    cache = make_cache(layout, args)
    rows = []
    for n in args.blocks:
        rows += bench_blocks(kernels, cache, layout, n, args, copy_peak, zero_peak)
    return rows


def bench_blocks(
    kernels: ModuleType,
    cache: Cache,
    layout: str,
    n: int,
    args: argparse.Namespace,
    copy_peak: float,
    zero_peak: float,
) -> list[Row]:
    bufs = cache.buffers
    table = kernels.block_table(bufs)
    perm = torch.randperm(args.num_blocks, device=DEVICE)
    ids = perm[:n].contiguous()
    dst_ids = perm[n : 2 * n].contiguous()
    shape = (n, args.layers, 2, args.block_size, args.heads, args.head_dim)
    out = torch.empty(shape, dtype=bufs[0].dtype, device=DEVICE)
    # The baseline's own tensors, made once: its writes are timed, not its allocations.
    per_buffer = [torch.empty_like(b[:n]) for b in bufs]
    gib = n * len(bufs) * cache.block_bytes / 2**30

    def gather() -> None:
        kernels.gather_blocks(table, ids, out)

    def gather_torch() -> None:
        for j, b in enumerate(bufs):
            torch.index_select(b, 0, ids, out=per_buffer[j])

    def scatter() -> None:
        kernels.scatter_blocks(table, ids, out)

    def scatter_torch() -> None:
        for j, b in enumerate(bufs):
            b.index_copy_(0, ids, per_buffer[j])

    def zero() -> None:
        kernels.zero_blocks(table, ids)

    def zero_torch() -> None:
        for b in bufs:
            b.index_fill_(0, ids, 0)

    def copy() -> None:
        kernels.copy_blocks(table, ids, dst_ids)

    def copy_torch() -> None:
        for b in bufs:
            b.index_copy_(0, dst_ids, b.index_select(0, ids))

    check(kernels, cache, table, ids, dst_ids, out)
    rows = []
    for op, fn, base_name, base_fn, moved, peak in (
        ("gather", gather, "index_select", gather_torch, 2 * gib, copy_peak),
        ("scatter", scatter, "index_copy_", scatter_torch, 2 * gib, copy_peak),
        ("copy", copy, "index_select+index_copy_", copy_torch, 2 * gib, copy_peak),
        ("zero", zero, "index_fill_", zero_torch, gib, zero_peak),
    ):
        ms = time_ms(fn)
        base_ms = time_ms(base_fn, reps=2, trials=3)
        rows.append(Row(op, layout, n, moved, ms, base_name, base_ms, peak))
    return rows


def check(
    kernels: ModuleType,
    cache: Cache,
    table: object,
    ids: torch.Tensor,
    dst_ids: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Each kernel against torch indexing, bitwise, before anything is timed."""
    bufs, n = cache.buffers, ids.numel()
    kernels.gather_blocks(table, ids, out)
    flat = out.view(n, len(bufs), *bufs[0].shape[1:])
    for j, b in enumerate(bufs):
        assert torch.equal(bits(flat[:, j]), bits(b[ids])), f"gather differs in buffer {j}"
    out.view(torch.int16).random_()
    kernels.scatter_blocks(table, ids, out)
    for j, b in enumerate(bufs):
        assert torch.equal(bits(b[ids]), bits(flat[:, j])), f"scatter differs in buffer {j}"
    kernels.copy_blocks(table, ids, dst_ids)
    for j, b in enumerate(bufs):
        assert torch.equal(bits(b[dst_ids]), bits(b[ids])), f"copy differs in buffer {j}"
    kernels.zero_blocks(table, ids)
    for j, b in enumerate(bufs):
        assert not bits(b[ids]).any(), f"zero left data in buffer {j}"


def sweep(kernels: ModuleType, args: argparse.Namespace) -> None:
    """TB/s of each kernel for a few chunk sizes and warp counts (for tuning the defaults)."""
    from kvasync.kernels import block_copy

    cache = make_cache("per-layer", args)
    table = kernels.block_table(cache.buffers)
    n = max(args.blocks)
    perm = torch.randperm(args.num_blocks, device=DEVICE)
    ids, dst_ids = perm[:n].contiguous(), perm[n : 2 * n].contiguous()
    shape = (n, args.layers, 2, args.block_size, args.heads, args.head_dim)
    out = torch.empty(shape, dtype=cache.buffers[0].dtype, device=DEVICE)
    gib = n * len(cache.buffers) * cache.block_bytes / 2**30
    defaults = block_copy._CHUNK_BYTES, block_copy._NUM_WARPS
    print(f"sweep, per-layer, {n} blocks: TB/s of gather scatter copy zero")
    for chunk in (2048, 4096, 8192):
        for warps in (4, 8, 16):
            block_copy._CHUNK_BYTES, block_copy._NUM_WARPS = chunk, warps
            tbps = [
                moved * 2**30 / time_ms(fn) / 1e9
                for fn, moved in (
                    (lambda: kernels.gather_blocks(table, ids, out), 2 * gib),
                    (lambda: kernels.scatter_blocks(table, ids, out), 2 * gib),
                    (lambda: kernels.copy_blocks(table, ids, dst_ids), 2 * gib),
                    (lambda: kernels.zero_blocks(table, ids), gib),
                )
            ]
            print(f"  chunk {chunk:5d} B, {warps} warps: " + " ".join(f"{t:.2f}" for t in tbps))
    block_copy._CHUNK_BYTES, block_copy._NUM_WARPS = defaults


def sweep_gather(kernels: ModuleType, args: argparse.Namespace) -> None:
    """TB/s of the gather on the interleaved layout for a few chunk sizes and warp counts (for
    tuning its defaults), beside the copy peak of this run."""
    from kvasync.kernels import block_copy

    cache = make_cache("interleaved", args)
    table = kernels.block_table(cache.buffers)
    copy_peak, _ = peaks()
    peak = copy_peak.gib * 2**30 / copy_peak.ms * 1e3
    defaults = block_copy._GATHER_CHUNK_BYTES, block_copy._GATHER_NUM_WARPS
    for n in args.blocks:
        ids = torch.randperm(args.num_blocks, device=DEVICE)[:n].contiguous()
        shape = (n, args.layers, 2, args.block_size, args.heads, args.head_dim)
        out = torch.empty(shape, dtype=cache.buffers[0].dtype, device=DEVICE)
        gib = 2 * n * len(cache.buffers) * cache.block_bytes / 2**30
        print(f"gather sweep, interleaved, {n} blocks: TB/s (/ copy peak {peak / 1e12:.2f})")
        for chunk, warps in ((4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32)):
            block_copy._GATHER_CHUNK_BYTES, block_copy._GATHER_NUM_WARPS = chunk, warps
            ms = time_ms(lambda ids=ids, out=out: kernels.gather_blocks(table, ids, out))
            bps = gib * 2**30 / ms * 1e3
            print(
                f"  chunk {chunk:5d} B {warps:2d} warps: {bps / 1e12:.2f} TB/s ({bps / peak:.3f})"
            )
    block_copy._GATHER_CHUNK_BYTES, block_copy._GATHER_NUM_WARPS = defaults


def print_table(rows: list[Row]) -> None:
    tables.print_table(HEADER, [r.cells() for r in rows], justify=["left"] * len(HEADER))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--layouts", nargs="+", default=["per-layer", "interleaved"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--num-blocks", type=int, default=0, help="cache size (default 2 x max)")
    p.add_argument("--sweep", action="store_true", help="also try other chunk sizes and warps")
    p.add_argument(
        "--sweep-gather", action="store_true", help="only sweep the interleaved gather's settings"
    )
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under Triton's interpreter")
    args = p.parse_args()
    args.num_blocks = args.num_blocks or 2 * max(args.blocks)
    return args


def main() -> None:
    global DEVICE
    args = parse_args()
    DEVICE = args.device
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU (or --device cpu for a smoke run)")
    kernels = load_kernels()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    print(
        f"{name}; torch {torch.__version__}; {args.layers} layers, K and "
        f"V, block {args.block_size} x {args.heads} x {args.head_dim} x {args.dtype}; "
        f"{args.num_blocks} blocks per buffer; random block ids"
    )
    if args.sweep_gather:
        sweep_gather(kernels, args)
        return
    copy_peak, zero_peak = peaks()
    copy_bps = copy_peak.gib * 2**30 / copy_peak.ms * 1e3
    zero_bps = zero_peak.gib * 2**30 / zero_peak.ms * 1e3
    rows = [copy_peak, zero_peak]
    for layout in args.layouts:
        rows += bench_layout(kernels, layout, args, copy_bps, zero_bps)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print_table(rows)
    if args.sweep:
        sweep(kernels, args)


if __name__ == "__main__":
    main()
