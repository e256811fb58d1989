"""What the SGLang plugin touches in SGLang, checked before anything is patched.

Note [SGLang seam table]
~~~~~~~~~~~~~~~~~~~~~~~~
Each seam is one SGLang function or method the plugin hooks (through SGLang's own plugin API,
``HookRegistry``) or calls, with the parameters it must have. ``check_all`` resolves every one
and compares its signature before the plugin registers a single hook: a seam that moved is a
refusal at start that names it, never an engine half patched (a pool from kvasync beside an
allocator from SGLang, which would hand out slots on unmapped pages). SGLang's ``apply_hooks``
only logs a hook it cannot apply and goes on, which is why the plugin checks first.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass
from typing import Any

__all__ = [
    "READS",
    "SEAMS",
    "TESTED",
    "Reads",
    "Seam",
    "UnsupportedSGLang",
    "check_all",
    "check_reads",
    "installed_version",
]

# The SGLang releases the plugin was run with: its seams and SGLang's own tests on the CPU, and
# the engine end to end on an H200 (docs/sglang/index.md).
TESTED: tuple[str, ...] = ("0.5.17",)

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_MHA_POOL = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
_MLA_POOL = "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool"
_PAGED = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_WEIGHTS = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"


class UnsupportedSGLang(RuntimeError):
    """This SGLang, or a setting of it, is one the plugin does not run under."""


@dataclass(frozen=True)
class Seam:
    """One SGLang callable and the parameters (in order, ``self`` first for a method) the plugin
    relies on; a ``*name`` entry is a variadic positional parameter."""

    target: str
    parameters: tuple[str, ...]
    why: str


SEAMS: tuple[Seam, ...] = (
    Seam(
        f"{_CONFIGURATOR}._profile_available_bytes",
        ("self", "pre_model_load_memory"),
        "capacity: the KV bytes come from kvasync's limit or budget, not a profile of free memory",
    ),
    Seam(
        "sglang.srt.mem_cache.kv_cache_configurator.get_parallel",
        (),
        "capacity: the tensor-parallel size of attention, for the KV bytes of a token",
    ),
    Seam(
        f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator",
        (
            "self",
            "sizes",
            "token_to_kv_pool",
            "is_dsv4_model",
            "req_to_token_pool",
            "token_to_kv_pool_allocator",
        ),
        "the token-to-KV allocator: kvasync's paged allocator in place of SGLang's",
    ),
    Seam(
        f"{_MHA_POOL}._create_buffers_normal",
        ("self",),
        "the KV memory: each layer's K and V buffers are views over kvasync's ranges",
    ),
    Seam(f"{_MHA_POOL}._clear_buffers", ("self",), "the KV memory's end: the allocator closes"),
    Seam(
        f"{_MLA_POOL}.__init__",
        (
            "self",
            "size",
            "page_size",
            "dtype",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "layer_num",
            "device",
            "enable_memory_saver",
            "start_layer",
            "end_layer",
            "use_dsa",
            "override_kv_cache_dim",
        ),
        "the MLA pool's shape: one latent buffer a layer of kv_lora_rank + qk_rope_head_dim",
    ),
    Seam(
        f"{_MLA_POOL}._create_buffers",
        ("self",),
        "the KV memory (MLA): each layer's latent buffer is a view over a kvasync range",
    ),
    Seam(
        f"{_MLA_POOL}._clear_buffers", ("self",), "the KV memory's end (MLA): the allocator closes"
    ),
    Seam(
        f"{_PAGED}.__init__",
        ("self", "size", "page_size", "dtype", "device", "kvcache", "need_sort"),
        "kvasync's allocator subclasses SGLang's paged allocator",
    ),
    Seam(f"{_PAGED}.alloc", ("self", "need_size"), "the allocator's page-aligned alloc"),
    Seam(
        f"{_PAGED}.alloc_extend",
        (
            "self",
            "prefix_lens",
            "prefix_lens_cpu",
            "seq_lens",
            "seq_lens_cpu",
            "last_loc",
            "extend_num_tokens",
            "num_new_pages",
        ),
        "the allocator's prefill alloc (its page count is taken first)",
    ),
    Seam(
        f"{_PAGED}.alloc_decode",
        ("self", "seq_lens", "seq_lens_cpu", "last_loc"),
        "the allocator's decode alloc (its page count is taken first)",
    ),
    Seam(f"{_PAGED}._release_page_ids", ("self", "*page_ids"), "every free's one funnel"),
    Seam(f"{_PAGED}.clear", ("self",), "a flush: every page back to kvasync"),
    Seam(
        "sglang.srt.mem_cache.allocator.paged.get_num_new_pages",
        ("seq_lens", "page_size", "prefix_lens", "decode"),
        "the pages an alloc takes, counted before SGLang's kernel runs",
    ),
    Seam(
        "sglang.srt.mem_cache.base_prefix_cache.EvictParams",
        ("num_tokens",),
        "eviction of the radix cache under pressure and past KVASYNC_PREFIX_CACHE",
    ),
    Seam(
        f"{_SCHEDULER}.get_next_batch_to_run",
        ("self", "running_batch", "last_batch"),
        "once a scheduler step: the share's demand, pressure and the prefix-cache bound",
    ),
    Seam(
        "sglang.srt.managers.scheduler_components.pool_stats_observer."
        "SchedulerPoolStatsObserver._get_token_info",
        ("self",),
        "the idle leak check and the metrics count the pages SGLang holds",
    ),
    Seam(
        f"{_WEIGHTS}.release_memory_occupation",
        ("self", "recv_req"),
        "release_memory_occupation: the released KV pages are unmapped and go back to the share",
    ),
)


@dataclass(frozen=True)
class Reads:
    """Names the plugin reads off SGLang objects it does not hook (through ``getattr`` with a
    default, so a renamed one would go unnoticed): ``attributes`` must be set by some function
    of ``owner``'s classes (they are in its code), ``methods`` must be methods of ``owner``."""

    owner: str
    attributes: tuple[str, ...]
    methods: tuple[str, ...]
    why: str


READS: tuple[Reads, ...] = (
    Reads(
        _SCHEDULER,
        ("forward_stream", "waiting_queue", "tree_cache", "token_to_kv_pool_allocator"),
        (),
        "each step: the forward stream is every free's fence, the waiting queue the share's "
        "demand, the radix cache what pressure and the prefix bound evict",
    ),
    Reads(
        "sglang.srt.managers.schedule_batch.Req",
        ("origin_input_ids",),
        (),
        "the share's demand: the pages a waiting request's prompt needs",
    ),
    Reads(
        "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache",
        (),
        ("evict", "evictable_size", "is_chunk_cache"),
        "the radix cache's unused prefixes, evicted under pressure, for the prefix bound and "
        "for an alloc kvasync refused",
    ),
)


def _names_in(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):  # nested functions, comprehensions
            names |= _names_in(const)
    return names


def _resolve(target: str, named: str, why: str) -> Any:
    """``target`` resolved, or a refusal naming it (as ``named``) and why the plugin needs it."""
    try:
        return pkgutil.resolve_name(target)
    except (ImportError, AttributeError, ValueError) as error:
        raise UnsupportedSGLang(
            f"kvasync's SGLang plugin: {named} ({why}) is missing in this SGLang: {error}"
        ) from None


def check_reads(reads: Reads) -> None:
    """Resolves ``reads.owner`` and finds each of its attributes in its classes' code and each
    method on it.

    Raises:
        UnsupportedSGLang: the owner, an attribute or a method is missing, naming it.
    """
    owner = _resolve(reads.owner, reads.owner, reads.why)
    names: set[str] = set()
    for cls in inspect.getmro(owner):
        if cls is object:
            continue
        for member in vars(cls).values():
            function = getattr(member, "__func__", member)
            if inspect.isfunction(function):
                names |= _names_in(function.__code__)
    for attribute in reads.attributes:
        if attribute not in names:
            raise UnsupportedSGLang(
                f"kvasync's SGLang plugin reads {reads.owner}.{attribute} ({reads.why}), which "
                "no code of that class sets in this SGLang"
            )
    for method in reads.methods:
        if not callable(getattr(owner, method, None)):
            raise UnsupportedSGLang(
                f"kvasync's SGLang plugin calls {reads.owner}.{method} ({reads.why}), which "
                "this SGLang does not have"
            )


def installed_version() -> str:
    """The installed SGLang's version.

    Raises:
        UnsupportedSGLang: SGLang is not importable.
    """
    try:
        module = importlib.import_module("sglang.version")
    except ImportError as error:
        raise UnsupportedSGLang(
            f"kvasync's SGLang plugin: SGLang is not importable ({error})"
        ) from None
    return str(module.__version__)


def _parameters(target: Any) -> tuple[str, ...]:
    names = []
    for parameter in inspect.signature(target).parameters.values():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            names.append(f"*{parameter.name}")
        elif parameter.kind is not inspect.Parameter.VAR_KEYWORD:
            names.append(parameter.name)
    return tuple(names)


def check_seam(seam: Seam) -> None:
    """Resolves ``seam.target`` and checks its parameters start with ``seam.parameters``.

    Raises:
        UnsupportedSGLang: the target is missing or its signature differs, naming both.
    """
    target = _resolve(seam.target, f"seam {seam.target}", seam.why)
    if isinstance(target, type):
        # A dataclass: its fields are its constructor's parameters.
        found = tuple(name for name in _parameters(target))
    else:
        found = _parameters(target)
    if found[: len(seam.parameters)] != seam.parameters:
        raise UnsupportedSGLang(
            f"kvasync's SGLang plugin: seam {seam.target} ({seam.why}) has parameters "
            f"{found}, expected {seam.parameters} first"
        )


def check_all() -> None:
    """Checks every seam in ``SEAMS``.

    Raises:
        UnsupportedSGLang: the first seam that is missing or changed.
    """
    for seam in SEAMS:
        check_seam(seam)
    for reads in READS:
        check_reads(reads)
