"""A pytest plugin that runs SGLang's own memory-pool, allocator and radix-cache unit tests with
kvasync in SGLang's place.

``pytest -p kvasync.integrations.sglang.pytest_sglang test/registered/unit/mem_cache`` (from
SGLang's source tree; see ``make sglang-test``). Before any test module is imported:

- the plugin is switched on as an engine would have it (``KVASYNC_SGLANG=1``, a
  ``KVASYNC_MEMORY_LIMIT`` when none is set) and registered through SGLang's own plugin API:
  ``register()``, then ``HookRegistry.apply_hooks()``, which is what SGLang's engine does at
  start. So every ``MHATokenToKVPool`` a test builds lays its K and V buffers over a kvasync
  range (the host backend on the CPU), through the same hook as in an engine;
- SGLang's unit tests build ``PagedTokenToKVPoolAllocator(...)`` themselves, where an engine
  has the configurator build it (the hook the plugin wraps there). So the class is replaced by
  kvasync's subclass (``allocator_class()``) with SGLang's own class hook
  (``HookType.REPLACE``), which rebinds the name in every module that imported it, and a test
  module imported later gets kvasync's. An allocator over a pool that is not kvasync's (a
  test's mock, or none) keeps its pages in a host allocator of its own
  (``KVASYNC_SGLANG_HOST_POOL=1``). ``pytest_configure`` checks the name is kvasync's in
  ``ALLOCATOR_MODULES``, where the tests take it from, and fails the run if not.
"""

from __future__ import annotations

import importlib
import os

import pytest

__all__ = ["ALLOCATOR_MODULES", "DEFAULT_MEMORY_LIMIT"]

# Where SGLang 0.5.17 (and its tests) name the paged allocator: the defining module and the
# package that re-exports it.
ALLOCATOR_MODULES = ("sglang.srt.mem_cache.allocator.paged", "sglang.srt.mem_cache.allocator")
_NAME = "PagedTokenToKVPoolAllocator"
# The capacity the plugin's configurator hook would report: unit tests size their pools
# themselves, so it is read only by the plugin's checks at register().
DEFAULT_MEMORY_LIMIT = "1GiB"


def pytest_configure(config: pytest.Config) -> None:
    from . import register
    from ._allocator import allocator_class
    from ._kv import HOST_POOL

    os.environ["KVASYNC_SGLANG"] = "1"
    os.environ[HOST_POOL] = "1"
    os.environ.setdefault("KVASYNC_MEMORY_LIMIT", DEFAULT_MEMORY_LIMIT)
    register()
    hooks = importlib.import_module("sglang.srt.plugins.hook_registry")
    ours = allocator_class()  # subclasses SGLang's class: built before the class is replaced
    hooks.HookRegistry.register(f"{ALLOCATOR_MODULES[0]}.{_NAME}", ours, hooks.HookType.REPLACE)
    hooks.HookRegistry.apply_hooks()
    stale = [
        name
        for name in ALLOCATOR_MODULES
        if getattr(importlib.import_module(name), _NAME) is not ours
    ]
    if stale:
        raise pytest.UsageError(
            f"kvasync: SGLang's {_NAME} is still SGLang's own in {', '.join(stale)} after "
            "the class hook: the tests there would run on stock"
        )
    config.addinivalue_line("markers", "kvasync_pool: run with kvasync's SGLang allocator")


def pytest_report_header(config: pytest.Config) -> str:
    return (
        "kvasync: SGLang's MHATokenToKVPool buffers over kvasync ranges (host backend), "
        f"{_NAME} is kvasync's in {', '.join(ALLOCATOR_MODULES)}"
    )
