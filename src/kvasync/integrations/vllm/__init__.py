"""kvasync inside vLLM: an elastic KV cache for vLLM's v1 engine (``pip install kvasync[vllm]``).

vLLM loads ``register`` through its ``vllm.general_plugins`` entry point in every process. It is
inert unless ``KVASYNC_VLLM=1`` or one of ``KVASYNC_SHARE``, ``KVASYNC_DEVICE_BUDGET``,
``KVASYNC_MEMORY_LIMIT`` is set (sizes like ``12GiB``); ``KVASYNC_NAME`` names the engine in
``kvasync top``; ``KVASYNC_PREFIX_CACHE`` bounds the freed blocks that stay mapped for prefix
reuse (``0``, ``2GiB``; all the budget allows when unset).

Note [vLLM seams]
~~~~~~~~~~~~~~~~~
vLLM v1 with the uniprocess executor runs its scheduler and its worker in one process (the
EngineCore; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the caller's): one kvasync allocator
serves both. With the multiprocess executor see Note [Page ids across processes and ranks].

- Worker, two shapes (Note [Seam table] in _seams):
  - per-layer (0.26-0.28): ``GPUModelRunner._allocate_kv_cache_tensors(self, kv_cache_config)``
    (the V1 runner; ``gpu.attn_utils._allocate_kv_cache(kv_cache_config, shared_layers,
    device)`` in the V2 runner) returns, for each attention layer, an int8 tensor of
    ``num_blocks * page_size_bytes`` that vLLM reshapes for its attention backend. The plugin
    returns views over a kvasync allocator's ranges instead (one range per layer, a kvasync
    block of exactly ``page_size_bytes``: ``_worker.kv_layout_for``).
  - one-backing (0.29-): ``vllm.v1.worker.utils.allocate_kv_cache(kv_cache_config, device,
    layout, kernel_block_sizes)``, which both runners call, allocates one int8 backing and
    returns each layer's typed view of it. With a block-outermost layout (``BLNHC``, which the
    plugin asks for through ``VLLM_KV_CACHE_LAYOUT`` when it is unset) block ``b`` of every
    layer is one run of ``block_stride`` bytes, a kvasync block of one range
    (``_worker.one_backing_layout``); the plugin runs vLLM's own function on the meta device
    and rebases each view it returns onto that range (same shape, strides, dtype and offset).
  Either way block id ``b`` is the same bytes for vLLM and kvasync, and the attention kernels
  run unchanged. Capacity is reserved, nothing but the null block's page is mapped.
- Capacity: ``Worker.determine_available_memory(self)`` is where vLLM profiles free memory and
  sizes the cache. The plugin sets ``cache_config.kv_cache_memory_bytes`` to kvasync's capacity
  (``KVASYNC_MEMORY_LIMIT``, else ``KVASYNC_DEVICE_BUDGET``) before calling it, which is vLLM's
  own branch that still runs the profile (compile) pass but does not size by free memory; and
  ``gpu_worker.request_memory(init_snapshot, cache_config, ...)``, vLLM's start-up check that
  the free memory covers ``gpu_memory_utilization``, no longer refuses a GPU another engine
  uses: stock's check runs on a copy of the snapshot whose free memory is the device's total,
  so its other refusals (0.32's externally held weights, a bad setting) still raise.
- Refused at start, in ``request_memory`` (a worker's first step, before the model loads):
  a ``kv_cache_memory_bytes`` the user set (kvasync sizes the cache: ``KVASYNC_MEMORY_LIMIT``
  is the setting that does what it did), and vLLM's CPU KV offload (``kv_offloading_size``;
  its ``SimpleCPUOffloadConnector`` named in ``kv_transfer_config`` is refused in
  ``determine_available_memory``), whose scheduler builds a second ``BlockPool`` of CPU
  blocks through the coordinator's name, which is kvasync's pool.
- Scheduler: ``kv_cache_coordinator.BlockPool`` is the class the coordinator builds; the plugin
  puts a subclass there (``_pool``, Note [Who owns a free block]) whose free blocks are those
  the allocator hands out, on mapped pages. A shortage is vLLM's ordinary scheduling miss.
  ``KVCacheCoordinator.get_num_blocks_to_allocate`` also tells that pool the count it made,
  so that what ``get_num_free_blocks`` promises is mapped and the pool's own (Note [Count only
  what is mapped] in _pool): no step waits for the mapper.

Note [Checked patches]
~~~~~~~~~~~~~~~~~~~~~~
``register`` refuses, at start, a vLLM newer than the newest in ``TESTED`` (or older than the
oldest) with a message naming the tested releases; ``KVASYNC_VLLM_ANY_VERSION=1`` lifts that.
Then, whatever the version, it finds every seam's shape (``_seams.check_all``: signatures, the
names their code reads, and probes of vLLM's own pool, free list and blocks, so the private
internals the pool relies on are checked too) and refuses the first seam no known shape
matches, naming it, before patching anything: a half-patched vLLM (scheduler patched, worker
not) is how the reference allocator hangs. ``TESTED`` is every release the seam table lists,
each of which ``make vllm-matrix`` runs (docs/vllm/matrix-results.md).

Note [Page ids across processes and ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The scheduler decides block ids, and a block id is the same page id on every rank, because every
rank's KV tensors have the same geometry (heads split evenly). CUDA VMM mappings are per process,
so with vLLM's multiprocess executor (``distributed_executor_backend="mp"``: TP=1 in a worker
process, and TP > 1) kvasync's tensor-parallel group carries the scheduler's maps to the workers
(README, "Tensor parallel"; ``_ranks``):

- EngineCore: ``Executor.initialize_from_config(self, kv_cache_configs)`` is where the KV cache
  config is known and the workers have not yet allocated (vLLM 0.26 builds the scheduler and its
  BlockPool only after it returns). There the plugin opens the engine's allocator with
  ``Config(tensor_parallel=TensorParallel(group, world_size, map_local=False))`` on a host
  backend of the workers' geometry (pages of the device's granularity): it reserves address
  space, holds no KV memory and touches no GPU. The group is ``vllm-engine-<EngineCore pid>``;
  the executor's workers are that process's children and find it by ``os.getppid()``. A thread
  takes block 0 (vLLM's null block), retrying while the ranks join; the scheduler's pool finds
  the allocator as in one process (``register_engine``).
- Worker: the allocation seams (V1 and V2 runner) read the group's geometry (waiting up to 60 s
  for it), reserve a cuda range of it, run a ``RankMapper`` on it as rank
  ``get_tensor_model_parallel_rank()``, wait until block 0's page is mapped there (vLLM's dummy
  runs write it), zero block 0 and return views over the range.
- An alloc completes only when every rank has mapped its pages (C++ threads, a shared-memory
  ring, no Python on the path), so the pool's contract is unchanged: a block handed out is mapped
  on every rank. A rank that fails, dies or is slow fails the map within ``_MAP_TIMEOUT`` (5 s);
  the pool counts only what is mapped, so that is a scheduling miss, never a wait of the step
  (Note [Count only what is mapped] in _pool). A dead rank breaks the group: every later map
  fails at once; the engine must be restarted.
- Refused at start, naming the executor: Ray, an external launcher, several nodes, pipeline
  parallelism.
- A rank waits for its own GPU work before an unmap: the EngineCore frees blocks with no fence
  of the worker's streams (with async scheduling the next step may still read a finished
  request's blocks), so the rank's cuda backend waits for all of its process's device work
  before each unmap (``CudaBackend.sync_before_unmap``, on the RankMapper's thread, never the
  engine loop's), within ``unmap_sync_timeout`` (Note [Bounded device sync] in
  csrc/backends/cuda_device_sync.h: past it the unmap fails and the pages stay mapped). The
  scheduler waits for that within ``unmap_timeout``.
- With ``KVASYNC_SHARE`` the share is charged once per page, for the engine, not per device.
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from .._settings import PluginSettings, read_settings
from ._engine import EngineKV, current_engine
from ._seams import RELEASES, Found, UnsupportedVLLM, check_all, release_key

__all__ = ["TESTED", "UnsupportedVLLM", "register"]

logger = logging.getLogger("kvasync.vllm")

# The vLLM releases the plugin supports: every one the seam table lists (each seam's shape
# there), each run by `make vllm-matrix` (docs/vllm/compatibility.md).
TESTED: tuple[str, ...] = RELEASES
ANY_VERSION = "KVASYNC_VLLM_ANY_VERSION"
# vLLM's variable for the KV cache layout (0.29-); the one-backing shape needs a block-outermost
# layout (Note [vLLM seams]).
KV_CACHE_LAYOUT = "VLLM_KV_CACHE_LAYOUT"
_BLOCK_OUTERMOST = "BLNHC"  # the default's (LBNHC) per-layer order, blocks outermost

_registered = False


def vllm_version() -> str:
    """The installed vLLM's release, without a local suffix (``0.26.0+cu129`` -> ``0.26.0``)."""
    vllm = importlib.import_module("vllm")
    return str(vllm.__version__).split("+", 1)[0]


def check_version(version: str, env: dict[str, str] | None = None) -> None:
    """Refuses a vLLM the plugin was not tested with.

    Raises:
        UnsupportedVLLM: ``version`` is not in ``TESTED`` and ``KVASYNC_VLLM_ANY_VERSION`` is
            not 1, naming the tested releases, whether it is newer than the newest, and how to
            go on.
    """
    env = dict(os.environ) if env is None else env
    if version in TESTED or env.get(ANY_VERSION) == "1":
        return
    if release_key(version) > release_key(TESTED[-1]):
        where = f"newer than the newest tested ({TESTED[-1]})"
    elif release_key(version) < release_key(TESTED[0]):
        where = f"older than the oldest tested ({TESTED[0]})"
    else:
        where = "not a tested release"
    raise UnsupportedVLLM(
        f"kvasync's vLLM plugin was tested with vLLM {', '.join(TESTED)}; {version} is {where}: "
        f"install one of those, or unset KVASYNC_SHARE/KVASYNC_DEVICE_BUDGET/"
        f"KVASYNC_MEMORY_LIMIT/KVASYNC_VLLM to run vLLM without kvasync "
        f"({ANY_VERSION}=1 tries it anyway; every seam is still checked before anything is "
        "patched)"
    )


def find_engine(num_gpu_blocks: int, settings: PluginSettings) -> EngineKV:
    """The allocator the scheduler's pool uses: the one this process's worker opened, or (for
    vLLM's scheduler tests, ``KVASYNC_VLLM_HOST_POOL=1``) a host-backend allocator of its own.

    Raises:
        RuntimeError: no worker registered one in this process (the worker runs elsewhere).
        UnsupportedVLLM: a pool of another size than the engine's: a second ``BlockPool`` (vLLM's
            CPU KV offload builds one of CPU blocks), naming the setting.
    """
    engine = current_engine()
    if engine is not None:
        if engine.allocator.num_blocks != num_gpu_blocks and not settings.host_pool:
            raise UnsupportedVLLM(
                f"kvasync's vLLM plugin: a second BlockPool of {num_gpu_blocks} blocks is being "
                f"built beside the engine's ({engine.allocator.num_blocks} blocks, kvasync's); "
                "vLLM's CPU KV offload (kv_offloading_size / --kv-offloading-size, or "
                "kv_transfer_config's SimpleCPUOffloadConnector) builds one for its CPU blocks, "
                "which kvasync does not serve: unset it, or run vLLM without kvasync"
            )
        return engine
    if settings.host_pool:
        return host_engine(num_gpu_blocks, settings)
    raise RuntimeError(
        "kvasync's vLLM plugin found no KV allocator in the scheduler's process: neither the "
        "in-process worker nor Executor.initialize_from_config (workers in their own "
        "processes) opened one; run with vLLM's uniprocess or multiprocess executor, or "
        "without kvasync"
    )


def host_engine(
    num_gpu_blocks: int,
    settings: PluginSettings,
    *,
    reserve_pages: tuple[int, int] | None = None,
) -> EngineKV:
    """A host-backend allocator of ``num_gpu_blocks`` small blocks, for a pool with no worker.

    ``reserve_pages`` is its reserve's (low, high) watermark; None maps every page the limit
    allows before it returns and keeps them mapped. That is the pool vLLM's own tests get: they
    expect every block they count to be handed out in the same call, as a pool that maps ahead
    does when the reserve covers the step (Note [Count only what is mapped] in _pool); the
    plugin's tests set a small reserve to see pages come and go.
    """
    import torch

    from ..._config import Config
    from ..._layout import KVLayout
    from ..._sync import open_allocator_sync
    from ._engine import hold_null_block

    # 4 KiB blocks on 64 KiB pages: 16 blocks a page, so tests see pages come and go.
    layout = KVLayout(1, 1, 256, 16, dtype=torch.int8, kv_buffers=1)
    page_size = 64 << 10
    all_pages = -(-num_gpu_blocks * layout.range_block_bytes // page_size)
    kv = open_allocator_sync(
        layout,
        Config(
            backend="host",
            max_blocks=num_gpu_blocks,
            page_size=page_size,
            memory_limit=settings.memory_limit,
            reserve_pages=(all_pages, all_pages) if reserve_pages is None else reserve_pages,
        ),
    )
    try:
        timeout = kv.config.default_timeout
        hold_null_block(kv, timeout)
        if reserve_pages is None and (room := kv.available_blocks()) > 0:
            # Mapped now; the reserve keeps them. Freed last first, so that ids are handed out
            # lowest first again, as from a fresh pool (vLLM's tests expect its order).
            kv.free(kv.alloc(room, timeout=timeout)[::-1])
    except BaseException:
        kv.close()
        raise
    return EngineKV(allocator=kv, owned=True)


def check_layout_setting(env: dict[str, str] | None = None) -> str | None:
    """For the one-backing shape (0.29-): the KV cache layout must put blocks outermost, so that
    a block of every layer is one run of bytes. Sets ``VLLM_KV_CACHE_LAYOUT=BLNHC`` in ``env``
    (``os.environ``) when it is unset, and says so (returns the value set, else None).

    Raises:
        UnsupportedVLLM: the user set a layout whose blocks are not outermost, naming it.
    """
    env = os.environ if env is None else env  # type: ignore[assignment]
    assert env is not None
    requested = env.get(KV_CACHE_LAYOUT)
    if requested is None or not requested.strip():
        env[KV_CACHE_LAYOUT] = _BLOCK_OUTERMOST
        logger.warning(
            "kvasync: %s=%s set for vLLM (a block of every layer in one run of bytes, which "
            "kvasync maps as one block); set it yourself to choose another block-outermost "
            "layout (BLHNC, BHLNC)",
            KV_CACHE_LAYOUT,
            _BLOCK_OUTERMOST,
        )
        return _BLOCK_OUTERMOST
    layouts = importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout
    layout = layouts.__members__.get(requested.strip().upper())
    if layout is None or not layout.is_block_outermost:
        raise UnsupportedVLLM(
            f"kvasync's vLLM plugin: {KV_CACHE_LAYOUT}={requested} keeps each layer's blocks "
            "in a region of their own; kvasync maps a block of every layer as one run of "
            f"bytes, which a block-outermost layout gives: set {KV_CACHE_LAYOUT}="
            f"{_BLOCK_OUTERMOST} (or BLHNC, BHLNC), or unset it, or run vLLM without kvasync"
        )
    return None


def check_cache_config(cache_config: Any, settings: PluginSettings) -> None:
    """Refuses, at a worker's start, the vLLM settings kvasync would otherwise override or
    break, each named with what to do instead.

    Raises:
        UnsupportedVLLM: ``kv_offloading_size`` (vLLM's CPU KV offload) is set.
        ValueError: ``kv_cache_memory_bytes`` is set to another size than kvasync's capacity.
    """
    offload = getattr(cache_config, "kv_offloading_size", None)
    if offload is not None:
        raise UnsupportedVLLM(
            f"kvasync's vLLM plugin does not run with vLLM's CPU KV offload "
            f"(kv_offloading_size={offload}, --kv-offloading-size): its scheduler builds a "
            "second BlockPool for the CPU blocks, which kvasync does not serve; unset it, or "
            "run vLLM without kvasync"
        )
    asked = cache_config.kv_cache_memory_bytes
    if asked is not None and int(asked) != settings.capacity_bytes:
        raise ValueError(
            f"kvasync's vLLM plugin sizes the KV cache itself ({settings.capacity_bytes} bytes: "
            f"KVASYNC_MEMORY_LIMIT, else KVASYNC_DEVICE_BUDGET), and kv_cache_memory_bytes="
            f"{asked} (--kv-cache-memory-bytes) is set too: to cap this engine's KV memory, set "
            f"KVASYNC_MEMORY_LIMIT={asked} and leave kv_cache_memory_bytes unset"
        )


def check_connector(vllm_config: Any) -> None:
    """Refuses vLLM's CPU KV offload connector set directly in ``kv_transfer_config``.

    Raises:
        UnsupportedVLLM: ``kv_transfer_config.kv_connector`` is ``SimpleCPUOffloadConnector``.
    """
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    connector = getattr(transfer, "kv_connector", None)
    if connector == "SimpleCPUOffloadConnector":
        raise UnsupportedVLLM(
            "kvasync's vLLM plugin does not run with vLLM's CPU KV offload (kv_transfer_config "
            "kv_connector=SimpleCPUOffloadConnector): its scheduler builds a second BlockPool "
            "for the CPU blocks, which kvasync does not serve; remove it, or run vLLM without "
            "kvasync"
        )


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: installs the plugin when it is asked for.

    Idempotent (vLLM calls it once per process, perhaps more). Checks everything first, then
    patches.

    Raises:
        UnsupportedVLLM: an untested vLLM, or a seam that changed (nothing is patched then).
        ValueError: a malformed ``KVASYNC_*`` variable.
    """
    global _registered
    settings = read_settings()
    if not settings.enabled or _registered:
        return
    check_version(vllm_version())
    engine = not settings.host_pool
    found = check_all(engine=engine)
    if engine:
        settings.capacity_bytes  # noqa: B018 - refuses a missing size now, not at the first request
        if found["allocate-kv-cache"].present:
            check_layout_setting()
    from ._pool import counting_demand, make_block_pool_class

    pool = found["coordinator-block-pool"]
    count = found["coordinator-count"]
    pool.replace(
        make_block_pool_class(pool.value, functools.partial(find_engine, settings=settings))
    )
    count.replace(counting_demand(count.value))
    if settings.share is not None:  # Note [The engine's demand in a share]
        from ._demand import reporting_demand

        schedule = found["scheduler-schedule"]
        schedule.replace(reporting_demand(schedule.value))
    if engine:
        _patch_worker(settings, found)
    _registered = True
    logger.info(
        "kvasync: vLLM plugin installed (vLLM %s; %s)",
        vllm_version(),
        ", ".join(sorted({f.shape.adapter for f in found.values() if f.shape.adapter})) or "pool",
    )


def executor_kind(executor: Any) -> str:
    """``"uni"`` for an executor whose worker runs in the EngineCore's process, ``"mp"`` for
    vLLM's multiprocess executor on one node (its workers are the EngineCore's children).

    Raises:
        UnsupportedVLLM: any other executor (Ray, an external launcher, several nodes), naming it.
    """
    names = [cls.__name__ for cls in type(executor).__mro__]
    parallel = executor.vllm_config.parallel_config
    if "ExecutorWithExternalLauncher" not in names and not any("Ray" in n for n in names):
        if "UniProcExecutor" in names:
            return "uni"
        if "MultiprocExecutor" in names and int(getattr(parallel, "nnodes", 1)) == 1:
            if int(parallel.pipeline_parallel_size) != 1:
                raise UnsupportedVLLM(
                    "kvasync's vLLM plugin supports tensor parallelism, not pipeline "
                    f"parallelism (pipeline_parallel_size={parallel.pipeline_parallel_size})"
                )
            return "mp"
    raise UnsupportedVLLM(
        f"kvasync's vLLM plugin runs with vLLM's uniprocess or multiprocess executor on one "
        f"node, not {type(executor).__name__}: use distributed_executor_backend='uni' or 'mp', "
        "or run without kvasync"
    )


def workers_in_own_processes(distributed_executor_backend: Any) -> bool:
    """Whether a worker with this ``parallel_config.distributed_executor_backend`` runs in a
    process of its own (vLLM's multiprocess executor, named ``"mp"`` or given as its class or a
    subclass), as ``executor_kind`` says ``"mp"`` in the EngineCore: the two sides must agree, or
    the EngineCore's group waits for ranks that never join.
    """
    if distributed_executor_backend == "mp":
        return True
    if isinstance(distributed_executor_backend, type):
        names = [cls.__name__ for cls in distributed_executor_backend.__mro__]
        return "MultiprocExecutor" in names
    return False


def _open_engine_for_workers(
    executor: Any, kv_cache_configs: Any, settings: PluginSettings, layout_of: Callable[[Any], Any]
) -> Any:
    """Opens the EngineCore's allocator for workers in their own processes (Note [Page ids
    across processes and ranks]) and starts taking its null block; returns the holder."""
    from ._engine import register_engine, take_engine
    from ._ranks import NullBlockHolder, cuda_page_size, open_scheduler_engine
    from ._worker import reserve_pages_for, step_blocks

    vllm_config = executor.vllm_config
    layout = layout_of(kv_cache_configs[0])
    page_size = layout.page_unit(cuda_page_size(layout.range_block_bytes, 0))
    reserve = reserve_pages_for(layout, page_size, step_blocks(vllm_config, layout.block_size))
    previous = take_engine()
    if previous is not None:
        previous.allocator.close()
    engine = open_scheduler_engine(
        kv_cache_configs,
        num_ranks=int(vllm_config.parallel_config.world_size),
        settings=settings,
        name=settings.name or f"vllm:{vllm_config.model_config.served_model_name}",
        reserve=reserve,
        page_size=page_size,
        layout_of=layout_of,
    )
    register_engine(engine)
    logger.info(
        "kvasync: %d KV blocks for %d worker process(es), page %d bytes a layer, reserve %s",
        engine.allocator.num_blocks,
        vllm_config.parallel_config.world_size,
        page_size,
        reserve,
    )
    return NullBlockHolder(engine.allocator)


def lift_free_memory_check(
    stock: Callable[..., int], settings: PluginSettings
) -> Callable[..., int]:
    """vLLM's ``request_memory`` (either shape) without its free-memory refusal alone.

    The KV cache is not taken at start, so free memory need not cover
    ``gpu_memory_utilization``; a busy GPU (a neighbour engine) is not a reason to refuse. Stock
    runs on a copy of the snapshot whose free memory is the device's total: what it returns is
    what it would with the device free, and any other refusal (0.32's externally held weights
    over the utilization, a bad setting) raises as it does without kvasync. The settings the
    plugin cannot honour are refused first (``check_cache_config``).
    """

    def request_memory(init_snapshot: Any, cache_config: Any, *args: Any, **kwargs: Any) -> int:
        check_cache_config(cache_config, settings)
        as_free = copy.copy(init_snapshot)  # a dataclass copy: no new measure
        as_free.free_memory = init_snapshot.total_memory
        return stock(as_free, cache_config, *args, **kwargs)

    request_memory.kvasync_stock = stock  # type: ignore[attr-defined]
    return request_memory


def _patch_worker(settings: PluginSettings, found: dict[str, Found]) -> None:
    """Installs the worker's and the executor's patches, one adapter per shape found."""
    from ._worker import (
        allocate_kv_cache_tensors,
        kv_layout_for,
        one_backing_geometry,
        one_backing_layout,
        per_layer_geometry,
    )

    def allocate(geometry: Any, device: Any, vllm_config: Any) -> Any:
        if workers_in_own_processes(vllm_config.parallel_config.distributed_executor_backend):
            # A worker process: the EngineCore's allocator decides, this rank maps.
            from ._ranks import rank_kv_cache_tensors

            distributed = importlib.import_module("vllm.distributed")
            return rank_kv_cache_tensors(
                geometry,
                device=device,
                vllm_config=vllm_config,
                settings=settings,
                rank=int(distributed.get_tensor_model_parallel_rank()),
            )
        return allocate_kv_cache_tensors(
            geometry, device=device, vllm_config=vllm_config, settings=settings
        )

    def current_vllm_config() -> Any:
        # The runners allocate inside Worker.initialize_from_config, which vLLM's worker
        # wrapper runs under set_current_vllm_config.
        return importlib.import_module("vllm.config").get_current_vllm_config()

    layout_of: Callable[[Any], Any] = kv_layout_for
    if found["runner-allocate"].present:  # the per-layer shape (0.26-0.28)

        def kv_cache_tensors(self: Any, kv_cache_config: Any) -> Any:
            geometry = per_layer_geometry(
                kv_cache_config, skip_layers=frozenset(self.runner_only_attn_layers)
            )
            return allocate(geometry, self.device, self.vllm_config)

        def kv_cache_tensors_v2(kv_cache_config: Any, shared_layers: Any, device: Any) -> Any:
            geometry = per_layer_geometry(kv_cache_config, shared_layers=frozenset(shared_layers))
            return allocate(geometry, device, current_vllm_config())

        found["runner-allocate"].replace(kv_cache_tensors)
        found["v2-runner-allocate"].replace(kv_cache_tensors_v2)
    if found["allocate-kv-cache"].present:  # the one-backing shape (0.29-)
        stock_allocate: Callable[..., Any] = found["allocate-kv-cache"].value
        layout_of = one_backing_layout

        def allocate_kv_cache(
            kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: Any = None
        ) -> Any:
            geometry = one_backing_geometry(
                kv_cache_config, stock_allocate, layout, kernel_block_sizes
            )
            return allocate(geometry, device, current_vllm_config())

        allocate_kv_cache.kvasync_stock = stock_allocate  # type: ignore[attr-defined]
        for key in ("allocate-kv-cache", "runner-allocate-kv-cache", "v2-runner-allocate-kv-cache"):
            found[key].replace(allocate_kv_cache)

    stock_init: Callable[[Any, Any], None] = found["executor-init"].value

    def initialize_from_config(self: Any, kv_cache_configs: Any) -> None:
        if executor_kind(self) == "uni":
            return stock_init(self, kv_cache_configs)
        from ._engine import take_engine

        holder = _open_engine_for_workers(self, kv_cache_configs, settings, layout_of)
        try:
            stock_init(self, kv_cache_configs)  # the workers join, map block 0's page, compile
            holder.wait()
        except BaseException:
            engine = take_engine()
            if engine is not None:
                engine.allocator.close()  # the group's ranks unmap and leave
            raise
        return None

    stock_available: Callable[[Any], int] = found["determine-available-memory"].value

    def determine_available_memory(self: Any) -> int:
        # vLLM's own branch for a given KV size: it runs the profile (compile) pass and skips
        # the free-memory profile, which a neighbour's allocations or releases would upset. A
        # size the user set was refused at start (check_cache_config), so none is overwritten.
        check_cache_config(self.cache_config, settings)
        check_connector(self.vllm_config)
        self.cache_config.kv_cache_memory_bytes = settings.capacity_bytes
        return stock_available(self)

    found["executor-init"].replace(initialize_from_config)
    found["determine-available-memory"].replace(determine_available_memory)
    found["request-memory"].replace(lift_free_memory_check(found["request-memory"].value, settings))
