"""Shared test setup.

NOTE: Triton decides at kernel definition whether to interpret, so TRITON_INTERPRET must be set
before kvasync.kernels is first imported; this module is imported before any test module.
Without a GPU, Triton's interpreter runs the kernels on CPU tensors (~1 ms per program instance).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# -- allocator fixtures -----------------------------------------------------------------------
import asyncio
from collections.abc import Callable

import pytest

import kvasync


def _has_cuda_driver() -> bool:
    return torch.cuda.is_available()


@pytest.fixture(
    params=[
        "host",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not _has_cuda_driver(), reason="needs an NVIDIA GPU"),
            ],
        ),
    ]
)
def backend_name(request: pytest.FixtureRequest) -> str:
    """Every backend the contract tests run on: host always, cuda where a GPU is present."""
    return str(request.param)


@pytest.fixture
def small_layout() -> kvasync.KVLayout:
    """4 layers, K and V, 16 tokens x 2 heads x 64 x fp16: 4 KiB blocks, 512 per 2 MiB page."""
    return kvasync.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Waits for ``predicate`` to hold, checking each loop iteration, failing at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s")
        await asyncio.sleep(0.001)
