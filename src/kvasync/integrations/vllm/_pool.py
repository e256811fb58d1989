"""The scheduler side: vLLM's ``BlockPool`` whose free blocks come from a kvasync allocator.

Note [Who owns a free block]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
vLLM's pool starts with every block id free in its ``free_block_queue``. Here a block id is in
one of four places:

- the allocator's: free in kvasync, perhaps on no mapped page (most ids, at first);
- the pool's pocket: taken from the allocator, mapped, promised to the allocation vLLM is
  counting for (Note [Count only what is mapped]); free to vLLM;
- vLLM's queue (``cached_free_queue``): free to vLLM and on a mapped page; freed blocks that
  keep a prefix-cache entry (vLLM evicts them LRU when it needs blocks), at most
  ``prefix_cache_blocks`` of them, and none in the pages the allocator drains;
- a request's: ``ref_cnt > 0``, mapped.

A block without a prefix-cache entry goes back to the allocator as soon as vLLM frees it, and its
page is unmapped as the reserve policy says. The allocator hands out its lowest page's free
blocks first, and a page's last freed first; so the pool frees blocks last first: those vLLM
frees come out again first and in its order (vLLM puts them at the head of its queue), and the
pocket's unused blocks, given back before them, in the order they were taken, as if they had
never left. The allocator's reserve keeps the blocks of the longest request, or of one step's
batch, plus one per running sequence mapped and free (its low watermark, ``_worker``), refilled
by the mapper thread in the background, so that a step's blocks are normally mapped before it
asks.

Note [Count only what is mapped]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
vLLM's ``KVCacheManager.allocate_slots`` asks the coordinator how many blocks a request needs
(``get_num_blocks_to_allocate``), compares that with ``get_num_free_blocks()``, returns None
(a scheduling miss: the request waits, or vLLM preempts) when it is larger, and otherwise calls
``get_new_blocks`` (once per KV cache group) in the same call, which must then hand every block
out: it cannot fail or return fewer. So the count is a promise, and a promise kept by waiting for
the mapper would stall the engine loop (the scheduler step). Instead:

- The coordinator's count is passed to the pool (a checked patch of
  ``KVCacheCoordinator.get_num_blocks_to_allocate``: the demand ``n``, and whether the request
  is running: it has computed tokens and no new prefix hits, and this is not an admission
  check).
- ``get_num_free_blocks`` then takes up to ``n`` mapped free blocks from the allocator
  (``alloc_nowait``, never a wait; one call on the hot path) into the pool's pocket. When the
  pocket holds ``n``, the count adds the queue and the allocator's room (what vLLM counts beyond
  its demand is only headroom: it allocates exactly what it counted). When it holds fewer, the
  count beyond the pocket is only the queued cached blocks the rule below lets it evict. The
  pocket is the promise: those blocks are the pool's, so no trim, drain or neighbour can take
  them between the count and ``get_new_blocks``.
- A shortfall the budget can still map is asked of the mapper at once (``alloc_nowait`` of the
  shortfall, whose miss starts mapping it in the background), and is a miss for this step: the
  next step finds the pages mapped. A map failure therefore never meets a block vLLM counted:
  it is a miss again, the mapper's error in ``stats().last_error``.
- Note [Evict only what the budget lacks]: vLLM evicts a prefix-cache entry only when no
  uncached block is free. Here the uncached free blocks are the allocator's, mapped or not, so
  for a waiting request a cached block counts as free only for what the allocator cannot give
  within its limit and budget (an unmapped page is a wait for the mapper, not a reason to drop
  a prefix others may hit). For a running request the shortfall may be evicted too: the other
  outcome of a miss there is a preemption, which costs more than a cached prefix and would
  cascade (a preempted request's full blocks go to the queue, which the rule does not count).
- A count of no block (a running request whose next tokens fit in its last block: nearly every
  count, every running request every step) takes and gives back nothing, and answers the queue
  and the allocator's room: headroom alone, which vLLM compares only with its watermark and the
  blocks it reserves for in-flight loads (none for a running request). The room is read once a
  step: the step's first such count asks ``available_blocks`` and the later ones reuse the
  answer, until the pool next allocates or frees (``_promise``'s count reads it afresh, the
  others drop it) or the step ends (vLLM takes the pool's events once a step, in
  ``update_from_output``: ``take_events``). So within a step they miss only what another thread
  or process changed meanwhile (a limit lowered, a neighbour's share, a close), as if it had
  happened at the step's end; the next step's first count sees it. A room of none is never
  reused (it is where a close shows, Note [When the allocator fails]), and a forked child
  forgets it.
- The pocket keeps at most the demand being counted: a smaller demand gives the surplus back,
  and so does a free that leaves no request holding blocks, so an idle engine's memory goes back
  as the reserve policy says.
- A call vLLM did not count (a direct ``get_new_blocks``, as vLLM's pool tests make) falls back
  to the allocator, waiting up to ``_MAP_WAIT`` for pages the budget allows before evicting
  what it lacks. vLLM's scheduler in 0.26 makes no such call.

The one promise not kept by the pocket: with mapping ahead counted as a miss, a step whose
blocks outrun the reserve admits fewer requests (or, for running requests, evicts cached
prefixes) until the mapper catches up; the worker sizes the reserve to a step so that this is
rare.

Note [When the allocator fails]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
vLLM treats any exception from ``Scheduler.schedule()`` or ``update_from_output()`` as a fatal
EngineCore error. The scheduler reaches the allocator through the pool alone: the count
(``get_num_free_blocks``: ``alloc_nowait``, ``available_blocks``, ``free`` of the pocket's
surplus), ``get_new_blocks`` (the pocket; ``alloc_nowait``, and ``alloc`` for a call vLLM did
not count), ``free_blocks``, ``evict_blocks`` and ``reset_prefix_cache`` (``free``,
``drain_from``), ``get_usage`` (``available_blocks``), and the free list's view (``stats``,
``free_block_ids``: read by vLLM's tests and offload, not its scheduler). Each error class the
allocator raises there is one of:

- A scheduling miss (the engine goes on): ``WouldBlock`` and ``OutOfBlocks`` (no mapped block
  now, or never within the limit: the ordinary misses of Note [Count only what is mapped]), and
  any other ``KVAsyncError`` of ``alloc_nowait`` (a backend's or the share ledger's error):
  the count is answered on what the pool already has, as if the budget were spent, and one
  warning line a ``log_interval`` (30 s) names the error, the failures since the last line and
  the allocator's ``last_error``; ``num_allocator_errors`` counts them. The allocator keeps
  serving what it can (DESIGN, "Failures are values"), and the next step tries again. A failed
  map never reaches the count: the mapper's error stays in ``stats().last_error`` and the pages
  are not there, a miss. For a call vLLM did not count, ``alloc``'s ``AllocTimeout``,
  ``MapError`` and ``OutOfBlocks`` make it evict what the allocator lacks, and raise (as stock
  raises when it is out of blocks) only when no cached block can make up for them.
- An orderly stop: ``AllocatorClosed`` (the allocator was closed, or this is a forked child of
  the process that opened it). The engine's KV pages are gone, so no step can run. The pool
  logs one error line that says so and raises ``AllocatorClosed`` with that message (every
  later call raises the same), and vLLM's own fatal-error path tells its front-ends the engine
  is dead (each request ends with an engine error) and shuts it down: never a step over
  unmapped pages, never a stall. On the count's hot path a closed allocator's checked
  ``available_blocks`` raises it; where that finds none available, the count also looks at most
  every ``_CLOSED_PROBE_INTERVAL`` (50 ms) whether any page is still mapped (an open engine's
  allocator always maps block 0's page, the null block). A count of no block reuses the
  step's room (Note [Count only what is mapped]), so a close during a step stops the engine at
  the next step's first count, or at the pool's next allocation, whichever comes first; a
  forked child reads the room afresh at its first count. Frees into a closed allocator raise
  nothing: vLLM's side is recorded and the pages are gone already.
- A bug (raised as is): ``ValueError`` or ``TypeError`` (a free of a block not allocated, a
  count below 1) means the pool's bookkeeping is wrong, and going on would hand a block out
  twice.

A request that cannot fit under the limit in force (the limit was lowered, or the share's
budget went to a neighbour) is a miss at every step until the limit rises, and with vLLM's
first-come-first-served queue the requests behind it wait too: the engine schedules nothing
and recovers by itself when the limit rises. The count sees it when the request needs more
than all the pool holds and the allocator can still give within the limit
(``_taken + available_blocks()``): then one warning line a ``log_interval`` names the request,
the blocks it needs, what the limit lets the engine hold, its limit, and how long it has waited;
``num_stalled_counts`` counts those counts, ``stalled`` is the request, and a line says when it
is scheduled again. It keeps waiting: the limit in force is meant to move (a share's fair
share, an operator's ``kvasync limit``), vLLM 0.26 has no per-request deadline and no way for
the pool to finish a request, and a client's own timeout or disconnect aborts it through
vLLM's abort path. A running request that cannot grow is vLLM's to preempt; once preempted, its
count as a waiting request is seen here.

Note [What vLLM's free_block_queue shows]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In stock vLLM ``BlockPool.free_block_queue`` holds every free block, and code outside the pool
reads it (vLLM's tests; ``num_free_blocks`` is ``get_num_free_blocks()``). Here the queue vLLM's
methods keep is ``cached_free_queue``, the cached free blocks alone (Note [Who owns a free
block]), and ``free_block_queue`` is a ``FreeBlocksView`` over the whole free set:

- ``num_free_blocks`` counts, when it is read, what ``get_num_free_blocks()`` with no demand
  counts: the pocket, the allocator's mapped free blocks and the cached ones. Nothing is kept
  between reads, so a reference held across allocations and frees stays true.
- ``get_all_free_blocks()`` and the linked list (``fake_free_list_head``,
  ``fake_free_list_tail``, each block's ``prev_free_block``/``next_free_block``) show every free
  block in the order the pool hands them out: the pocket (``get_new_blocks`` takes it first),
  then the allocator's mapped free blocks in its own order (``Allocator.free_block_ids``:
  lowest page first, within a page the last freed first; ``_mapped_now`` takes them next, and
  ``_release`` frees last first, so vLLM's freed blocks lead, as stock prepends them), then the
  cached queue, first freed first (``_evict`` takes those last). The list is linked on read
  only: a read splices the uncached blocks between the cached queue's head sentinel and its
  first block, so the sentinels are the cached queue's, and an empty list is head and tail
  linked to each other, as in stock. Nothing on the scheduler's path reads it; the pool unlinks
  the spliced blocks (``FreeBlocksView.unlink``, their links back to None, the cached queue
  vLLM's alone again) before it moves any block (``get_new_blocks``, ``free_blocks``,
  ``evict_blocks``, ``reset_prefix_cache``), at the cost of one attribute test while nothing is
  linked. The list is a snapshot: a block the allocator hands out or takes back (a map, an
  unmap, another thread's free) after the read is not in it until the next read.
- ``remove`` and ``append_n`` are the cached queue's own: vLLM's ``touch`` (a prefix hit on a
  cached free block) and 0.33's ``unpin_blocks`` call them, and a block either takes is in that
  queue, the end of the free set's order. ``iter_blocks_after`` walks the cached blocks: vLLM's
  CPU offload walks it for free blocks with KV worth copying out, and only those hold any.
  While the list is linked, ``remove`` and ``iter_blocks_after`` unlink it first.
- Not offered, each raising ``NotImplementedError`` that says why: the mutators that take or
  put blocks at the head (``popleft``, ``popleft_n``, ``prepend_n``: only the pool's
  ``get_new_blocks`` and ``free_blocks`` move blocks between the allocator and vLLM). vLLM
  0.26's sink-attention manager takes its sink blocks with ``popleft_n`` when it is built, so a
  model with sink attention stops there, saying so (before the view, it failed an assertion).
  A caller that picks free blocks off the list and hands them to ``allocate_slots`` as prefix
  hits (vLLM's ``test_cache_hit_local_and_external*``) picks the allocator's blocks, which have
  no prefix-cache entry: ``touch`` takes only cached blocks out of the free set, so it raises
  ``RuntimeError`` naming the block (vLLM's queue raises one too when the list is not linked).
  Taking a chosen id out of the allocator's free set would be an API for those tests alone: in
  a run, a prefix hit is a block with an entry, which is in the cached queue.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from ..._errors import AllocatorClosed, KVAsyncError, OutOfBlocks, WouldBlock
from ._engine import EngineKV

__all__ = [
    "Demand",
    "FreeBlocksView",
    "RequestDemand",
    "counting_demand",
    "make_block_pool_class",
]

logger = logging.getLogger("kvasync.vllm")

# The longest a call vLLM did not count waits for pages the budget allows (Note [Count only
# what is mapped]: vLLM's scheduler never makes one).
_MAP_WAIT = 5.0
# While a request cannot fit under the limit in force, or the allocator fails, one warning line
# per this many seconds (Note [When the allocator fails]).
_LOG_INTERVAL = 30.0
# The engine's demand in a share (Note [The engine's demand in a share] in _demand): reported
# at most this often unless it rose by a page or more. The share's watchers tick every 100 ms.
_REPORT_INTERVAL = 0.05
# While no block is asked and none is available, how often the count looks whether the
# allocator was closed (a closed allocator has none available, and raises nothing there).
_CLOSED_PROBE_INTERVAL = 0.05


class Demand(NamedTuple):
    """What the coordinator counted for the allocation it is about to make."""

    blocks: int
    running: bool


class RequestDemand(Demand):
    """A ``Demand`` the coordinator counted for a named request. The request is not part of
    the demand's value (it compares equal to the plain ``Demand``): the pool reads it only to
    name a request that cannot fit (Note [When the allocator fails])."""

    request_id: Any


# Most counts ask for no block (a running request's decode step inside its last block): one
# demand for them all. ``running`` is read only for a shortfall, which a demand of no block
# cannot have.
_NO_BLOCKS = Demand(0, False)
# A demand made without the named tuple's ``__new__`` (a Python frame): the same tuple.
_make_demand: Callable[[type[Any], tuple[int, bool]], Any] = tuple.__new__


def counting_demand(stock: Callable[..., int]) -> Callable[..., int]:
    """``KVCacheCoordinator.get_num_blocks_to_allocate`` that also tells the coordinator's
    pool the demand it counted (Note [Count only what is mapped]).

    Its parameters are the checked ones of this vLLM (0.33 added ``prefill_end``). vLLM calls it
    for every running request every step, by keyword: with 0.26's parameters the wrapper has
    them too, and stock's defaults, so that a call passes them on as they are; with others the
    three it reads are found by name, positionally or by keyword.
    """
    parameters = inspect.signature(stock).parameters
    names = list(parameters)

    def counted(
        blocks: int, admission: Any, local_computed: Any, new_computed: Any, request_id: Any
    ) -> Demand:
        # Running: it computed tokens before and hits no new prefix; an admission check (the
        # full sequence of a waiting request) is not. Not for a count of no block (the hot
        # path, every running request every step: _NO_BLOCKS, no argument read).
        demand: RequestDemand = _make_demand(
            RequestDemand, (blocks, not admission and local_computed > 0 and not any(new_computed))
        )
        demand.request_id = request_id
        return demand

    def get_num_blocks_to_allocate_026(
        self: Any,
        request_id: Any,
        num_tokens: Any,
        new_computed_blocks: Any,
        num_encoder_tokens: Any,
        total_computed_tokens: Any,
        num_local_computed_tokens: Any,
        num_tokens_main_model: Any,
        apply_admission_cap: Any,
    ) -> int:
        blocks = stock(
            self,
            request_id,
            num_tokens,
            new_computed_blocks,
            num_encoder_tokens,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
        )
        try:
            expect = self.block_pool.expect
        except AttributeError:  # not kvasync's pool
            return blocks
        if blocks:  # counted(), inline: a new block for a request, up to every 16th step
            demand: RequestDemand = _make_demand(
                RequestDemand,
                (
                    blocks,
                    not apply_admission_cap
                    and num_local_computed_tokens > 0
                    and not any(new_computed_blocks),
                ),
            )
            demand.request_id = request_id
            expect(demand)
        else:
            expect(_NO_BLOCKS)
        return blocks

    fixed = inspect.signature(get_num_blocks_to_allocate_026).parameters
    if names == list(fixed) and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters.values()):
        defaults = tuple(p.default for p in parameters.values() if p.default is not p.empty)
        get_num_blocks_to_allocate_026.__defaults__ = defaults or None
        return get_num_blocks_to_allocate_026

    request_at = names.index("request_id")
    computed_at = names.index("new_computed_blocks")
    local_at = names.index("num_local_computed_tokens")
    admission_at = names.index("apply_admission_cap")

    def argument(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, default: Any) -> Any:
        # ``args`` start after self: parameter ``at`` (counting self) is args[at - 1].
        return args[at - 1] if len(args) >= at else kwargs.get(names[at], default)

    def get_num_blocks_to_allocate(self: Any, *args: Any, **kwargs: Any) -> int:
        blocks = stock(self, *args, **kwargs)
        expect = getattr(self.block_pool, "expect", None)
        if expect is not None:
            expect(
                counted(
                    blocks,
                    argument(args, kwargs, admission_at, False),
                    argument(args, kwargs, local_at, 0),
                    argument(args, kwargs, computed_at, ()),
                    argument(args, kwargs, request_at, None),
                )
                if blocks
                else _NO_BLOCKS
            )
        return blocks

    return get_num_blocks_to_allocate


class FreeBlocksView:
    """``BlockPool.free_block_queue`` of kvasync's pool: every block free to vLLM, read when
    asked (Note [What vLLM's free_block_queue shows])."""

    def __init__(self, pool: Any, cached: Any) -> None:
        # A weak reference: the pool owns its view, and a cycle would keep a dropped pool's
        # allocator open until the garbage collector ran.
        self._pool = weakref.ref(pool)
        self._cached = cached
        # The uncached free blocks spliced in front of the cached ones by the last read of the
        # list; [] when none are (the pool unlinks them before it moves any block).
        self.linked: list[Any] = []
        # vLLM's own callers, on the cached blocks (its queue's methods, no wrapper between
        # while nothing is linked).
        self.remove: Callable[[Any], None] = cached.remove
        self.append_n: Callable[[list[Any]], None] = cached.append_n
        self.iter_blocks_after: Callable[..., Any] = cached.iter_blocks_after

    @property
    def num_free_blocks(self) -> int:
        """The pocket, the allocator's mapped free blocks and vLLM's cached free blocks."""
        return int(self._live_pool().num_free_blocks_now())

    def get_all_free_blocks(self) -> list[Any]:
        """Every free block, in the order the pool hands them out: a snapshot."""
        self._link()
        blocks: list[Any] = self._cached.get_all_free_blocks()
        return blocks

    @property
    def fake_free_list_head(self) -> Any:
        """The head sentinel of the list of every free block, linked as the pool is now."""
        self._link()
        return self._cached.fake_free_list_head

    @property
    def fake_free_list_tail(self) -> Any:
        """The tail sentinel of the list of every free block, linked as the pool is now."""
        self._link()
        return self._cached.fake_free_list_tail

    def popleft(self) -> Any:
        raise self._moves("popleft")

    def popleft_n(self, n: int) -> list[Any]:
        raise self._moves("popleft_n")

    def prepend_n(self, blocks: list[Any]) -> None:
        raise self._moves("prepend_n")

    def unlink(self) -> None:
        """Takes the uncached free blocks out of the list again: the cached queue is vLLM's
        alone, and those blocks' links are None, as a block off every list has them."""
        linked = self.linked
        if not linked:
            return
        self.linked = []
        cached = self._cached
        head = cached.fake_free_list_head
        # Whatever follows the last linked block now: the first cached block, or the tail
        # (cached blocks appended or removed since the list was linked kept it whole).
        after = linked[-1].next_free_block
        head.next_free_block = after
        after.prev_free_block = head
        for block in linked:
            block.prev_free_block = block.next_free_block = None
        self.remove = cached.remove
        self.iter_blocks_after = cached.iter_blocks_after

    def _link(self) -> None:
        """Splices the uncached free blocks, in the order they are handed out, between the
        cached queue's head sentinel and its first block."""
        pool = self._live_pool()
        self.unlink()
        uncached: list[Any] = pool.uncached_free_blocks()
        if not uncached:
            return
        head = self._cached.fake_free_list_head
        first = head.next_free_block
        previous = head
        for block in uncached:
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = first
        first.prev_free_block = previous
        self.linked = uncached
        # A prefix hit (touch) or vLLM's offload walking the cached blocks meets the cached
        # queue alone.
        self.remove = self._remove_unlinked
        self.iter_blocks_after = self._iter_blocks_after_unlinked

    def _remove_unlinked(self, block: Any) -> None:
        if any(linked is block for linked in self.linked):
            raise RuntimeError(
                f"kvasync's vLLM pool: block {block.block_id} is a free block of kvasync's "
                "allocator, with no prefix-cache entry; a prefix hit takes only cached blocks, "
                "and the allocator's are handed out by get_new_blocks alone"
            )
        self.unlink()
        self._cached.remove(block)

    def _iter_blocks_after_unlinked(self, *args: Any, **kwargs: Any) -> Any:
        self.unlink()
        return self._cached.iter_blocks_after(*args, **kwargs)

    def _live_pool(self) -> Any:
        pool = self._pool()
        if pool is None:
            raise ReferenceError("kvasync's vLLM pool: the pool of this free_block_queue is gone")
        return pool

    @staticmethod
    def _moves(name: str) -> NotImplementedError:
        return NotImplementedError(
            f"kvasync's vLLM pool: free_block_queue.{name}() is not offered; blocks move between "
            "kvasync's allocator and vLLM only through the pool's get_new_blocks and free_blocks"
        )


# Every pool of this process, for the fork hook below.
_pools: weakref.WeakSet[Any] = weakref.WeakSet()


def _forget_rooms_in_child() -> None:
    """A forked child reads each pool's room afresh: the allocator there is the parent's, and
    its checked ``available_blocks`` raises the fork's error (Note [When the allocator
    fails])."""
    for pool in list(_pools):
        pool.forget_room()


os.register_at_fork(after_in_child=_forget_rooms_in_child)


def make_block_pool_class(base: type[Any], find_engine: Any) -> type[Any]:
    """A subclass of vLLM's ``BlockPool`` (``base``) over the engine ``find_engine()`` returns.

    ``find_engine(num_gpu_blocks)`` returns the ``EngineKV`` the pool uses; it is called once per
    pool, in ``__init__``.
    """

    class KVAsyncBlockPool(base):  # type: ignore[misc]
        """vLLM's ``BlockPool`` whose free blocks are handed out by kvasync.

        Notes [Who owns a free block] and [Count only what is mapped] in _pool.py.
        """

        # The pool's own state is in slots, and vLLM's in the instance dict: that dict then
        # holds stock's few keys, which CPython shares between instances and reads inline (past
        # 30 keys it stops), so vLLM's reads of the pool (several for every running request
        # every step) cost what they cost on stock's pool.
        __slots__ = (
            "_alloc_nowait",
            "_available_blocks",
            "_closed_error",
            "_closed_probe_due",
            "_counted",
            "_demand_due",
            "_demand_reported",
            "_drain",
            "_engine",
            "_error_logged",
            "_errors_unlogged",
            "_fence",
            "_foreign_blocks",
            "_free",
            "_keep_cached",
            "_kv",
            "_may_evict",
            "_page_blocks",
            "_pocket",
            "_room_this_step",
            "_set_demand",
            "_stall_logged",
            "_taken",
            "_view",
            "_watched",
            "cached_free_queue",
            "clock",
            "expect",
            "log_interval",
            "num_allocator_errors",
            "num_lag_evictions",
            "num_map_ahead_misses",
            "num_stalled_counts",
            "stalled",
        )

        free_block_queue: Any
        cached_block_hash_to_block: Any

        def __init__(
            self,
            num_gpu_blocks: int,
            enable_caching: bool,
            hash_block_size: int,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            # The rest as the checked BlockPool.__init__ of this vLLM has them (0.33 added
            # num_hash_lookahead_tokens and medium).
            engine: EngineKV = find_engine(num_gpu_blocks)
            if engine.allocator.num_blocks != num_gpu_blocks:
                raise ValueError(
                    f"kvasync's vLLM plugin: the scheduler's pool has {num_gpu_blocks} blocks but "
                    f"the worker's allocator {engine.allocator.num_blocks}"
                )
            super().__init__(num_gpu_blocks, enable_caching, hash_block_size, *args, **kwargs)
            # vLLM made every block free and popped block 0 as the null block; kvasync's block 0
            # is held by the worker (hold_null_block). The rest are kvasync's until handed out.
            queue_type = type(self.free_block_queue)
            for block in self.blocks:
                block.prev_free_block = block.next_free_block = None
            # vLLM's queue now holds only the cached free blocks; its readers get the view of
            # every free block (Note [What vLLM's free_block_queue shows]).
            self.cached_free_queue = queue_type([])
            self.free_block_queue = FreeBlocksView(self, self.cached_free_queue)
            self._view = self.free_block_queue  # unlinked before the pool moves a block
            self._engine = engine
            if engine.owned:  # a pool of vLLM's tests: its allocator lives as long as it does
                weakref.finalize(self, engine.allocator.close)
            self._kv = engine.allocator
            # The calls that never wait, made on the scheduler's path (available_blocks for
            # every running request every step, the rest for each new block and free): the
            # Allocator's own checked methods (each raises AllocatorClosed when closed or in a
            # forked child), without the SyncAllocator's pass-through frame.
            allocator = engine.allocator.allocator
            self._available_blocks: Callable[[], int] = allocator.available_blocks
            self._alloc_nowait: Callable[[int], list[int]] = allocator.alloc_nowait
            self._free: Callable[..., None] = allocator.free
            self._drain = allocator.drain_from
            self._set_demand: Callable[[int], None] = allocator.set_demand
            # The demand last reported and when the next report is due at the latest (Note [The
            # engine's demand in a share]); a rise of a page's blocks is reported at once.
            self._demand_reported = -1
            self._demand_due = -float("inf")
            self._page_blocks = max(
                1, engine.allocator.page_size // engine.allocator.layout.range_block_bytes
            )
            self._fence = engine.fence
            self._keep_cached = engine.prefix_cache_blocks
            self._pocket: list[int] = []  # mapped, the pool's, free to vLLM
            # Taken from the allocator and not given back: the pocket, vLLM's queue and what
            # requests hold; the allocator's used blocks less the null block, kept here so that
            # the per-step usage builds no stats snapshot.
            self._taken = engine.allocator.stats().used_blocks - 1
            # The coordinator's counts not yet answered, the latest last: ``expect(demand)``
            # is the list's own append (a C call, no Python frame: every running request makes
            # one every step), and holds no reference to the pool.
            self._counted: list[Demand] = []
            self.expect: Callable[[Demand], None] = self._counted.append
            # vLLM 0.33: blocks name their pool, and reuse has watchers (unpin_blocks); 0.26's
            # have neither, and asking each block costs an AttributeError.
            self._foreign_blocks = hasattr(type(self.blocks[0]), "pool") or hasattr(
                self.blocks[0], "pool"
            )
            self._watched = hasattr(self, "_reuse_watchers")
            self._may_evict = 0  # queued blocks the last count let get_new_blocks evict
            # The allocator's room as this step's counts of no block read it (Note [Count only
            # what is mapped]); None: read it afresh. Dropped when the pool allocates or frees,
            # at the step's end (take_events) and in a forked child.
            self._room_this_step: int | None = None
            _pools.add(self)
            self.num_map_ahead_misses = 0  # counts answered short while the mapper maps ahead
            self.num_lag_evictions = 0  # cached blocks a running request took for unmapped ones
            # Note [When the allocator fails]: counts answered short because the request needs
            # more than the limit in force lets the engine hold, and because the allocator
            # raised; the request stalled now, and the clock and interval of the warnings.
            self.num_stalled_counts = 0
            self.num_allocator_errors = 0
            self.stalled: Stall | None = None
            self.clock: Callable[[], float] = time.monotonic
            self.log_interval = _LOG_INTERVAL
            self._stall_logged = -float("inf")
            self._error_logged = -float("inf")
            self._errors_unlogged = 0
            self._closed_error: AllocatorClosed | None = None
            self._closed_probe_due = 0.0

        # -- what vLLM asks --------------------------------------------------------------------

        def get_num_free_blocks(self) -> int:
            counted = self._counted
            if not counted:  # not vLLM's allocation check: what is free now, as vLLM counts
                self._may_evict = 0
                return self.num_free_blocks_now()
            demand = counted.pop()
            if demand is _NO_BLOCKS and not counted and not self._pocket:
                # The hot path, every running request every step: nothing to take or give back,
                # so what _promise counts is the headroom alone, the allocator's room read once
                # a step (Note [Count only what is mapped]); below, at the step's first count.
                room = self._room_this_step
                if room is not None:
                    self._may_evict = 0
                    queued: int = self.cached_free_queue.num_free_blocks
                    return queued + room
            elif counted:  # counts never answered (vLLM's reserve estimate): the latest stands
                counted.clear()
            queued = self.cached_free_queue.num_free_blocks
            try:
                if demand is _NO_BLOCKS and not self._pocket:
                    self._may_evict = 0
                    room = self._room_this_step
                    if room is None:
                        room = self._available_blocks()
                        if room <= 0:  # none: is any page still mapped?
                            self._probe_closed()
                        else:
                            self._room_this_step = room
                    return queued + room
                return self._promise(demand, queued)
            except AllocatorClosed as error:
                raise self._closed(error) from error

        def get_new_blocks(self, num_blocks: int) -> list[Any]:
            if num_blocks <= 0:
                return []
            if self._view.linked:  # a read of the free list linked blocks this hands out
                self._view.unlink()
            # The pocket (promised by the count), then mapped free blocks, then the cached blocks
            # the count let go; only a call vLLM did not count reaches the allocator's wait.
            ids = self._pocket
            if len(ids) == num_blocks:  # the count's promise, whole: every counted allocation
                self._pocket = []
            else:
                ids = self._from_other_places(num_blocks)
            blocks = self.blocks
            taken = [blocks[i] for i in ids]
            for block in taken:
                block.ref_cnt = 1
            collector = self.metrics_collector
            if collector:
                for block in taken:
                    collector.on_block_allocated(block)
            if len(taken) < num_blocks:  # what the count let go, and what _take left to evict
                taken.extend(self._evict(num_blocks - len(taken)))
            return taken

        def free_blocks(self, ordered_blocks: Any) -> None:
            if self._view.linked:
                self._view.unlink()
            cached = []
            released = []
            others: dict[Any, list[Any]] = {}
            foreign = self._foreign_blocks
            caching = self.enable_caching
            for block in ordered_blocks:
                if foreign:  # vLLM 0.33: a block of another pool
                    owner = getattr(block, "pool", None)
                    if owner is not None and owner is not self:
                        others.setdefault(owner, []).append(block)
                        continue
                block.ref_cnt -= 1
                if block.ref_cnt == 0 and not block.is_null:
                    # No prefix will hit it (caching off, or no hash): kvasync's at once.
                    if not caching or block.block_hash is None:
                        released.append(block)
                    else:
                        cached.append(block)
            # vLLM's order: the first freed is the first evicted, so cached blocks go to the tail.
            if cached:
                self.cached_free_queue.append_n(cached)
            # Idle (only the blocks freed now are held): the reserve policy decides what stays
            # mapped. The pocket goes back first, so that the blocks freed now come out first.
            if self._pocket and self._num_running() == len(released):
                self._give_back_pocket(0)
            self._release(released)
            for owner, blocks in others.items():
                owner.free_blocks(blocks)
            self._trim_cached()

        def evict_blocks(self, block_ids: Any) -> None:
            # vLLM drops the blocks' cache entries (a KV connector reports them unusable); a
            # free one stays in its queue, where with no entry it would hold a prefix-cache slot
            # (KVASYNC_PREFIX_CACHE) until evicted: give it back to kvasync now.
            self._view.unlink()  # then only the blocks of vLLM's queue have links
            super().evict_blocks(block_ids)
            queue = self.cached_free_queue
            stale = [
                block
                for block in (self.blocks[i] for i in block_ids)
                if block.ref_cnt == 0
                and block.block_hash is None
                and not block.is_null
                and block.prev_free_block is not None  # in vLLM's queue, not kvasync's
            ]
            for block in stale:
                queue.remove(block)
            self._release(stale)

        def reset_prefix_cache(self) -> bool:
            # vLLM counts used blocks as capacity less free; here most of the capacity is
            # unmapped, so count what requests hold: the null block alone when nothing runs.
            running = self._num_running()
            if running:
                logger.warning(
                    "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                    running,
                )
                return False
            self._view.unlink()
            self._give_back_pocket(0)
            queue = self.cached_free_queue
            cached = queue.popleft_n(queue.num_free_blocks)
            for block in cached:
                self._maybe_evict_cached_block(block)
            self._release(cached)
            if self._watched and self._reuse_watchers:  # vLLM 0.33: every watcher hears it
                self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
            self.cached_block_hash_to_block = type(self.cached_block_hash_to_block)()
            self.cached_block_hashes_by_block.clear()
            if self.metrics_collector:
                self.metrics_collector.reset()
            if self.enable_kv_cache_events:
                self.kv_event_queue.append(sys.modules[base.__module__].AllBlocksCleared())
            return True

        def take_events(self) -> list[Any]:
            # vLLM's scheduler takes the pool's events once a step (update_from_output): the
            # step's end, after which a count of no block reads the room afresh (Note [Count
            # only what is mapped]).
            self._room_this_step = None
            events: list[Any] = base.take_events(self)
            return events

        def get_usage(self) -> float:
            # The share of what the budget allows that requests and the prefix cache use: read
            # every step (vLLM's stats), so from the pool's count, not a stats snapshot.
            used = self._taken - len(self._pocket)
            total = self._taken + self._available_blocks()
            return used / total if total > 0 else 1.0

        # -- kvasync's side --------------------------------------------------------------------

        @property
        def kvasync_allocator(self) -> Any:
            """The engine's ``kvasync.SyncAllocator``."""
            return self._kv

        def forget_room(self) -> None:
            """The next count of no block reads the allocator's room afresh (Note [Count only
            what is mapped]): at a step's end, and in a forked child."""
            self._room_this_step = None

        def report_demand(self, waiting_blocks: int) -> None:
            """Tells the share the blocks this engine wants now: those its requests hold, the
            pocket and the null block, and ``waiting_blocks`` (what its waiting requests that
            fit the batch need). Once a step, in a share (Note [The engine's demand in a share]
            in _demand). A rise of a page's blocks or more is reported at once; anything else at
            most every ``_REPORT_INTERVAL`` (a report that changes the share's figure wakes every
            member's watcher). An allocator error is a count's to report, never the engine's end.
            """
            wanted = 1 + self._num_running() + len(self._pocket) + waiting_blocks
            now = self.clock()
            if now < self._demand_due and wanted < self._demand_reported + self._page_blocks:
                return
            self._demand_reported, self._demand_due = wanted, now + _REPORT_INTERVAL
            try:
                self._set_demand(wanted)
            except AllocatorClosed:
                pass  # the next count finds it (Note [When the allocator fails])
            except KVAsyncError as error:
                self._allocator_failed(error)

        @property
        def num_pocket_blocks(self) -> int:
            """Blocks taken from the allocator and promised to vLLM's next allocation."""
            return len(self._pocket)

        def _num_running(self) -> int:
            """Blocks requests hold: those taken from the allocator (its used blocks less the
            null block, counted here without a stats snapshot) less vLLM's queue and the
            pocket."""
            queued = int(self.cached_free_queue.num_free_blocks)
            return self._taken - queued - len(self._pocket)

        def uncached_free_blocks(self) -> list[Any]:
            """The free blocks handed out before any cached one, in that order: the pocket, then
            the allocator's mapped free blocks as it hands them out (a snapshot; Note [What
            vLLM's free_block_queue shows])."""
            blocks = self.blocks
            ids = self._pocket + self._kv.free_block_ids(self._mapped_free())
            return [blocks[i] for i in ids]

        def num_free_blocks_now(self) -> int:
            """Blocks vLLM could take now without waiting: the pocket, the allocator's mapped
            free blocks and the cached ones in vLLM's queue."""
            queued = int(self.cached_free_queue.num_free_blocks)
            return len(self._pocket) + self._mapped_free() + queued

        def _mapped_free(self) -> int:
            """The allocator's blocks an ``alloc_nowait`` gets now: mapped, free, not draining
            (over its limit, ``available_blocks`` is just those)."""
            return max(0, min(self._kv.stats().free_blocks, self._available_blocks()))

        def _mapped_now(self, n: int) -> list[int]:
            """Up to ``n`` of the allocator's mapped free blocks, without waiting."""
            k = min(n, self._mapped_free())
            if k <= 0:
                return []
            self._room_this_step = None  # it allocates
            try:
                ids = list(self._alloc_nowait(k))
            except (WouldBlock, OutOfBlocks):  # taken back meanwhile (a trim, a drain)
                return []
            except AllocatorClosed:
                raise
            except KVAsyncError as error:  # Note [When the allocator fails]: none now
                self._allocator_failed(error)
                return []
            self._taken += len(ids)
            return ids

        def _promise(self, demand: Demand, queued: int) -> int:
            """The free count for ``demand`` (Note [Count only what is mapped])."""
            n = demand.blocks
            if len(self._pocket) > n:
                self._give_back_pocket(n)
            short = n - len(self._pocket)
            if short > 0:
                try:  # the hot path: mapped free blocks, taken in one call
                    taken = self._alloc_nowait(short)
                    self._taken += len(taken)
                    self._pocket += taken
                except (WouldBlock, OutOfBlocks):
                    # The miss asked the mapper for what the budget allows of the shortfall
                    # (mapping ahead, in the background); take what is mapped now.
                    self._pocket += self._mapped_now(short)
                except AllocatorClosed:
                    raise
                except KVAsyncError as error:
                    # Note [When the allocator fails]: a miss, counted on what the pool has.
                    self._allocator_failed(error)
                short = n - len(self._pocket)
            if short <= 0:
                # The demand is the pool's own now. vLLM allocates exactly it; what it counts
                # beyond (a watermark, blocks reserved for other sequences) is headroom.
                self._may_evict = 0
                if self.stalled is not None:
                    self._served(demand)
                room = self._available_blocks()  # _room_now(), inline: every new block
                self._room_this_step = room if room > 0 else None
                return len(self._pocket) + queued + room
            room = self._room_now()  # on their way in, and mappable within the budget
            lacking = max(0, short - room)  # what the budget cannot give: vLLM would evict
            self._may_evict = min(queued, short if demand.running else lacking)
            if self._may_evict < short:
                self.num_map_ahead_misses += 1
                # All the pool holds and all the allocator can still give, within the limit
                # in force: more than that waits for the limit to rise.
                if n > self._taken + room:
                    self._stalled(demand, self._taken + room)
            elif demand.running and lacking < short:
                self.num_lag_evictions += short - lacking
            return len(self._pocket) + self._may_evict

        def _room_now(self) -> int:
            """The allocator's ``available_blocks``, read now: the step's later counts of no
            block reuse it while the pool neither allocates nor frees (Note [Count only what is
            mapped])."""
            room = self._available_blocks()
            self._room_this_step = room if room > 0 else None
            return room

        def _from_other_places(self, n: int) -> list[int]:
            """The ids of ``n`` blocks for a call the count did not promise whole: the pocket's,
            then mapped free blocks, then for a call vLLM did not count the allocator's (waiting
            for their mapping); short of ``n`` by the cached blocks the caller evicts."""
            pocket = self._pocket
            ids, self._pocket = pocket[:n], pocket[n:]
            pocketed = len(ids)
            queued = int(self.cached_free_queue.num_free_blocks)
            # The allocator's part can fail (a call vLLM did not count, past what the limit
            # allows), so it comes before any block is handed out or prefix dropped: as in
            # vLLM's pool, a call that fails takes nothing.
            try:
                if pocketed < n:
                    ids += self._mapped_now(n - pocketed)
                rest = n - len(ids)
                evict = min(rest, self._may_evict, queued)
                if rest > evict:
                    fresh = self._take(rest - evict, queued - evict)
                    self._taken += len(fresh)
                    ids += fresh
            except BaseException as error:
                self._pocket[:0] = ids[:pocketed]  # the promise stands
                self._give_back(ids[pocketed:])
                if isinstance(error, AllocatorClosed):
                    raise self._closed(error) from error
                raise
            self._may_evict -= evict
            return ids

        def _give_back_pocket(self, keep: int) -> None:
            if len(self._pocket) > keep:
                surplus, self._pocket = self._pocket[keep:], self._pocket[:keep]
                self._give_back(surplus)

        def _give_back(self, ids: list[int]) -> None:
            """Gives back blocks taken from the allocator and never handed to vLLM (no GPU work
            to wait for); last first, so that they come out again in the order they were taken
            (Note [Who owns a free block])."""
            if ids:
                self._room_this_step = None  # it frees
                try:
                    self._free(ids[::-1])
                except AllocatorClosed as error:
                    raise self._closed(error) from error
                self._taken -= len(ids)

        def _evict(self, n: int) -> list[Any]:
            """``n`` blocks from vLLM's queue, first freed first, their cache entries dropped."""
            taken: list[Any] = self.cached_free_queue.popleft_n(n)
            self._notify_reused(taken)
            for block in taken:
                self._maybe_evict_cached_block(block)
                block.ref_cnt = 1
                if self.metrics_collector:
                    self.metrics_collector.on_block_allocated(block)
            return taken

        def _take(self, n: int, queued: int) -> list[int]:
            """Blocks from the allocator for a call vLLM did not count: ``n`` when it can give
            them within its limit and budget (waiting for their mapping), else what it can, and
            at least what the ``queued`` blocks of vLLM's queue do not cover (Note [Evict only
            what the budget lacks]).
            """
            kv = self._kv
            self._room_this_step = None  # it allocates
            try:
                return list(self._alloc_nowait(n))
            except WouldBlock:
                pass  # the miss started mapping what the reserve lacks
            lacking = n - queued
            wanted = max(lacking, min(n, self._available_blocks()))
            if wanted <= 0:
                return []
            deadline = time.monotonic() + _MAP_WAIT
            try:
                return list(kv.alloc(wanted, deadline=deadline))
            except AllocatorClosed:
                raise
            except KVAsyncError:  # timed out, never fits, a map or the budget failed
                if wanted <= lacking:
                    raise
            # The budget shrank (a neighbour's share) or the mapper fell behind: the cached
            # blocks of vLLM's queue make up the rest, as vLLM would evict them.
            return list(kv.alloc(lacking, deadline=deadline)) if lacking > 0 else []

        def _release(self, blocks: list[Any]) -> None:
            """Gives vLLM's ``blocks`` back to the allocator (after the worker's stream)."""
            if not blocks:
                return
            self._room_this_step = None  # it frees
            if self._watched and self._reuse_watchers:
                self._notify_reuse(blocks)  # _notify_reused, inline: every free comes here
            after = self._fence() if self._fence is not None else None
            # Last first: the first of ``blocks`` is handed out first (Note [Who owns a free
            # block]). Not contextlib.suppress: its three Python calls on every free.
            try:  # noqa: SIM105
                self._free([b.block_id for b in reversed(blocks)], after=after)
            except AllocatorClosed:
                # A closed allocator and its pages are gone (Note [When the allocator fails]):
                # vLLM's shutdown ends its requests after the stop, and their frees give back
                # nothing.
                pass
            self._taken -= len(blocks)

        def _notify_reused(self, blocks: list[Any]) -> None:
            """vLLM 0.33's ``unpin_blocks``: a block released with a watcher stays readable
            until the pool reuses it; leaving vLLM's queue (to a request or to kvasync, whose
            pages may be unmapped) is that reuse."""
            if self._watched and self._reuse_watchers:
                self._notify_reuse(blocks)

        def _trim_cached(self) -> None:
            """Gives back cached free blocks beyond the bound, and cached and pocket blocks on
            draining pages."""
            queue = self.cached_free_queue
            keep = self._keep_cached
            if not self._pocket and not queue.num_free_blocks:
                return  # none to give back (caching off: every free)
            try:
                drain = self._drain()
            except AllocatorClosed:  # gone with its pages: vLLM's shutdown frees after the stop
                return
            if drain is not None:
                draining = [b for b in queue.get_all_free_blocks() if b.block_id >= drain]
                for block in draining:
                    queue.remove(block)
                    self._maybe_evict_cached_block(block)
                self._release(draining)
                pocket = self._pocket
                self._pocket = [i for i in pocket if i < drain]
                self._give_back([i for i in pocket if i >= drain])
            if keep is not None and queue.num_free_blocks > keep:
                surplus = queue.popleft_n(queue.num_free_blocks - keep)
                for block in surplus:
                    self._maybe_evict_cached_block(block)
                self._release(surplus)

        # -- Note [When the allocator fails] -------------------------------------------------

        def _closed(self, error: AllocatorClosed) -> AllocatorClosed:
            """The error that stops the engine: its allocator is closed, so its KV pages are
            gone. Logged once; every later call raises the same."""
            if self._closed_error is None:
                self._closed_error = AllocatorClosed(
                    f"kvasync's vLLM pool: the engine's KV cache allocator is closed ({error}), "
                    "so its KV pages are unmapped and no step can run on them: the engine stops "
                    "here, and vLLM ends its requests with an engine error. The allocator "
                    "closes when the engine shuts down; if it was not shutting down, restart "
                    "it and report this"
                )
                logger.error("%s", self._closed_error)
            return self._closed_error

        def _probe_closed(self) -> None:
            """Raises ``AllocatorClosed`` when the allocator was closed: looked at most every
            ``_CLOSED_PROBE_INTERVAL`` seconds, on the count's path where none is available.
            An open engine's allocator always has a page mapped: block 0, the null block."""
            if self._closed_error is not None:
                raise AllocatorClosed("seen closed at an earlier step")
            now = self.clock()
            if now < self._closed_probe_due:
                return
            self._closed_probe_due = now + _CLOSED_PROBE_INTERVAL
            if self._kv.stats().mapped_pages == 0:
                raise AllocatorClosed("none of its pages is mapped, not even the null block's")

        def _allocator_failed(self, error: KVAsyncError) -> None:
            """An allocator error on the count's path: a miss, logged at most once a
            ``log_interval``."""
            self.num_allocator_errors += 1
            self._errors_unlogged += 1
            now = self.clock()
            if now - self._error_logged < self.log_interval:
                return
            logger.warning(
                "kvasync: the KV allocator failed while the scheduler counted free blocks "
                "(%s: %s); the count is a scheduling miss and the next step tries again "
                "(%d failure(s) since the last line; the allocator's last error: %s)",
                type(error).__name__,
                error,
                self._errors_unlogged,
                self._kv.stats().last_error or "none",
            )
            self._error_logged = now
            self._errors_unlogged = 0

        def _stalled(self, demand: Demand, capacity: int) -> None:
            """A count answered short because the request needs more than the limit in force
            lets the engine hold (``capacity``: all the pool holds and the allocator can still
            give): warned at most once a ``log_interval``."""
            self.num_stalled_counts += 1
            now = self.clock()
            request_id = getattr(demand, "request_id", None)
            stall = self.stalled
            if stall is None or stall.request_id != request_id:
                stall = self.stalled = Stall(request_id, demand.blocks, now)
            stall.need = demand.blocks
            stall.counts += 1
            if now - self._stall_logged < self.log_interval:
                return
            stats = self._kv.stats()
            logger.warning(
                "kvasync: request %s cannot be scheduled: it needs %d KV blocks and the memory "
                "limit in force lets this engine hold %d (its limit is %d blocks; %d held by "
                "requests, %d by the prefix cache). It has waited %.1f s (%d counts) and "
                "waits until the limit rises, and the requests queued behind it wait too: "
                "raise the limit (KVASYNC_MEMORY_LIMIT, the share's budget, `kvasync limit`) "
                "or abort the request",
                request_id,
                demand.blocks,
                capacity,
                stats.memory_limit_blocks,
                self._num_running(),
                int(self.cached_free_queue.num_free_blocks),
                now - stall.since,
                stall.counts,
            )
            self._stall_logged = now

        def _served(self, demand: Demand) -> None:
            """A count answered in full: if it is the stalled request's, its stall is over."""
            stall = self.stalled
            if stall is None or getattr(demand, "request_id", None) != stall.request_id:
                return
            self.stalled = None
            logger.warning(
                "kvasync: request %s is scheduled again: it needs %d KV blocks and the limit in "
                "force allows them now, after %.1f s (%d counts) of waiting",
                stall.request_id,
                demand.blocks,
                self.clock() - stall.since,
                stall.counts,
            )

    return KVAsyncBlockPool


class Stall:
    """A request that cannot fit under the limit in force (Note [When the allocator fails])."""

    __slots__ = ("counts", "need", "request_id", "since")

    def __init__(self, request_id: Any, need: int, since: float) -> None:
        self.request_id = request_id
        self.need = need  # blocks its last count asked for
        self.since = since  # the pool's clock at its first count answered short
        self.counts = 0  # counts answered short since
