"""The token-to-KV allocator: SGLang's paged allocator whose pages come from kvasync.

Note [SGLang's count and kvasync's pages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
SGLang's scheduler admits a request (``PrefillAdder``), or retracts a running one, on
``available_size()``, evicts the radix cache's unused prefixes for the shortfall
(``evict_from_tree_cache``), and then allocates in the same step (``alloc_extend``,
``alloc_decode``); an alloc that then returns None is a fatal "out of memory" error. So the count
must be what the allocator can hand out:

- ``available_size()`` is the pages in hand (``free_pages``, normally empty) plus
  ``Allocator.available_blocks()``: kvasync's mapped free blocks and those the limit in force
  (in a share, the budget or the fair share) still lets it map. Idle and under no pressure, that
  is SGLang's total less what requests and the radix cache hold, which is SGLang's own invariant.
- An alloc counts its pages first (SGLang's ``get_num_new_pages``, on the CPU lengths) and takes
  them from kvasync: the mapped ones at once (``alloc_nowait``), and, when the mapper has not
  caught up, by waiting for it (``alloc`` with a deadline of ``_MAP_WAIT``), which the reserve
  makes rare (it keeps a step's pages mapped ahead: ``_kv``). The pages then go to SGLang's own
  kernels in ``free_pages``, as stock's do. The count was within the limit, so the wait ends
  when the pages are mapped; it fails only on a map error (the device has no memory left
  outside the share's accounting) or when the limit fell between the count and the alloc.
  kvasync having fewer pages than were counted means the latter: the radix cache's unused
  prefixes are evicted for the difference first (their pages come back here), and outside a
  share, where no neighbour can give budget back, nothing waits at the limit. After a map error
  they are evicted too, and the alloc tried once more. Only when that is not enough does the
  alloc return None: SGLang's own out-of-memory error, with a line here that says why.
- Every free goes through ``_release_page_ids`` (stock's one funnel) and back to kvasync at once,
  with the scheduler stream as its fence, so freed pages are unmapped as kvasync's reserve policy
  says and a neighbour in the share can have them. Only the pages SGLang holds go back (Note [A
  free of pages SGLang does not hold]).
- ``clear()`` (a flush: no request runs and the radix cache was reset) gives back every page
  SGLang held, except page 0.

Note [A free of pages SGLang does not hold]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A free runs on SGLang's scheduler thread, where an exception stops the server. A page freed that
SGLang does not hold (freed twice, in one call or in two, or never handed out) is a bug in SGLang
or in code beside it. Stock 0.5.17 checks nothing: the page goes into ``free_pages`` again, counts
twice in ``available_size()`` (past SGLang's total), and the next two allocs hand it to two
requests, whose KV then overwrite each other; with ``SGLANG_DEBUG_MEMORY_POOL=1`` its check raises
``AssertionError`` after the page is listed twice. kvasync's own free refuses such a list whole
(``ValueError``, nothing freed): raised out of SGLang's free it would stop the server, and the
pages the same call rightly freed would stay taken. So a free here gives kvasync only the pages
this allocator handed to SGLang and has not had back (``_held`` less the pages in hand in
``free_pages``, which SGLang's next alloc takes), each once, as any free (none lost, none leaks);
the others are ignored: nothing goes to kvasync twice, so no page goes to two requests. Each
ignored page is counted (``num_ignored_free_pages``) and a warning names them at most once a
``_LOG_INTERVAL``. In SGLang's debug mode (``SGLANG_DEBUG_MEMORY_POOL=1``: stop at the first),
the free then raises ``AssertionError``, as stock's check does, with the held pages freed
already. kvasync cannot refuse what is left; if it did, this record would be wrong (a bug, raised
as is, as the vLLM plugin raises its own: Note [When the allocator fails] there).

Note [SGLang's idle check]
~~~~~~~~~~~~~~~~~~~~~~~~~
When idle, SGLang checks ``available + evictable + protected == max_total_num_tokens`` and, by
default (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``), stops the scheduler with "memory leak
detected" when it does not hold. Here ``available_size()`` is what kvasync can hand out now,
which an elastic allocator makes smaller than SGLang's unheld pages whenever a page is being
unmapped, another engine of the share holds budget, or the limit was lowered: not a leak. So the
pool statistics SGLang's checks and metrics read (``SchedulerPoolStatsObserver._get_token_info``)
count ``unheld_size()``: SGLang's total less the pages this allocator handed out and has not
had back. The check is then SGLang's own bookkeeping against this allocator's (a page lost by
either fails it), and SGLang's token usage is the share of its pages in use. The scheduler's
admission and retraction still count ``available_size()``.

Note [Pressure and the radix cache]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The radix cache keeps finished requests' pages for prefix hits; they count against the share
like any mapped page. Once a scheduler step (``maintain``, at most every ``_MAINTAIN_EVERY``):

- ``KVASYNC_PREFIX_CACHE`` bounds them: unused cached tokens past the bound are evicted (LRU, by
  SGLang's own ``evict``), so they are given back.
- When kvasync wants pages back (``drain_from()``: the limit was lowered, or in a share the fair
  share fell while another engine waits), the unused cached prefixes are evicted first, as many
  tokens as the pages past the drain point hold. Running requests keep theirs: SGLang retracts
  one only when its own count says it cannot grow.
- In a share, the demand (pages held plus what the waiting queue's prompts need) is reported
  (``set_demand``) so the fair share follows the load.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Iterable
from typing import Any, cast

import torch

from ..._errors import AllocatorClosed, KVAsyncError, WouldBlock
from ._kv import engine_of, open_bookkeeping_engine

__all__ = ["allocator_class", "maintain"]

logger = logging.getLogger("kvasync.sglang")

# The longest an alloc waits for the mapper on SGLang's scheduler thread. A map of a step's pages
# takes milliseconds; this bounds a wait for budget a neighbour is giving back.
_MAP_WAIT = 10.0
# A wait for the mapper longer than this is logged (rate-limited).
_SLOW_WAIT = 0.1
_LOG_INTERVAL = 30.0
# The page ids a warning about pages SGLang does not hold names, at most.
_PAGES_NAMED = 16
_MAINTAIN_EVERY = 0.05

_class: type | None = None


def allocator_class() -> type:
    """kvasync's subclass of SGLang's ``PagedTokenToKVPoolAllocator`` (built once, on first use:
    SGLang is imported only in an SGLang process)."""
    global _class
    if _class is None:
        _class = _build_class()
    return _class


def _build_class() -> type:
    paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
    evict_params = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache").EvictParams
    base: Any = paged.PagedTokenToKVPoolAllocator
    num_new_pages = paged.get_num_new_pages

    class KvasyncPagedAllocator(base):  # type: ignore[misc]
        """SGLang's paged allocator over kvasync's pages (Note [SGLang's count and kvasync's
        pages])."""

        def __init__(
            self,
            size: int,
            page_size: int,
            dtype: torch.dtype,
            device: str,
            kvcache: Any,
            need_sort: bool,
        ) -> None:
            engine = engine_of(kvcache)
            if engine is None:
                # SGLang's own unit tests build allocators over pools of their own (or none):
                # with KVASYNC_SGLANG_HOST_POOL=1 the allocator keeps its pages in a host
                # allocator of its own, which holds no KV (bookkeeping only).
                engine = open_bookkeeping_engine(size, page_size)
            self.free_pages: torch.Tensor
            self.release_pages: torch.Tensor
            self._engine = engine
            self._kv = engine.allocator
            self._held: set[int] = set()  # pages SGLang holds (in requests and the radix cache)
            self._closed_logged = False
            self._last_log = 0.0
            self._last_ignored_log = float("-inf")
            self._errors = 0
            self._next_maintain = 0.0
            self._stream: Any = None  # the scheduler's forward stream, once a step has seen it
            self._tree_cache: Any = None  # the scheduler's radix cache, once a step has seen it
            self.num_map_waits = 0
            self.map_wait_seconds = 0.0
            self.num_failed_allocs = 0
            self.num_evicted_for_pressure = 0
            self.num_evicted_for_alloc = 0  # cached tokens evicted for an alloc kvasync refused
            self.num_ignored_free_pages = 0  # freed while SGLang did not hold them: ignored
            super().__init__(size, page_size, dtype, device, kvcache, need_sort)

        # -- the count ------------------------------------------------------------------------

        def available_size(self) -> int:
            pages = len(self.free_pages) + len(self.release_pages)
            try:
                pages += self._kv.available_blocks()
            except KVAsyncError as error:
                self._log_error("available_blocks", error)
            return int(pages) * int(self.page_size)

        def unheld_size(self) -> int:
            """Tokens of the pages SGLang holds in no request and no radix-cache entry: its total
            less what it holds, by its own bookkeeping (Note [SGLang's idle check]). kvasync's
            limit in force may let it map fewer: ``available_size`` is that count."""
            in_use = len(self._held) - len(self.free_pages)
            return (int(self.num_pages) - in_use) * int(self.page_size)

        # -- allocs ---------------------------------------------------------------------------

        def alloc(self, need_size: int) -> Any:
            if not self._take(need_size // self.page_size):
                return None
            return super().alloc(need_size)

        def alloc_extend(
            self,
            prefix_lens: torch.Tensor,
            prefix_lens_cpu: torch.Tensor,
            seq_lens: torch.Tensor,
            seq_lens_cpu: torch.Tensor,
            last_loc: torch.Tensor,
            extend_num_tokens: int,
            num_new_pages: int | None = None,
        ) -> Any:
            if num_new_pages is None:
                num_new_pages = int(
                    num_new_pages_of(seq_lens_cpu, self.page_size, prefix_lens_cpu, False)
                )
            if not self._take(num_new_pages):
                return None
            return super().alloc_extend(
                prefix_lens,
                prefix_lens_cpu,
                seq_lens,
                seq_lens_cpu,
                last_loc,
                extend_num_tokens,
                num_new_pages,
            )

        def alloc_decode(
            self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
        ) -> Any:
            if not self._take(int(num_new_pages_of(seq_lens_cpu, self.page_size, None, True))):
                return None
            return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)

        def _take(self, pages: int) -> bool:
            """Puts at least ``pages`` mapped pages in ``free_pages``; False when kvasync cannot
            give them even after the radix cache's unused prefixes were evicted."""
            short = pages - len(self.free_pages)
            if short <= 0:
                return True
            # SGLang counted these pages on available_size(); fewer now means the limit fell
            # since (or a neighbour's share grew): unused prefixes go first, not a wait.
            evicted = self._evict_for(short - self._available_blocks())
            got, error = self._from_kvasync(short)
            closed = isinstance(error, AllocatorClosed)
            # a map error: the cached prefixes' pages can make up for it
            if got is None and not evicted and not closed and self._evict_for(short):
                got, error = self._from_kvasync(short)
            if got is None:
                self.num_failed_allocs += 1
                if error is not None:
                    self._log_error(
                        f"alloc of {short} pages (after evicting the radix cache's unused "
                        f"prefixes: {self.num_evicted_for_alloc} tokens so far)",
                        error,
                    )
                return False
            self._held.update(got)
            fresh = torch.tensor(got, dtype=torch.int64).to(self.device, non_blocking=True)
            self.free_pages = torch.cat((self.free_pages, fresh))
            return True

        def _from_kvasync(self, n: int) -> tuple[list[int] | None, KVAsyncError | None]:
            """``n`` pages from kvasync, or None and why (logged by the caller, once)."""
            try:
                return self._kv.alloc_nowait(n), None
            except WouldBlock as error:
                # The map of what is missing started: wait for it below, unless the limit
                # binds and no neighbour can give budget back (no share): then waiting would
                # only stall SGLang's scheduler thread for nothing.
                if self._engine.settings.share is None and self._available_blocks() < n:
                    return None, error
            except KVAsyncError as error:
                return None, error
            started = time.monotonic()
            try:
                got = self._kv.alloc(n, timeout=_MAP_WAIT)
            except KVAsyncError as error:
                return None, error
            waited = time.monotonic() - started
            self.num_map_waits += 1
            self.map_wait_seconds += waited
            if waited > _SLOW_WAIT:
                self._log_rate_limited(
                    logging.WARNING,
                    "kvasync: an SGLang alloc of %d pages waited %.3f s for the mapper (%d waits, "
                    "%.3f s in all)",
                    n,
                    waited,
                    self.num_map_waits,
                    self.map_wait_seconds,
                )
            return got, None

        def _available_blocks(self) -> int:
            try:
                return int(self._kv.available_blocks())
            except KVAsyncError:
                return 1 << 62  # closed: the alloc says so, and nothing is evicted for it

        def _evict_for(self, pages: int) -> bool:
            """After kvasync refused ``pages`` that SGLang's count had (a map error, or the limit
            fell between the count and the alloc: Note [SGLang's count and kvasync's pages]):
            evicts that many pages' tokens of the radix cache's unused prefixes, whose pages go
            back to kvasync. Whether anything was evicted."""
            cache = self._tree_cache
            evictable = _evictable_tokens(cache) if pages > 0 else 0
            if not evictable:
                return False
            tokens = min(evictable, pages * int(self.page_size))
            cache.evict(evict_params(num_tokens=tokens))
            self.num_evicted_for_alloc += tokens
            return True

        # -- frees ----------------------------------------------------------------------------

        def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
            ids: list[int] = (
                torch.cat(page_ids).tolist() if len(page_ids) > 1 else page_ids[0].tolist()
            )
            self._give_back(ids)

        def _give_back(self, ids: Iterable[int]) -> None:
            """SGLang's free: Note [A free of pages SGLang does not hold]."""
            held, pages, ignored = self._held, [], []
            # Pages in hand (taken for an alloc, normally none between steps) are not SGLang's.
            in_hand = set(self.free_pages.tolist()) if len(self.free_pages) else set()
            for page in ids:
                if not page:
                    continue  # never page 0: the padded page stays
                if page in held and page not in in_hand:
                    held.discard(page)  # given back below; a repeat is then not held
                    pages.append(page)
                else:
                    ignored.append(page)
            self._return(pages)
            if ignored:
                self._ignore_free(ignored)

        def _return(self, pages: list[int]) -> None:
            """Gives ``pages`` (held by this allocator, taken out of ``_held``) back to kvasync."""
            if not pages:
                return
            try:
                self._kv.free(pages, after=self._stream or self._engine.fence_now())
            except AllocatorClosed:
                pass  # the engine is closing, and its pages are gone already
            except ValueError:  # a bug (the Note): kvasync freed nothing, so they are still held
                self._held.update(pages)
                raise

        def _ignore_free(self, pages: list[int]) -> None:
            self.num_ignored_free_pages += len(pages)
            named = ", ".join(map(str, pages[:_PAGES_NAMED]))
            if len(pages) > _PAGES_NAMED:
                named += f", ... ({len(pages) - _PAGES_NAMED} more)"
            message = (
                f"kvasync: SGLang freed {len(pages)} page(s) it does not hold ({named}): freed "
                f"already, or never handed out"
            )
            now = time.monotonic()
            if now - self._last_ignored_log >= _LOG_INTERVAL:
                self._last_ignored_log = now
                logger.warning(
                    "%s. Ignored: none goes back to kvasync twice, so none goes to two requests "
                    "(%d such page(s) since start; one line a %g s). A bug in SGLang or in code "
                    "beside it: SGLANG_DEBUG_MEMORY_POOL=1 stops at the first",
                    message,
                    self.num_ignored_free_pages,
                    _LOG_INTERVAL,
                )
            if getattr(self, "debug_mode", False):  # SGLang's: stop at the first, as stock does
                raise AssertionError(f"{message} (SGLANG_DEBUG_MEMORY_POOL=1)")

        def clear(self) -> None:
            in_hand = self.free_pages.tolist() if self.free_pages is not None else []
            pages = sorted((self._held | set(in_hand)) - {0})
            self._held.clear()
            self._return(pages)
            super().clear()
            empty = torch.empty((0,), dtype=torch.int64, device=self.device)
            self.free_pages = empty
            self.release_pages = empty.clone()

        # -- once a step ----------------------------------------------------------------------

        def maintain(self, tree_cache: Any, waiting: Iterable[Any], stream: Any = None) -> None:
            """Note [Pressure and the radix cache]. ``stream``: the scheduler's forward stream,
            the fence of every later free (SGLang runs forward passes there, not on the
            scheduler thread's current stream; a free's pages are unmapped only after the work
            queued there when it was freed)."""
            if stream is not None and self._engine.fence is not None:
                self._stream = stream
            self._tree_cache = tree_cache
            now = time.monotonic()
            if now < self._next_maintain or self._engine.closed:
                return
            self._next_maintain = now + _MAINTAIN_EVERY
            try:
                self._maintain(tree_cache, waiting)
            except AllocatorClosed as error:
                self._log_error("maintain", error)

        def _maintain(self, tree_cache: Any, waiting: Iterable[Any]) -> None:
            page = int(self.page_size)
            evictable = _evictable_tokens(tree_cache)
            bound = self._engine.settings.prefix_cache_bytes
            if bound is not None and evictable:
                bound_tokens = bound // max(1, self._token_bytes())
                if evictable > bound_tokens:
                    tree_cache.evict(evict_params(num_tokens=evictable - bound_tokens))
                    evictable = _evictable_tokens(tree_cache)
            drain = self._kv.drain_from()
            if drain is not None and evictable:
                over = sum(1 for held in self._held if held >= drain)
                if over:
                    tokens = min(evictable, over * page)
                    tree_cache.evict(evict_params(num_tokens=tokens))
                    self.num_evicted_for_pressure += tokens
            if self._engine.settings.share is not None:
                wanted = sum(
                    -(-len(getattr(req, "origin_input_ids", ())) // page) for req in waiting
                )
                self._kv.set_demand(max(1, len(self._held) + 1 + wanted))

        def _token_bytes(self) -> int:
            layout = self._kv.layout
            return layout.block_bytes * layout.num_buffers // layout.block_size

        def release_memory(self, timeout: float) -> int:
            """After SGLang's ``release_memory_occupation`` flushed the cache: unmaps every free
            page now (page 0 stays). Returns the bytes still mapped."""
            self.clear()
            self._kv.trim(timeout=timeout)
            return int(self._kv.stats().mapped_bytes)

        # -- errors ---------------------------------------------------------------------------

        def _log_error(self, what: str, error: KVAsyncError) -> None:
            self._errors += 1
            if isinstance(error, AllocatorClosed):
                if not self._closed_logged:
                    self._closed_logged = True
                    logger.error(
                        "kvasync: the SGLang engine's allocator is closed (%s): no page can be "
                        "handed out; the engine is shutting down or its KV memory is gone",
                        error,
                    )
                return
            self._log_rate_limited(
                logging.WARNING,
                "kvasync: %s failed: %s: %s (%d errors; allocator's last error: %s); SGLang sees "
                "the pages as unavailable and goes on",
                what,
                type(error).__name__,
                error,
                self._errors,
                _last_error(self._kv),
            )

        def _log_rate_limited(self, level: int, message: str, *args: object) -> None:
            now = time.monotonic()
            if now - self._last_log >= _LOG_INTERVAL:
                self._last_log = now
                logger.log(level, message, *args)

    def num_new_pages_of(
        seq_lens_cpu: torch.Tensor,
        page_size: int,
        prefix_lens_cpu: torch.Tensor | None,
        decode: bool,
    ) -> int:
        if decode:
            return int(num_new_pages(seq_lens=seq_lens_cpu, page_size=page_size, decode=True))
        return int(
            num_new_pages(seq_lens=seq_lens_cpu, page_size=page_size, prefix_lens=prefix_lens_cpu)
        )

    KvasyncPagedAllocator.__module__ = __name__
    return KvasyncPagedAllocator


def _evictable_tokens(tree_cache: Any) -> int:
    if tree_cache is None or tree_cache.is_chunk_cache():
        return 0
    return int(tree_cache.evictable_size())


def _last_error(kv: Any) -> str:
    try:
        return str(kv.stats().last_error) or "none"
    except KVAsyncError:
        return "unknown (closed)"


def maintain(scheduler: Any) -> None:
    """Once a scheduler step: Note [Pressure and the radix cache] for the scheduler's allocator,
    when it is kvasync's."""
    allocator: Any = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if _class is None or type(allocator) is not _class:
        return
    cast(Any, allocator).maintain(
        getattr(scheduler, "tree_cache", None),
        getattr(scheduler, "waiting_queue", ()),
        getattr(scheduler, "forward_stream", None),
    )
