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

- Worker: ``GPUModelRunner._allocate_kv_cache_tensors(self, kv_cache_config)`` (the V1 model
  runner; ``gpu.attn_utils._allocate_kv_cache(kv_cache_config, shared_layers, device)`` in the
  V2 runner, 0.26's default for Llama-family models) returns, for each
  attention layer, an int8 tensor of ``num_blocks * page_size_bytes`` that vLLM reshapes for its
  attention backend. The plugin returns views over a kvasync allocator's virtual ranges instead
  (one range per layer, a kvasync block of exactly ``page_size_bytes``: ``_worker.kv_layout_for``),
  so block id ``b`` is the same bytes for vLLM and kvasync, and the attention kernels run
  unchanged. Capacity is reserved, nothing but the null block's page is mapped.
- Capacity: ``Worker.determine_available_memory(self)`` is where vLLM profiles free memory and
  sizes the cache. The plugin sets ``cache_config.kv_cache_memory_bytes`` to kvasync's capacity
  (``KVASYNC_MEMORY_LIMIT``, else ``KVASYNC_DEVICE_BUDGET``) before calling it, which is vLLM's
  own branch that still runs the profile (compile) pass but does not size by free memory; and
  ``gpu_worker.request_memory(init_snapshot, cache_config)``, vLLM's start-up check that the
  free memory covers ``gpu_memory_utilization``, no longer refuses a GPU another engine uses.
- Scheduler: ``kv_cache_coordinator.BlockPool`` is the class the coordinator builds; the plugin
  puts a subclass there (``_pool``, Note [Who owns a free block]) whose free blocks are those
  the allocator hands out, on mapped pages. A shortage is vLLM's ordinary scheduling miss.
  ``KVCacheCoordinator.get_num_blocks_to_allocate`` also tells that pool the count it made,
  so that what ``get_num_free_blocks`` promises is mapped and the pool's own (Note [Count only
  what is mapped] in _pool): no step waits for the mapper.

Note [Checked patches]
~~~~~~~~~~~~~~~~~~~~~~
Each patch names the attribute, the parameters it must have, and the vLLM versions it was
tested with (``TESTED``). ``register`` refuses, at start, a vLLM outside ``TESTED`` with a
message naming the tested versions, and refuses any seam whose attribute is missing or whose
signature differs, before patching anything: a half-patched vLLM (scheduler patched, worker
not) is how the reference allocator hangs. ``KVASYNC_VLLM_ANY_VERSION=1`` lifts the version
check (never the signature checks), for trying a new release. A seam may accept the signature
another tested release has (``Seam.also``). The block pool alone (``KVASYNC_VLLM_HOST_POOL=1``,
vLLM's own scheduler tests) is tested on more releases (``SCHEDULER_TESTED``: 0.33.0, whose
``tests/v1/core`` pass with it as with stock vLLM but for the 10 tests that read vLLM's
``free_block_queue``); an engine on those is refused, saying the worker side is not tested.

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

import functools
import importlib
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._engine import EngineKV, current_engine
from ._settings import PluginSettings, read_settings

__all__ = ["TESTED", "UnsupportedVLLM", "register"]

logger = logging.getLogger("kvasync.vllm")

# vLLM releases the plugin was run against end to end (worker and scheduler).
TESTED: tuple[str, ...] = ("0.26.0",)
# Releases whose scheduler side (the block pool) was run through vLLM's own tests: the pool alone
# (KVASYNC_VLLM_HOST_POOL=1, as `make vllm-test` runs it) is allowed on these.
SCHEDULER_TESTED: tuple[str, ...] = ("0.26.0", "0.33.0")
ANY_VERSION = "KVASYNC_VLLM_ANY_VERSION"


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is not one the plugin was tested with, or a seam has changed."""


@dataclass(frozen=True)
class Seam:
    """One attribute the plugin replaces, and the parameters it must have (``parameters``, or
    one of ``also``: the same seam as another tested vLLM has it)."""

    module: str
    attribute: str  # "Name" or "Class.method"
    parameters: tuple[str, ...]
    also: tuple[tuple[str, ...], ...] = ()

    def resolve(self) -> tuple[Any, str, Any]:
        """(owner, name, current value).

        Raises:
            UnsupportedVLLM: the module, attribute or signature is not the expected one.
        """
        try:
            owner: Any = importlib.import_module(self.module)
        except ImportError as error:
            raise UnsupportedVLLM(f"cannot import {self.module}: {error}") from error
        *path, name = self.attribute.split(".")
        for part in path:
            owner = getattr(owner, part, None)
            if owner is None:
                raise UnsupportedVLLM(f"{self.module}.{self.attribute}: {part} is missing")
        value = inspect.getattr_static(owner, name, None)
        if value is None:
            raise UnsupportedVLLM(f"{self.module}.{self.attribute} is missing")
        target = value.__init__ if inspect.isclass(value) else value
        found = tuple(inspect.signature(target).parameters)
        if found != self.parameters and found not in self.also:
            raise UnsupportedVLLM(
                f"{self.module}.{self.attribute} has parameters {found}, expected {self.parameters}"
            )
        return owner, name, getattr(owner, name)


_POOL_INIT = (
    "self",
    "num_gpu_blocks",
    "enable_caching",
    "hash_block_size",
    "enable_kv_cache_events",
    "metrics_collector",
)
BLOCK_POOL = Seam(
    "vllm.v1.core.kv_cache_coordinator",
    "BlockPool",
    _POOL_INIT,
    also=((*_POOL_INIT, "num_hash_lookahead_tokens", "medium"),),  # 0.33
)
# The coordinator's count of the blocks an allocation needs, which the pool is told (Note [Count
# only what is mapped] in _pool).
_COUNT_PARAMETERS = (
    "self",
    "request_id",
    "num_tokens",
    "new_computed_blocks",
    "num_encoder_tokens",
    "total_computed_tokens",
    "num_local_computed_tokens",
    "num_tokens_main_model",
    "apply_admission_cap",
)
COORDINATOR_COUNT = Seam(
    "vllm.v1.core.kv_cache_coordinator",
    "KVCacheCoordinator.get_num_blocks_to_allocate",
    _COUNT_PARAMETERS,
    also=((*_COUNT_PARAMETERS, "prefill_end"),),  # 0.33
)
# The methods of vLLM's BlockPool and FreeKVCacheBlockQueue that the pool overrides or calls.
POOL_METHODS = (
    Seam("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks", ("self",)),
    Seam("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", ("self", "num_blocks")),
    Seam("vllm.v1.core.block_pool", "BlockPool.free_blocks", ("self", "ordered_blocks")),
    Seam("vllm.v1.core.block_pool", "BlockPool.reset_prefix_cache", ("self",)),
    Seam("vllm.v1.core.block_pool", "BlockPool.get_usage", ("self",)),
    Seam("vllm.v1.core.block_pool", "BlockPool._maybe_evict_cached_block", ("self", "block")),
    Seam("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue.popleft_n", ("self", "n")),
    Seam("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue.append_n", ("self", "blocks")),
    Seam("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue.remove", ("self", "block")),
    Seam("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue.get_all_free_blocks", ("self",)),
)
ALLOCATE = Seam(
    "vllm.v1.worker.gpu_model_runner",
    "GPUModelRunner._allocate_kv_cache_tensors",
    ("self", "kv_cache_config"),
)
# The V2 model runner (vLLM's default for Llama-family models in 0.26) allocates here.
ALLOCATE_V2 = Seam(
    "vllm.v1.worker.gpu.attn_utils",
    "_allocate_kv_cache",
    ("kv_cache_config", "shared_layers", "device"),
)
# The EngineCore's call that has the workers allocate their KV caches: with workers in their own
# processes, the engine's allocator (the group's scheduler) is opened here, before they join.
EXECUTOR_INIT = Seam(
    "vllm.v1.executor.abstract",
    "Executor.initialize_from_config",
    ("self", "kv_cache_configs"),
)
AVAILABLE_MEMORY = Seam("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory", ("self",))
REQUEST_MEMORY = Seam(
    "vllm.v1.worker.gpu_worker", "request_memory", ("init_snapshot", "cache_config")
)

_registered = False


def vllm_version() -> str:
    """The installed vLLM's release, without a local suffix (``0.26.0+cu129`` -> ``0.26.0``)."""
    vllm = importlib.import_module("vllm")
    return str(vllm.__version__).split("+", 1)[0]


def check_version(
    version: str, env: dict[str, str] | None = None, *, pool_only: bool = False
) -> None:
    """Refuses a vLLM the plugin was not tested with.

    ``pool_only``: only the scheduler's block pool is installed (vLLM's own tests), which is
    tested on ``SCHEDULER_TESTED``.

    Raises:
        UnsupportedVLLM: ``version`` is not in ``TESTED`` (``SCHEDULER_TESTED`` for the pool
            alone) and ``KVASYNC_VLLM_ANY_VERSION`` is not 1, naming the tested versions and
            how to go on.
    """
    env = dict(os.environ) if env is None else env
    tested = SCHEDULER_TESTED if pool_only else TESTED
    if version in tested or env.get(ANY_VERSION) == "1":
        return
    pool_note = (
        f" (its block pool alone is tested with {', '.join(SCHEDULER_TESTED)} through vLLM's "
        "own tests; the worker side is not)"
        if version in SCHEDULER_TESTED
        else ""
    )
    raise UnsupportedVLLM(
        f"kvasync's vLLM plugin was tested with vLLM {', '.join(TESTED)}, not {version}"
        f"{pool_note}: "
        f"install one of those, or unset KVASYNC_SHARE/KVASYNC_DEVICE_BUDGET/"
        f"KVASYNC_MEMORY_LIMIT/KVASYNC_VLLM to run vLLM without kvasync "
        f"({ANY_VERSION}=1 tries it anyway; the seams are still checked)"
    )


def find_engine(num_gpu_blocks: int, settings: PluginSettings) -> EngineKV:
    """The allocator the scheduler's pool uses: the one this process's worker opened, or (for
    vLLM's scheduler tests, ``KVASYNC_VLLM_HOST_POOL=1``) a host-backend allocator of its own.

    Raises:
        RuntimeError: no worker registered one in this process (the worker runs elsewhere).
    """
    engine = current_engine()
    if engine is not None:
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


def _replace(owner: Any, name: str, value: Any) -> None:
    setattr(owner, name, value)


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
    check_version(vllm_version(), pool_only=settings.host_pool)
    pool_owner, pool_name, block_pool = BLOCK_POOL.resolve()
    for seam in POOL_METHODS:
        seam.resolve()
    count = COORDINATOR_COUNT.resolve()
    worker = None
    if not settings.host_pool:
        worker = (
            ALLOCATE.resolve(),
            ALLOCATE_V2.resolve(),
            AVAILABLE_MEMORY.resolve(),
            REQUEST_MEMORY.resolve(),
            EXECUTOR_INIT.resolve(),
        )
        settings.capacity_bytes  # noqa: B018 - refuses a missing size now, not at the first request
    from ._pool import counting_demand, make_block_pool_class

    pool_class = make_block_pool_class(
        block_pool, functools.partial(find_engine, settings=settings)
    )
    _replace(pool_owner, pool_name, pool_class)
    _replace(count[0], count[1], counting_demand(count[2]))
    if worker is not None:
        _patch_worker(settings, *worker)
    _registered = True
    logger.info("kvasync: vLLM plugin installed (vLLM %s)", vllm_version())


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


def _open_engine_for_workers(executor: Any, kv_cache_configs: Any, settings: PluginSettings) -> Any:
    """Opens the EngineCore's allocator for workers in their own processes (Note [Page ids
    across processes and ranks]) and starts taking its null block; returns the holder."""
    from ._engine import register_engine, take_engine
    from ._ranks import NullBlockHolder, cuda_page_size, open_scheduler_engine
    from ._worker import kv_layout_for, reserve_pages_for, step_blocks

    vllm_config = executor.vllm_config
    layout = kv_layout_for(kv_cache_configs[0])
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


def _patch_worker(
    settings: PluginSettings,
    allocate: tuple[Any, str, Any],
    allocate_v2: tuple[Any, str, Any],
    available: tuple[Any, str, Any],
    request: tuple[Any, str, Any],
    executor_init: tuple[Any, str, Any],
) -> None:
    from ._worker import allocate_kv_cache_tensors

    def allocate_tensors(kv_cache_config: Any, device: Any, vllm_config: Any, **layers: Any) -> Any:
        if workers_in_own_processes(vllm_config.parallel_config.distributed_executor_backend):
            # A worker process: the EngineCore's allocator decides, this rank maps.
            from ._ranks import rank_kv_cache_tensors

            distributed = importlib.import_module("vllm.distributed")

            return rank_kv_cache_tensors(
                kv_cache_config,
                device=device,
                vllm_config=vllm_config,
                settings=settings,
                rank=int(distributed.get_tensor_model_parallel_rank()),
                **layers,
            )
        return allocate_kv_cache_tensors(
            kv_cache_config, device=device, vllm_config=vllm_config, settings=settings, **layers
        )

    def kv_cache_tensors(self: Any, kv_cache_config: Any) -> Any:
        return allocate_tensors(
            kv_cache_config,
            self.device,
            self.vllm_config,
            skip_layers=frozenset(self.runner_only_attn_layers),
        )

    def kv_cache_tensors_v2(kv_cache_config: Any, shared_layers: Any, device: Any) -> Any:
        # Called inside Worker.initialize_from_config, under vLLM's set_current_vllm_config.
        current = importlib.import_module("vllm.config").get_current_vllm_config

        return allocate_tensors(
            kv_cache_config, device, current(), shared_layers=frozenset(shared_layers)
        )

    stock_init: Callable[[Any, Any], None] = executor_init[2]

    def initialize_from_config(self: Any, kv_cache_configs: Any) -> None:
        if executor_kind(self) == "uni":
            return stock_init(self, kv_cache_configs)
        from ._engine import take_engine

        holder = _open_engine_for_workers(self, kv_cache_configs, settings)
        try:
            stock_init(self, kv_cache_configs)  # the workers join, map block 0's page, compile
            holder.wait()
        except BaseException:
            engine = take_engine()
            if engine is not None:
                engine.allocator.close()  # the group's ranks unmap and leave
            raise
        return None

    stock_available: Callable[[Any], int] = available[2]

    def determine_available_memory(self: Any) -> int:
        # vLLM's own branch for a given KV size: it runs the profile (compile) pass and skips
        # the free-memory profile, which a neighbour's allocations or releases would upset.
        self.cache_config.kv_cache_memory_bytes = settings.capacity_bytes
        return stock_available(self)

    stock_request: Callable[[Any, Any], int] = request[2]

    def request_memory(init_snapshot: Any, cache_config: Any) -> int:
        # The KV cache is not taken at start, so free memory need not cover
        # gpu_memory_utilization; a busy GPU (a neighbour engine) is not a reason to refuse.
        try:
            return stock_request(init_snapshot, cache_config)
        except ValueError:
            return int(init_snapshot.free_memory)

    _replace(allocate[0], allocate[1], kv_cache_tensors)
    _replace(allocate_v2[0], allocate_v2[1], kv_cache_tensors_v2)
    _replace(available[0], available[1], determine_available_memory)
    _replace(request[0], request[1], request_memory)
    _replace(executor_init[0], executor_init[1], initialize_from_config)
