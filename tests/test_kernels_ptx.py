"""The block kernels compile for Hopper, and move 16-byte vectors when the layout allows it.

No GPU is needed: triton.compile targets sm_90 from the CPU, and we read the PTX. Each case
compiles exactly what the launcher would launch for a layout (its unit, vector, chunk and mask
choices come from kernels/block_copy.py's own planner).

NOTE: the compiles run in a child process without TRITON_INTERPRET. Triton's interpreter patches
triton.language's operators for the whole process, which breaks a compile in the same process
(and the kernels imported under it are interpreted functions, not compilable ones).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import ModuleType

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
GLOBAL_ACCESS = re.compile(r"\b((?:ld|st)\.global(?:\.\w+)*)\s")

# name: (block_size, num_kv_heads, head_dim, dtype, block stride in elements or None: packed)
LAYOUTS = {
    "fp16_16x8x128": (16, 8, 128, torch.float16, None),  # 32 KiB, eight unmasked 4 KiB chunks
    "fp8_interleaved": (16, 8, 128, torch.float8_e4m3fn, 64 * 16 * 8 * 128),
    "fp32_head_dim_80": (16, 2, 80, torch.float32, None),  # 10 KiB, five 2 KiB chunks
    "bf16_masked": (2, 3, 80, torch.bfloat16, None),  # 960 bytes: one masked chunk
    "int8_unaligned": (1, 1, 5, torch.int8, 5),  # 5 bytes: no 16-byte vector possible
}
KERNELS = ["_gather_kernel", "_scatter_kernel", "_zero_kernel", "_copy_kernel"]
ALIGNED = {name for name, layout in LAYOUTS.items() if name != "int8_unaligned"}


def plan(block_copy: ModuleType, layout: tuple[int, int, int, torch.dtype, int | None]) -> object:
    bs, heads, head_dim, dtype, stride = layout
    size = torch.empty((), dtype=dtype).element_size()
    block_elems = bs * heads * head_dim
    stride_elems = block_elems if stride is None else stride
    table = block_copy.BlockTable(
        pointers=torch.empty(0, dtype=torch.int64),
        num_buffers=64,
        block_bytes=block_elems * size,
        block_stride_bytes=stride_elems * size,
        alignment=block_copy._alignment(block_elems * size, stride_elems * size, 1 << 20),
    )
    return block_copy._plan(table)


def signature(kernel: triton.JITFunction, launch: object, pointers: dict[str, str]) -> dict:
    constexprs = launch.constexprs  # type: ignore[attr-defined]
    sig = {}
    for name in kernel.arg_names:
        sig[name] = "constexpr" if name in constexprs else pointers.get(name, "i32")
    return sig


def compile_ptx(block_copy: ModuleType, kernel_name: str, layout_name: str) -> str:
    kernel = getattr(block_copy, kernel_name)
    launch = plan(block_copy, LAYOUTS[layout_name])
    unit = {4: "*i32", 2: "*i16", 1: "*i8"}[launch.unit_bytes]  # type: ignore[attr-defined]
    pointers = {
        "table_ptr": "*i64",
        "ids_ptr": "*i64",
        "src_ids_ptr": "*i64",
        "dst_ids_ptr": "*i64",
        "out_ptr": unit,
        "src_ptr": unit,
    }
    # As Triton specializes a launch: tensors from torch are 16-byte aligned, and so is an int
    # argument that is a multiple of 16.
    sizes = {
        "num_buffers": 64,
        "vecs_per_block": launch.vecs_per_block,  # type: ignore[attr-defined]
        "block_stride_vecs": launch.block_stride_vecs,  # type: ignore[attr-defined]
    }
    attrs = {}
    for index, name in enumerate(kernel.arg_names):
        if name in pointers or sizes.get(name, 1) % 16 == 0:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(
        fn=kernel,
        signature=signature(kernel, launch, pointers),
        constexprs=launch.constexprs,  # type: ignore[attr-defined]
        attrs=attrs,
    )
    compiled = triton.compile(source, target=HOPPER, options={"num_warps": launch.num_warps})
    return compiled.asm["ptx"]


def compile_all() -> dict[str, list[str]]:
    """Global data accesses in the PTX of every kernel for every layout, by "kernel/layout"."""
    from kvasync.kernels import block_copy

    return {
        f"{kernel}/{layout}": data_accesses(compile_ptx(block_copy, kernel, layout))
        for kernel in KERNELS
        for layout in LAYOUTS
    }


@pytest.fixture(scope="module")
def accesses() -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=100
    )
    assert child.returncode == 0, child.stderr
    result: dict[str, list[str]] = json.loads(child.stdout)
    return result


def data_accesses(ptx: str) -> list[str]:
    """Global loads and stores of block data: all but the 8-byte loads of ids and base addresses."""
    return [op for op in GLOBAL_ACCESS.findall(ptx) if op != "ld.global.b64"]


@pytest.mark.parametrize("layout_name", sorted(ALIGNED))
@pytest.mark.parametrize("kernel_name", KERNELS)
def test_main_loop_moves_16_byte_vectors(
    accesses: dict[str, list[str]], kernel_name: str, layout_name: str
) -> None:
    ops = accesses[f"{kernel_name}/{layout_name}"]
    assert "st.global.v4.b32" in ops
    if kernel_name != "_zero_kernel":
        assert "ld.global.v4.b32" in ops
    assert set(ops) <= {"ld.global.v4.b32", "st.global.v4.b32"}, ops


@pytest.mark.parametrize("kernel_name", KERNELS)
def test_unaligned_layout_still_compiles(accesses: dict[str, list[str]], kernel_name: str) -> None:
    ops = accesses[f"{kernel_name}/int8_unaligned"]
    assert ops
    assert not any(".v4" in op for op in ops), ops


if __name__ == "__main__":
    print(json.dumps(compile_all()))
