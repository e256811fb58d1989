"""A pytest plugin tests/vllm_matrix.py loads into vLLM's own test runs (stock and kvasync alike)
on a machine with no accelerator, so that each test's teardown ends as it would on a GPU box.

vLLM's tests/conftest.py tears every test down with ``cleanup_dist_env_and_memory()``, which
calls ``torch.accelerator.empty_cache()`` (and, from 0.33, ``empty_host_cache()``) unless vLLM's
platform is its CPU platform. vLLM's CUDA wheel on a machine with no GPU is the "unspecified"
platform, and torch raises ``RuntimeError: Cannot access accelerator device when none is
available`` there: every test then ended with a teardown error (203 in one 0.26.0 suite), on
stock as on kvasync, hiding the outcomes that matter. With no accelerator there is no device
cache to empty, so these two calls do nothing here; with an accelerator nothing is changed.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or accelerator.is_available():
        return

    def nothing_to_empty() -> None:
        """No accelerator: no device (or pinned host) cache to empty."""

    for name in ("empty_cache", "empty_host_cache"):
        if hasattr(accelerator, name):
            setattr(accelerator, name, nothing_to_empty)


def pytest_report_header(config: pytest.Config) -> str:
    return "kvasync_matrix_cpu: no accelerator, torch.accelerator.empty_cache is a no-op"
