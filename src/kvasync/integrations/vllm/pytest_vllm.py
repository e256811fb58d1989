"""A pytest plugin that runs vLLM's own scheduler tests with kvasync's block pool in its place.

``pytest -p kvasync.integrations.vllm.pytest_vllm tests/v1/core`` (from vLLM's source tree; see
``make vllm-test``): every ``BlockPool`` vLLM's coordinator builds is kvasync's, each over a
host-backend allocator of its own (there is no worker in these tests). Prefix-cache entries are
kept for every freed block (``KVASYNC_PREFIX_CACHE`` unset), as vLLM's pool does.
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from . import register

    os.environ["KVASYNC_VLLM"] = "1"
    os.environ["KVASYNC_VLLM_HOST_POOL"] = "1"
    register()
    config.addinivalue_line("markers", "kvasync_pool: run with kvasync's block pool")


def pytest_report_header(config: pytest.Config) -> str:
    return "kvasync: vLLM's BlockPool is kvasync's (host-backend allocators)"
