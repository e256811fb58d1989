"""Workers in their own processes (vLLM's multiprocess executor, tensor parallelism): one
scheduler's page decisions mapped in every worker (Note [Page ids across processes and ranks]).

The EngineCore opens the engine's allocator as a tensor-parallel group's scheduler that holds no
KV memory (``open_scheduler_engine``); each worker joins the group as a rank
(``open_rank_tensors``) and returns views over its own range, which the group maps as the
scheduler decides.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import _core, _cuda
from ..._config import Config
from ..._errors import AllocTimeout, KVAsyncError, MapError
from ..._group import RankMapper, TensorParallel, group_geometry
from ..._layout import KVLayout
from ..._sync import SyncAllocator, open_allocator_sync
from .._settings import PluginSettings
from ._engine import EngineKV, hold_null_block
from ._worker import KVGeometry, kv_layout_for, per_layer_geometry, reserve_pages_for

__all__ = [
    "NullBlockHolder",
    "RankKV",
    "cuda_page_size",
    "group_name_for",
    "open_rank_tensors",
    "open_scheduler_engine",
    "rank_kv_cache_tensors",
]

# Joining, and the null block's page mapped on every rank: the workers join while the EngineCore
# waits for their initialize_from_config, after compiling nothing yet.
_JOIN_TIMEOUT = 60.0
# A map through the group waits this long for every rank (then it is a miss, never a hang).
_MAP_TIMEOUT = 5.0
# The null block's map is retried while ranks join, pausing between tries (10 ms, doubling).
_RETRY_PAUSE_MIN, _RETRY_PAUSE_MAX = 0.01, 0.25
# What csrc/group/group_backend.cpp says of every map once the group is broken (GroupBackend::map).
_GROUP_BROKEN = "the group must be reopened"


def group_name_for(engine_pid: int) -> str:
    """The group of the EngineCore process ``engine_pid``: vLLM's multiprocess executor starts
    its workers as that process's children, so a worker finds it as ``os.getppid()``."""
    return f"vllm-engine-{engine_pid}"


def open_scheduler_engine(
    kv_cache_configs: Sequence[Any],
    *,
    num_ranks: int,
    settings: PluginSettings,
    name: str,
    reserve: tuple[int, int],
    page_size: int,
    group: str | None = None,
    map_timeout: float = _MAP_TIMEOUT,
    layout_of: Callable[[Any], KVLayout] = kv_layout_for,
) -> EngineKV:
    """The EngineCore's allocator: the scheduler of a group of ``num_ranks`` worker processes.

    It reserves address space of the workers' geometry on the host backend (never mapped: the
    ``TensorParallel(map_local=False)`` scheduler holds no KV memory), and every map it makes is
    made by each rank's ``RankMapper`` before an alloc completes. ``page_size``: bytes per range
    of a page id, a multiple of the ranks' device granularity. ``layout_of``: the kvasync
    layout of a worker's KV cache config, as this vLLM's allocation shape lays it out.

    Raises:
        ValueError: the workers' KV caches differ (the plugin lays out one geometry), or a KV
            cache it does not lay out (``kv_layout_for``).
        KVAsyncError: the group's name is in use by a live EngineCore.
    """
    layouts = {layout_of(config) for config in kv_cache_configs}
    blocks = {int(config.num_blocks) for config in kv_cache_configs}
    if len(layouts) != 1 or len(blocks) != 1:
        raise ValueError(
            "kvasync's vLLM plugin needs every worker's KV cache of one geometry (tensor "
            f"parallelism splits heads evenly), got {len(layouts)} layouts and block counts "
            f"{sorted(blocks)}"
        )
    layout = layouts.pop()
    config = Config(
        backend="host",
        max_blocks=blocks.pop(),
        page_size=layout.page_unit(page_size),
        memory_limit=settings.memory_limit,
        share=settings.share,
        device_budget=settings.device_budget,
        name=name,
        default_timeout=_JOIN_TIMEOUT,
        reserve_pages=reserve,
        linger=settings.linger,
        tensor_parallel=TensorParallel(
            group or group_name_for(os.getpid()),
            num_ranks,
            map_timeout=map_timeout,
            unmap_timeout=map_timeout,
            map_local=False,
        ),
    )
    kv = open_allocator_sync(layout, config)
    prefix = settings.prefix_cache_bytes
    return EngineKV(
        allocator=kv,
        fence=None,  # the GPU work is the ranks'; Note [Page ids across processes and ranks]
        prefix_cache_blocks=(
            None if prefix is None else prefix // (layout.range_block_bytes * layout.num_layers)
        ),
    )


class NullBlockHolder:
    """Takes block 0 (vLLM's null block) on a thread of its own, retrying while ranks join.

    The group maps page 0 on every rank only once they have all joined, which they do inside
    vLLM's ``initialize_from_config`` RPC, while the EngineCore's thread waits for it: so the map
    is asked from another thread, and retried until ``timeout`` (a map waits ``_MAP_TIMEOUT`` for
    an absent rank, then fails).
    """

    def __init__(self, kv: SyncAllocator, timeout: float = _JOIN_TIMEOUT) -> None:
        self._kv = kv
        self._deadline = time.monotonic() + timeout
        self._error: BaseException | None = None
        self._stop = threading.Event()  # never set: its wait is the retries' bounded pause
        self._thread = threading.Thread(target=self._run, name="kvasync-null-block", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failed: MapError | None = None
        pause = _RETRY_PAUSE_MIN
        while True:
            left = self._deadline - time.monotonic()
            try:
                hold_null_block(self._kv, max(0.001, left))
                return
            except MapError as error:  # a rank not there yet: the map waited, then failed
                failed = error
                # A broken group (a rank left, was refused or died) fails every map at once and
                # for good: retrying it would only spin until the deadline.
                if _GROUP_BROKEN in str(error) or time.monotonic() >= self._deadline:
                    self._error = error
                    return
                # A map that failed fast (not a wait for an absent rank) is retried after a
                # pause, growing, so a failing driver does not turn this thread into a spin.
                self._stop.wait(min(pause, max(0.0, self._deadline - time.monotonic())))
                pause = min(2 * pause, _RETRY_PAUSE_MAX)
            except AllocTimeout as error:  # the deadline: the last map's failure says why
                self._error = failed or error
                return
            except BaseException as error:  # handed to the joining thread
                self._error = error
                return

    def wait(self) -> None:
        """Waits for block 0 until the deadline.

        Raises:
            KVAsyncError: block 0's page was not mapped on every rank in time (the error names
                the rank that did not join or failed).
        """
        self._thread.join(max(0.0, self._deadline - time.monotonic()) + 1.0)
        if self._thread.is_alive():
            raise KVAsyncError(
                "kvasync's vLLM plugin: the null block's page was not mapped in time"
            )
        if self._error is not None:
            raise self._error


class RankKV:
    """A worker's side of the group: its backend, its ``RankMapper``, and its KV tensors."""

    def __init__(self, mapper: RankMapper, tensors: dict[str, torch.Tensor]) -> None:
        self.mapper = mapper
        self.tensors = tensors

    def close(self) -> None:
        """Unmaps this rank's pages and leaves the group."""
        self.mapper.close()


def open_rank_tensors(
    kv_cache_config: Any,
    *,
    rank: int,
    group: str,
    make_backend: Callable[[int, int, int], _core.Backend],
    range_tensor: Callable[[_core.Backend, int], torch.Tensor],
    zero: bool = True,
    timeout: float = _JOIN_TIMEOUT,
    geometry: KVGeometry | None = None,
) -> RankKV:
    """Joins ``group`` as ``rank`` and returns views over this process's ranges.

    ``make_backend(num_ranges, num_pages, page_size)`` reserves this rank's ranges (the cuda
    backend on the worker's device); ``range_tensor(backend, i)`` is a uint8 tensor over range
    ``i``. Returns once block 0's page is mapped here for good, by the whole group (zeroed when
    ``zero``), as vLLM's dummy runs write there.

    Raises:
        KVAsyncError: no group within ``timeout``, a geometry that is not this worker's, a rank
            taken, or block 0's page not mapped in time.
    """
    if geometry is None:
        geometry = per_layer_geometry(kv_cache_config)
    layout = geometry.layout
    found = group_geometry(group, timeout)
    needed = geometry.num_blocks * layout.range_block_bytes
    span = found["num_pages"] * found["page_size"]
    if found["num_ranges"] != layout.num_ranges or span < needed:
        raise KVAsyncError(
            f"kvasync's vLLM plugin: group {group!r} has {found['num_ranges']} ranges of "
            f"{span} bytes, this worker's KV cache needs {layout.num_ranges} of {needed}"
        )
    backend = make_backend(found["num_ranges"], found["num_pages"], found["page_size"])
    mapper = RankMapper(group, rank, backend, timeout=timeout)
    try:
        deadline = time.monotonic() + timeout
        # The scheduler's null block (NullBlockHolder), committed: mapped by the whole group. A
        # map this rank did is rolled back when another rank failed it or was late (as they join,
        # under load), and zeroing the page then faults, or zeroes memory that the rollback and
        # the next map replace (Note [Tensor parallel group] in csrc/group/group_file.h).
        while 0 not in mapper.committed_page_ids():
            if mapper.left or time.monotonic() > deadline:
                raise KVAsyncError(
                    f"kvasync's vLLM plugin: rank {rank} of group {group!r}: the null block's "
                    f"page was not mapped within {timeout} s ({mapper.left_reason or 'no map'})"
                )
            time.sleep(0.001)
        views = [
            range_tensor(backend, index)[:needed].view(torch.int8)
            for index in range(layout.num_ranges)
        ]
        if zero:
            for view in views:
                view[: layout.range_block_bytes].zero_()
        tensors = geometry.build(views)
    except BaseException:
        mapper.close()
        raise
    return RankKV(mapper, tensors)


def cuda_page_size(layout_bytes: int, device: int) -> int:
    """The page of the cuda backend's default: the driver's granularity, at least a block."""
    granularity = _core.cuda_granularity(device)
    return max(granularity, math.ceil(layout_bytes / granularity) * granularity)


def rank_kv_cache_tensors(
    geometry: KVGeometry,
    *,
    device: torch.device,
    vllm_config: Any,
    settings: PluginSettings,
    rank: int,
) -> dict[str, torch.Tensor]:
    """What vLLM's KV allocation returns in a worker process (either shape, ``geometry``):
    views over this rank's cuda range, mapped as the EngineCore's allocator decides (its group:
    ``group_name_for(os.getppid())``).

    Raises:
        ValueError: a KV cache this plugin does not lay out, or tensors that do not cover the
            attention layers.
        KVAsyncError: as ``open_rank_tensors``.
    """
    from ..._backends import range_tensor
    from ._worker import step_blocks

    global _rank
    if _rank is not None:  # a KV cache sized again: the earlier views are gone by then
        _rank.close()
        _rank = None
    layout = geometry.layout
    ordinal = device.index if device.index is not None else torch.cuda.current_device()

    def make_backend(num_ranges: int, num_pages: int, page_size: int) -> _core.Backend:
        granularity = _core.cuda_granularity(ordinal)
        if page_size % granularity:
            raise KVAsyncError(
                f"kvasync's vLLM plugin: the group's page of {page_size} bytes is not a multiple "
                f"of device {ordinal}'s granularity ({granularity} bytes)"
            )
        spare = reserve_pages_for(layout, page_size, step_blocks(vllm_config, layout.block_size))[1]
        backend = _core.CudaBackend(
            ordinal,
            num_ranges,
            num_pages,
            page_size,
            # No pooled handles where memory is bounded: _backends.pooled_handle_pages says why.
            0 if settings.share or settings.memory_limit is not None else spare,
            0.95,
        )
        # The EngineCore frees blocks with no fence of this process's GPU work (async
        # scheduling may still be reading a finished request's blocks): every unmap here waits
        # for this process's work on the device first, within unmap_sync_timeout (Note
        # [Bounded device sync]).
        backend.sync_before_unmap = True
        # vLLM captures CUDA graphs after this: no sync may run inside a capture.
        _cuda.guard_graph_captures()
        return backend

    ranked = open_rank_tensors(
        None,
        rank=rank,
        group=group_name_for(os.getppid()),
        make_backend=make_backend,
        range_tensor=range_tensor,
        geometry=geometry,
    )
    _rank = ranked
    return ranked.tensors


_rank: RankKV | None = None
