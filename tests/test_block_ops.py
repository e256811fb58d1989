"""gather / scatter / zero / copy of whole KV blocks, against plain torch indexing.

Without a GPU the Triton kernels run under Triton's interpreter (tests/conftest.py), which costs
about 1 ms per program instance (one per block id and buffer): the grids here stay small.
Every comparison is bitwise (uint8 views), and covers the whole memory of the cache, so that a
kernel writing outside its blocks fails too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from kvasync import _block_ops

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8]
# separate: one tensor per buffer; interleaved: one block-major tensor, strided views (the
# allocator's contiguous layout); padded: a block stride that is not a multiple of 16 bytes.
LAYOUTS = ["separate", "interleaved", "padded"]
HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA")]
    ),
]


@dataclass
class Cache:
    """Buffers over storages we own, so that a test can compare all of their memory."""

    storages: list[torch.Tensor]
    views: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    kv_buffers: int

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.views(self.storages)

    def clone(self) -> Cache:
        return Cache([s.clone() for s in self.storages], self.views, self.kv_buffers)

    def bits(self) -> list[torch.Tensor]:
        return [bits(s) for s in self.storages]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random bits (NaNs included: every comparison is bitwise)."""
    size = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for n in shape:
        numel *= n
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, device=device)
    return raw.view(dtype).view(shape)


def make_cache(
    layout: str,
    *,
    num_layers: int = 3,
    kv_buffers: int = 2,
    num_blocks: int = 6,
    block: tuple[int, int, int] = (2, 3, 80),
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
) -> Cache:
    num_buffers = num_layers * kv_buffers
    bs, h, d = block
    if layout == "separate":
        storages = [random_tensor((num_blocks, *block), dtype, device) for _ in range(num_buffers)]
        return Cache(storages, list, kv_buffers)
    if layout == "interleaved":
        shape = (num_blocks, num_layers, kv_buffers, *block)
        storages = [random_tensor(shape, dtype, device)]

        def interleaved(s: list[torch.Tensor]) -> list[torch.Tensor]:
            return [s[0][:, j // kv_buffers, j % kv_buffers] for j in range(num_buffers)]

        return Cache(storages, interleaved, kv_buffers)
    assert layout == "padded"
    stride = bs * h * d + 3
    storages = [random_tensor((num_blocks * stride,), dtype, device) for _ in range(num_buffers)]

    def padded(s: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.as_strided((num_blocks, *block), (stride, h * d, d, 1)) for t in s]

    return Cache(storages, padded, kv_buffers)


def all_allocated(ids: list[int]) -> list[int]:
    return []


def allocated_only(allocated: set[int]) -> Callable[[list[int]], list[int]]:
    return lambda ids: [i for i in ids if i not in allocated]


# Plain torch references, on raw bits: out[i, layer, kv] = buffers[layer * kv_buffers + kv][ids[i]]
def ref_gather(cache: Cache, ids: list[int]) -> torch.Tensor:
    blocks = torch.stack([bits(b)[ids] for b in cache.buffers], dim=1) if ids else None
    n, num_buffers = len(ids), len(cache.buffers)
    if blocks is None:
        return torch.empty(0, dtype=torch.uint8)
    return blocks.view(n, num_buffers // cache.kv_buffers, cache.kv_buffers, *blocks.shape[2:])


def ref_scatter(cache: Cache, ids: list[int], src: torch.Tensor) -> None:
    flat = bits(src).view(len(ids), len(cache.buffers), -1)
    for j, buf in enumerate(cache.buffers):
        for k, i in enumerate(ids):
            buf[i].view(torch.uint8).view(-1).copy_(flat[k, j])


def ref_zero(cache: Cache, ids: list[int]) -> None:
    for buf in cache.buffers:
        for i in ids:
            buf[i].view(torch.uint8).zero_()


def ref_copy(cache: Cache, src_ids: list[int], dst_ids: list[int]) -> None:
    for buf in cache.buffers:
        for s, d in zip(src_ids, dst_ids, strict=True):
            buf[d].copy_(buf[s])


def assert_same_memory(cache: Cache, expected: Cache) -> None:
    for mine, theirs in zip(cache.bits(), expected.bits(), strict=True):
        assert torch.equal(mine, theirs)


@pytest.fixture(params=["kernels", "torch"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run each test once through the Triton kernels and once through the torch fallback."""
    if request.param == "torch":
        monkeypatch.setattr(_block_ops, "_use_kernels", lambda device: False)
    yield request.param


def ops(cache: Cache) -> dict[str, object]:
    return {"kv_buffers": cache.kv_buffers, "is_allocated": all_allocated}


# --- each operation against torch, every dtype and layout ---------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_matches_torch_indexing(
    engine: str, device: str, layout: str, dtype: torch.dtype
) -> None:
    cache = make_cache(layout, dtype=dtype, device=device)
    before = cache.clone()
    ids = [5, 0, 5, 2]  # out of order, with a repeat
    out = _block_ops.gather(cache.buffers, ids, **ops(cache))
    assert out.shape == (4, 3, 2, 2, 3, 80)
    assert out.dtype == dtype
    assert out.is_contiguous()
    assert torch.equal(bits(out), bits(ref_gather(cache, ids)))
    assert_same_memory(cache, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_writes_only_the_given_blocks(
    engine: str, device: str, layout: str, dtype: torch.dtype
) -> None:
    cache = make_cache(layout, dtype=dtype, device=device)
    expected = cache.clone()
    ids = [4, 1, 3]
    src = random_tensor((3, 3, 2, 2, 3, 80), dtype, device)
    _block_ops.scatter(cache.buffers, ids, src, **ops(cache))
    ref_scatter(expected, ids, src)
    assert_same_memory(cache, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_clears_only_the_given_blocks(
    engine: str, device: str, layout: str, dtype: torch.dtype
) -> None:
    cache = make_cache(layout, dtype=dtype, device=device)
    expected = cache.clone()
    ids = torch.tensor([3, 0, 3], dtype=torch.int32)  # an int32 tensor, with a repeat
    _block_ops.zero(cache.buffers, ids, **ops(cache))
    ref_zero(expected, [3, 0])
    assert_same_memory(cache, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_duplicates_blocks_in_every_layer(
    engine: str, device: str, layout: str, dtype: torch.dtype
) -> None:
    cache = make_cache(layout, dtype=dtype, device=device)
    expected = cache.clone()
    src_ids, dst_ids = [1, 1, 4], [0, 5, 2]  # a shared source copied twice
    _block_ops.copy(cache.buffers, src_ids, dst_ids, **ops(cache))
    ref_copy(expected, src_ids, dst_ids)
    assert_same_memory(cache, expected)


# --- odd shapes ---------------------------------------------------------------------------------

ODD_SHAPES = {
    # name: (num_layers, kv_buffers, num_blocks, (block_size, heads, head_dim), dtype)
    "one_byte_blocks": (3, 2, 3, (1, 1, 1), torch.float8_e4m3fn),
    "block_size_1_head_dim_80": (3, 2, 4, (1, 1, 80), torch.bfloat16),
    "odd_elements": (1, 2, 3, (3, 1, 5), torch.float16),
    "single_block": (2, 2, 1, (4, 2, 16), torch.float32),
    "k_only": (3, 1, 4, (2, 2, 8), torch.int8),
    "loop_of_chunks": (1, 2, 3, (16, 2, 128), torch.float32),  # 16 KiB: four unmasked chunks
    "loop_with_mask": (1, 1, 3, (1, 1, 4100), torch.float16),  # 8200 bytes: masked chunks
    "chunks_of_2k": (1, 1, 3, (16, 2, 80), torch.float32),  # 10 KiB: five 2 KiB chunks
    # Real models' blocks at block_size 16: not powers of two, yet multiples of 16 bytes.
    "mla_576_bf16": (2, 1, 3, (16, 1, 576), torch.bfloat16),  # DeepSeek-V3: 18432 bytes
    "phi2_32x80": (1, 2, 2, (16, 32, 80), torch.float16),  # 81920 bytes
    "phi3_32x96": (1, 1, 2, (16, 32, 96), torch.float16),  # 98304 bytes
}


@pytest.mark.parametrize("shape", ODD_SHAPES.values(), ids=ODD_SHAPES.keys())
@pytest.mark.parametrize("layout", ["separate", "interleaved"])
def test_odd_shapes_round_trip(
    engine: str, layout: str, shape: tuple[int, int, int, tuple[int, int, int], torch.dtype]
) -> None:
    num_layers, kv_buffers, num_blocks, block, dtype = shape
    cache = make_cache(
        layout,
        num_layers=num_layers,
        kv_buffers=kv_buffers,
        num_blocks=num_blocks,
        block=block,
        dtype=dtype,
    )
    expected = cache.clone()
    kw = ops(cache)
    last = num_blocks - 1
    out = _block_ops.gather(cache.buffers, [last, 0], **kw)
    assert torch.equal(bits(out), bits(ref_gather(expected, [last, 0])))
    src = random_tensor(tuple(out.shape[1:]), dtype, "cpu").unsqueeze(0)
    _block_ops.scatter(cache.buffers, [0], src, **kw)
    ref_scatter(expected, [0], src)
    if num_blocks > 1:
        _block_ops.copy(cache.buffers, [0], [last], **kw)
        ref_copy(expected, [0], [last])
    _block_ops.zero(cache.buffers, [0], **kw)
    ref_zero(expected, [0])
    assert_same_memory(cache, expected)


def test_repeated_calls_see_each_others_writes(engine: str) -> None:
    cache = make_cache("interleaved", num_blocks=6)
    expected = cache.clone()
    kw = ops(cache)
    out = torch.empty(2, 3, 2, 2, 3, 80, dtype=torch.float16)
    for step in range(3):
        src = random_tensor((2, 3, 2, 2, 3, 80), torch.float16, "cpu")
        _block_ops.scatter(cache.buffers, [step, step + 1], src, **kw)
        ref_scatter(expected, [step, step + 1], src)
        _block_ops.copy(cache.buffers, [step + 1], [5], **kw)
        ref_copy(expected, [step + 1], [5])
        got = _block_ops.gather(cache.buffers, [5, step], out, **kw)
        assert got is out
        assert torch.equal(bits(out), bits(ref_gather(expected, [5, step])))
        _block_ops.zero(cache.buffers, torch.tensor([step]), **kw)
        ref_zero(expected, [step])
    assert_same_memory(cache, expected)


# --- empty ids and bad input: nothing is launched -----------------------------------------------


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any kernel is launched."""

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel was launched")

    for name in ("gather_blocks", "scatter_blocks", "zero_blocks", "copy_blocks"):
        monkeypatch.setattr(_block_ops._kernels(), name, launched)


@pytest.mark.usefixtures("no_launch")
def test_empty_ids_launch_nothing() -> None:
    cache = make_cache("separate")
    before = cache.clone()
    kw = ops(cache)
    out = _block_ops.gather(cache.buffers, [], **kw)
    assert out.shape == (0, 3, 2, 2, 3, 80)
    assert out.dtype == torch.float16
    empty = torch.empty(0, 3, 2, 2, 3, 80, dtype=torch.float16)
    _block_ops.scatter(cache.buffers, torch.tensor([], dtype=torch.int64), empty, **kw)
    _block_ops.zero(cache.buffers, [], **kw)
    _block_ops.copy(cache.buffers, [], [], **kw)
    assert_same_memory(cache, before)


def _call(op: str, cache: Cache, changes: dict[str, object]) -> None:
    """Call `op` with valid arguments, but for `changes`."""
    block = (3, 2, 2, 3, 80)
    args: dict[str, object] = {
        "buffers": cache.buffers,
        "kv_buffers": 2,
        "is_allocated": all_allocated,
    }
    if op == "gather":
        args |= {"ids": [1, 2], "out": torch.empty(2, *block, dtype=torch.float16)}
    elif op == "scatter":
        args |= {"ids": [1, 2], "src": torch.zeros(2, *block, dtype=torch.float16)}
    elif op == "zero":
        args |= {"ids": [1, 2]}
    else:
        args |= {"src_ids": [1, 2], "dst_ids": [3, 4]}
    args |= changes
    getattr(_block_ops, op)(**args)


def _non_contiguous_blocks() -> torch.Tensor:
    return torch.empty(2, 3, 2, 2, 80, 3, dtype=torch.float16).transpose(-1, -2)


BAD_INPUT = {
    # name: (op, changes, message)
    "id_not_allocated": ("gather", {"is_allocated": allocated_only({1})}, r"not allocated: \[2\]"),
    "dst_not_allocated": (
        "copy",
        {"is_allocated": allocated_only({1, 2, 3})},
        r"dst_ids names blocks that are not allocated: \[4\]",
    ),
    "id_past_the_end": ("zero", {"ids": [1, 6, 9]}, r"ids out of range \[0, 6\): \[6, 9\]"),
    "negative_id": ("scatter", {"ids": [-1, 2]}, r"out of range \[0, 6\): \[-1\]"),
    "float_id": ("zero", {"ids": [1, 2.0]}, r"ids\[1\] is 2.0, not an int"),
    "bool_id": ("zero", {"ids": [True]}, r"ids\[0\] is a bool"),
    "string_ids": ("zero", {"ids": "12"}, "sequence of ints or a 1-D tensor"),
    "float_tensor_ids": ("zero", {"ids": torch.tensor([1.0])}, "1-D integer tensor"),
    "2d_tensor_ids": ("gather", {"ids": torch.tensor([[1, 2]])}, "1-D integer tensor"),
    "ids_on_another_device": ("zero", {"ids": torch.tensor([1], device="meta")}, "is on meta"),
    "out_wrong_shape": (
        "gather",
        {"out": torch.empty(2, 3, 2, 2, 3, 81, dtype=torch.float16)},
        r"out must be a torch.float16 tensor of shape \(2, 3, 2, 2, 3, 80\) on cpu",
    ),
    "out_wrong_dtype": (
        "gather",
        {"out": torch.empty(2, 3, 2, 2, 3, 80, dtype=torch.bfloat16)},
        "got a torch.bfloat16 tensor",
    ),
    "out_on_another_device": (
        "gather",
        {"out": torch.empty(2, 3, 2, 2, 3, 80, dtype=torch.float16, device="meta")},
        "on meta",
    ),
    "out_not_contiguous": ("gather", {"out": _non_contiguous_blocks()}, "out must be contiguous"),
    "src_not_contiguous": ("scatter", {"src": _non_contiguous_blocks()}, "src must be contiguous"),
    "src_too_few_blocks": (
        "scatter",
        {"src": torch.zeros(1, 3, 2, 2, 3, 80, dtype=torch.float16)},
        r"src must be .* of shape \(2, 3, 2, 2, 3, 80\)",
    ),
    "scatter_repeats_a_block": ("scatter", {"ids": [2, 2]}, r"ids repeats blocks \[2\]"),
    "copy_lengths_differ": ("copy", {"dst_ids": [3]}, "differ in length: 2 vs 1"),
    "copy_repeats_a_destination": ("copy", {"dst_ids": [3, 3]}, r"dst_ids repeats blocks \[3\]"),
    "copy_source_is_a_destination": (
        "copy",
        {"dst_ids": [3, 1]},
        r"blocks \[1\] are both in src_ids and in dst_ids",
    ),
    "kv_buffers_3": ("zero", {"kv_buffers": 3}, "kv_buffers must be 1"),
    "odd_buffer_count": ("zero", {"buffers": [torch.zeros(6, 2, 3, 80)] * 3}, "got 3"),
    "no_buffers": ("zero", {"buffers": []}, "got 0"),
    "unsupported_dtype": (
        "zero",
        {"buffers": [torch.zeros(6, 2, 3, 80, dtype=torch.float64)] * 2},
        "has dtype torch.float64",
    ),
    "buffers_differ_in_shape": (
        "zero",
        {"buffers": [torch.zeros(6, 2, 3, 80), torch.zeros(7, 2, 3, 80)]},
        r"buffers\[1\] has shape \(7, 2, 3, 80\)",
    ),
    "buffers_differ_in_device": (
        "zero",
        {"buffers": [torch.zeros(6, 2, 3, 80), torch.zeros(6, 2, 3, 80, device="meta")]},
        r"buffers\[1\] has device meta",
    ),
    "buffer_not_4d": ("zero", {"buffers": [torch.zeros(6, 480)] * 2}, "must be a 4-D tensor"),
    "block_not_contiguous": (
        "zero",
        {"buffers": [torch.zeros(6, 80, 3, 2).permute(0, 3, 2, 1)] * 2},
        "each block contiguously",
    ),
}


# Note [Argument errors] in kvasync._validate: a wrong type (or dtype) is a TypeError, not a
# ValueError (issue 27 found these five raising ValueError); every other case is a wrong value.
WRONG_TYPES = {"float_id", "bool_id", "string_ids", "float_tensor_ids", "out_wrong_dtype"}


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_raises_before_any_launch(case: str) -> None:
    op, changes, message = BAD_INPUT[case]
    cache = make_cache("separate")
    before = cache.clone()
    with pytest.raises(TypeError if case in WRONG_TYPES else ValueError, match=message) as raised:
        _call(op, cache, changes)
    assert raised.type is (TypeError if case in WRONG_TYPES else ValueError)  # not a subclass
    assert_same_memory(cache, before)


def test_error_names_at_most_eight_ids() -> None:
    cache = make_cache("separate", num_blocks=20)
    with pytest.raises(ValueError, match=r"\[0, 1, 2, 3, 4, 5, 6, 7, \.\.\. \(20 in all\)\]"):
        _block_ops.zero(cache.buffers, list(range(20)), kv_buffers=2, is_allocated=lambda ids: ids)


# --- the allocator's own memory ----------------------------------------------------------------


ALLOCATOR_GEOMETRIES = {
    # name: (num_kv_heads, head_dim, block_size, dtype, kv_buffers)
    # 512-byte blocks (4 KiB across layers): a whole number of them in a 2 MiB page.
    "pow2": (2, 64, 2, torch.float16, 2),
    # MLA's 18432-byte blocks: a block id per page boundary is never handed out.
    "mla576": (1, 576, 16, torch.bfloat16, 1),
    # 480-byte blocks: 16-byte aligned but no power of two, odd head count.
    "3x80": (3, 80, 1, torch.float16, 2),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("contiguous", [False, True], ids=["per-layer", "contiguous"])
@pytest.mark.parametrize("geometry", list(ALLOCATOR_GEOMETRIES))
async def test_block_ops_on_the_allocators_host_mapped_memory(
    engine: str, contiguous: bool, geometry: str
) -> None:
    # Only allocated blocks are mapped: touching any other one faults, so this also pins that an
    # unallocated id is refused before anything touches memory.
    from kvasync import Config, KVLayout, open_allocator

    heads, head_dim, block_size, dtype, kv_buffers = ALLOCATOR_GEOMETRIES[geometry]
    layout = KVLayout(
        num_layers=4,
        num_kv_heads=heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        kv_buffers=kv_buffers,
        contiguous=contiguous,
    )
    async with open_allocator(layout, Config(backend="host", max_blocks=4096)) as kv:
        ids = await kv.alloc(4)
        buffers = [b for i in range(4) for b in kv.layer(i)]
        allocated = allocated_only(set(ids))
        kw: dict[str, object] = {"kv_buffers": kv_buffers, "is_allocated": allocated}
        src = random_tensor((4, 4, kv_buffers, block_size, heads, head_dim), dtype, "cpu")
        _block_ops.scatter(buffers, ids, src, **kw)
        assert torch.equal(bits(_block_ops.gather(buffers, ids, **kw)), bits(src))
        _block_ops.copy(buffers, ids[:1], ids[1:2], **kw)
        _block_ops.zero(buffers, ids[2:3], **kw)
        expected = src.clone()
        expected[1] = src[0]
        expected[2] = 0
        assert torch.equal(bits(_block_ops.gather(buffers, ids, **kw)), bits(expected))
        unmapped = next(i for i in range(kv.num_blocks - 1, -1, -1) if i not in ids)
        with pytest.raises(ValueError, match=rf"not allocated: \[{unmapped}\]"):
            _block_ops.gather(buffers, [ids[0], unmapped], **kw)


@pytest.mark.skipif(HAS_CUDA, reason="a GPU runs the kernels compiled")
def test_kernels_run_under_the_interpreter_without_a_gpu() -> None:
    # Else the CPU tests above would only check the torch fallback.
    assert _block_ops._use_kernels(torch.device("cpu"))
