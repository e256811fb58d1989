"""kvasync inside SGLang: SGLang's KV pool as an elastic kvasync range (``pip install
"kvasync[sglang]"``).

SGLang runs ``register`` through its general-plugin entry point (``sglang.srt.plugins``) in every
SGLang process: the one that builds the engine and each scheduler process. It is inert unless
``KVASYNC_SGLANG=1`` or one of ``KVASYNC_SHARE``, ``KVASYNC_DEVICE_BUDGET``,
``KVASYNC_MEMORY_LIMIT`` is set; ``KVASYNC_SGLANG=0`` turns it off whatever else is set. The other
variables are the vLLM plugin's: ``KVASYNC_NAME`` names the engine in ``kvasync top``,
``KVASYNC_PREFIX_CACHE`` bounds the radix cache's unused tokens that stay mapped.

Note [SGLang seams]
~~~~~~~~~~~~~~~~~~~
SGLang's plugin API (``sglang.srt.plugins.hook_registry.HookRegistry``) wraps named functions;
the plugin registers these hooks, each on a seam of ``_seams.SEAMS``, and nothing else:

- ``KVCacheConfigurator._profile_available_bytes`` (replaced): the KV bytes are kvasync's limit
  or budget, not the device's free memory less ``mem_fraction_static``'s slack.
- ``MHATokenToKVPool._create_buffers_normal`` (replaced for the MHA pool): the per-layer K and
  V buffers are views over a kvasync allocator's ranges, of which only page 0 is mapped
  (Note [SGLang's KV buffers over kvasync] in _kv). ``_clear_buffers`` closes the allocator.
- ``MLATokenToKVPool._create_buffers`` (replaced for ``MLATokenToKVPool`` itself, not its
  subclasses): each layer's latent buffer is a view over a kvasync range, the same way.
  ``_clear_buffers`` closes the allocator.
- ``KVCacheConfigurator._build_token_to_kv_pool_allocator`` (wrapped): SGLang builds its paged
  allocator, and the plugin returns its own subclass with the same size and page size (Note
  [SGLang's count and kvasync's pages] in _allocator). Any other pool or allocator (DSA's MLA
  pool with its indexer cache, hybrid SWA or Mamba models, a quantized (fp4, mxfp8),
  page-major or unified pool, one token a page, decode context parallelism, PD
  disaggregation) is refused there, at start, naming it (``refusal``).
- ``SchedulerPoolStatsObserver._get_token_info`` (wrapped): the pool statistics SGLang's idle
  leak check and its metrics read count the pages SGLang holds, not what kvasync can map now
  (Note [SGLang's idle check] in _allocator).
- ``Scheduler.get_next_batch_to_run`` (before): once a step, the share's demand, pressure and
  the radix cache's bound (Note [Pressure and the radix cache] in _allocator).
- ``SchedulerWeightUpdaterManager.release_memory_occupation`` (after): with the KV cache among
  the tags, SGLang has flushed its cache; the plugin gives every page back and unmaps them at
  once (page 0 stays). ``resume_memory_occupation`` needs nothing: pages are mapped as requests
  come.

Note [Refusing at start]
~~~~~~~~~~~~~~~~~~~~~~~~
SGLang logs an exception a plugin raises and starts without it, so a refusal raised by
``register`` would leave an operator who asked for kvasync on stock SGLang with one log line.
Instead ``register`` checks the version (``_seams.TESTED``; ``KVASYNC_SGLANG_ANY_VERSION=1``
tries another) and every seam before registering any hook, and on a failure registers one hook
alone, before ``ServerArgs.__post_init__``, that raises the refusal: the engine (or
``launch_server``) stops with the message, which names the version or the seam.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .._settings import SGLANG_ENABLE, PluginSettings, read_settings
from ._seams import TESTED, UnsupportedSGLang, check_all, installed_version

__all__ = ["ANY_VERSION", "TESTED", "UnsupportedSGLang", "register"]

logger = logging.getLogger("kvasync.sglang")

ANY_VERSION = "KVASYNC_SGLANG_ANY_VERSION"
_RELEASE_TIMEOUT = 30.0

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_MHA_POOL = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
_MLA_POOL = "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool"
_PAGED_NAME = "PagedTokenToKVPoolAllocator"
_STATS = "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver"


def register() -> None:
    """SGLang's entry point: inert unless asked for; else checks, then hooks (Note [SGLang
    seams], Note [Refusing at start])."""
    try:
        settings = read_settings(switch=SGLANG_ENABLE)
    except ValueError as error:
        # SGLang's plugin loader logs a plugin's exception and starts stock SGLang: a malformed
        # KVASYNC_* variable would then run the engine without kvasync, unnoticed. It refuses
        # the start instead, unless the switch turns the plugin off.
        switch = os.environ.get(SGLANG_ENABLE)
        if switch is None or switch.strip().lower() not in ("0", "false", "no", "off", ""):
            _refuse(str(error))
        return
    if not settings.enabled:
        return
    try:
        check_version(installed_version(), os.environ.get(ANY_VERSION, "") == "1")
        check_all()
        settings.capacity_bytes  # noqa: B018 - raises the ValueError that names the variables
    except (UnsupportedSGLang, ValueError) as error:
        _refuse(str(error))
        return
    _install(settings)


def check_version(version: str, any_version: bool) -> None:
    """Refuses an SGLang not in ``TESTED`` unless ``any_version``.

    Raises:
        UnsupportedSGLang: naming the version and the tested ones.
    """
    if version not in TESTED and not any_version:
        raise UnsupportedSGLang(
            f"kvasync's SGLang plugin was tested with SGLang {', '.join(TESTED)}, not {version}; "
            f"{ANY_VERSION}=1 tries anyway (refusing only a seam whose signature differs)"
        )


def check_parallel(server_args: Any) -> None:
    """Refuses tensor, pipeline and data parallelism at start: each of SGLang's ranks schedules
    on its own allocator's count, and two ranks' kvasync counts can differ (a share, a page being
    unmapped), so their batches, and then their collectives, could diverge and hang.

    Raises:
        UnsupportedSGLang: naming the setting.
    """
    for name in ("tp_size", "pp_size", "dp_size"):
        size = int(getattr(server_args, name, 1) or 1)
        if size > 1:
            raise UnsupportedSGLang(
                f"kvasync's SGLang plugin runs one rank, not {name}={size}: each rank would "
                "schedule on its own kvasync count, and ranks whose batches differ hang in their "
                "collectives; unset KVASYNC_SGLANG and the KVASYNC_* variables to run SGLang's own"
            )


# SGLang's KV pools the plugin does not lay out, and why, for the refusal (Note [SGLang seams]).
_REFUSED_POOLS = {
    "DSATokenToKVPool": "DeepSeek V3.2's sparse attention: an indexer cache beside the latent one",
    "MLATokenToKVPoolFP4": "fp4 MLA: packed latent rows with a scale buffer beside them",
    "MHATokenToKVPoolFP4": "fp4 KV: packed K and V with scale buffers",
    "MHATokenToKVPoolMXFP8": "mxfp8 KV: K and V with scale buffers",
    "PageMajorMHATokenToKVPool": "the page-major layout (--enable-page-major-kv-layout)",
    "UnifiedMHATokenToKVPool": "the unified memory pool (--enable-unified-memory)",
    "UnifiedMLATokenToKVPool": "the unified memory pool (--enable-unified-memory)",
    "BaseSWAKVPool": "a sliding-window hybrid model, or DeepSeek V4's compressed pools",
    "HybridLinearKVPool": "a hybrid linear-attention (Mamba) model",
    "NoOpMHATokenToKVPool": "a prefill-only engine with no KV cache",
    "MiniMaxSparseKVPool": "MiniMax's sparse attention: an indexer pool beside the main one",
}


def refusal(pool: Any) -> str:
    """The refusal of an engine whose KV ``pool`` the plugin did not open, naming the pool and,
    where the plugin knows it, why it is not laid out."""
    name = type(pool).__name__
    known = [_REFUSED_POOLS[c.__name__] for c in type(pool).__mro__ if c.__name__ in _REFUSED_POOLS]
    if known:
        why = known[0]
    elif getattr(pool, "enable_custom_mem_pool", False) or getattr(pool, "custom_mem_pool", None):
        why = "a pool in PD disaggregation's NVLink memory pool (SGLANG_MOONCAKE_CUSTOM_MEM_POOL)"
    elif getattr(pool, "is_quantized_kv_cache", False) or getattr(
        pool, "post_capture_active", False
    ):
        why = "a quantized KV cache with scale buffers, or post-capture KV backing"
    else:
        why = "a pool the plugin does not know"
    return (
        f"kvasync's SGLang plugin lays out SGLang's MHATokenToKVPool and MLATokenToKVPool, not "
        f"{name} ({why}: not supported yet); unset KVASYNC_SGLANG and the KVASYNC_* variables "
        "to run SGLang's own"
    )


def _hooks() -> Any:
    import importlib

    module = importlib.import_module("sglang.srt.plugins.hook_registry")
    return module.HookRegistry, module.HookType


def _refuse(message: str) -> None:
    logger.error("kvasync: %s", message)
    registry, kind = _hooks()

    def refuse(*args: object, **kwargs: object) -> None:
        raise UnsupportedSGLang(message)

    registry.register("sglang.srt.server_args.ServerArgs.__post_init__", refuse, kind.BEFORE)


def _install(settings: PluginSettings) -> None:
    registry, kind = _hooks()

    def profile(original: Any, configurator: Any, pre_model_load_memory: int) -> int:
        from ._kv import capacity_bytes

        del original, pre_model_load_memory  # no profile of free memory
        check_parallel(configurator.server_args)
        return capacity_bytes(settings, configurator)

    def create_buffers(original: Any, pool: Any) -> None:
        from ._kv import attach, open_kv_buffers

        if getattr(pool, "enable_custom_mem_pool", False):
            original(pool)  # PD's NVLink pool: refused when the allocator is built
            return
        attach(pool, open_kv_buffers(pool, settings))

    def create_mla_buffers(original: Any, pool: Any) -> None:
        import pkgutil

        from ._kv import attach, open_kv_buffers

        # Only SGLang's own MLA pool: its subclasses that inherit this method (DSA's, with an
        # indexer cache beside) and a pool in PD's NVLink pool keep SGLang's buffers, and are
        # refused when the allocator is built.
        if (
            type(pool) is not pkgutil.resolve_name(_MLA_POOL)
            or getattr(pool, "custom_mem_pool", None) is not None
            or getattr(pool, "use_dsa", False)
        ):
            original(pool)
            return
        attach(pool, open_kv_buffers(pool, settings))

    def clear_buffers(result: Any, pool: Any) -> None:
        from ._kv import detach

        engine = detach(pool)
        if engine is not None:
            engine.close()

    def build_allocator(original: Any, configurator: Any, **kwargs: Any) -> Any:
        from ._allocator import allocator_class
        from ._kv import engine_of

        pool = kwargs["token_to_kv_pool"]
        if kwargs.get("token_to_kv_pool_allocator") is not None:
            return original(configurator, **kwargs)  # a draft model shares the target's
        stock = original(configurator, **kwargs)
        if engine_of(pool) is None:
            raise UnsupportedSGLang(refusal(pool))
        if type(stock).__name__ != _PAGED_NAME:
            raise UnsupportedSGLang(
                f"kvasync's SGLang plugin replaces SGLang's {_PAGED_NAME}, but this engine "
                f"built {type(stock).__name__} (run with --page-size 16, no sliding-window "
                "hybrid model)"
            )
        if (stock.size, stock.page_size) != (pool.size, pool.page_size):
            raise UnsupportedSGLang(
                f"kvasync's SGLang plugin maps SGLang page p to kvasync block p, but this engine's "
                f"allocator pages {stock.size} tokens {stock.page_size} a page over a pool of "
                f"{pool.size} tokens {pool.page_size} a page (decode context parallelism, "
                "--dcp-size above 1, is not supported yet)"
            )
        if stock.need_sort:
            raise UnsupportedSGLang(
                "kvasync's SGLang plugin does not support PD disaggregation yet "
                "(--disaggregation-mode)"
            )
        return allocator_class()(
            stock.size, stock.page_size, stock.dtype, stock.device, pool, stock.need_sort
        )

    def token_info(original: Any, observer: Any) -> Any:
        import dataclasses

        stats = original(observer)
        unheld = getattr(observer.token_to_kv_pool_allocator, "unheld_size", None)
        if unheld is None:
            return stats
        available = int(unheld())
        total = int(observer.max_total_num_tokens)
        used = total - (available + int(stats.full_evictable_size))
        return dataclasses.replace(
            stats, full_available_size=available, full_num_used=used, full_token_usage=used / total
        )

    def each_step(scheduler: Any, *args: Any, **kwargs: Any) -> None:
        from ._allocator import maintain

        maintain(scheduler)

    def released(result: Any, updater: Any, recv_req: Any) -> None:
        import importlib

        weights = importlib.import_module("sglang.srt.managers.scheduler_components.weight_updater")
        tags = recv_req.tags or weights.GPU_MEMORY_ALL_TYPES
        scheduler = getattr(updater, "scheduler", None)
        allocator: Any = getattr(scheduler, "token_to_kv_pool_allocator", None)
        if weights.GPU_MEMORY_TYPE_KV_CACHE not in tags or not hasattr(allocator, "release_memory"):
            return
        started = time.monotonic()
        mapped = allocator.release_memory(_RELEASE_TIMEOUT)
        logger.info(
            "kvasync: SGLang released its KV cache in %.3f s; %d bytes stay mapped (page 0)",
            time.monotonic() - started,
            mapped,
        )

    registry.register(f"{_CONFIGURATOR}._profile_available_bytes", profile, kind.AROUND)
    registry.register(
        f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator", build_allocator, kind.AROUND
    )
    registry.register(f"{_MHA_POOL}._create_buffers_normal", create_buffers, kind.AROUND)
    registry.register(f"{_MHA_POOL}._clear_buffers", clear_buffers, kind.AFTER)
    registry.register(f"{_MLA_POOL}._create_buffers", create_mla_buffers, kind.AROUND)
    registry.register(f"{_MLA_POOL}._clear_buffers", clear_buffers, kind.AFTER)
    registry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run", each_step, kind.BEFORE
    )
    registry.register(f"{_STATS}._get_token_info", token_info, kind.AROUND)
    registry.register(
        "sglang.srt.managers.scheduler_components.weight_updater."
        "SchedulerWeightUpdaterManager.release_memory_occupation",
        released,
        kind.AFTER,
    )
    logger.info(
        "kvasync: SGLang plugin on (share=%s, budget=%s, limit=%s, name=%s)",
        settings.share,
        settings.device_budget,
        settings.memory_limit,
        settings.name,
    )
