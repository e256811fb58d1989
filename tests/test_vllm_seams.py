"""kvasync's vLLM plugin: the seam table (_seams), the version refusal, the checks made before
anything is patched, and the start-up settings the plugin refuses rather than override.

The table's own tests run anywhere; those that need vLLM skip where it is not importable (CI),
saying so, and run in ``make vllm-matrix`` on every release.
"""

from __future__ import annotations

import importlib
import inspect
import math
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvasync.integrations import vllm as plugin
from kvasync.integrations.vllm import _seams
from kvasync.integrations.vllm._engine import register_engine, take_engine
from kvasync.integrations.vllm._settings import read_settings

try:
    with warnings.catch_warnings():
        # vLLM's worker modules import code that uses deprecated torch.jit APIs; the import is
        # not under test.
        warnings.simplefilter("ignore", DeprecationWarning)
        import vllm.v1.core.block_pool as vllm_block_pool
        import vllm.v1.core.kv_cache_coordinator as vllm_coordinator
        import vllm.v1.worker.gpu_worker as vllm_gpu_worker
        from vllm.utils.mem_utils import MemorySnapshot

    VLLM_ERROR = ""
except Exception as error:  # any import failure means: no vLLM here
    VLLM_ERROR = f"vLLM is not importable here ({type(error).__name__}: {error})"

needs_vllm = pytest.mark.skipif(bool(VLLM_ERROR), reason=VLLM_ERROR or "vLLM present")
GIB = 1 << 30

# -- the table ---------------------------------------------------------------------------------


def test_every_tested_release_has_exactly_one_shape_of_every_seam() -> None:
    assert plugin.TESTED == _seams.RELEASES
    for seam in _seams.SEAMS:
        for release in plugin.TESTED:
            having = [shape.name for shape in seam.shapes if release in shape.releases]
            assert len(having) == 1, (seam.key, release, having)


def test_every_patched_seam_has_a_shape_that_is_there_in_every_release_or_an_adapter() -> None:
    # A patched seam absent in a release must be one of the allocation shapes, whose other
    # shape (with its adapter) is there instead.
    for release in plugin.TESTED:
        adapters = set()
        for seam in _seams.SEAMS:
            shape = seam.shape_of(release)
            assert shape is not None
            if seam.patched and shape.absent:
                assert "allocate" in seam.key, (seam.key, release)
            if "allocate" in seam.key and not shape.absent:
                adapters.add(shape.adapter)
        assert len(adapters) == 1, (release, adapters)


def test_release_keys_order_releases_and_pre_releases() -> None:
    assert _seams.release_key("0.27.1") == (0, 27, 1)
    assert _seams.release_key("0.34.0rc1+cu129") == (0, 34, 0)
    assert _seams.release_key("0.26.0") < _seams.release_key("0.27.0") < (0, 27, 1)


def test_a_release_newer_than_the_newest_tested_is_refused_saying_what_was_tested() -> None:
    with pytest.raises(
        plugin.UnsupportedVLLM, match=r"0\.26\.0, .*0\.33\.0; 0\.34\.0 is newer than the newest"
    ):
        plugin.check_version("0.34.0", env={})
    with pytest.raises(plugin.UnsupportedVLLM, match=r"0\.25\.0 is older than the oldest"):
        plugin.check_version("0.25.0", env={})
    with pytest.raises(plugin.UnsupportedVLLM, match=r"0\.27\.2 is not a tested release"):
        plugin.check_version("0.27.2", env={})
    for release in plugin.TESTED:
        plugin.check_version(release, env={})
    plugin.check_version("0.34.0", env={plugin.ANY_VERSION: "1"})


def seam(shapes: tuple[_seams.Shape, ...], attribute: str = "SyncAllocator.alloc") -> _seams.Seam:
    """A seam over kvasync's own code, whose shapes the tests choose."""
    return _seams.Seam("test-seam", "kvasync._sync", attribute, "a test", shapes)


def test_a_seam_takes_the_first_shape_that_matches_and_names_what_differs_from_each() -> None:
    alloc = tuple(
        inspect.signature(importlib.import_module("kvasync._sync").SyncAllocator.alloc).parameters
    )
    old = _seams.Shape("old", "0.26.0", "0.29.0", ("self", "n"))
    new = _seams.Shape("new", "0.30.0", "0.33.0", alloc)
    assert seam((old, new)).find().shape is new
    with pytest.raises(plugin.UnsupportedVLLM, match=r"seam test-seam .*shape old .*parameters"):
        seam((old,)).find()
    reads = _seams.Shape("reads", "0.26.0", "0.33.0", alloc, reads=("no_such_name",))
    with pytest.raises(plugin.UnsupportedVLLM, match=r"does not read \['no_such_name'\]"):
        seam((reads,)).find()
    probed = _seams.Shape("probed", "0.26.0", "0.33.0", probe=lambda value: "the probe says no")
    with pytest.raises(plugin.UnsupportedVLLM, match="the probe says no"):
        seam((probed,)).find()
    failing = _seams.Shape("failing", "0.26.0", "0.33.0", probe=lambda value: 1 // 0)
    with pytest.raises(plugin.UnsupportedVLLM, match="probe failed: ZeroDivisionError"):
        seam((failing,)).find()


def test_an_absent_shape_matches_only_a_missing_attribute() -> None:
    gone = _seams.Shape("gone", "0.26.0", "0.33.0", absent=True)
    found = seam((gone,), "SyncAllocator.no_such_method").find()
    assert not found.present
    with pytest.raises(plugin.UnsupportedVLLM, match="it is there"):
        seam((gone,)).find()
    with pytest.raises(plugin.UnsupportedVLLM, match="it is missing"):
        seam((_seams.Shape("x", "0.26.0", "0.33.0", ("self",)),), "SyncAllocator.nope").find()


# -- the table against the vLLM installed here -------------------------------------------------


@needs_vllm
def test_every_seam_has_the_shape_the_table_lists_for_this_vllm() -> None:
    version = plugin.vllm_version()
    assert version in plugin.TESTED, f"vLLM {version} is not in the table"
    for each in _seams.SEAMS:
        found = each.find()
        assert found.shape is each.shape_of(version), (each.key, found.shape.name)


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Every attribute the plugin patches (as any version of it did) is put back at the end,
    and the plugin may register again."""
    for module, attribute in (
        ("vllm.v1.core.kv_cache_coordinator", "BlockPool"),
        ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.get_num_blocks_to_allocate"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._allocate_kv_cache_tensors"),
        ("vllm.v1.worker.gpu_model_runner", "allocate_kv_cache"),
        ("vllm.v1.worker.gpu.attn_utils", "_allocate_kv_cache"),
        ("vllm.v1.worker.gpu.attn_utils", "allocate_kv_cache"),
        ("vllm.v1.worker.utils", "allocate_kv_cache"),
        ("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory"),
        ("vllm.v1.worker.gpu_worker", "request_memory"),
        ("vllm.v1.executor.abstract", "Executor.initialize_from_config"),
    ):
        owner: Any = importlib.import_module(module)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        if name in vars(owner):
            monkeypatch.setattr(owner, name, vars(owner)[name])
    monkeypatch.setattr(plugin, "_registered", False)
    for name in ("KVASYNC_VLLM_HOST_POOL", "KVASYNC_SHARE", "KVASYNC_DEVICE_BUDGET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLNHC")
    monkeypatch.setenv("KVASYNC_MEMORY_LIMIT", "1GiB")
    yield monkeypatch
    engine = take_engine()
    if engine is not None:
        engine.allocator.close()


@needs_vllm
def test_under_any_version_a_changed_private_internal_is_refused_at_start_naming_it(
    restored: pytest.MonkeyPatch,
) -> None:
    # The review: AllBlocksCleared, kv_event_queue, the free list's links... were used but not
    # checked, so a release that changed them would fail mid-run. Now a start refuses, naming
    # the seam, and patches nothing.
    restored.setenv(plugin.ANY_VERSION, "1")
    restored.setattr(plugin, "vllm_version", lambda: "0.34.0")
    before = vllm_coordinator.BlockPool
    restored.delattr(vllm_block_pool, "AllBlocksCleared")
    with pytest.raises(plugin.UnsupportedVLLM, match=r"seam block-pool-state .*AllBlocksCleared"):
        plugin.register()
    assert vllm_coordinator.BlockPool is before
    assert not plugin._registered


@needs_vllm
def test_under_any_version_a_free_list_without_its_links_is_refused_at_start(
    restored: pytest.MonkeyPatch,
) -> None:
    restored.setenv(plugin.ANY_VERSION, "1")
    restored.setattr(plugin, "vllm_version", lambda: "0.34.0")
    queue = vllm_block_pool.FreeKVCacheBlockQueue

    class Unlinked(queue):  # type: ignore[misc, valid-type]
        def __init__(self, blocks: list[Any]) -> None:
            super().__init__(blocks)
            del self.fake_free_list_tail

    restored.setattr(vllm_block_pool, "FreeKVCacheBlockQueue", Unlinked)
    before = vllm_coordinator.BlockPool
    with pytest.raises(
        plugin.UnsupportedVLLM, match=r"seam free-block-queue .*fake_free_list_tail"
    ):
        plugin.register()
    assert vllm_coordinator.BlockPool is before


@needs_vllm
def test_a_worker_seam_that_changed_is_refused_before_the_pool_is_patched(
    restored: pytest.MonkeyPatch,
) -> None:
    before = vllm_coordinator.BlockPool

    def determine_available_memory(self: Any, extra: int) -> int:
        return extra

    restored.setattr(
        vllm_gpu_worker.Worker, "determine_available_memory", determine_available_memory
    )
    with pytest.raises(plugin.UnsupportedVLLM, match=r"seam determine-available-memory .*extra"):
        plugin.register()
    assert vllm_coordinator.BlockPool is before


# -- the settings the plugin refuses rather than override (review, Low) ------------------------


def snapshot(free: int, total: int) -> Any:
    return MemorySnapshot(device="cpu", auto_measure=False, free_memory=free, total_memory=total)


def cache_config(**fields: Any) -> Any:
    """What request_memory and the plugin read of vLLM's CacheConfig (a namespace: vLLM's own
    validation refuses the bad values some tests need)."""
    values = {
        "gpu_memory_utilization": 0.9,
        "kv_cache_memory_bytes": None,
        "kv_offloading_size": None,
    }
    values.update(fields)
    return SimpleNamespace(**values)


@needs_vllm
def test_request_memory_lifts_the_free_memory_refusal_alone(restored: pytest.MonkeyPatch) -> None:
    stock = vllm_gpu_worker.request_memory
    with pytest.raises(ValueError, match="Free memory on device"):
        stock(snapshot(10 * GIB, 80 * GIB), cache_config())
    plugin.register()
    patched = vllm_gpu_worker.request_memory
    # A neighbour holds most of the GPU: stock refuses, kvasync starts, and asks what stock
    # would with the device free.
    assert patched(snapshot(10 * GIB, 80 * GIB), cache_config()) == math.ceil(80 * GIB * 0.9)
    # Any other refusal is stock's, raised as without kvasync (review: the patch swallowed every
    # ValueError and returned the free memory, hiding an unrelated start-up problem).
    with pytest.raises(ValueError, match="NaN"):
        patched(snapshot(10 * GIB, 80 * GIB), cache_config(gpu_memory_utilization=math.nan))
    if "external_weight_memory" in inspect.signature(stock).parameters:  # 0.32-
        with pytest.raises(ValueError, match="Externally held weights"):
            patched(snapshot(10 * GIB, 80 * GIB), cache_config(), 100 * GIB)


@needs_vllm
def test_a_kv_cache_memory_bytes_the_user_set_is_refused_at_start_and_not_overwritten(
    restored: pytest.MonkeyPatch,
) -> None:
    plugin.register()
    asked = cache_config(kv_cache_memory_bytes=2 * GIB)
    with pytest.raises(
        ValueError, match=r"kv_cache_memory_bytes=2147483648 .*KVASYNC_MEMORY_LIMIT"
    ):
        vllm_gpu_worker.request_memory(snapshot(80 * GIB, 80 * GIB), asked)
    # The profile step refuses it too (review: it overwrote the user's size, silently).
    worker = object.__new__(vllm_gpu_worker.Worker)
    worker.cache_config = asked
    worker.vllm_config = SimpleNamespace(kv_transfer_config=None, cache_config=asked)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=2147483648"):
        vllm_gpu_worker.Worker.determine_available_memory(worker)
    assert asked.kv_cache_memory_bytes == 2 * GIB
    # The same size as kvasync's (the plugin's own, or the user's, equal) is no conflict.
    vllm_gpu_worker.request_memory(
        snapshot(80 * GIB, 80 * GIB), cache_config(kv_cache_memory_bytes=GIB)
    )


@needs_vllm
def test_cpu_kv_offload_is_refused_at_start_naming_the_setting(
    restored: pytest.MonkeyPatch,
) -> None:
    plugin.register()
    with pytest.raises(plugin.UnsupportedVLLM, match=r"kv_offloading_size=4\.0"):
        vllm_gpu_worker.request_memory(
            snapshot(80 * GIB, 80 * GIB), cache_config(kv_offloading_size=4.0)
        )
    worker = object.__new__(vllm_gpu_worker.Worker)
    worker.cache_config = cache_config()
    worker.vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector="SimpleCPUOffloadConnector")
    )
    with pytest.raises(plugin.UnsupportedVLLM, match="SimpleCPUOffloadConnector"):
        vllm_gpu_worker.Worker.determine_available_memory(worker)


@needs_vllm
def test_a_second_block_pool_of_other_blocks_is_refused_naming_cpu_offload(
    restored: pytest.MonkeyPatch,
) -> None:
    # vLLM's CPU offload builds its CPU pool through the coordinator's BlockPool name, kvasync's
    # class: it failed with "the scheduler's pool has N blocks but the worker's allocator M".
    plugin.register()
    engine = plugin.host_engine(64, read_settings({"KVASYNC_VLLM": "1"}), reserve_pages=(1, 2))
    register_engine(engine)
    pool = vllm_coordinator.BlockPool(64, True, 16)  # the engine's own
    assert pool.kvasync_allocator is engine.allocator
    with pytest.raises(
        plugin.UnsupportedVLLM, match=r"second BlockPool of 32 blocks.*kv_offloading_size"
    ):
        vllm_coordinator.BlockPool(32, True, 16)
