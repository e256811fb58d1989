"""Every vLLM attribute the plugin patches or reads, and which shape each vLLM release has.

Note [Seam table]
~~~~~~~~~~~~~~~~~
``SEAMS`` lists each thing the plugin touches in vLLM (a seam): the attribute, what the plugin
does with it, and its shapes. A ``Shape`` is what a range of releases has: the callable's
parameters, the names its code reads (``reads``: the attribute, global or field names in its
bytecode, e.g. that ``Worker.determine_available_memory`` still reads
``kv_cache_memory_bytes``), or what a probe of vLLM's own object finds (``probe``: a small
stock ``BlockPool`` built at start shows ``kv_event_queue``, ``cached_block_hashes_by_block``
and the free list's links), or that the seam is absent in those releases (``absent``). The
releases are the ones whose source was read (``RELEASES``; ``docs/vllm/compatibility.md``
prints the table).

``check_all`` finds every seam's shape before anything is patched, and raises
``UnsupportedVLLM`` naming the first seam no known shape matches, with what it found. The
plugin is written once against kvasync's own protocol; what differs between shapes is done by
one adapter per shape (``adapter`` names it; ``__init__`` and ``_worker`` hold them), chosen by
the shape ``check_all`` found, never by the version string. So a release the table has not seen
(``KVASYNC_VLLM_ANY_VERSION=1``) runs if every seam has a known shape, and is refused at start,
naming the seam, if one has not.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RELEASES",
    "SEAMS",
    "Found",
    "Seam",
    "Shape",
    "UnsupportedVLLM",
    "check_all",
    "release_key",
]

# The vLLM releases whose source the table was built from, oldest first.
RELEASES: tuple[str, ...] = (
    "0.26.0",
    "0.27.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
)


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is not one the plugin was tested with, or a seam has changed."""


def release_key(version: str) -> tuple[int, ...]:
    """``"0.27.1"`` -> ``(0, 27, 1)``: the leading numbers of a release (``0.34.0rc1+cu129``
    -> ``(0, 34, 0)``, so a pre-release sorts with its release)."""
    parts = []
    for part in version.split("+", 1)[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() != len(part):
            break
    return tuple(parts)


@dataclass(frozen=True)
class Shape:
    """One shape of a seam and the releases that have it (``first`` to ``last``, both in)."""

    name: str
    first: str
    last: str
    parameters: tuple[str, ...] | None = None
    reads: tuple[str, ...] = ()
    probe: Callable[[Any], str | None] | None = None
    absent: bool = False
    adapter: str = ""  # the adapter the plugin uses for it ("" when none differs)

    @property
    def releases(self) -> tuple[str, ...]:
        """The releases of ``RELEASES`` that have this shape."""
        low, high = release_key(self.first), release_key(self.last)
        return tuple(r for r in RELEASES if low <= release_key(r) <= high)

    def mismatch(self, value: Any) -> str | None:
        """What in ``value`` (None: the attribute is missing) differs from this shape."""
        if value is None:
            return None if self.absent else "it is missing"
        if self.absent:
            return "it is there"
        if self.parameters is not None:
            target = value.__init__ if inspect.isclass(value) else value
            try:
                found = tuple(inspect.signature(target).parameters)
            except (TypeError, ValueError) as error:
                return f"its signature cannot be read ({error})"
            if found != self.parameters:
                return f"it has parameters {found}, this shape {self.parameters}"
        if self.reads:
            names = _code_names(value)
            missing = [n for n in self.reads if n not in names]
            if missing:
                return f"its code does not read {missing}"
        if self.probe is not None:
            try:
                return self.probe(value)
            except Exception as error:  # a probe of vLLM's object: any failure is a mismatch
                return f"the probe failed: {type(error).__name__}: {error}"
        return None


def _code_names(value: Any) -> set[str]:
    """The names a function's (or a class's ``__init__``'s) bytecode reads or stores, nested
    functions included."""
    target = value.__init__ if inspect.isclass(value) else value
    code = getattr(inspect.unwrap(target), "__code__", None)
    names: set[str] = set()
    stack = [code] if code is not None else []
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(c for c in current.co_consts if inspect.iscode(c))
    return names


@dataclass(frozen=True)
class Seam:
    """A vLLM attribute the plugin patches (``patched``) or relies on."""

    key: str
    module: str
    attribute: str  # "Name" or "Class.method"
    what: str  # what the plugin does with it
    shapes: tuple[Shape, ...]
    patched: bool = False
    engine: bool = False  # only for an engine (the worker side), not the block pool alone

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.attribute}"

    def lookup(self) -> tuple[Any, str, Any]:
        """(owner, name, value), value None where the attribute is missing.

        Raises:
            UnsupportedVLLM: the module does not import.
        """
        try:
            owner: Any = importlib.import_module(self.module)
        except ImportError as error:
            raise UnsupportedVLLM(
                f"kvasync's vLLM plugin: seam {self.key} ({self.qualname}): cannot import "
                f"{self.module}: {error}"
            ) from error
        *path, name = self.attribute.split(".")
        for part in path:
            owner = inspect.getattr_static(owner, part, None)
            if owner is None:
                return None, name, None
        value = inspect.getattr_static(owner, name, None)
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        return owner, name, value

    def find(self) -> Found:
        """The shape this vLLM has.

        Raises:
            UnsupportedVLLM: no known shape matches, naming the seam and what differs from each.
        """
        owner, name, value = self.lookup()
        differences = []
        for shape in self.shapes:
            problem = shape.mismatch(value)
            if problem is None:
                return Found(self, shape, owner, name, value)
            differences.append(f"shape {shape.name} ({shape.first}-{shape.last}): {problem}")
        raise UnsupportedVLLM(
            f"kvasync's vLLM plugin: seam {self.key} ({self.qualname}, {self.what}) has no shape "
            f"the plugin knows: {'; '.join(differences)}. Nothing was patched; run vLLM without "
            "kvasync (unset KVASYNC_SHARE/KVASYNC_DEVICE_BUDGET/KVASYNC_MEMORY_LIMIT/"
            "KVASYNC_VLLM), or a release listed in docs/vllm/compatibility.md"
        )

    def shape_of(self, release: str) -> Shape | None:
        """The shape the table lists for ``release``, or None."""
        for shape in self.shapes:
            if release in shape.releases:
                return shape
        return None


@dataclass(frozen=True)
class Found:
    """A seam as this vLLM has it."""

    seam: Seam
    shape: Shape
    owner: Any
    name: str
    value: Any

    @property
    def present(self) -> bool:
        return not self.shape.absent

    def replace(self, value: Any) -> None:
        """Puts ``value`` where the seam is (the plugin's patch)."""
        setattr(self.owner, self.name, value)


# -- probes: vLLM's own objects, built small at start ----------------------------------------


def _probe_num_tokens(request_class: Any) -> str | None:
    found = inspect.getattr_static(request_class, "num_tokens", None)
    return None if isinstance(found, property) else f"Request.num_tokens is {found!r}, no property"


def _probe_block(block_class: Any, *, pool_field: bool) -> str | None:
    block = block_class(block_id=3)
    wanted = ["block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block"]
    missing = [n for n in wanted if not hasattr(block, n)]
    if missing:
        return f"a KVCacheBlock has no {missing}"
    if not hasattr(type(block), "is_null") and not hasattr(block, "is_null"):
        return "a KVCacheBlock has no is_null"
    if hasattr(block, "pool") != pool_field:
        return f"a KVCacheBlock {'has no' if pool_field else 'has a'} pool field"
    return None


def _block_probe(pool_field: bool) -> Callable[[Any], str | None]:
    return lambda block_class: _probe_block(block_class, pool_field=pool_field)


def _probe_free_queue(queue_class: Any) -> str | None:
    """vLLM's free list as the pool uses it: built from blocks, linked through sentinels."""
    block_class = importlib.import_module("vllm.v1.core.block_pool").KVCacheBlock
    blocks = [block_class(block_id=i) for i in range(3)]
    queue = queue_class(blocks)
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    if queue.num_free_blocks != 3:
        return f"num_free_blocks is {queue.num_free_blocks} for 3 blocks"
    if head.next_free_block is not blocks[0] or tail.prev_free_block is not blocks[2]:
        return "the sentinels fake_free_list_head/tail do not link the first and last blocks"
    if blocks[0].next_free_block is not blocks[1] or blocks[1].prev_free_block is not blocks[0]:
        return "the blocks are not linked through prev_free_block/next_free_block"
    queue.remove(blocks[1])
    queue.append_n([blocks[1]])
    if [b.block_id for b in queue.get_all_free_blocks()] != [0, 2, 1]:
        return "remove/append_n/get_all_free_blocks do not keep the order"
    taken = queue.popleft_n(2)
    if [b.block_id for b in taken] != [0, 2] or queue.num_free_blocks != 1:
        return "popleft_n does not take from the head"
    for method in ("iter_blocks_after", "prepend_n", "popleft"):
        if not callable(getattr(queue, method, None)):
            return f"it has no {method}"
    return None


def _probe_pool(pool_class: Any, *, reuse_watchers: bool) -> str | None:
    """A stock BlockPool of 4 blocks: the attributes the plugin's pool reads and replaces."""
    pool = pool_class(4, True, 16, True, None)
    queue_class = importlib.import_module(pool_class.__module__).FreeKVCacheBlockQueue
    checks = [
        (isinstance(pool.blocks, list) and len(pool.blocks) == 4, "blocks (a list of 4)"),
        (isinstance(pool.free_block_queue, queue_class), "free_block_queue"),
        (pool.null_block is pool.blocks[0], "null_block (block 0)"),
        (isinstance(pool.kv_event_queue, list), "kv_event_queue (a list)"),
        (isinstance(pool.cached_block_hashes_by_block, dict), "cached_block_hashes_by_block"),
        (hasattr(pool, "cached_block_hash_to_block"), "cached_block_hash_to_block"),
        (pool.enable_caching is True and pool.enable_kv_cache_events is True, "its flags"),
        (hasattr(pool, "metrics_collector"), "metrics_collector"),
    ]
    if reuse_watchers:
        watchers = getattr(pool, "_reuse_watchers", None)  # vLLM's own, probed by name
        checks.append((isinstance(watchers, dict), "_reuse_watchers (a dict)"))
        checks.append((callable(getattr(pool, "_notify_reuse", None)), "_notify_reuse"))
    else:
        checks.append((not hasattr(pool, "_reuse_watchers"), "no _reuse_watchers"))
    wrong = [what for ok, what in checks if not ok]
    if wrong:
        return f"a stock BlockPool has not {wrong}"
    module = importlib.import_module(pool_class.__module__)
    cleared = getattr(module, "AllBlocksCleared", None)
    if cleared is None:
        return f"{pool_class.__module__} has no AllBlocksCleared"
    cleared()  # the event the plugin's reset_prefix_cache appends, built with no argument
    return None


def _pool_probe(reuse_watchers: bool) -> Callable[[Any], str | None]:
    return lambda pool_class: _probe_pool(pool_class, reuse_watchers=reuse_watchers)


def _probe_cache_config(cache_config_class: Any) -> str | None:
    fields = {f.name for f in dataclasses.fields(cache_config_class)}
    missing = [
        n
        for n in ("kv_cache_memory_bytes", "kv_offloading_size", "gpu_memory_utilization")
        if n not in fields
    ]
    return f"CacheConfig has no field {missing}" if missing else None


def _probe_snapshot(snapshot_class: Any) -> str | None:
    snapshot = snapshot_class(device="cpu", auto_measure=False)
    missing = [n for n in ("free_memory", "total_memory") if not hasattr(snapshot, n)]
    return f"a MemorySnapshot has no {missing}" if missing else None


def _same_as_utils(name: str) -> Callable[[Any], str | None]:
    def probe(value: Any) -> str | None:
        stock = importlib.import_module("vllm.v1.worker.utils").allocate_kv_cache
        if value is not stock and getattr(value, "kvasync_stock", None) is not stock:
            return f"{name}.allocate_kv_cache is not vllm.v1.worker.utils.allocate_kv_cache"
        return None

    return probe


_LAST = RELEASES[-1]
_POOL_INIT = (
    "self",
    "num_gpu_blocks",
    "enable_caching",
    "hash_block_size",
    "enable_kv_cache_events",
    "metrics_collector",
)
_COUNT = (
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


def _method(key: str, attribute: str, parameters: tuple[str, ...], what: str) -> Seam:
    return Seam(
        key,
        "vllm.v1.core.block_pool",
        attribute,
        what,
        (Shape("all", RELEASES[0], _LAST, parameters),),
    )


_CORE = "vllm.v1.core.kv_cache_utils"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_ATTN = "vllm.v1.worker.gpu.attn_utils"

SEAMS: tuple[Seam, ...] = (
    # -- the scheduler's block pool ------------------------------------------------------------
    Seam(
        "coordinator-block-pool",
        "vllm.v1.core.kv_cache_coordinator",
        "BlockPool",
        "replaced by kvasync's BlockPool subclass, which the coordinator builds",
        (
            Shape("0.26", "0.26.0", "0.29.0", _POOL_INIT),
            Shape("0.30", "0.30.0", "0.32.0", (*_POOL_INIT, "medium")),
            Shape("0.33", "0.33.0", _LAST, (*_POOL_INIT, "num_hash_lookahead_tokens", "medium")),
        ),
        patched=True,
    ),
    Seam(
        "coordinator-builds-pool",
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator.__init__",
        "builds the pool through the module's BlockPool name",
        (Shape("all", RELEASES[0], _LAST, reads=("BlockPool",)),),
    ),
    _method("pool-get-num-free-blocks", "BlockPool.get_num_free_blocks", ("self",), "overridden"),
    _method(
        "pool-get-new-blocks", "BlockPool.get_new_blocks", ("self", "num_blocks"), "overridden"
    ),
    _method("pool-free-blocks", "BlockPool.free_blocks", ("self", "ordered_blocks"), "overridden"),
    _method("pool-reset-prefix-cache", "BlockPool.reset_prefix_cache", ("self",), "overridden"),
    _method("pool-get-usage", "BlockPool.get_usage", ("self",), "overridden"),
    _method(
        "pool-take-events",
        "BlockPool.take_events",
        ("self",),
        "overridden: the step's end, after which the count reads the allocator's room afresh",
    ),
    Seam(
        "manager-takes-pool-events",
        "vllm.v1.core.kv_cache_manager",
        "KVCacheManager.take_events",
        "takes the pool's events",
        (Shape("all", RELEASES[0], _LAST, ("self",), reads=("block_pool", "take_events")),),
    ),
    Seam(
        "scheduler-takes-events",
        "vllm.v1.core.sched.scheduler",
        "Scheduler.update_from_output",
        "takes the KV cache manager's events once a step",
        (Shape("all", RELEASES[0], _LAST, reads=("kv_cache_manager", "take_events")),),
    ),
    Seam(
        "scheduler-schedule",
        "vllm.v1.core.sched.scheduler",
        "Scheduler.schedule",
        "wrapped in a share: after each step the engine reports its demand (its pool's held "
        "blocks and its waiting requests' need)",
        (
            Shape(
                "all",
                RELEASES[0],
                _LAST,
                ("self", "throttle_prefills"),
                reads=("waiting", "running", "max_num_running_reqs", "kv_cache_manager"),
            ),
        ),
        patched=True,
    ),
    Seam(
        "scheduler-block-size",
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        "its block_size sizes the waiting requests' need in blocks",
        (Shape("all", RELEASES[0], _LAST, reads=("block_size",)),),
    ),
    Seam(
        "request-tokens",
        "vllm.v1.request",
        "Request",
        "num_tokens less num_computed_tokens: a waiting request's need",
        (
            Shape(
                "all",
                RELEASES[0],
                _LAST,
                reads=("num_computed_tokens",),
                probe=_probe_num_tokens,
            ),
        ),
    ),
    _method(
        "pool-evict-blocks", "BlockPool.evict_blocks", ("self", "block_ids"), "overridden, calls it"
    ),
    _method("pool-maybe-evict", "BlockPool._maybe_evict_cached_block", ("self", "block"), "called"),
    _method("pool-touch", "BlockPool.touch", ("self", "blocks"), "vLLM's, on the cached queue"),
    Seam(
        "pool-unpin-blocks",
        "vllm.v1.core.block_pool",
        "BlockPool.unpin_blocks",
        "vLLM's; kvasync's pool tells its reuse watchers when a block leaves the cached queue",
        (
            Shape("none", "0.26.0", "0.29.0", absent=True),
            Shape("0.30", "0.30.0", _LAST, ("self", "blocks", "on_reuse")),
        ),
    ),
    Seam(
        "pool-notify-reuse",
        "vllm.v1.core.block_pool",
        "BlockPool._notify_reuse",
        "called by kvasync's pool for blocks that leave the cached queue",
        (
            Shape("none", "0.26.0", "0.29.0", absent=True),
            Shape("0.30", "0.30.0", _LAST, ("self", "blocks")),
        ),
    ),
    Seam(
        "kv-cache-block",
        _CORE,
        "KVCacheBlock",
        "its fields and free-list links, set by kvasync's pool",
        (
            Shape("0.26", "0.26.0", "0.29.0", probe=_block_probe(False)),
            Shape("0.30", "0.30.0", _LAST, probe=_block_probe(True)),
        ),
    ),
    Seam(
        "free-block-queue",
        "vllm.v1.core.block_pool",
        "FreeKVCacheBlockQueue",
        "the free list BlockPool builds: built empty for the cached free blocks, its links "
        "spliced by the free-list view",
        (Shape("all", RELEASES[0], _LAST, ("self", "blocks"), probe=_probe_free_queue),),
    ),
    Seam(
        "free-queue-iter-after",
        _CORE,
        "FreeKVCacheBlockQueue.iter_blocks_after",
        "passed on by the free-list view (vLLM's CPU offload walks it)",
        (Shape("all", RELEASES[0], _LAST, ("self", "cursor")),),
    ),
    Seam(
        "block-pool-state",
        "vllm.v1.core.block_pool",
        "BlockPool",
        "its blocks, kv_event_queue, cached_block_hashes_by_block, AllBlocksCleared, reuse "
        "watchers: read and reset by kvasync's pool",
        (
            Shape("0.26", "0.26.0", "0.29.0", probe=_pool_probe(False)),
            Shape("0.30", "0.30.0", _LAST, probe=_pool_probe(True)),
        ),
    ),
    Seam(
        "coordinator-count",
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator.get_num_blocks_to_allocate",
        "wrapped to tell the pool the count it made",
        (
            Shape("0.26", "0.26.0", "0.30.0", _COUNT),
            Shape("0.31", "0.31.0", _LAST, (*_COUNT, "prefill_end")),
        ),
        patched=True,
    ),
    # -- the worker: KV allocation -------------------------------------------------------------
    Seam(
        "runner-allocate",
        _RUNNER,
        "GPUModelRunner._allocate_kv_cache_tensors",
        "the V1 runner's KV allocation (int8 tensor per layer): views over kvasync's ranges",
        (
            Shape(
                "per-layer",
                "0.26.0",
                "0.28.0",
                ("self", "kv_cache_config"),
                reads=("runner_only_attn_layers", "shared_by", "block_stride"),
                adapter="per-layer",
            ),
            Shape("none", "0.29.0", _LAST, absent=True),
        ),
        patched=True,
        engine=True,
    ),
    Seam(
        "v2-runner-allocate",
        _ATTN,
        "_allocate_kv_cache",
        "the V2 runner's KV allocation (int8 tensor per layer): views over kvasync's ranges",
        (
            Shape(
                "per-layer",
                "0.26.0",
                "0.28.0",
                ("kv_cache_config", "shared_layers", "device"),
                reads=("shared_by", "block_stride"),
                adapter="per-layer",
            ),
            Shape("none", "0.29.0", _LAST, absent=True),
        ),
        patched=True,
        engine=True,
    ),
    Seam(
        "allocate-kv-cache",
        "vllm.v1.worker.utils",
        "allocate_kv_cache",
        "both runners' KV allocation (one backing, per-layer views): views over one kvasync range",
        (
            Shape("none", "0.26.0", "0.28.0", absent=True),
            Shape(
                "one-backing",
                "0.29.0",
                _LAST,
                ("kv_cache_config", "device", "layout", "kernel_block_sizes"),
                reads=("kv_cache_tensors", "zeros", "create_kv_cache_views"),
                adapter="one-backing",
            ),
        ),
        patched=True,
        engine=True,
    ),
    Seam(
        "runner-allocate-kv-cache",
        _RUNNER,
        "allocate_kv_cache",
        "the V1 runner's binding of allocate_kv_cache, patched with it",
        (
            Shape("none", "0.26.0", "0.28.0", absent=True),
            Shape(
                "one-backing",
                "0.29.0",
                _LAST,
                probe=_same_as_utils(_RUNNER),
                adapter="one-backing",
            ),
        ),
        patched=True,
        engine=True,
    ),
    Seam(
        "v2-runner-allocate-kv-cache",
        _ATTN,
        "allocate_kv_cache",
        "the V2 runner's binding of allocate_kv_cache, patched with it",
        (
            Shape("none", "0.26.0", "0.28.0", absent=True),
            Shape(
                "one-backing",
                "0.29.0",
                _LAST,
                probe=_same_as_utils(_ATTN),
                adapter="one-backing",
            ),
        ),
        patched=True,
        engine=True,
    ),
    Seam(
        "runner-only-layers",
        _RUNNER,
        "GPUModelRunner.__init__",
        "sets runner_only_attn_layers, the layers the V1 runner allocates no KV for",
        (Shape("all", RELEASES[0], _LAST, reads=("runner_only_attn_layers",)),),
        engine=True,
    ),
    # -- the worker: capacity and the start-up memory check ------------------------------------
    Seam(
        "cache-config",
        "vllm.config",
        "CacheConfig",
        "kv_cache_memory_bytes (set to kvasync's capacity), kv_offloading_size (refused)",
        (Shape("all", RELEASES[0], _LAST, probe=_probe_cache_config),),
        engine=True,
    ),
    Seam(
        "determine-available-memory",
        "vllm.v1.worker.gpu_worker",
        "Worker.determine_available_memory",
        "wrapped: sizes the KV cache to kvasync's capacity through kv_cache_memory_bytes",
        (Shape("all", RELEASES[0], _LAST, ("self",), reads=("kv_cache_memory_bytes",)),),
        patched=True,
        engine=True,
    ),
    Seam(
        "request-memory",
        "vllm.v1.worker.gpu_worker",
        "request_memory",
        "wrapped: the free-memory refusal alone is lifted",
        (
            Shape("0.26", "0.26.0", "0.31.0", ("init_snapshot", "cache_config")),
            Shape(
                "0.32",
                "0.32.0",
                _LAST,
                ("init_snapshot", "cache_config", "external_weight_memory"),
            ),
        ),
        patched=True,
        engine=True,
    ),
    Seam(
        "init-device-requests",
        "vllm.v1.worker.gpu_worker",
        "Worker.init_device",
        "calls request_memory through the module's name",
        (Shape("all", RELEASES[0], _LAST, reads=("request_memory",)),),
        engine=True,
    ),
    Seam(
        "memory-snapshot",
        "vllm.utils.mem_utils",
        "MemorySnapshot",
        "copied with free_memory raised to total_memory for request_memory",
        (Shape("all", RELEASES[0], _LAST, probe=_probe_snapshot),),
        engine=True,
    ),
    # -- the EngineCore's executor ---------------------------------------------------------------
    Seam(
        "executor-init",
        "vllm.v1.executor.abstract",
        "Executor.initialize_from_config",
        "wrapped: opens the engine's allocator for workers in their own processes",
        (Shape("all", RELEASES[0], _LAST, ("self", "kv_cache_configs")),),
        patched=True,
        engine=True,
    ),
)


def check_all(*, engine: bool) -> dict[str, Found]:
    """Every seam's shape in this vLLM (the block pool's alone unless ``engine``), found before
    anything is patched.

    Raises:
        UnsupportedVLLM: the first seam with no known shape, naming it; or a vLLM that has
            neither KV allocation shape.
    """
    found = {seam.key: seam.find() for seam in SEAMS if engine or not seam.engine}
    if engine and not any(
        f.present and f.shape.adapter for key, f in found.items() if "allocate" in key
    ):
        raise UnsupportedVLLM(
            "kvasync's vLLM plugin: this vLLM has none of the KV allocation seams it knows "
            "(GPUModelRunner._allocate_kv_cache_tensors with gpu.attn_utils._allocate_kv_cache, "
            "or vllm.v1.worker.utils.allocate_kv_cache); nothing was patched"
        )
    return found


def markdown_table() -> str:
    """The seam table as docs/vllm/compatibility.md prints it: a row per seam, a column per
    release, each cell the shape's name (``-`` where the seam is absent)."""
    short = [r.removeprefix("0.") for r in RELEASES]
    lines = [
        "| seam | vLLM attribute | " + " | ".join(short) + " |",
        "| --- | --- | " + " | ".join("---" for _ in RELEASES) + " |",
    ]
    for seam in SEAMS:
        cells = []
        for release in RELEASES:
            shape = seam.shape_of(release)
            cells.append("?" if shape is None else "-" if shape.absent else shape.name)
        patched = " (patched)" if seam.patched else ""
        lines.append(f"| `{seam.key}`{patched} | `{seam.qualname}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
