"""kvasync's SGLang plugin against SGLang's own code, on the CPU: the settings and the version
refusal, the seam check, SGLang's ``MHATokenToKVPool`` and ``MLATokenToKVPool`` with their
buffers over a kvasync range (host backend), the pools still refused, and
``KvasyncPagedAllocator`` beside SGLang's ``PagedTokenToKVPoolAllocator`` on one workload, with a
real ``RadixCache`` for the prefix bound and pressure.

The tests that need SGLang skip where it is not importable (CI), saying so; ``make sglang-test``
runs them in a venv with SGLang 0.5.17 (tests/sglang_suite.py). SGLang's allocator kernels are
Triton kernels: they run here under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py).

NOTE: SGLang's ``HookRegistry`` patches the process: once the plugin's hooks are applied
(``hooks``, module scope), every ``MHATokenToKVPool`` and ``MLATokenToKVPool`` built here is
kvasync's. The stock pools the comparisons need are built first (``stock_pools``, which ``hooks``
depends on).
"""

from __future__ import annotations

import logging
import os
import random
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import wait_until_sync

from kvasync._sync import SyncAllocator
from kvasync.integrations import sglang as plugin
from kvasync.integrations.sglang import _seams
from kvasync.integrations.sglang._kv import detach, engine_of
from kvasync.integrations.sglang._seams import Seam, UnsupportedSGLang

try:
    with warnings.catch_warnings():
        # SGLang's import warns on a CPU machine (no AWQ/GGUF kernels, torch.jit deprecations).
        warnings.simplefilter("ignore")
        import sglang.srt.mem_cache.allocator.paged as sglang_paged
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.memory_pool import (
            DSATokenToKVPool,
            MHATokenToKVPool,
            MLATokenToKVPool,
            MLATokenToKVPoolFP4,
        )
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
        from sglang.srt.plugins.hook_registry import HookRegistry

    SGLANG_ERROR = ""
except Exception as error:  # any import failure means: no SGLang here
    SGLANG_ERROR = f"SGLang is not importable here ({type(error).__name__}: {error})"

needs_sglang = pytest.mark.skipif(bool(SGLANG_ERROR), reason=SGLANG_ERROR or "SGLang present")
PAGE = 16  # SGLang's page size in these tests (tokens a page)
# A pool whose K/V pages are 32 KiB a layer, so the host backend's 2 MiB pages hold 64 of them
# and the range spans several kvasync pages: the "only page 0 is mapped" claim means something.
POOL = {"head_num": 8, "head_dim": 128, "layer_num": 3, "dtype": torch.bfloat16}
POOL_TOKENS = PAGE * 256
# DeepSeek-V2-Lite's latent row (kv_lora_rank 512 + qk_rope_head_dim 64): 18 KiB a page a layer,
# so the host backend's 2 MiB pages hold 113.8 of them and the range spans three kvasync pages.
MLA_RANK, MLA_ROPE, MLA_LAYERS = 512, 64, 3
MLA_POOL = {
    "kv_lora_rank": MLA_RANK,
    "qk_rope_head_dim": MLA_ROPE,
    "layer_num": MLA_LAYERS,
    "dtype": torch.bfloat16,
}
MLA_ROW = MLA_RANK + MLA_ROPE
_STEADY = dict(os.environ)

# -- settings and the version, no SGLang needed ------------------------------------------------


def test_an_untested_release_is_refused_naming_it_and_the_tested_ones() -> None:
    with pytest.raises(UnsupportedSGLang) as refused:
        plugin.check_version("0.5.16", any_version=False)
    assert "0.5.16" in str(refused.value)
    assert "0.5.17" in str(refused.value)
    assert plugin.ANY_VERSION in str(refused.value)


def test_any_version_lets_an_untested_release_through_to_the_seam_check() -> None:
    plugin.check_version("0.5.16", any_version=True)  # no refusal: the seams decide


def test_a_tested_release_is_not_refused() -> None:
    for release in plugin.TESTED:
        plugin.check_version(release, any_version=False)


# -- the seams against SGLang 0.5.17 -----------------------------------------------------------


def changed_alloc_decode(self: object, seq_lens: object, last_loc: object) -> None:
    """A real function shaped as a later SGLang might have ``alloc_decode``: no CPU lengths."""


@needs_sglang
def test_every_seam_matches_the_installed_sglang() -> None:
    assert _seams.installed_version() in plugin.TESTED
    _seams.check_all()


@needs_sglang
def test_a_seam_whose_signature_differs_is_refused_naming_it_and_both_signatures() -> None:
    wanted = next(s for s in _seams.SEAMS if s.target.endswith(".alloc_decode"))
    changed = Seam(f"{__name__}.changed_alloc_decode", wanted.parameters, wanted.why)
    with pytest.raises(UnsupportedSGLang) as refused:
        _seams.check_seam(changed)
    message = str(refused.value)
    assert f"{__name__}.changed_alloc_decode" in message
    assert "('self', 'seq_lens', 'last_loc')" in message  # what is there
    assert str(wanted.parameters) in message  # what the plugin needs
    assert wanted.why in message


@needs_sglang
def test_a_missing_seam_is_refused_naming_it() -> None:
    missing = Seam(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_later",
        ("self",),
        "a method no SGLang has",
    )
    with pytest.raises(UnsupportedSGLang, match=r"alloc_later .*is missing in this SGLang"):
        _seams.check_seam(missing)


class _Holder:
    """Stands in for an SGLang class whose attributes the plugin reads (``Reads``)."""

    def __init__(self) -> None:
        self.kept = 1

    def later(self) -> None:
        def nested() -> None:
            self.set_in_nested = 2

        nested()

    def method(self) -> None:
        pass


def test_reads_finds_attributes_set_in_the_code_and_refuses_a_missing_one_naming_it() -> None:
    from kvasync.integrations.sglang._seams import Reads

    owner = f"{__name__}._Holder"
    _seams.check_reads(Reads(owner, ("kept", "set_in_nested"), ("method",), "why"))
    with pytest.raises(UnsupportedSGLang, match=r"_Holder\.gone \(the reason\)"):
        _seams.check_reads(Reads(owner, ("kept", "gone"), (), "the reason"))
    with pytest.raises(UnsupportedSGLang, match=r"_Holder\.absent \(why\)"):
        _seams.check_reads(Reads(owner, (), ("absent",), "why"))
    with pytest.raises(UnsupportedSGLang, match=r"_Nowhere \(why\) is missing"):
        _seams.check_reads(Reads(f"{__name__}._Nowhere", ("kept",), (), "why"))


@needs_sglang
def test_every_name_the_plugin_reads_off_sglang_is_there() -> None:
    for reads in _seams.READS:
        _seams.check_reads(reads)


@needs_sglang
def test_register_is_inert_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVASYNC_"):
            monkeypatch.delenv(name)
    before = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    plugin.register()
    after = {target: list(hooks) for target, hooks in HookRegistry._hooks.items() if hooks}
    assert after == {t: h for t, h in before.items() if h}


@needs_sglang
def test_register_without_a_size_refuses_at_server_args_naming_the_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):
        if name.startswith("KVASYNC_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVASYNC_SGLANG", "1")
    target = "sglang.srt.server_args.ServerArgs.__post_init__"
    before = list(HookRegistry._hooks.get(target, []))
    plugin.register()
    added = HookRegistry._hooks[target][len(before) :]
    try:
        # One hook, and only there: nothing else of SGLang is hooked by a refused plugin.
        assert len(added) == 1
        with pytest.raises(UnsupportedSGLang, match="KVASYNC_MEMORY_LIMIT"):
            added[0][1](object())
    finally:
        HookRegistry._hooks[target] = before  # the registry is process-wide


@needs_sglang
@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"KVASYNC_SGLANG": "1", "KVASYNC_MEMORY_LIMIT": "12 gigs"}, "KVASYNC_MEMORY_LIMIT"),
        ({"KVASYNC_MEMORY_LIMIT": "12 gigs"}, "KVASYNC_MEMORY_LIMIT"),  # asked by the size
        ({"KVASYNC_DEVICE_BUDGET": "4GiB"}, "KVASYNC_DEVICE_BUDGET needs KVASYNC_SHARE"),
        ({"KVASYNC_SGLANG": "1", "KVASYNC_LINGER": "soon"}, "KVASYNC_LINGER"),
    ],
)
def test_a_malformed_variable_refuses_the_start_rather_than_running_stock(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str
) -> None:
    """SGLang's loader logs a plugin's exception and starts stock SGLang: a malformed variable
    must not reach it, but refuse the start at ServerArgs, naming the variable."""
    for name in list(os.environ):
        if name.startswith("KVASYNC_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    target = "sglang.srt.server_args.ServerArgs.__post_init__"
    before = list(HookRegistry._hooks.get(target, []))
    plugin.register()  # raises nothing
    added = HookRegistry._hooks.get(target, [])[len(before) :]
    try:
        assert len(added) == 1
        with pytest.raises(UnsupportedSGLang, match=match):
            added[0][1](object())
    finally:
        HookRegistry._hooks[target] = before  # the registry is process-wide


@needs_sglang
def test_a_malformed_variable_with_the_switch_off_stays_inert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):
        if name.startswith("KVASYNC_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVASYNC_SGLANG", "0")
    monkeypatch.setenv("KVASYNC_MEMORY_LIMIT", "12 gigs")
    before = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    plugin.register()
    after = {target: list(hooks) for target, hooks in HookRegistry._hooks.items() if hooks}
    assert after == {t: h for t, h in before.items() if h}


@pytest.mark.parametrize(
    ("sizes", "refused"),
    [
        ({}, None),
        ({"tp_size": 1, "pp_size": 1, "dp_size": 1}, None),
        ({"tp_size": 2}, "tp_size=2"),
        ({"pp_size": 2}, "pp_size=2"),
        ({"tp_size": 1, "dp_size": 4}, "dp_size=4"),
    ],
)
def test_parallel_ranks_are_refused_at_start_naming_the_setting(
    sizes: dict[str, int], refused: str | None
) -> None:
    """Each rank would schedule on its own kvasync count: ranks could diverge and hang."""
    import types

    args = types.SimpleNamespace(**sizes)
    if refused is None:
        plugin.check_parallel(args)
    else:
        with pytest.raises(UnsupportedSGLang, match=refused):
            plugin.check_parallel(args)


# -- the pool and the allocator ----------------------------------------------------------------


def make_pool() -> Any:
    return MHATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
        **POOL,
    )


def make_mla_pool() -> Any:
    return MLATokenToKVPool(
        size=POOL_TOKENS, page_size=PAGE, device="cpu", enable_memory_saver=False, **MLA_POOL
    )


@pytest.fixture(scope="module")
def stock_pools() -> list[Any]:
    """SGLang's own pools, built before the plugin's hooks are applied (module NOTE): two MHA
    pools, then an MLA pool (``[2]``)."""
    if SGLANG_ERROR:
        pytest.skip(SGLANG_ERROR)
    return [make_pool(), make_pool(), make_mla_pool()]


@pytest.fixture(scope="module")
def hooks(stock_pools: list[Any]) -> Iterator[None]:
    """The plugin registered and applied as SGLang's engine does it, with a memory limit."""
    saved = dict(os.environ)
    os.environ.update(KVASYNC_SGLANG="1", KVASYNC_MEMORY_LIMIT="1GiB")
    try:
        plugin.register()
        HookRegistry.apply_hooks()
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def pool(hooks: None) -> Iterator[Any]:
    built = make_pool()
    yield built
    built._clear_buffers()  # closes the kvasync allocator behind it (the plugin's hook)


@needs_sglang
def test_the_pool_buffers_are_views_over_the_kvasync_range_shaped_as_stock(
    pool: Any, stock_pools: list[Any]
) -> None:
    stock = stock_pools[0]
    kv = engine_of(pool).allocator
    assert len(pool.k_buffer) == len(stock.k_buffer) == POOL["layer_num"]
    for index in range(POOL["layer_num"]):
        k_range, v_range = kv.layer(index)
        for ours, theirs, base in (
            (pool.k_buffer[index], stock.k_buffer[index], k_range),
            (pool.v_buffer[index], stock.v_buffer[index], v_range),
        ):
            assert (ours.shape, ours.stride(), ours.dtype) == (
                theirs.shape,
                theirs.stride(),
                theirs.dtype,
            )
            assert ours.data_ptr() == base.data_ptr()
            assert ours.untyped_storage().nbytes() == base.untyped_storage().nbytes()
            assert pool.get_key_buffer(index).data_ptr() == pool.k_buffer[index].data_ptr()


@needs_sglang
@pytest.mark.parametrize(("value", "linger"), [(None, 0.0), ("2", 2.0), ("1.5s", 1.5)])
def test_kvasync_linger_at_register_is_the_pool_allocators_linger(
    monkeypatch: pytest.MonkeyPatch, pool: Any, value: str | None, linger: float
) -> None:
    """``KVASYNC_LINGER`` in the environment SGLang's ``register()`` sees (where the plugin reads
    its settings, as in an engine's scheduler process) is the ``Config.linger`` of the allocator
    its pool hook opens; unset, none. The hook is called on a pool whose own engine is taken off
    first; the registry is left as it was."""
    for name in list(os.environ):
        if name.startswith("KVASYNC_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVASYNC_SGLANG", "1")
    monkeypatch.setenv("KVASYNC_MEMORY_LIMIT", "1GiB")
    if value is not None:
        monkeypatch.setenv("KVASYNC_LINGER", value)
    target = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal"
    before = {name: list(hooks) for name, hooks in HookRegistry._hooks.items()}
    try:
        plugin.register()
        added = HookRegistry._hooks[target][len(before.get(target, [])) :]
    finally:
        for name in list(HookRegistry._hooks):  # the registry is process-wide
            HookRegistry._hooks[name] = before.get(name, [])
    assert len(added) == 1
    first = detach(pool)
    assert first is not None
    first.close()
    added[0][1](lambda _pool: None, pool)  # the AROUND hook, as SGLang calls it
    engine = engine_of(pool)
    assert engine is not None and engine is not first
    assert engine.settings.linger == linger
    assert engine.allocator.config.linger == linger


@needs_sglang
def test_only_block_0_is_taken_at_open_and_page_0_starts_zeroed(pool: Any) -> None:
    """Block 0 (SGLang's padded page) is held for the pool's life; every other mapped page is
    the reserve the mapper keeps ahead of the scheduler (mapped, free), never more than its
    high watermark: no SGLang page is taken until SGLang allocates."""
    kv = engine_of(pool).allocator
    assert kv.num_blocks == POOL_TOKENS // PAGE + 1
    assert kv.num_blocks > 2 * (kv.page_size // kv.layout.block_bytes)  # several kvasync pages

    def idle() -> bool:
        stats = kv.stats()
        return stats.mapping_pages == 0 and stats.queued_jobs == 0

    wait_until_sync(idle, "the mapper to finish the reserve")
    stats = kv.stats()
    assert stats.used_blocks == 1
    assert stats.mapped_pages == 1 + stats.reserve_pages
    assert stats.reserve_pages <= kv.config.reserve_pages[1]
    padded = pool.k_buffer[0][:PAGE]
    assert torch.count_nonzero(padded) == 0


@needs_sglang
def test_sglang_writes_through_the_pool_land_in_kvasync_blocks(pool: Any) -> None:
    allocator = plugin_allocator(pool)
    slots = allocator.alloc(2 * PAGE)
    heads, dim = POOL["head_num"], POOL["head_dim"]
    k = torch.randn(2 * PAGE, heads, dim).to(POOL["dtype"])
    v = torch.randn(2 * PAGE, heads, dim).to(POOL["dtype"])
    layer = SimpleLayer(layer_id=1)
    pool.set_kv_buffer(layer, slots, k, v)
    rows = engine_of(pool).allocator.layer(1)[0].view(POOL["dtype"]).view(-1, heads, dim)
    torch.testing.assert_close(rows[slots], k)  # kvasync's own view of layer 1's K range
    allocator.free(slots)


class SimpleLayer:
    """What MHATokenToKVPool.set_kv_buffer reads of SGLang's RadixAttention layer."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id
        self.k_scale = None
        self.v_scale = None


def plugin_allocator(pool: Any) -> Any:
    """kvasync's allocator over ``pool``, built as the plugin's configurator hook builds it."""
    from kvasync.integrations.sglang._allocator import allocator_class

    return allocator_class()(POOL_TOKENS, PAGE, POOL["dtype"], "cpu", pool, False)


def stock_allocator(pool: Any) -> Any:
    return sglang_paged.PagedTokenToKVPoolAllocator(
        POOL_TOKENS, PAGE, POOL["dtype"], "cpu", pool, False
    )


def held_pages(out: torch.Tensor) -> set[int]:
    return {int(slot) // PAGE for slot in out.tolist()}


@needs_sglang
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_allocator_matches_stock_on_one_random_workload(
    pool: Any, stock_pools: list[Any], seed: int
) -> None:
    """alloc / alloc_extend / alloc_decode / free / clear on both, step by step: the same
    counts, the same None, never a page handed out twice, freed pages back in kvasync, and an
    available_size() that is what an alloc can take."""
    ours, stock = plugin_allocator(pool), stock_allocator(stock_pools[1])
    kv = engine_of(pool).allocator
    rng = random.Random(seed)
    requests: list[tuple[list[torch.Tensor], list[torch.Tensor], int]] = []  # ours, stock, len
    for step in range(40):
        assert ours.available_size() == stock.available_size(), step
        # kvasync holds block 0 and every page SGLang holds; nothing else.
        held = set().union(*(held_pages(t) for r in requests for t in r[0])) if requests else set()
        assert kv.stats().used_blocks == 1 + len(held), step
        action = rng.choice(
            ["extend", "decode", "alloc", "free", "free"] if requests else ["extend"]
        )
        if action == "extend":
            batch = rng.randint(1, 3)
            lens = [rng.randint(1, 3 * PAGE) for _ in range(batch)]
            prefix = torch.zeros(batch, dtype=torch.int64)
            seq = torch.tensor(lens, dtype=torch.int64)
            last = torch.full((batch,), -1, dtype=torch.int64)
            a = ours.alloc_extend(prefix, prefix, seq, seq, last, sum(lens))
            b = stock.alloc_extend(prefix, prefix, seq, seq, last, sum(lens))
            assert (a is None) == (b is None), step
            if a is None:
                continue
            assert len(a) == len(b) == sum(lens)
            assert not held_pages(a) & held, "a page SGLang holds was handed out again"
            start = 0
            for n in lens:
                requests.append(([a[start : start + n]], [b[start : start + n]], n))
                start += n
        elif action == "decode":
            picked = rng.sample(range(len(requests)), rng.randint(1, len(requests)))
            seq = torch.tensor([requests[i][2] + 1 for i in picked], dtype=torch.int64)
            last_ours = torch.stack([requests[i][0][-1][-1] for i in picked])
            last_stock = torch.stack([requests[i][1][-1][-1] for i in picked])
            a = ours.alloc_decode(seq, seq, last_ours)
            b = stock.alloc_decode(seq, seq, last_stock)
            assert (a is None) == (b is None), step
            if a is None:
                continue
            assert len(a) == len(b) == len(picked)
            new_pages = {int(x) // PAGE for x, i in zip(a.tolist(), picked, strict=True)}
            new_pages -= {int(requests[i][0][-1][-1]) // PAGE for i in picked}
            assert not new_pages & held, "a page SGLang holds was handed out again"
            for j, i in enumerate(picked):
                ours_t, stock_t, n = requests[i]
                requests[i] = ([*ours_t, a[j : j + 1]], [*stock_t, b[j : j + 1]], n + 1)
        elif action == "alloc":
            n = PAGE * rng.randint(1, 4)
            a, b = ours.alloc(n), stock.alloc(n)
            assert (a is None) == (b is None), step
            if a is not None:
                assert not held_pages(a) & held
                requests.append(([a], [b], n))
        else:
            ours_t, stock_t, _ = requests.pop(rng.randrange(len(requests)))
            ours.free(torch.cat(ours_t))
            stock.free(torch.cat(stock_t))
    ours.clear()
    stock.clear()
    assert ours.available_size() == stock.available_size() == POOL_TOKENS
    assert kv.stats().used_blocks == 1


@needs_sglang
def test_an_alloc_past_the_pool_is_none_as_on_stock_and_takes_nothing(
    pool: Any, stock_pools: list[Any]
) -> None:
    ours, stock = plugin_allocator(pool), stock_allocator(stock_pools[1])
    too_many = POOL_TOKENS + PAGE
    assert ours.alloc(too_many) is None
    assert stock.alloc(too_many) is None
    assert ours.available_size() == stock.available_size() == POOL_TOKENS
    assert engine_of(pool).allocator.stats().used_blocks == 1


@needs_sglang
def test_freed_pages_go_back_to_kvasync_and_unmap_when_trimmed(pool: Any) -> None:
    ours = plugin_allocator(pool)
    kv = engine_of(pool).allocator
    per_page = kv.page_size // kv.layout.block_bytes
    slots = ours.alloc(PAGE * 3 * per_page)  # three kvasync pages' worth of SGLang pages
    assert kv.stats().mapped_pages >= 3
    ours.free(slots)
    assert kv.stats().used_blocks == 1
    mapped = ours.release_memory(timeout=10.0)
    assert kv.stats().mapped_pages == 1  # page 0 stays
    assert mapped == kv.stats().mapped_bytes


# -- the radix cache: the prefix bound and pressure -------------------------------------------


def cache_over(allocator: Any) -> Any:
    return RadixCache.create_simulated(mock_allocator=allocator, page_size=PAGE)


def cache_pages(cache: Any, allocator: Any, requests: int, pages: int) -> list[torch.Tensor]:
    """``requests`` finished requests of ``pages`` SGLang pages each, cached in ``cache`` (their
    pages then belong to the cache, unused and evictable), distinct prefixes."""
    out = []
    for r in range(requests):
        slots = allocator.alloc(PAGE * pages)
        tokens = [r * 100_000 + t for t in range(PAGE * pages)]
        cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
        out.append(slots)
    return out


@needs_sglang
def test_the_prefix_cache_bound_evicts_unused_prefixes_back_to_kvasync(
    monkeypatch: pytest.MonkeyPatch, hooks: None
) -> None:
    from kvasync.integrations.sglang._allocator import allocator_class

    # An allocator over no kvasync pool keeps its pages in a bookkeeping allocator of its own,
    # whose settings are read now: a bound of 2 SGLang pages' tokens.
    monkeypatch.setenv("KVASYNC_SGLANG_HOST_POOL", "1")
    probe = allocator_class()(PAGE * 16, PAGE, torch.bfloat16, "cpu", None, False)
    token_bytes = probe._token_bytes()
    probe._engine.close()
    monkeypatch.setenv("KVASYNC_PREFIX_CACHE", str(2 * PAGE * token_bytes))
    allocator = allocator_class()(PAGE * 16, PAGE, torch.bfloat16, "cpu", None, False)
    try:
        kv = allocator._kv
        cache = cache_over(allocator)
        cache_pages(cache, allocator, requests=3, pages=2)
        assert (cache.evictable_size(), kv.stats().used_blocks) == (6 * PAGE, 1 + 6)
        allocator.maintain(cache, [])
        assert cache.evictable_size() == 2 * PAGE
        assert kv.stats().used_blocks == 1 + 2  # the evicted prefixes' pages came back
        assert allocator.available_size() == (16 - 2) * PAGE
    finally:
        allocator._engine.close()


@needs_sglang
def test_pressure_evicts_unused_prefixes_on_draining_pages(pool: Any) -> None:
    ours = plugin_allocator(pool)
    kv = engine_of(pool).allocator
    per_page = kv.page_size // kv.layout.block_bytes
    cache = cache_over(ours)
    # Two kvasync pages of cached prefixes (one request a kvasync page's worth of SGLang pages).
    cache_pages(cache, ours, requests=2, pages=per_page)
    assert kv.stats().mapped_pages >= 2
    kv.resize(memory_limit=kv.stats().page_bytes, timeout=10.0)  # room for page 0 only
    drain = kv.drain_from()
    assert drain is not None
    ours.maintain(cache, [])
    assert ours.num_evicted_for_pressure > 0
    assert all(block < drain for block in ours._held)  # nothing held on a draining page
    assert kv.stats().mapped_pages == 1


@needs_sglang
def test_a_limit_fallen_between_the_count_and_the_alloc_evicts_unused_prefixes_for_it(
    pool: Any,
) -> None:
    """SGLang counts ``available_size()`` and then allocates; an alloc that returns None is its
    fatal "out of memory" error. When the limit falls in between, the alloc evicts the radix
    cache's unused prefixes for what kvasync refused and takes their pages."""
    ours = plugin_allocator(pool)
    kv = engine_of(pool).allocator
    per_page = kv.page_size // kv.layout.block_bytes  # SGLang pages a kvasync page
    cache = cache_over(ours)
    cache_pages(cache, ours, requests=2, pages=per_page)  # two kvasync pages' worth, unused
    ours.maintain(cache, [])  # a scheduler step: the allocator learns the radix cache
    assert ours.available_size() >= per_page * PAGE  # the count SGLang admits on
    # Now the limit falls to the pages mapped (page 0's, and the cached prefixes'): kvasync has
    # fewer than per_page free blocks left, so the counted alloc needs evicted prefixes' pages.
    kv.resize(memory_limit=3 * kv.stats().page_bytes, timeout=10.0)
    assert kv.available_blocks() < per_page
    slots = ours.alloc(per_page * PAGE)
    assert slots is not None and len(slots) == per_page * PAGE
    assert 0 < ours.num_evicted_for_alloc <= per_page * PAGE
    assert ours.num_failed_allocs == 0
    assert kv.stats().mapped_pages <= 3  # within the lowered limit
    ours.free(slots)


@needs_sglang
def test_an_alloc_kvasync_refuses_with_nothing_to_evict_is_none_and_logged(
    pool: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvasync.integrations.sglang import _allocator

    monkeypatch.setattr(_allocator, "_MAP_WAIT", 0.2)  # the wait for budget a neighbour frees
    ours = plugin_allocator(pool)
    kv = engine_of(pool).allocator
    per_page = kv.page_size // kv.layout.block_bytes
    ours.maintain(cache_over(ours), [])  # an empty radix cache: nothing to evict
    kv.resize(memory_limit=kv.stats().page_bytes, timeout=10.0)  # page 0's page only
    with caplog.at_level(logging.WARNING, logger="kvasync.sglang"):
        assert ours.alloc(per_page * PAGE) is None  # SGLang's own out-of-memory path
    assert ours.num_failed_allocs == 1 and ours.num_evicted_for_alloc == 0
    assert any("alloc of" in r.getMessage() for r in caplog.records)


def ignored_free_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvasync.sglang" and "does not hold" in r.getMessage()
    ]


@needs_sglang
def test_a_page_freed_twice_is_ignored_counted_and_logged_while_the_held_pages_are_freed(
    pool: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Note [A free of pages SGLang does not hold]: the free runs on SGLang's scheduler thread,
    so it raises nothing; the page SGLang holds goes back to kvasync, the one freed already is
    not given twice (stock 0.5.17 lists it twice and hands it to two requests)."""
    ours = plugin_allocator(pool)
    kv = engine_of(pool).allocator
    first, second = ours.alloc(PAGE), ours.alloc(PAGE)
    ours.free(first)
    with caplog.at_level(logging.WARNING, logger="kvasync.sglang"):
        ours.free(torch.cat([second, first]))  # first's page is freed twice
    assert kv.stats().used_blocks == 1  # second's page is back; nothing leaked
    assert ours.num_ignored_free_pages == 1
    assert ours.available_size() == ours.unheld_size() == POOL_TOKENS  # not counted twice
    (line,) = ignored_free_lines(caplog)
    assert f"SGLang freed 1 page(s) it does not hold ({int(first[0]) // PAGE})" in line
    # No page is handed out twice: every page of a pool-wide alloc is distinct.
    everything = ours.alloc(POOL_TOKENS)
    pages = [int(slot) // PAGE for slot in everything[::PAGE].tolist()]
    assert len(set(pages)) == len(pages) == POOL_TOKENS // PAGE
    assert ours.alloc(PAGE) is None
    ours.free(everything)
    assert kv.stats().used_blocks == 1


@needs_sglang
def test_a_free_of_a_page_never_handed_out_gives_kvasync_nothing(pool: Any) -> None:
    ours = plugin_allocator(pool)
    kv = engine_of(pool).allocator
    held = ours.alloc(PAGE)
    never = torch.arange(200 * PAGE, 201 * PAGE)  # page 200: SGLang never had it
    ours.free(torch.cat([never, held]))
    assert (kv.stats().used_blocks, ours.num_ignored_free_pages) == (1, 1)
    assert ours.available_size() == POOL_TOKENS


@needs_sglang
def test_a_free_of_a_page_in_hand_gives_kvasync_nothing_and_the_next_alloc_takes_it(
    pool: Any,
) -> None:
    """A page in hand (taken from kvasync for an alloc, in free_pages, not yet SGLang's): given
    to kvasync, it would be free there while SGLang's next alloc hands it out."""
    ours = plugin_allocator(pool)
    kv = engine_of(pool).allocator
    assert ours._take(1)
    (in_hand,) = ours.free_pages.tolist()
    ours.free(torch.arange(in_hand * PAGE, (in_hand + 1) * PAGE))
    assert kv.stats().used_blocks == 2  # block 0 and the page in hand: still this allocator's
    assert ours.num_ignored_free_pages == 1
    taken = ours.alloc(PAGE)
    assert held_pages(taken) == {in_hand}
    ours.free(taken)
    assert kv.stats().used_blocks == 1


@needs_sglang
def test_the_ignored_free_warning_comes_at_most_once_an_interval_with_the_count(
    pool: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ours = plugin_allocator(pool)
    freed = [ours.alloc(2 * PAGE) for _ in range(3)]
    for slots in freed:
        ours.free(slots)
    with caplog.at_level(logging.WARNING, logger="kvasync.sglang"):
        for slots in freed:
            ours.free(slots)  # each freed twice: 2 pages a time
    assert ours.num_ignored_free_pages == 6
    (line,) = ignored_free_lines(caplog)  # the later two within the 30 s interval
    assert "SGLang freed 2 page(s) it does not hold" in line
    assert "2 such page(s) since start" in line


@needs_sglang
def test_in_sglang_debug_mode_a_page_freed_twice_raises_assertion_error_as_stock(
    pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLANG_DEBUG_MEMORY_POOL=1 asks SGLang to stop at a double free (stock's check raises
    AssertionError); the pages SGLang holds are freed first, so nothing leaks."""
    monkeypatch.setenv("SGLANG_DEBUG_MEMORY_POOL", "1")
    ours = plugin_allocator(pool)
    kv = engine_of(pool).allocator
    first, second = ours.alloc(PAGE), ours.alloc(PAGE)
    ours.free(first)
    with pytest.raises(AssertionError, match=r"freed 1 page\(s\) it does not hold"):
        ours.free(torch.cat([second, first]))
    assert (kv.stats().used_blocks, ours.num_ignored_free_pages) == (1, 1)
    assert ours.available_size() == POOL_TOKENS


# -- the MLA pool ------------------------------------------------------------------------------


@pytest.fixture
def mla_pool(hooks: None) -> Iterator[Any]:
    built = make_mla_pool()
    yield built
    built._clear_buffers()  # closes the kvasync allocator behind it (the plugin's hook)


def kv_of(pool: Any) -> SyncAllocator:
    """The kvasync allocator behind ``pool`` (one the plugin opened)."""
    engine = engine_of(pool)
    assert engine is not None, f"{type(pool).__name__} is not over a kvasync range"
    return engine.allocator


def build_allocator_hook() -> Any:
    """The plugin's hook on SGLang's ``_build_token_to_kv_pool_allocator``, as registered."""
    target = (
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
        "_build_token_to_kv_pool_allocator"
    )
    return HookRegistry._hooks[target][-1][1]


def build_with_plugin(pool: Any, size: int = POOL_TOKENS, page: int = PAGE) -> Any:
    """The token-to-KV allocator the configurator's hook builds over ``pool``, SGLang's own
    being a paged allocator of ``size`` tokens ``page`` a page."""

    def stock(configurator: object, **kwargs: Any) -> Any:
        return sglang_paged.PagedTokenToKVPoolAllocator(
            size, page, torch.bfloat16, "cpu", kwargs["token_to_kv_pool"], False
        )

    return build_allocator_hook()(
        stock,
        None,
        sizes=None,
        token_to_kv_pool=pool,
        is_dsv4_model=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
    )


@needs_sglang
def test_the_mla_pool_buffers_are_views_over_the_kvasync_range_shaped_as_stock(
    mla_pool: Any, stock_pools: list[Any]
) -> None:
    stock = stock_pools[2]
    kv = kv_of(mla_pool)
    layout = kv.layout
    assert (layout.kv_buffers, layout.num_kv_heads, layout.head_dim) == (1, 1, MLA_ROW)
    assert len(mla_pool.kv_buffer) == len(stock.kv_buffer) == MLA_LAYERS
    for index, (ours, theirs) in enumerate(zip(mla_pool.kv_buffer, stock.kv_buffer, strict=True)):
        (latent,) = kv.layer(index)
        assert (ours.shape, ours.stride(), ours.dtype) == (
            theirs.shape,
            theirs.stride(),
            theirs.dtype,
        )
        assert ours.data_ptr() == latent.data_ptr()
        assert ours.untyped_storage().nbytes() == latent.untyped_storage().nbytes()
        for getter in ("get_key_buffer", "get_value_buffer"):
            got, stock_got = getattr(mla_pool, getter)(index), getattr(stock, getter)(index)
            assert (got.shape, got.stride(), got.dtype) == (
                stock_got.shape,
                stock_got.stride(),
                stock_got.dtype,
            )
            assert got.data_ptr() == ours.data_ptr()
    # What the attention backends and CUDA graphs read: the pointers SGLang takes after the
    # buffers are made, and PD's registration of the buffers.
    pointers = [buffer.data_ptr() for buffer in mla_pool.kv_buffer]
    assert [int(p) for p in mla_pool.data_ptrs.to(torch.int64)] == pointers
    ptrs, lens, items = mla_pool.get_contiguous_buf_infos()
    assert ptrs == pointers
    assert (lens, items) == tuple(stock.get_contiguous_buf_infos()[1:])
    assert mla_pool.get_kv_size_bytes() == stock.get_kv_size_bytes()


@needs_sglang
def test_the_mla_pool_takes_only_block_0_at_open_and_page_0_starts_zeroed(mla_pool: Any) -> None:
    kv = kv_of(mla_pool)
    assert kv.num_blocks == POOL_TOKENS // PAGE + 1
    assert kv.num_blocks * kv.layout.block_bytes > 2 * kv.page_size  # several kvasync pages

    def idle() -> bool:
        stats = kv.stats()
        return stats.mapping_pages == 0 and stats.queued_jobs == 0

    wait_until_sync(idle, "the mapper to finish the reserve")
    stats = kv.stats()
    assert stats.used_blocks == 1
    assert stats.mapped_pages == 1 + stats.reserve_pages
    assert stats.reserve_pages <= kv.config.reserve_pages[1]
    assert torch.count_nonzero(mla_pool.kv_buffer[0][:PAGE]) == 0


@needs_sglang
def test_set_kv_buffer_on_the_mla_pool_lands_in_kvasync_blocks_and_reads_back(
    mla_pool: Any,
) -> None:
    allocator = build_with_plugin(mla_pool)
    slots = allocator.alloc(2 * PAGE)
    rows = torch.randn(2 * PAGE, 1, MLA_ROW).to(torch.bfloat16)
    layer = SimpleLayer(layer_id=1)
    mla_pool.set_kv_buffer(layer, slots, rows, None)  # MLA's: one latent row a token
    (latent,) = kv_of(mla_pool).layer(1)
    torch.testing.assert_close(latent.view(torch.bfloat16).view(-1, 1, MLA_ROW)[slots], rows)
    rank = MLA_RANK
    nope, rope = mla_pool.get_mla_kv_buffer(layer, slots)  # SGLang's Triton read kernel
    torch.testing.assert_close(nope, rows[..., :rank])
    torch.testing.assert_close(rope, rows[..., rank:])
    torch.testing.assert_close(mla_pool.get_value_buffer(1)[slots], rows[..., :rank])
    allocator.free(slots)


@needs_sglang
def test_set_mla_kv_buffer_lands_in_kvasync_blocks_as_on_stock(
    mla_pool: Any, stock_pools: list[Any]
) -> None:
    stock = stock_pools[2]
    allocator = build_with_plugin(mla_pool)
    slots = allocator.alloc(PAGE)
    nope = torch.randn(PAGE, 1, MLA_RANK).to(torch.bfloat16)
    rope = torch.randn(PAGE, 1, MLA_ROPE).to(torch.bfloat16)
    layer = SimpleLayer(layer_id=2)
    try:
        stock.set_mla_kv_buffer(layer, slots, nope, rope)
    except Exception as error:  # Triton's InterpreterError, on stock's own pool
        allocator.free(slots)
        pytest.skip(
            "SGLang 0.5.17's set_mla_kv_buffer kernel does not run under Triton's interpreter "
            f"(on stock's pool too: {type(error).__name__}: {error}); a GPU runs it"
        )
    mla_pool.set_mla_kv_buffer(layer, slots, nope, rope)
    (latent,) = kv_of(mla_pool).layer(2)
    ours = latent.view(torch.bfloat16).view(-1, 1, MLA_ROW)[slots]
    assert torch.equal(ours, stock.kv_buffer[2][slots])
    assert torch.equal(ours, torch.cat([nope, rope], dim=-1))
    allocator.free(slots)


@needs_sglang
def test_mla_pages_map_as_sglang_allocates_and_unmap_when_freed_and_released(
    mla_pool: Any,
) -> None:
    ours = build_with_plugin(mla_pool)
    assert type(ours).__name__ == "KvasyncPagedAllocator"
    kv = kv_of(mla_pool)
    assert ours._kv is kv
    per_page = kv.page_size // kv.layout.block_bytes  # 113 SGLang pages in a 2 MiB page
    slots = ours.alloc(PAGE * 2 * per_page)  # two kvasync pages' worth of SGLang pages
    assert slots is not None
    assert kv.stats().used_blocks == 1 + 2 * per_page
    assert kv.stats().mapped_pages >= 3
    ours.free(slots)
    assert kv.stats().used_blocks == 1
    mapped = ours.release_memory(timeout=10.0)  # after release_memory_occupation's flush
    assert kv.stats().mapped_pages == 1  # page 0 stays
    assert mapped == kv.stats().mapped_bytes
    again = ours.alloc(PAGE * per_page)  # resumed: pages map again as SGLang allocates
    assert again is not None and kv.stats().mapped_pages >= 2
    ours.clear()  # a flush: every page SGLang held goes back
    assert kv.stats().used_blocks == 1
    assert ours.available_size() > 0


@needs_sglang
def test_an_mla_block_across_a_kvasync_page_boundary_is_never_counted_nor_handed_out(
    mla_pool: Any,
) -> None:
    """MLA's 18 KiB pages do not divide kvasync's 2 MiB pages: the block ids across a boundary
    are never handed out (Note [Blocks across page boundaries] in _layout), so SGLang's count
    leaves them out, and an alloc of all it counts succeeds."""
    ours = build_with_plugin(mla_pool)
    kv = kv_of(mla_pool)
    lost = kv.layout.unusable_blocks(kv.page_size, kv.num_blocks)
    assert lost == kv.stats().unusable_blocks >= 1
    assert ours.available_size() == POOL_TOKENS - lost * PAGE
    assert ours.unheld_size() == POOL_TOKENS  # SGLang's own bookkeeping: its idle check holds
    everything = ours.alloc(ours.available_size())
    assert everything is not None
    assert ours.alloc(PAGE) is None
    pages = {int(slot) // PAGE for slot in everything.tolist()}
    page_bytes, block_bytes = kv.page_size, kv.layout.block_bytes
    assert all(
        (p * block_bytes) // page_bytes == ((p + 1) * block_bytes - 1) // page_bytes for p in pages
    )
    ours.free(everything)
    assert kv.stats().used_blocks == 1


@needs_sglang
@pytest.mark.parametrize("kind", ["fp4", "dsa"])
def test_mla_pools_the_plugin_does_not_lay_out_keep_sglangs_buffers_and_are_refused_by_name(
    hooks: None, kind: str
) -> None:
    if kind == "fp4":
        pool = MLATokenToKVPoolFP4(
            size=POOL_TOKENS, page_size=PAGE, device="cpu", enable_memory_saver=False, **MLA_POOL
        )
        name, why, page = "MLATokenToKVPoolFP4", "fp4 MLA", PAGE
    else:
        page = 64  # DSA's page on a GPU
        pool = DSATokenToKVPool(
            size=page * 4,
            page_size=page,
            kv_lora_rank=MLA_RANK,
            dtype=torch.bfloat16,
            qk_rope_head_dim=MLA_ROPE,
            layer_num=2,
            device="cpu",
            index_head_dim=128,
            enable_memory_saver=False,
            kv_cache_dim=MLA_ROW,
        )
        name, why = "DSATokenToKVPool", "indexer cache"
    try:
        assert engine_of(pool) is None  # SGLang's own buffers, untouched
        assert pool.kv_buffer[0].data_ptr() != 0
        with pytest.raises(UnsupportedSGLang) as refused:
            build_with_plugin(pool, size=pool.size, page=page)
        message = str(refused.value)
        assert f"not {name} (" in message
        assert why in message
        assert "KVASYNC_SGLANG" in message
    finally:
        pool._clear_buffers()


@needs_sglang
def test_an_allocator_paged_otherwise_than_its_pool_is_refused_naming_dcp(mla_pool: Any) -> None:
    with pytest.raises(UnsupportedSGLang, match=r"--dcp-size"):
        build_with_plugin(mla_pool, size=2 * POOL_TOKENS, page=2 * PAGE)


@needs_sglang
def test_an_mla_engines_capacity_is_kvasyncs_limit_less_page_0_in_sglangs_own_cell_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's configurator turns ``_profile_available_bytes`` (the plugin's answer) into tokens
    by its cell size, which for MLA is one latent row a layer: the plugin counts the same row,
    so the pool SGLang sizes, page 0 included, is within kvasync's limit, less than a page
    short of it."""
    from types import SimpleNamespace

    import sglang.srt.model_executor.pool_configurator as pool_configurator

    from kvasync.integrations._settings import SGLANG_ENABLE, read_settings
    from kvasync.integrations.sglang._kv import capacity_bytes

    # No process group on the CPU: attention's TP size is 1.
    monkeypatch.setattr(pool_configurator, "get_parallel", lambda: SimpleNamespace(attn_tp_size=1))
    layers = 27  # DeepSeek-V2-Lite
    hf = SimpleNamespace(architectures=["DeepseekV2ForCausalLM"])
    configurator = SimpleNamespace(
        model_config=SimpleNamespace(
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            head_dim=192,
            v_head_dim=128,
            hf_config=hf,
            hf_text_config=hf,
            get_num_kv_heads=lambda tp: 16,
        ),
        kv_cache_dtype=torch.bfloat16,
        kv_cache_dtype_str="auto",
        use_mla_backend=True,
        is_draft_worker=False,
        layer_info=SimpleNamespace(num_effective_layers=layers),
        server_args=SimpleNamespace(
            page_size=PAGE, enable_hisparse=False, enable_dsa_cache_layer_split=False
        ),
    )
    sglang_configurator = pool_configurator.DefaultPoolConfigurator
    cell = sglang_configurator._compute_cell_size(configurator, configurator, layers)
    assert cell == layers * MLA_ROW * 2
    limit = 8 << 30
    settings = read_settings(
        {"KVASYNC_SGLANG": "1", "KVASYNC_MEMORY_LIMIT": str(limit)}, switch=SGLANG_ENABLE
    )
    assert settings.capacity_bytes == limit
    available = capacity_bytes(settings, configurator)
    assert available == limit - PAGE * cell
    sizing = SimpleNamespace(_cell_size=cell, _zero_kv_max_tokens=0)
    tokens = sglang_configurator.calculate_pool_sizes(sizing, available, PAGE).max_total_num_tokens
    assert limit - 2 * PAGE * cell < (tokens + PAGE) * cell <= limit
