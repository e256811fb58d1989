"""kvasync's vLLM plugin: its settings, its version and seam checks, and its block pool against
vLLM's own BlockPool and KVCacheManager with a real host-backend allocator.

The pool tests need vLLM importable (``make vllm-test`` builds such an environment); CI's venv has
no vLLM, and they skip there, saying so.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvasync import Config, KVLayout, OutOfBlocks, _core, open_allocator_sync
from kvasync.integrations import vllm as plugin
from kvasync.integrations._settings import read_settings
from kvasync.integrations.vllm._engine import EngineKV, hold_null_block
from kvasync.integrations.vllm._pool import Demand, counting_demand, make_block_pool_class

try:
    with warnings.catch_warnings():
        # vLLM 0.33 imports code that uses deprecated torch.jit APIs; the import is not under
        # test (with the suite's warnings as errors it made every test here skip).
        warnings.simplefilter("ignore", DeprecationWarning)
        import vllm.v1.core.block_pool as vllm_block_pool
        import vllm.v1.core.kv_cache_coordinator as vllm_coordinator
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

    VLLM_ERROR = ""
except Exception as error:  # any import failure means: no vLLM here
    VLLM_ERROR = (
        f"vLLM is not importable here ({type(error).__name__}: {error}); run make vllm-test"
    )

needs_vllm = pytest.mark.skipif(bool(VLLM_ERROR), reason=VLLM_ERROR or "vLLM present")

BLOCKS_PER_PAGE = 16  # host_engine's pages: 64 KiB of 4 KiB blocks
DEADLINE = 10.0


def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Waits for ``condition`` (the mapper thread's work) until a deadline."""
    due = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > due:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.005)


# -- settings --------------------------------------------------------------------------------


def test_plugin_is_inert_without_kvasync_variables() -> None:
    assert not read_settings({}).enabled
    assert not read_settings({"KVASYNC_MEMORY_LIMIT": "1GiB", "KVASYNC_VLLM": "0"}).enabled


def test_sizes_and_share_come_from_the_environment() -> None:
    settings = read_settings(
        {
            "KVASYNC_SHARE": "gpu0",
            "KVASYNC_DEVICE_BUDGET": "12GiB",
            "KVASYNC_MEMORY_LIMIT": "512MiB",
            "KVASYNC_NAME": "engine-a",
            "KVASYNC_PREFIX_CACHE": "0",
        }
    )
    assert settings.enabled
    assert (settings.share, settings.device_budget, settings.memory_limit) == (
        "gpu0",
        12 << 30,
        512 << 20,
    )
    assert settings.name == "engine-a"
    assert settings.prefix_cache_bytes == 0
    assert settings.capacity_bytes == 512 << 20
    assert read_settings({"KVASYNC_VLLM": "1"}).prefix_cache_bytes is None


def test_a_malformed_size_names_its_variable() -> None:
    with pytest.raises(ValueError, match="KVASYNC_MEMORY_LIMIT"):
        read_settings({"KVASYNC_MEMORY_LIMIT": "twelve gigs"})
    with pytest.raises(ValueError, match="needs KVASYNC_SHARE"):
        read_settings({"KVASYNC_DEVICE_BUDGET": "12GiB"})


def test_the_linger_comes_from_the_environment_in_seconds() -> None:
    assert read_settings({"KVASYNC_VLLM": "1"}).linger == 0.0
    assert read_settings({"KVASYNC_VLLM": "1", "KVASYNC_LINGER": "2"}).linger == 2.0
    assert read_settings({"KVASYNC_VLLM": "1", "KVASYNC_LINGER": "0.5s"}).linger == 0.5
    for bad in ("soon", "-1", "nan", "1e9"):
        with pytest.raises(ValueError, match="KVASYNC_LINGER"):
            read_settings({"KVASYNC_VLLM": "1", "KVASYNC_LINGER": bad})


def test_no_size_is_refused_with_the_variables_to_set() -> None:
    with pytest.raises(ValueError, match="KVASYNC_MEMORY_LIMIT or KVASYNC_DEVICE_BUDGET"):
        _ = read_settings({"KVASYNC_VLLM": "1"}).capacity_bytes


# -- version and seam checks: tests/test_vllm_seams.py ---------------------------------------


# -- the block pool against vLLM's ----------------------------------------------------------


@pytest.fixture
def engines() -> Iterator[list[EngineKV]]:
    """Host-backend engines the test opens; closed at its end."""
    opened: list[EngineKV] = []
    yield opened
    for engine in opened:
        engine.allocator.close()


def open_engine(
    engines: list[EngineKV],
    num_blocks: int,
    *,
    memory_limit: int | None = None,
    prefix_cache_blocks: int | None = None,
) -> EngineKV:
    settings = read_settings(
        {"KVASYNC_VLLM": "1"}
        if memory_limit is None
        else {"KVASYNC_MEMORY_LIMIT": str(memory_limit)}
    )
    engine = plugin.host_engine(num_blocks, settings, reserve_pages=(1, 2))
    engine.prefix_cache_blocks = prefix_cache_blocks
    engines.append(engine)
    return engine


def pool_class(engine: EngineKV) -> Any:
    return make_block_pool_class(vllm_block_pool.BlockPool, lambda n: engine)


def make_pool(engine: EngineKV, *, caching: bool = False) -> Any:
    return pool_class(engine)(engine.allocator.num_blocks, caching, 16)


@needs_vllm
def test_blocks_come_only_from_mapped_pages_and_the_null_block_is_block_0(
    engines: list[EngineKV],
) -> None:
    engine = open_engine(engines, 256)
    pool = make_pool(engine)
    kv = engine.allocator
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    blocks = pool.get_new_blocks(40)
    ids = [b.block_id for b in blocks]
    assert len(set(ids)) == 40 and 0 not in ids
    assert all(b.ref_cnt == 1 for b in blocks)
    stats = kv.stats()
    assert stats.used_blocks == 41  # the null block and the 40
    # Every block handed out is on a mapped page: the allocator refuses nothing of them.
    assert not kv.allocator._pool.unallocated(ids)
    assert stats.mapped_pages >= -(-41 // BLOCKS_PER_PAGE)


@needs_vllm
def test_free_blocks_go_back_to_the_allocator_and_pages_unmap(engines: list[EngineKV]) -> None:
    engine = open_engine(engines, 512)
    pool = make_pool(engine)
    kv = engine.allocator
    available_before = kv.available_blocks()
    blocks = pool.get_new_blocks(200)  # grow: 13 pages
    assert kv.available_blocks() == available_before - 200
    # vLLM's count is what is handed out without waiting: the mapped free blocks.
    assert pool.get_num_free_blocks() == kv.stats().free_blocks
    grown = kv.stats().mapped_pages
    assert grown >= 13
    pool.free_blocks(reversed(blocks))
    assert kv.stats().used_blocks == 1
    # Pages being unmapped count again once unmapped (they are the mapper's meanwhile).
    wait_until(lambda: kv.available_blocks() == available_before, "the budget's room back")
    # Shrink: the reserve keeps at most its high watermark (2 pages) beyond the null block's.
    wait_until(lambda: kv.stats().mapped_pages <= 3, "unmapping the freed pages")
    assert kv.stats().mapped_pages < grown


@needs_vllm
def test_cached_blocks_stay_mapped_for_prefix_reuse_within_their_bound(
    engines: list[EngineKV],
) -> None:
    engine = open_engine(engines, 256, prefix_cache_blocks=5)
    pool = make_pool(engine, caching=True)
    kv = engine.allocator
    blocks = pool.get_new_blocks(8)
    cache_blocks(pool, blocks)
    pool.free_blocks(blocks)
    # Five keep their entry (the last freed, as vLLM evicts the first freed first).
    assert pool.cached_free_queue.num_free_blocks == 5
    assert [b.block_id for b in pool.cached_free_queue.get_all_free_blocks()] == [
        b.block_id for b in blocks[3:]
    ]
    assert kv.stats().used_blocks == 1 + 5
    assert len(pool.cached_block_hash_to_block) == 5
    # A hit takes a cached block back without the allocator.
    pool.touch([blocks[7]])
    assert pool.cached_free_queue.num_free_blocks == 4
    assert pool.reset_prefix_cache() is False  # block 7 is in use
    pool.free_blocks([blocks[7]])
    assert pool.reset_prefix_cache() is True
    assert kv.stats().used_blocks == 1
    assert len(pool.cached_block_hash_to_block) == 0


@needs_vllm
def test_a_free_cached_block_evicted_by_id_goes_back_to_kvasync(
    engines: list[EngineKV],
) -> None:
    # vLLM's evict_blocks (a KV connector's failed load) drops cache entries by block id: a free
    # block then has no entry, and must not keep a prefix-cache slot in vLLM's queue.
    engine = open_engine(engines, 256, prefix_cache_blocks=5)
    pool = make_pool(engine, caching=True)
    kv = engine.allocator
    blocks = pool.get_new_blocks(3)
    cache_blocks(pool, blocks)
    pool.free_blocks(blocks[:2])  # two free and cached, one in use and cached
    assert pool.cached_free_queue.num_free_blocks == 2
    assert kv.stats().used_blocks == 1 + 3
    pool.evict_blocks({blocks[0].block_id, blocks[2].block_id})
    assert [b.block_id for b in pool.cached_free_queue.get_all_free_blocks()] == [
        blocks[1].block_id
    ]
    assert kv.stats().used_blocks == 1 + 2  # block 0 of the three went back; 2 still used
    assert blocks[2].block_hash is None and blocks[2].ref_cnt == 1  # in use: kept, entry gone
    assert len(pool.cached_block_hash_to_block) == 1
    assert pool.get_usage() == usage_by_the_allocator(pool, kv)
    pool.free_blocks([blocks[2]])  # no entry: straight back to kvasync
    assert kv.stats().used_blocks == 1 + 1


def cache_blocks(pool: Any, blocks: list[Any]) -> None:
    """Gives each block a prefix-cache entry, as vLLM's cache_full_blocks does."""
    for block in blocks:
        key = vllm_block_pool.make_block_hash_with_group_id(
            vllm_block_pool.BlockHash(block.block_id.to_bytes(32, "little")), 0
        )
        block.set_block_hash(key, num_tokens=16)
        pool.cached_block_hash_to_block.insert(key, block)


@needs_vllm
def test_an_uncounted_burst_beyond_the_reserve_waits_for_pages_rather_than_evict_prefixes(
    engines: list[EngineKV],
) -> None:
    # vLLM evicts a cached block only when no uncached block is free; the allocator's unmapped
    # blocks are free ones (vLLM's test_hybrid_local_kv_retention_interval_survives_recycling).
    engine = open_engine(engines, 512)
    pool = make_pool(engine, caching=True)
    kv = engine.allocator
    # Requests of 10 blocks: the reserve, sized to the requests it sees, stays a few pages.
    cached = [block for _ in range(20) for block in pool.get_new_blocks(10)]
    cache_blocks(pool, cached)
    pool.free_blocks(cached)
    assert pool.cached_free_queue.num_free_blocks == 200
    burst = 150  # more than the reserve keeps mapped, fewer than the queue holds
    wait_until(lambda: kv.stats().free_blocks < burst, "a reserve smaller than the burst")
    taken = pool.get_new_blocks(burst)
    assert len(taken) == burst
    assert not {b.block_id for b in taken} & {b.block_id for b in cached}
    assert pool.cached_free_queue.num_free_blocks == 200
    assert len(pool.cached_block_hash_to_block) == 200
    assert kv.stats().used_blocks == 1 + 200 + burst


@needs_vllm
def test_cached_prefixes_are_evicted_first_freed_first_for_what_the_limit_lacks(
    engines: list[EngineKV],
) -> None:
    # A limit of 8 pages (128 blocks, the null block's included).
    engine = open_engine(engines, 1024, memory_limit=8 * 64 << 10)
    pool = make_pool(engine, caching=True)
    kv = engine.allocator
    cached = pool.get_new_blocks(100)
    cache_blocks(pool, cached)
    pool.free_blocks(cached)
    room = 8 * BLOCKS_PER_PAGE - 101  # the limit's blocks less the null block and the cached
    wait_until(lambda: kv.available_blocks() == room, "the limit's room counted")
    taken = pool.get_new_blocks(50)
    evicted = 50 - room
    assert [b.block_id for b in taken[room:]] == [b.block_id for b in cached[:evicted]]
    assert pool.cached_free_queue.num_free_blocks == 100 - evicted
    assert len(pool.cached_block_hash_to_block) == 100 - evicted
    assert all(b.block_hash is None and b.ref_cnt == 1 for b in taken)
    assert kv.stats().mapped_pages <= 8


@needs_vllm
def test_an_uncounted_call_that_cannot_be_served_hands_out_nothing_and_keeps_nothing(
    engines: list[EngineKV],
) -> None:
    # vLLM's get_new_blocks takes nothing when it cannot hand out every block. Here the mapped
    # free blocks are taken before the allocator is asked for the rest: when it cannot give
    # them (the limit), those taken must go back, or they are held by nobody, counted used for
    # good (get_usage, reset_prefix_cache).
    engine = open_engine(engines, 1024, memory_limit=8 * 64 << 10)  # 128 blocks, null's included
    pool = make_pool(engine, caching=True)
    kv = engine.allocator
    wait_until(lambda: kv.stats().free_blocks > 0, "mapped free blocks")
    pocketed = 3
    pool.expect(Demand(pocketed, running=False))
    pool.get_num_free_blocks()
    assert pool.num_pocket_blocks == pocketed
    with pytest.raises(OutOfBlocks):
        pool.get_new_blocks(2 * 8 * BLOCKS_PER_PAGE)  # more than the limit ever holds
    assert pool.num_pocket_blocks == pocketed  # the promise still stands
    assert kv.stats().used_blocks == 1 + pocketed
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert pool.get_usage() == 0.0
    assert len(pool.get_new_blocks(pocketed)) == pocketed
    assert pool.num_pocket_blocks == 0


@needs_vllm
def test_free_block_queue_counts_every_free_mapped_block_when_read(
    engines: list[EngineKV],
) -> None:
    # vLLM's own tests hold free_block_queue and read its count after allocations and frees, as
    # in stock vLLM, where it is every free block.
    engine = plugin.host_engine(64, read_settings({"KVASYNC_VLLM": "1"}))  # all pages mapped
    engines.append(engine)
    pool = make_pool(engine, caching=True)
    queue = pool.free_block_queue
    assert queue.num_free_blocks == 63  # all but the null block
    blocks = pool.get_new_blocks(10)
    assert queue.num_free_blocks == 53
    cache_blocks(pool, blocks[:4])
    pool.free_blocks(blocks)  # 4 keep their entry in vLLM's queue, 6 go back to the allocator
    assert pool.cached_free_queue.num_free_blocks == 4
    assert queue.num_free_blocks == 63
    pool.touch([blocks[0]])  # a prefix hit: vLLM's touch takes it out through the view
    assert pool.cached_free_queue.num_free_blocks == 3
    assert queue.num_free_blocks == 62 == pool.get_num_free_blocks()
    # Blocks promised to a counted allocation are still free to vLLM until it takes them.
    pool.expect(Demand(5, running=False))
    pool.get_num_free_blocks()
    assert pool.num_pocket_blocks == 5
    assert queue.num_free_blocks == 62
    pool.get_new_blocks(5)
    assert queue.num_free_blocks == 57
    # Taking or putting blocks through the view is refused, saying why.
    with pytest.raises(NotImplementedError, match="get_new_blocks"):
        queue.popleft_n(1)
    with pytest.raises(NotImplementedError, match="get_new_blocks"):
        queue.prepend_n([])


def walk(queue: Any) -> tuple[list[int], list[int]]:
    """The block ids of the list from its head forward, and from its tail backward."""
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    forward, backward = [], []
    block = head.next_free_block
    while block is not tail:
        forward.append(block.block_id)
        block = block.next_free_block
    block = tail.prev_free_block
    while block is not head:
        backward.append(block.block_id)
        block = block.prev_free_block
    return forward, backward


@needs_vllm
def test_free_block_queue_lists_every_free_block_in_the_order_they_are_handed_out(
    engines: list[EngineKV],
) -> None:
    engine = plugin.host_engine(64, read_settings({"KVASYNC_VLLM": "1"}))  # all pages mapped
    engines.append(engine)
    pool = make_pool(engine, caching=True)
    queue = pool.free_block_queue
    fresh = list(range(1, 64))  # the allocator's, lowest first; the null block is not free
    assert walk(queue) == (fresh, fresh[::-1])
    assert [b.block_id for b in queue.get_all_free_blocks()] == fresh
    blocks = pool.get_new_blocks(12)
    cache_blocks(pool, blocks[6:9])
    pool.free_blocks(blocks[:9])  # 3 keep their entry, 6 go back to the allocator
    pool.expect(Demand(2, running=False))
    pool.get_num_free_blocks()  # 2 promised: the pocket, handed out first
    pocket = pool._pocket[:]
    listed = [b.block_id for b in queue.get_all_free_blocks()]
    assert len(listed) == len(set(listed)) == queue.num_free_blocks == 63 - 3 - 2 + 2
    assert listed[:2] == pocket
    assert listed[-3:] == [b.block_id for b in blocks[6:9]]  # cached: first freed, first evicted
    forward, backward = walk(queue)
    assert forward == listed and backward == listed[::-1]
    # vLLM's own queue of cached blocks is untouched by the list around it.
    assert pool.cached_free_queue.num_free_blocks == 3
    handed = pool.get_new_blocks(len(listed))
    assert [b.block_id for b in handed] == listed
    assert all(b.prev_free_block is None and b.next_free_block is None for b in handed)
    # Nothing free: the sentinels link to each other, as vLLM's empty queue's do.
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head
    assert queue.get_all_free_blocks() == []
    pool.free_blocks(handed + blocks[9:])


@needs_vllm
def test_a_prefix_hit_while_the_free_list_is_linked_keeps_vllms_queue_whole(
    engines: list[EngineKV],
) -> None:
    engine = plugin.host_engine(64, read_settings({"KVASYNC_VLLM": "1"}))  # all pages mapped
    engines.append(engine)
    pool = make_pool(engine, caching=True)
    queue = pool.free_block_queue
    blocks = pool.get_new_blocks(6)
    cache_blocks(pool, blocks[:3])
    pool.free_blocks(blocks)
    cached = [b.block_id for b in blocks[:3]]
    listed = [b.block_id for b in queue.get_all_free_blocks()]  # links the allocator's blocks
    assert listed[-3:] == cached and len(listed) == 63
    pool.touch([blocks[0]])  # vLLM's touch removes the hit through the view
    assert [b.block_id for b in pool.cached_free_queue.get_all_free_blocks()] == cached[1:]
    assert pool.cached_free_queue.num_free_blocks == 2
    assert walk(queue)[0] == [i for i in listed if i != cached[0]]
    # A "hit" on one of the allocator's free blocks (it has no entry) is refused, naming it.
    allocators = walk(queue)[0][0]
    with pytest.raises(RuntimeError, match=f"block {allocators} is a free block of kvasync"):
        pool.touch([pool.blocks[allocators]])
    assert pool.cached_free_queue.num_free_blocks == 2
    # vLLM's evict_blocks of the allocator's free blocks: not in vLLM's queue, nothing to drop.
    walk(queue)
    pool.evict_blocks({listed[0], listed[1]})
    assert pool.cached_free_queue.num_free_blocks == 2
    assert engine.allocator.stats().used_blocks == 1 + 1 + 2  # null, the hit, the cached
    pool.free_blocks([blocks[0]])
    assert [b.block_id for b in queue.get_all_free_blocks()][-3:] == cached[1:] + cached[:1]


@needs_vllm
def test_free_block_queue_counts_no_unmapped_room(engines: list[EngineKV]) -> None:
    engine = open_engine(engines, 256)  # a reserve of 1-2 pages: most blocks unmapped
    pool = make_pool(engine, caching=True)
    kv = engine.allocator
    taken = pool.get_new_blocks(40)
    pool.free_blocks(taken[20:])
    wait_until(lambda: kv.stats().inflight_pages == 0, "the mapper settled")
    stats = kv.stats()
    assert stats.mapped_pages * BLOCKS_PER_PAGE < 256
    # Mapped blocks less those in use (the null block and 20): free and mapped now.
    assert pool.free_block_queue.num_free_blocks == stats.mapped_pages * BLOCKS_PER_PAGE - 21


@needs_vllm
def test_freed_and_unused_blocks_are_handed_out_again_in_vllms_order(
    engines: list[EngineKV],
) -> None:
    # vLLM puts the blocks it frees without a prefix-cache entry at the head of its queue, first
    # given first out; blocks counted for an allocation but not taken never left that queue.
    engine = plugin.host_engine(64, read_settings({"KVASYNC_VLLM": "1"}))  # all pages mapped
    engines.append(engine)
    pool = make_pool(engine, caching=True)
    first = pool.get_new_blocks(3)
    assert [b.block_id for b in first] == [1, 2, 3]
    pool.expect(Demand(4, running=False))
    pool.get_num_free_blocks()
    second = pool.get_new_blocks(1)  # one of the four counted: three stay in the pocket
    assert [b.block_id for b in second] == [4] and pool.num_pocket_blocks == 3
    pool.free_blocks([second[0], *reversed(first)])  # as vLLM frees: the last block first
    assert pool.num_pocket_blocks == 0  # idle
    assert [b.block_id for b in pool.get_new_blocks(8)] == [4, 3, 2, 1, 5, 6, 7, 8]


def make_request(request_id: str, tokens: int, first_token: int = 0) -> Any:
    params = SamplingParams(max_tokens=17)
    params.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(first_token, first_token + tokens)),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(16, sha256),
    )


def allocate_when_mapped(manager: Any, request: Any, tokens: int) -> Any:
    """``allocate_slots`` step after step, as vLLM's scheduler retries a miss, until the pages
    the misses asked the mapper for are mapped (with a deadline)."""
    blocks: list[Any] = []

    def allocated() -> bool:
        blocks[:] = [manager.allocate_slots(request, tokens)]
        return blocks[0] is not None

    wait_until(allocated, f"allocating {tokens} tokens for {request.request_id}")
    return blocks[0]


def make_manager(monkeypatch: pytest.MonkeyPatch, engine: EngineKV, *, caching: bool) -> Any:
    init_none_hash(sha256)
    monkeypatch.setattr(vllm_coordinator, "BlockPool", pool_class(engine))
    coordinator = vllm_coordinator.KVCacheCoordinator
    monkeypatch.setattr(
        coordinator,
        "get_num_blocks_to_allocate",
        counting_demand(coordinator.get_num_blocks_to_allocate),
    )
    config = KVCacheConfig(
        num_blocks=engine.allocator.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=4096,
        enable_caching=caching,
        hash_block_size=16,
        scheduler_block_size=16,
    )


@needs_vllm
def test_a_budget_shortage_is_a_scheduling_miss_and_preempting_frees_room(
    monkeypatch: pytest.MonkeyPatch, engines: list[EngineKV]
) -> None:
    # Capacity of 1024 blocks, but a limit of 4 pages (64 blocks), the null block's included.
    engine = open_engine(engines, 1024, memory_limit=4 * 64 << 10)
    manager = make_manager(monkeypatch, engine, caching=False)
    first, second = make_request("a", 40 * 16), make_request("b", 40 * 16)
    allocate_when_mapped(manager, first, 40 * 16)  # beyond the reserve: a step's misses
    outcome: list[Any] = []
    worker = threading.Thread(target=lambda: outcome.append(manager.allocate_slots(second, 640)))
    worker.start()
    worker.join(DEADLINE)
    assert not worker.is_alive(), "allocate_slots hung on a budget shortage"
    assert outcome == [None]  # a miss: vLLM keeps it waiting, or preempts
    assert engine.allocator.stats().mapped_pages <= 4
    manager.free(first)  # what vLLM's preemption does
    assert manager.allocate_slots(second, 640) is not None
    assert engine.allocator.stats().used_blocks == 1 + 40


@needs_vllm
def test_requests_grow_and_shrink_through_vllms_manager(
    monkeypatch: pytest.MonkeyPatch, engines: list[EngineKV]
) -> None:
    engine = open_engine(engines, 2048)
    manager = make_manager(monkeypatch, engine, caching=True)
    kv = engine.allocator
    requests = [make_request(str(i), 300 + i) for i in range(8)]
    for request in requests:
        allocate_when_mapped(manager, request, request.num_tokens)
    held = sum(len(manager.get_block_ids(r.request_id)[0]) for r in requests)
    assert kv.stats().used_blocks >= 1 + held
    assert kv.stats().mapped_pages >= -(-held // BLOCKS_PER_PAGE)
    for request in requests:
        manager.free(request)
    # Prompts of distinct tokens: their full blocks are cached (no bound given), the partial
    # last blocks went back.
    assert kv.stats().used_blocks == 1 + manager.block_pool.cached_free_queue.num_free_blocks
    assert manager.block_pool.num_pocket_blocks == 0  # idle: nothing promised is kept
    assert manager.reset_prefix_cache()
    assert kv.stats().used_blocks == 1
    wait_until(lambda: kv.stats().mapped_pages <= 3, "unmapping after the requests ended")


def usage_by_the_allocator(pool: Any, kv: Any) -> float:
    """vLLM's usage as the allocator's stats say it: blocks requests and the prefix cache hold
    (used less the null block and the pocket) over those and what the budget still allows.

    Read once the mapper is idle: a page on its way in or out moves ``available_blocks``
    between two reads."""
    wait_until(
        lambda: kv.stats().inflight_pages == 0 and kv.stats().queued_jobs == 0,
        "the mapper settled",
    )
    used = kv.stats().used_blocks - 1
    return (used - pool.num_pocket_blocks) / (used + kv.available_blocks())


@needs_vllm
def test_usage_is_what_the_allocator_says_requests_and_the_prefix_cache_hold(
    monkeypatch: pytest.MonkeyPatch, engines: list[EngineKV]
) -> None:
    # The pool counts the blocks it takes and gives back, so that the per-step usage needs no
    # stats snapshot: the count must be the allocator's through every path.
    engine = open_engine(engines, 1024, prefix_cache_blocks=20)
    manager = make_manager(monkeypatch, engine, caching=True)
    pool, kv = manager.block_pool, engine.allocator
    assert usage_by_the_allocator(pool, kv) == pool.get_usage() == 0.0
    requests = [make_request(str(i), 200 + 30 * i, first_token=500 * i) for i in range(6)]
    for request in requests:
        allocate_when_mapped(manager, request, request.num_tokens)
        assert usage_by_the_allocator(pool, kv) == pool.get_usage()

    def promised() -> bool:  # counted, as vLLM retries a miss, until the mapper has the pages
        pool.expect(Demand(7, running=False))
        pool.get_num_free_blocks()
        return bool(pool.num_pocket_blocks == 7)

    wait_until(promised, "7 blocks promised")  # promised, not yet taken: free, not used
    assert usage_by_the_allocator(pool, kv) == pool.get_usage() > 0.0
    for request in requests:  # full blocks cached up to the bound, the rest given back
        manager.free(request)
        assert usage_by_the_allocator(pool, kv) == pool.get_usage()
    assert pool.cached_free_queue.num_free_blocks == 20
    assert manager.reset_prefix_cache()
    assert usage_by_the_allocator(pool, kv) == pool.get_usage() == 0.0


@needs_vllm
def test_a_count_of_no_block_reads_the_room_once_a_step_and_again_after_the_pool_moves_blocks(
    engines: list[EngineKV],
) -> None:
    # Every running request is counted every step, nearly always for no block: the step's first
    # such count reads the allocator's room and the later ones reuse it, until the pool
    # allocates or frees or the step ends (Note [Count only what is mapped]).
    engine = open_engine(engines, 1024, memory_limit=16 * 64 << 10)  # 16 pages of 16 blocks
    pool = make_pool(engine)
    kv = engine.allocator

    def nothing_to_allocate(
        self: Any,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        return 0

    count = counting_demand(nothing_to_allocate)

    class Coordinator:  # what the count sees of vLLM's coordinator: its pool
        block_pool = pool

    def count_of_no_block() -> int:
        """``allocate_slots``' two calls for a running request that needs no block."""
        assert count(Coordinator(), "r", 32, (), 0, 31, 31, 32) == 0
        return int(pool.get_num_free_blocks())

    held = pool.get_new_blocks(10)
    pool.take_events()  # a step's end, as update_from_output takes the events
    room = kv.available_blocks()
    assert count_of_no_block() == room  # caching off: no cached block queued
    kv.resize(memory_limit=8 * 64 << 10, timeout=DEADLINE)  # another thread's, mid-step
    lowered = kv.available_blocks()
    assert 0 < lowered < room
    assert count_of_no_block() == room  # the step's room, as if lowered at its end
    pool.take_events()
    assert count_of_no_block() == lowered
    pool.free_blocks(held[6:])  # the pool frees: the room is read afresh
    assert count_of_no_block() == kv.available_blocks() == lowered + 4
    pool.expect(Demand(2, running=True))  # a count of blocks takes them: read afresh after
    assert pool.get_num_free_blocks() == 2 + kv.available_blocks()
    pool.get_new_blocks(2)
    assert count_of_no_block() == kv.available_blocks() == lowered + 2


def test_the_count_reads_its_arguments_in_either_checked_signature() -> None:
    # vLLM 0.26's signature is passed on as it is; 0.33's (prefill_end added) is read by name.
    def stock_026(
        self: Any,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        self.calls.append((num_tokens, apply_admission_cap))
        return int(num_tokens // 16)

    def stock_033(
        self: Any,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int | None = None,
    ) -> int:
        self.calls.append((num_tokens, apply_admission_cap, prefill_end))
        return int(num_tokens // 16)

    class Demands:
        """A coordinator's block pool as the count sees it: what it was told."""

        def __init__(self) -> None:
            self.told: list[Demand] = []
            self.expect = self.told.append

    class Coordinator:
        def __init__(self) -> None:
            self.block_pool = Demands()
            self.calls: list[tuple[Any, ...]] = []

    for stock in (stock_026, stock_033):
        count = counting_demand(stock)
        coordinator = Coordinator()
        by_keyword = dict(
            request_id="r",
            new_computed_blocks=(),
            num_encoder_tokens=0,
            total_computed_tokens=32,
            num_tokens_main_model=64,
        )
        assert count(coordinator, num_tokens=64, num_local_computed_tokens=32, **by_keyword) == 4
        assert count(coordinator, "r", 8, (), 0, 0, 0, 8) == 0
        assert count(coordinator, "r", 48, (), 0, 0, 16, 48, True) == 3
        assert (
            count(
                coordinator,
                num_tokens=32,
                num_local_computed_tokens=0,
                apply_admission_cap=False,
                **by_keyword,
            )
            == 2
        )
        # Running: computed tokens before, no new prefix hit, not an admission check.
        assert coordinator.block_pool.told == [
            Demand(4, True),
            Demand(0, False),
            Demand(3, False),
            Demand(2, False),
        ]
        defaults = (False,) if stock is stock_026 else (False, None)
        assert [call[1:] for call in coordinator.calls] == [
            defaults,
            defaults,
            (True, *defaults[1:]),
            defaults,
        ]
    # A coordinator whose pool is not kvasync's is counted for as stock counts, and told nothing.
    plain = Coordinator()
    plain.block_pool = object()  # type: ignore[assignment]
    assert counting_demand(stock_026)(plain, "r", 64, (), 0, 32, 32, 64) == 4


def open_faulty_engine(engines: list[EngineKV], num_blocks: int, faults: Any) -> EngineKV:
    """host_engine's allocator with a small reserve and ``faults`` in its mapper thread."""
    layout = KVLayout(1, 1, 256, 16, dtype=torch.int8, kv_buffers=1)
    config = Config(
        backend="host",
        max_blocks=num_blocks,
        page_size=64 << 10,
        reserve_pages=(1, 2),
        faults=faults,
    )
    kv = open_allocator_sync(layout, config)
    hold_null_block(kv, DEADLINE)
    engine = EngineKV(allocator=kv, owned=True)
    engines.append(engine)
    return engine


def fill_prefix_cache(manager: Any, requests: int, blocks: int) -> None:
    """Runs ``requests`` prompts of ``blocks`` full blocks each and frees them: their blocks
    stay in vLLM's queue with their prefix-cache entries."""
    for i in range(requests):
        request = make_request(f"cached-{i}", blocks * 16, first_token=1000 * (i + 1))
        allocate_when_mapped(manager, request, blocks * 16)
        manager.free(request)


def allocate_in_thread(manager: Any, request: Any, tokens: int) -> Any:
    """``allocate_slots`` on another thread, failing the test if it does not return in time."""
    outcome: list[Any] = []
    worker = threading.Thread(
        target=lambda: outcome.append(manager.allocate_slots(request, tokens))
    )
    worker.start()
    worker.join(DEADLINE)
    assert not worker.is_alive(), "allocate_slots waited for the mapper (a stall of the step)"
    assert len(outcome) == 1, "allocate_slots raised"
    return outcome[0]


@needs_vllm
def test_a_burst_beyond_the_reserve_is_a_miss_that_maps_ahead_and_evicts_no_prefix(
    monkeypatch: pytest.MonkeyPatch, engines: list[EngineKV]
) -> None:
    from kvasync.testing import FaultInjector

    faults = FaultInjector()
    engine = open_faulty_engine(engines, 512, faults)
    manager = make_manager(monkeypatch, engine, caching=True)
    pool, kv = manager.block_pool, engine.allocator
    fill_prefix_cache(manager, 10, 10)
    assert pool.cached_free_queue.num_free_blocks == 100
    burst = 150  # more than the reserve keeps mapped, fewer than the queue holds
    wait_until(lambda: kv.stats().free_blocks < burst, "a reserve smaller than the burst")
    faults.hang()  # the mapper cannot map: a step that waited for it would not return
    request = make_request("burst", burst * 16, first_token=50_000)
    assert allocate_in_thread(manager, request, burst * 16) is None  # a miss, at once
    wait_until(lambda: faults.hung_maps > 0, "the mapper mapping ahead for the miss")
    assert pool.cached_free_queue.num_free_blocks == 100  # no prefix dropped for a wait
    assert len(pool.cached_block_hash_to_block) == 100
    assert pool.num_map_ahead_misses >= 1
    faults.release()
    # The next step finds the pages the miss asked for, and still evicts nothing.
    allocate_when_mapped(manager, request, burst * 16)
    assert pool.cached_free_queue.num_free_blocks == 100
    assert kv.stats().used_blocks == 1 + 100 + burst


@needs_vllm
def test_a_running_request_takes_cached_blocks_rather_than_be_preempted_while_pages_map(
    monkeypatch: pytest.MonkeyPatch, engines: list[EngineKV]
) -> None:
    from kvasync.testing import FaultInjector

    faults = FaultInjector()
    engine = open_faulty_engine(engines, 512, faults)
    manager = make_manager(monkeypatch, engine, caching=True)
    pool, kv = manager.block_pool, engine.allocator
    running = make_request("running", 64 * 16, first_token=70_000)
    allocate_when_mapped(manager, running, 16 * 16)
    running.num_computed_tokens = 16 * 16  # the step ran, as the scheduler records it
    fill_prefix_cache(manager, 10, 10)
    wait_until(lambda: kv.stats().free_blocks < 48, "a reserve smaller than the chunk")
    faults.hang()
    blocks = allocate_in_thread(manager, running, 48 * 16)
    assert blocks is not None  # not a miss: vLLM would preempt a running request for one
    mapped = 48 - pool.num_lag_evictions
    assert pool.cached_free_queue.num_free_blocks == 100 - pool.num_lag_evictions
    assert 0 < pool.num_lag_evictions <= 48 and mapped >= 0
    assert len(manager.get_block_ids("running")[0]) == 64
    faults.release()


@needs_vllm
def test_a_failing_map_after_the_count_is_a_miss_not_an_error(
    monkeypatch: pytest.MonkeyPatch, engines: list[EngineKV]
) -> None:
    from kvasync.testing import FaultInjector

    faults = FaultInjector()
    engine = open_faulty_engine(engines, 512, faults)
    manager = make_manager(monkeypatch, engine, caching=False)
    kv = engine.allocator
    wait_until(lambda: 0 < kv.stats().free_blocks < 100, "the reserve mapped, and small")
    faults.fail(10_000)  # every map fails as the driver's out-of-memory
    request = make_request("big", 100 * 16)
    for _ in range(3):  # each step's count asks the mapper again; each is a miss
        assert allocate_in_thread(manager, request, 100 * 16) is None
    wait_until(lambda: kv.stats().map_errors > 0, "the mapper's failure")
    assert "ENOMEM" in kv.stats().last_error
    faults.release()
    allocate_when_mapped(manager, request, 100 * 16)
    assert kv.stats().used_blocks == 1 + 100


def test_the_null_block_is_refused_from_an_allocator_in_use() -> None:
    layout = KVLayout(1, 1, 256, 16, dtype=torch.int8, kv_buffers=1)
    config = Config(backend="host", max_blocks=256, page_size=64 << 10, reserve_pages=(0, 0))
    with open_allocator_sync(layout, config) as kv:
        held = kv.alloc(1, timeout=DEADLINE)
        assert held == [0]
        with pytest.raises(RuntimeError, match="null block"):
            hold_null_block(kv, DEADLINE)
        assert kv.stats().used_blocks == 1  # what it took on the way is given back
        with pytest.raises(OutOfBlocks):
            kv.alloc_nowait(257)


def kv_cache_config(sizes: list[int], num_blocks: int, block_size: int = 16, **tensor: Any) -> Any:
    """vLLM's KVCacheConfig as plain data: one KVCacheTensor per layer."""
    from types import SimpleNamespace

    tensors = [
        SimpleNamespace(size=size, shared_by=[f"layer.{i}"], **tensor)
        for i, size in enumerate(sizes)
    ]
    spec = SimpleNamespace(block_size=block_size)
    group = SimpleNamespace(
        kv_cache_spec=spec, layer_names=[f"layer.{i}" for i in range(len(sizes))]
    )
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=[group])


def test_the_layout_puts_each_vllm_block_at_the_same_bytes() -> None:
    from kvasync.integrations.vllm._worker import kv_layout_for

    # Llama-1B: 16 layers, a block of 16 tokens x 8 heads x 64 x bf16 x (K, V) = 32 KiB a layer.
    block = 16 * 8 * 64 * 2 * 2
    layout = kv_layout_for(kv_cache_config([1000 * block] * 16, 1000))
    assert layout.num_ranges == 16
    assert layout.range_block_bytes == block
    assert layout.block_size == 16


def test_a_kv_cache_it_cannot_lay_out_is_refused_naming_why() -> None:
    from kvasync.integrations.vllm._worker import kv_layout_for

    with pytest.raises(ValueError, match="block_stride"):
        kv_layout_for(kv_cache_config([4096] * 2, 1, block_stride=4096))
    with pytest.raises(ValueError, match="one size"):
        kv_layout_for(kv_cache_config([4096, 8192], 1))
    with pytest.raises(ValueError, match="whole blocks"):
        kv_layout_for(kv_cache_config([4097], 2))


# -- workers in their own processes: the tensor-parallel group --------------------------------

# A worker process of the multiprocess executor, on the host backend: it joins the group as a
# rank (open_rank_tensors) and writes the blocks it is told to through its KV views (a block on a
# page it has not mapped faults: the process dies).
RANK_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
from kvasync import _core
from kvasync._backends import range_tensor
from kvasync.integrations.vllm._ranks import open_rank_tensors

group, rank, blocks, layers, block_bytes, timeout = sys.argv[1:7]
blocks, layers, block_bytes = int(blocks), int(layers), int(block_bytes)
config = SimpleNamespace(
    num_blocks=blocks,
    kv_cache_tensors=[
        SimpleNamespace(size=blocks * block_bytes, shared_by=[f"layer.{i}"]) for i in range(layers)
    ],
    kv_cache_groups=[
        SimpleNamespace(
            kv_cache_spec=SimpleNamespace(block_size=16),
            layer_names=[f"layer.{i}" for i in range(layers)],
        )
    ],
)
try:
    ranked = open_rank_tensors(
        config, rank=int(rank), group=group, range_tensor=range_tensor, timeout=float(timeout),
        make_backend=lambda ranges, pages, size: _core.HostBackend(ranges, pages, size),
    )
except Exception as error:
    print(json.dumps({"error": str(error)}), flush=True)
    sys.exit(0)
views = list(ranked.tensors.values())
zero = all(bool((v[:block_bytes] == 0).all()) for v in views)
print(json.dumps({"joined": True, "null_block_zero": zero}), flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    if ask["op"] == "write":
        for view in views:
            for b in ask["blocks"]:
                view[b * block_bytes : (b + 1) * block_bytes].fill_(ask["value"])
        print(json.dumps({"written": len(ask["blocks"])}), flush=True)
    elif ask["op"] == "pages":
        print(json.dumps({"pages": ranked.mapper.mapped_page_ids()}), flush=True)
ranked.close()
"""
RANK_BLOCKS, RANK_LAYERS, RANK_BLOCK_BYTES = 256, 2, 4096  # 16 blocks a 64 KiB page


class RankProcess:
    """A rank's process spoken to by JSON lines, every read bounded by a deadline."""

    def __init__(self, group: str, rank: int, timeout: float = 30.0) -> None:
        import subprocess
        import sys

        self.popen = subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK_SCRIPT,
                group,
                str(rank),
                str(RANK_BLOCKS),
                str(RANK_LAYERS),
                str(RANK_BLOCK_BYTES),
                str(timeout),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._buffer = ""

    def read(self, timeout: float = 60.0) -> dict[str, Any]:
        import json
        import os
        import select

        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.popen.stdout.fileno()
        while "\n" not in self._buffer:
            left = deadline - time.monotonic()
            assert left > 0, f"rank process {self.popen.pid} said nothing within {timeout} s"
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536).decode()
                assert chunk, f"rank process {self.popen.pid} exited (rc {self.popen.poll()})"
                self._buffer += chunk
        line, self._buffer = self._buffer.split("\n", 1)
        event: dict[str, Any] = json.loads(line)
        return event

    def ask(self, **command: Any) -> dict[str, Any]:
        import json

        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(command) + "\n")
        self.popen.stdin.flush()
        return self.read()

    def kill(self) -> None:
        import signal

        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=DEADLINE)

    def stop(self) -> None:
        import subprocess

        assert self.popen.stdin is not None
        with contextlib.suppress(OSError):
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            self.kill()
        assert self.popen.stdout is not None
        self.popen.stdout.close()


@pytest.fixture
def rank_processes() -> Iterator[list[RankProcess]]:
    started: list[RankProcess] = []
    yield started
    for process in started:
        process.stop()


def open_group_engine(
    engines: list[EngineKV], num_ranks: int, *, map_timeout: float = 5.0
) -> tuple[EngineKV, str]:
    """The EngineCore's allocator of a fresh group of ``num_ranks`` rank processes."""
    import uuid

    from kvasync.integrations.vllm._ranks import open_scheduler_engine

    group = f"test-vllm-{uuid.uuid4().hex[:12]}"
    config = kv_cache_config([RANK_BLOCKS * RANK_BLOCK_BYTES] * RANK_LAYERS, RANK_BLOCKS)
    engine = open_scheduler_engine(
        [config] * num_ranks,
        num_ranks=num_ranks,
        settings=read_settings({"KVASYNC_VLLM": "1"}),
        name="test",
        reserve=(1, 2),
        page_size=64 << 10,
        group=group,
        map_timeout=map_timeout,
    )
    engines.append(engine)
    return engine, group


def test_tensor_parallel_worker_processes_map_every_block_the_engine_hands_out(
    engines: list[EngineKV], rank_processes: list[RankProcess]
) -> None:
    from kvasync.integrations.vllm._ranks import NullBlockHolder

    engine, group = open_group_engine(engines, 2)
    kv = engine.allocator
    holder = NullBlockHolder(kv, timeout=60.0)  # while the workers join, as in vLLM's RPC
    rank_processes.extend(RankProcess(group, rank) for rank in range(2))
    for process in rank_processes:
        assert process.read() == {"joined": True, "null_block_zero": True}
    holder.wait()
    assert kv.stats().used_blocks == 1  # block 0, the null block, mapped on both ranks
    blocks = kv.alloc(100, timeout=DEADLINE)  # 7 pages: an alloc completes once all mapped
    for process in rank_processes:  # a block on a page a rank has not mapped would kill it
        assert process.ask(op="write", blocks=blocks, value=7) == {"written": 100}
    pages = {b * RANK_BLOCK_BYTES // (64 << 10) for b in [0, *blocks]}
    for process in rank_processes:
        assert pages <= set(process.ask(op="pages")["pages"])
    kv.free(blocks)
    kv.trim(timeout=DEADLINE)  # every free page unmapped, on every rank
    for process in rank_processes:
        assert process.ask(op="pages")["pages"] == [0]


def test_a_tensor_parallel_rank_that_never_starts_fails_the_engine_start_naming_it(
    engines: list[EngineKV], rank_processes: list[RankProcess]
) -> None:
    from kvasync import KVAsyncError
    from kvasync.integrations.vllm._ranks import NullBlockHolder

    engine, group = open_group_engine(engines, 2, map_timeout=0.5)
    holder = NullBlockHolder(engine.allocator, timeout=3.0)
    rank_processes.append(RankProcess(group, 0, timeout=3.0))  # rank 1 never starts
    with pytest.raises(KVAsyncError, match=r"(rank|ranks 0,) 1 never joined"):
        holder.wait()
    assert "null block's page was not mapped" in rank_processes[0].read()["error"]


def test_a_broken_tensor_parallel_group_ends_the_null_block_wait_without_spinning(
    engines: list[EngineKV], rank_processes: list[RankProcess]
) -> None:
    # Review: once a rank had left, the holder retried the null block's map (which then fails at
    # once) in a tight loop until its deadline: 69,857 failed maps in 3 s, a minute of a spinning
    # core before the engine's start failed.
    from kvasync import KVAsyncError
    from kvasync.integrations.vllm._ranks import NullBlockHolder

    engine, group = open_group_engine(engines, 2, map_timeout=0.5)
    # A deadline far past what the group's break takes, so that the bound below tells the break
    # from the deadline on a loaded machine too (10 s against a 20 s deadline failed 3 times in
    # 11 at a load of 12-18 on 2 cores, where spawning the rank alone took seconds).
    holder = NullBlockHolder(engine.allocator, timeout=90.0)
    # Rank 1 joins, waits 1 s for the null block, gives up and leaves; rank 0 never starts.
    rank_processes.append(RankProcess(group, 1, timeout=1.0))
    started = time.monotonic()
    with pytest.raises(KVAsyncError, match="must be reopened"):
        holder.wait()
    assert time.monotonic() - started < 60.0  # ended by the group's break, not the 90 s deadline
    assert "null block's page was not mapped" in rank_processes[0].read()["error"]


@needs_vllm
def test_a_killed_tensor_parallel_rank_makes_allocations_misses_not_hangs(
    monkeypatch: pytest.MonkeyPatch,
    engines: list[EngineKV],
    rank_processes: list[RankProcess],
) -> None:
    from kvasync.integrations.vllm._ranks import NullBlockHolder

    engine, group = open_group_engine(engines, 2)
    holder = NullBlockHolder(engine.allocator, timeout=60.0)
    rank_processes.extend(RankProcess(group, rank) for rank in range(2))
    for process in rank_processes:
        assert process.read()["joined"]
    holder.wait()
    manager = make_manager(monkeypatch, engine, caching=False)
    first = make_request("first", 20 * 16)
    allocate_when_mapped(manager, first, 20 * 16)
    rank_processes[1].kill()  # kill -9, as a crashed worker
    request = make_request("after", 200 * 16)  # beyond the mapped reserve: needs maps
    for _ in range(3):
        assert allocate_in_thread(manager, request, 200 * 16) is None
    wait_until(lambda: "rank 1" in engine.allocator.stats().last_error, "the dead rank named")
    assert len(manager.get_block_ids("first")[0]) == 20  # what was mapped stays served


@needs_vllm
def test_the_executor_decides_where_the_engines_allocator_lives_and_others_are_refused() -> None:
    from types import SimpleNamespace

    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor

    def executor(kind: type[Any], nnodes: int = 1, pipeline: int = 1) -> Any:
        made = object.__new__(kind)  # vLLM's own class; its __init__ starts workers on a GPU
        made.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(nnodes=nnodes, pipeline_parallel_size=pipeline)
        )
        return made

    assert plugin.executor_kind(executor(UniProcExecutor)) == "uni"
    assert plugin.executor_kind(executor(MultiprocExecutor)) == "mp"
    with pytest.raises(plugin.UnsupportedVLLM, match="ExecutorWithExternalLauncher"):
        plugin.executor_kind(executor(ExecutorWithExternalLauncher))
    with pytest.raises(plugin.UnsupportedVLLM, match="one node"):
        plugin.executor_kind(executor(MultiprocExecutor, nnodes=2))
    with pytest.raises(plugin.UnsupportedVLLM, match="pipeline_parallel_size=2"):
        plugin.executor_kind(executor(MultiprocExecutor, pipeline=2))
    # The worker's side agrees for every way vLLM takes the multiprocess executor: its name, its
    # class, a subclass (review: the worker compared with "mp" only, so an executor class made
    # the EngineCore open a group no worker joined, and the start failed after 60 s).
    MyExecutor = type("MyExecutor", (MultiprocExecutor,), {})
    for backend in ("mp", MultiprocExecutor, MyExecutor):
        assert plugin.workers_in_own_processes(backend), backend
        assert (
            plugin.executor_kind(
                executor(backend if isinstance(backend, type) else MultiprocExecutor)
            )
            == "mp"
        )
    for backend in ("uni", None, UniProcExecutor, "ray"):
        assert not plugin.workers_in_own_processes(backend), backend


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or _core.cuda_problem(0) is not None,
    reason="needs an NVIDIA GPU with a CUDA driver",
)
def test_a_tensor_parallel_ranks_unmap_waits_for_its_own_running_kernels() -> None:
    from kvasync._backends import range_tensor

    page = _core.cuda_granularity(0)
    backend = _core.CudaBackend(0, 1, 4, page, 0, 0.95)
    backend.sync_before_unmap = True  # as rank_kv_cache_tensors sets it
    _core.backend_time_map(backend, 0, 1)
    view = range_tensor(backend, 0)[:page]
    torch.cuda._sleep(1000)  # the kernel loaded: the next launch is the spin alone
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(0.3 * 10_000_000 / (start.elapsed_time(end) / 1000))
    torch.cuda._sleep(cycles)  # about 0.3 s of GPU work, then a write to the page
    view.fill_(1)
    done = torch.cuda.Event()
    done.record()
    assert not done.query()  # still running when the scheduler's unmap comes
    _core.backend_time_unmap(backend, 0, 1)
    assert done.query()  # the unmap waited for it, rather than pull the page from under it


def _gpu_spin_cycles(seconds: float) -> int:
    """Cycles of torch.cuda._sleep that keep the GPU busy about ``seconds``."""
    torch.cuda._sleep(1000)  # the kernel loaded: the next launch is the spin alone
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(seconds * 10_000_000 / (start.elapsed_time(end) / 1000))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or _core.cuda_problem(0) is not None,
    reason="needs an NVIDIA GPU with a CUDA driver",
)
def test_a_ranks_unmap_gives_up_at_its_deadline_while_work_on_another_stream_runs() -> None:
    # Note [Bounded device sync]: the wait for the process's device work has a deadline (the
    # first version called cuCtxSynchronize on the mapper's thread: a stuck kernel parked the
    # rank's mapper, and every job behind it, for ever). Work on a stream of its own counts too.
    from kvasync import KVAsyncError
    from kvasync._backends import range_tensor

    page = _core.cuda_granularity(0)
    backend = _core.CudaBackend(0, 1, 4, page, 0, 0.95)
    backend.sync_before_unmap = True
    with pytest.raises(ValueError, match="unmap_sync_timeout"):
        backend.unmap_sync_timeout = 0.0
    backend.unmap_sync_timeout = 0.2
    _core.backend_time_map(backend, 0, 1)
    view = range_tensor(backend, 0)[:page]
    cycles = _gpu_spin_cycles(1.5)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)  # about 1.5 s of GPU work, then a write to the page
        view.fill_(1)
        done = torch.cuda.Event()
        done.record()
    assert not done.query()
    started = time.monotonic()
    with pytest.raises(KVAsyncError, match="Bounded device sync"):
        _core.backend_time_unmap(backend, 0, 1)
    assert time.monotonic() - started < 1.0  # the deadline, not the kernel's end
    assert not done.query()  # given up while the work still ran: the page stayed mapped
    done.synchronize()
    assert bool((view == 1).all())  # the write landed in the page that stayed mapped
    _core.backend_time_unmap(backend, 0, 1)  # once the work is done, the unmap goes through
