"""kvasync's vLLM plugin: the seam table (_seams), the version refusal, the checks made before
anything is patched, and the start-up settings the plugin refuses rather than override.

The table's own tests run anywhere; those that need vLLM skip where it is not importable (CI),
saying so, and run in ``make vllm-matrix`` on every release.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvasync.integrations import vllm as plugin
from kvasync.integrations._settings import read_settings
from kvasync.integrations.vllm import _seams
from kvasync.integrations.vllm._engine import register_engine, take_engine

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


def test_the_compatibility_doc_prints_the_table_the_code_checks() -> None:
    from pathlib import Path

    doc = Path(__file__).parent.parent / "docs" / "vllm" / "compatibility.md"
    assert _seams.markdown_table() in doc.read_text(), (
        "docs/vllm/compatibility.md's table is not _seams.markdown_table(): print it again"
    )


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


# -- the worker seam: vLLM's own KV allocation path, stock against the plugin's -----------------

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def kv_setup(dtype: Any, block_size: int, num_blocks: int, layout: str | None) -> Any:
    """A real KVCacheConfig of 3 full-attention layers, built by vLLM's own planner, and the
    vLLM config the plugin reads."""
    import torch  # noqa: F401 - the dtypes the specs are built with
    from vllm.config import CacheConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    planner: Any = None
    for module in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        with contextlib.suppress(ImportError):
            planner = importlib.import_module(module).get_kv_cache_config_from_groups
            break
    assert planner is not None
    cache = CacheConfig(block_size=block_size)
    if layout is not None:
        cache.kv_cache_layout = layout
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=dtype)
    vllm_config = SimpleNamespace(
        cache_config=cache,
        kv_transfer_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
        parallel_config=SimpleNamespace(distributed_executor_backend=None),
        model_config=SimpleNamespace(max_model_len=256, served_model_name="seam-test"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256, max_num_seqs=4),
    )
    groups = [KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=spec)]
    config = planner(vllm_config, groups, spec.page_size_bytes * len(LAYERS) * num_blocks)
    assert config.num_blocks == num_blocks
    return config, vllm_config


def allocation_shape() -> str:
    return str(_seams.check_all(engine=True)["allocate-kv-cache"].shape.adapter or "per-layer")


def allocate_both_ways(config: Any, vllm_config: Any) -> Iterator[tuple[str, Any, Any]]:
    """(runner, stock's tensors, the plugin's) for each runner's call of the seam, as vLLM calls
    it; the plugin is registered between the two."""
    import torch
    from vllm.config import set_current_vllm_config

    cpu = torch.device("cpu")
    runner_module = importlib.import_module("vllm.v1.worker.gpu_model_runner")
    attn_utils = importlib.import_module("vllm.v1.worker.gpu.attn_utils")
    runner = object.__new__(runner_module.GPUModelRunner)
    runner.device = cpu
    runner.runner_only_attn_layers = set()
    runner.vllm_config = vllm_config
    if allocation_shape() == "per-layer":
        calls = {
            "v1": lambda: runner._allocate_kv_cache_tensors(config),
            "v2": lambda: attn_utils._allocate_kv_cache(config, {}, cpu),
        }
    else:
        layouts = importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout
        layout = layouts[config_layout(vllm_config)]
        block_sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
        calls = {
            "v1": lambda: runner_module.allocate_kv_cache(config, cpu, layout, block_sizes),
            "v2": lambda: attn_utils.allocate_kv_cache(config, cpu, layout, block_sizes),
        }
    stock = {name: call() for name, call in calls.items()}
    plugin.register()
    for name, call in calls.items():
        with set_current_vllm_config(vllm_config):
            yield name, stock[name], call()


def config_layout(vllm_config: Any) -> str:
    return str(vllm_config.cache_config.kv_cache_layout)


@needs_vllm
@pytest.mark.parametrize(
    ("dtype_name", "block_size"),
    [("bfloat16", 16), ("float16", 32), ("float32", 16), ("uint8", 64)],
)
def test_the_worker_seam_gives_stocks_views_over_a_kvasync_range(
    restored: pytest.MonkeyPatch, dtype_name: str, block_size: int
) -> None:
    import torch

    from kvasync.integrations.vllm._engine import current_engine

    num_blocks = 40
    layout = "BLNHC" if allocation_shape() == "one-backing" else None
    config, vllm_config = kv_setup(getattr(torch, dtype_name), block_size, num_blocks, layout)
    seen = 0
    for runner, stock, ours in allocate_both_ways(config, vllm_config):
        assert set(ours) == set(stock) == set(LAYERS), runner
        engine = current_engine()
        assert engine is not None and engine.allocator.num_blocks == num_blocks
        kv = engine.allocator
        ranges = [kv.layer(i)[0] for i in range(kv.layout.num_layers)]
        bases = {r.untyped_storage().data_ptr(): r for r in ranges}
        block = kv.layout.range_block_bytes
        for name in LAYERS:
            mine, theirs = ours[name], stock[name]
            assert (mine.dtype, mine.shape, mine.stride(), mine.storage_offset()) == (
                theirs.dtype,
                theirs.shape,
                theirs.stride(),
                theirs.storage_offset(),
            ), (runner, name)
            # Over a kvasync range, and vLLM's block b is in kvasync's block b of that range
            # (read through addresses only: the pages of blocks other than 0 are not mapped).
            base = mine.untyped_storage().data_ptr()
            assert base in bases, (runner, name)
            # The per-layer shape returns raw bytes (vLLM reshapes them later): block b is
            # their b-th run of a block's bytes.
            blocks = mine if mine.dim() > 1 else mine.view(num_blocks, -1)
            for b in range(num_blocks):
                offset = blocks[b].data_ptr() - base
                assert b * block <= offset < (b + 1) * block, (runner, name, b)
        # Block 0 (the null block, mapped and zeroed) is written and read through vLLM's view.
        first = ours[LAYERS[0]]
        first[0].fill_(7)
        assert bool((first[0] == 7).all())
        seen += 1
    assert seen == 2


@needs_vllm
def test_the_one_backing_worker_seam_refuses_a_layout_that_keeps_layers_apart(
    restored: pytest.MonkeyPatch,
) -> None:
    import torch

    if allocation_shape() != "one-backing":
        pytest.skip("this vLLM allocates a tensor per layer (the per-layer shape)")
    config, vllm_config = kv_setup(torch.bfloat16, 16, 40, "LBNHC")
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=BLNHC"):
        for _ in allocate_both_ways(config, vllm_config):
            pass


@needs_vllm
def test_the_layout_setting_is_set_when_unset_and_refused_when_it_keeps_layers_apart(
    restored: pytest.MonkeyPatch,
) -> None:
    if allocation_shape() != "one-backing":
        pytest.skip("this vLLM has no KV cache layout setting (the per-layer shape)")
    env: dict[str, str] = {}
    assert plugin.check_layout_setting(env) == "BLNHC"
    assert env == {"VLLM_KV_CACHE_LAYOUT": "BLNHC"}
    assert plugin.check_layout_setting({"VLLM_KV_CACHE_LAYOUT": "BLHNC"}) is None
    with pytest.raises(plugin.UnsupportedVLLM, match="VLLM_KV_CACHE_LAYOUT=LBNHC keeps"):
        plugin.check_layout_setting({"VLLM_KV_CACHE_LAYOUT": "LBNHC"})
