"""The scheduler side: vLLM's ``BlockPool`` whose free blocks come from a kvasync allocator.

Note [Who owns a free block]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
vLLM's pool starts with every block id free in its ``free_block_queue``. Here a block id is in
one of three places:

- the allocator's: free in kvasync, perhaps on no mapped page (most ids, at first);
- vLLM's queue: free to vLLM and on a mapped page; these are freed blocks that keep a
  prefix-cache entry (vLLM evicts them LRU when it needs blocks), at most
  ``prefix_cache_blocks`` of them, and none in the pages the allocator drains;
- a request's: ``ref_cnt > 0``, mapped.

``get_num_free_blocks`` is vLLM's queue plus ``available_blocks()``: what kvasync can hand out
now or by mapping within the memory limit and the share's budget. A shortage there is what vLLM
already handles as a scheduling miss (the request waits, or a running one is preempted). A
block without a prefix-cache entry goes back to the allocator as soon as vLLM frees it, and
its page is unmapped as the reserve policy says. ``get_new_blocks`` takes mapped free blocks
from the allocator first, and waits for the mapper only when the pages ahead of the scheduler
were not mapped in time: the allocator's reserve keeps at least the blocks of the longest
request plus one per running sequence mapped and free (its low watermark), refilled by the mapper
thread in the background.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from typing import Any

from ..._errors import AllocTimeout, OutOfBlocks, WouldBlock
from ._engine import EngineKV

__all__ = ["make_block_pool_class"]

logger = logging.getLogger("kvasync.vllm")

# The longest a step waits for pages the reserve did not cover (a map of a few pages).
_MAP_WAIT = 5.0


def make_block_pool_class(base: type[Any], find_engine: Any) -> type[Any]:
    """A subclass of vLLM's ``BlockPool`` (``base``) over the engine ``find_engine()`` returns.

    ``find_engine(num_gpu_blocks)`` returns the ``EngineKV`` the pool uses; it is called once per
    pool, in ``__init__``.
    """

    class KVAsyncBlockPool(base):  # type: ignore[misc]
        """vLLM's ``BlockPool`` whose free blocks are handed out by kvasync.

        Note [Who owns a free block] in _pool.py.
        """

        free_block_queue: Any
        cached_block_hash_to_block: Any

        def __init__(
            self,
            num_gpu_blocks: int,
            enable_caching: bool,
            hash_block_size: int,
            enable_kv_cache_events: bool = False,
            metrics_collector: Any = None,
        ) -> None:
            engine: EngineKV = find_engine(num_gpu_blocks)
            if engine.allocator.num_blocks != num_gpu_blocks:
                raise ValueError(
                    f"kvasync's vLLM plugin: the scheduler's pool has {num_gpu_blocks} blocks but "
                    f"the worker's allocator {engine.allocator.num_blocks}"
                )
            super().__init__(
                num_gpu_blocks,
                enable_caching,
                hash_block_size,
                enable_kv_cache_events,
                metrics_collector,
            )
            # vLLM made every block free and popped block 0 as the null block; kvasync's block 0
            # is held by the worker (hold_null_block). The rest are kvasync's until handed out.
            queue_type = type(self.free_block_queue)
            for block in self.blocks:
                block.prev_free_block = block.next_free_block = None
            self.free_block_queue = queue_type([])
            self._engine = engine
            if engine.owned:  # a pool of vLLM's tests: its allocator lives as long as it does
                weakref.finalize(self, engine.allocator.close)
            self._kv = engine.allocator
            self._drain = engine.allocator.allocator.drain_from
            self._fence = engine.fence
            self._keep_cached = engine.prefix_cache_blocks

        # -- what vLLM asks --------------------------------------------------------------------

        def get_num_free_blocks(self) -> int:
            return int(self.free_block_queue.num_free_blocks) + self._kv.available_blocks()

        def get_new_blocks(self, num_blocks: int) -> list[Any]:
            if num_blocks <= 0:
                return []
            # Fresh blocks from the allocator before evicting prefix-cache entries; the queue
            # (cached blocks) makes up what the allocator cannot give (Note [Evict only what
            # the budget lacks]).
            fresh = self._take(num_blocks, self.free_block_queue.num_free_blocks)
            blocks = self.blocks
            taken = [blocks[i] for i in fresh]
            for block in taken:
                block.ref_cnt = 1
                if self.metrics_collector:
                    self.metrics_collector.on_block_allocated(block)
            if len(fresh) < num_blocks:
                taken.extend(super().get_new_blocks(num_blocks - len(fresh)))
            return taken

        def free_blocks(self, ordered_blocks: Any) -> None:
            cached = []
            released = []
            for block in ordered_blocks:
                block.ref_cnt -= 1
                if block.ref_cnt == 0 and not block.is_null:
                    if block.block_hash is None:
                        released.append(block.block_id)
                    else:
                        cached.append(block)
            # vLLM's order: the first freed is the first evicted, so cached blocks go to the tail.
            self.free_block_queue.append_n(cached)
            self._release(released)
            self._trim_cached()

        def reset_prefix_cache(self) -> bool:
            # vLLM counts used blocks as capacity less free; here most of the capacity is
            # unmapped, so count what requests hold: the null block alone when nothing runs.
            queue = self.free_block_queue
            running = self._kv.stats().used_blocks - 1 - queue.num_free_blocks
            if running:
                logger.warning(
                    "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                    running,
                )
                return False
            cached = queue.popleft_n(queue.num_free_blocks)
            for block in cached:
                self._maybe_evict_cached_block(block)
            self._release([b.block_id for b in cached])
            self.cached_block_hash_to_block = type(self.cached_block_hash_to_block)()
            self.cached_block_hashes_by_block.clear()
            if self.metrics_collector:
                self.metrics_collector.reset()
            if self.enable_kv_cache_events:
                self.kv_event_queue.append(sys.modules[base.__module__].AllBlocksCleared())
            return True

        def get_usage(self) -> float:
            # The share of what the budget allows that requests and the prefix cache use.
            used = self._kv.stats().used_blocks - 1
            total = used + self._kv.available_blocks()
            return used / total if total > 0 else 1.0

        # -- kvasync's side --------------------------------------------------------------------

        @property
        def kvasync_allocator(self) -> Any:
            """The engine's ``kvasync.SyncAllocator``."""
            return self._kv

        def _take(self, n: int, queued: int) -> list[int]:
            """Blocks from the allocator: ``n`` when it can give them within its limit and
            budget (waiting for their mapping if the reserve was outrun), else what it can, and
            at least what the ``queued`` blocks of vLLM's queue do not cover.

            Note [Evict only what the budget lacks]: vLLM evicts a prefix-cache entry only when
            no uncached block is free. Here the uncached free blocks are the allocator's, so a
            cached block is evicted only for what the allocator cannot give within its limit
            and budget; that they are not mapped yet is a wait for the mapper, not a reason to
            drop a prefix others may hit (that made a cached prefix vanish under a burst of
            allocations larger than the reserve).
            """
            kv = self._kv
            try:
                return list(kv.alloc_nowait(n))
            except WouldBlock:
                pass  # the miss started mapping what the reserve lacks
            lacking = n - queued
            wanted = max(lacking, min(n, kv.available_blocks()))
            if wanted <= 0:
                return []
            # The scheduler counted these blocks in get_num_free_blocks: they are within the
            # limit and the budget, and only their mapping is not done. A deadline bounds the
            # wait; a MapError is the driver's.
            deadline = time.monotonic() + _MAP_WAIT
            try:
                return list(kv.alloc(wanted, deadline=deadline))
            except (AllocTimeout, OutOfBlocks):
                if wanted <= lacking:
                    raise
            # The budget shrank (a neighbour's share) or the mapper fell behind: the cached
            # blocks of vLLM's queue make up the rest, as vLLM would evict them.
            return list(kv.alloc(lacking, deadline=deadline)) if lacking > 0 else []

        def _release(self, block_ids: list[int]) -> None:
            if not block_ids:
                return
            after = self._fence() if self._fence is not None else None
            self._kv.free(block_ids, after=after)

        def _trim_cached(self) -> None:
            """Gives back cached free blocks beyond the bound and on draining pages."""
            queue = self.free_block_queue
            keep = self._keep_cached
            drain = self._drain()
            if drain is not None:
                draining = [b for b in queue.get_all_free_blocks() if b.block_id >= drain]
                for block in draining:
                    queue.remove(block)
                    self._maybe_evict_cached_block(block)
                self._release([b.block_id for b in draining])
            if keep is not None and queue.num_free_blocks > keep:
                surplus = queue.popleft_n(queue.num_free_blocks - keep)
                for block in surplus:
                    self._maybe_evict_cached_block(block)
                self._release([b.block_id for b in surplus])

    return KVAsyncBlockPool
