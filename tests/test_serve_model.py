"""The paged engine computes what a dense, unpaged forward pass of the same model computes.

Sequences span several blocks whose ids are shuffled (so a wrong table lookup shows), are
prefilled together in one batch, then decode step by step across block boundaries; every step's
logits are compared with a dense forward over the whole sequence.
"""

import importlib
import os
import random
import subprocess
import sys

import pytest
import torch

import kvasync
from kvasync import kernels  # type: ignore[attr-defined]
from kvasync.serve import ModelConfig, ModelRunner, Transformer
from kvasync.serve._attention import PagedBatch, reference_paged_attention
from kvasync.serve._model import preset

PROMPT_LENGTHS = (37, 5, 20)  # 3, 1 and 2 blocks of 16 before decoding
DECODE_STEPS = 14  # the second sequence crosses into its second block, the first into its fourth


def _layout(config: ModelConfig, dtype: torch.dtype) -> kvasync.KVLayout:
    return kvasync.KVLayout(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        block_size=config.block_size,
        dtype=dtype,
    )


async def _paged_matches_dense(
    device: str, backend: str, dtype: torch.dtype, use_kernel: bool, tolerance: float
) -> None:
    config = preset("tiny")
    model = Transformer(config, device, dtype)
    # cuda maps in multiples of the driver's 2 MiB granularity; host in any multiple of 4 KiB.
    page_size = (2 << 20) if backend == "cuda" else (64 << 10)
    kv_config = kvasync.Config(backend=backend, max_blocks=1024, page_size=page_size)
    rng = random.Random(7)
    async with kvasync.open_allocator(_layout(config, dtype), kv_config) as kv:
        runner = ModelRunner(model, kv, use_kernel)
        # Teacher forcing: the decoded tokens are fixed in advance, so one causal dense pass over
        # each whole sequence gives the expected logits of every step.
        final = [n + DECODE_STEPS for n in PROMPT_LENGTHS]
        sequences = [[rng.randrange(256) for _ in range(n)] for n in final]
        expected = [model.dense_forward(torch.tensor(seq)) for seq in sequences]
        pool = await kv.alloc(sum(-(-n // config.block_size) for n in final), timeout=5)
        rng.shuffle(pool)
        tables = []
        for n in final:
            count = -(-n // config.block_size)
            tables.append(pool[:count])
            pool = pool[count:]
        starts = [0] * len(sequences)
        ends = list(PROMPT_LENGTHS)
        for step in range(DECODE_STEPS + 1):
            logits = runner.step(
                [seq[:end] for seq, end in zip(sequences, ends, strict=True)], starts, tables
            )
            offset = 0
            for s in range(len(sequences)):
                computed = ends[s] - starts[s]
                torch.testing.assert_close(
                    logits[offset : offset + computed].cpu(),
                    expected[s][starts[s] : ends[s]].cpu(),
                    atol=tolerance, rtol=tolerance,
                    msg=lambda m, s=s, step=step: f"sequence {s}, step {step}: {m}",
                )  # fmt: skip
                offset += computed
                starts[s] = ends[s]
                ends[s] += 1
        assert offset == len(sequences)  # the last step decoded one token per sequence


async def test_paged_logits_equal_a_dense_forward_on_the_cpu() -> None:
    await _paged_matches_dense("cpu", "host", torch.float32, False, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-3), (torch.bfloat16, 6e-2)])
async def test_paged_logits_equal_a_dense_forward_with_the_triton_kernel(
    dtype: torch.dtype, tolerance: float
) -> None:
    await _paged_matches_dense("cuda", "cuda", dtype, True, tolerance)


def _random_batch(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch]:
    # 2 sequences: one prefilling 3 tokens at positions 4..6, one decoding at position 9; blocks
    # of 4 tokens, 2 query heads per KV head: a grid of 4 x 4 programs, 3 blocks each.
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(8, 4, 2, 16, generator=gen).to(device)
    v_cache = torch.randn(8, 4, 2, 16, generator=gen).to(device)
    q = torch.randn(4, 4, 16, generator=gen).to(device)
    batch = PagedBatch.build([[5, 2], [7, 0, 3]], [4, 9], [7, 10], 4, torch.device(device))
    return q, k_cache, v_cache, batch


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter runs only where there is no GPU"
)
def test_triton_kernel_matches_the_torch_reference_under_the_interpreter() -> None:
    assert kernels.INTERPRETED
    q, k_cache, v_cache, batch = _random_batch("cpu")
    expected = reference_paged_attention(q, k_cache, v_cache, batch)
    got = kernels.paged_attention(
        q, k_cache, v_cache, batch.block_tables, batch.query_seqs, batch.query_positions
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_triton_kernel_matches_the_torch_reference_on_the_gpu() -> None:
    q, k_cache, v_cache, batch = _random_batch("cuda")
    expected = reference_paged_attention(q, k_cache, v_cache, batch)
    got = kernels.paged_attention(
        q, k_cache, v_cache, batch.block_tables, batch.query_seqs, batch.query_positions
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_rejects_mismatched_shapes() -> None:
    q, k_cache, v_cache, batch = _random_batch("cpu")
    with pytest.raises(ValueError, match="query_seqs"):
        kernels.paged_attention(
            q, k_cache, v_cache, batch.block_tables, batch.query_seqs[:2], batch.query_positions
        )
    with pytest.raises(ValueError, match="head_dim"):
        kernels.paged_attention(
            q[..., :8], k_cache, v_cache, batch.block_tables, batch.query_seqs,
            batch.query_positions,
        )  # fmt: skip


def test_same_seed_same_weights_and_presets_have_their_sizes() -> None:
    a = Transformer(preset("tiny"))
    b = Transformer(preset("tiny"))
    assert torch.equal(a.layers[1]["wq"], b.layers[1]["wq"])
    assert 90e6 < preset("small").num_params < 120e6
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig("bad", 1, 8, num_heads=3, num_kv_heads=2, head_dim=4, ffn_dim=8)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")


def compile_for_hopper(dtype: str) -> str:
    """The kernel's PTX for sm_90 with a ``dtype`` cache (no GPU needed; run without the
    interpreter, which patches Triton for the whole process: hence a child process)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = importlib.import_module("kvasync.kernels.paged_attention")
    kernel = module._paged_attention_kernel
    constexprs = {"GROUP": 3, "BLOCK_SIZE": 16, "HEAD_DIM": 64, "MAX_BLOCKS": 8, "INTERPRET": False}
    types = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    types.update({name: "*i32" for name in ("table_ptr", "seq_ptr", "pos_ptr")})
    types["scale"] = "fp32"
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in kernel.arg_names
    }
    keyed = {(kernel.arg_names.index(name),): value for name, value in constexprs.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=keyed)
    target = GPUTarget("cuda", 90, 32)
    return str(triton.compile(source, target=target, options={"num_warps": 4}).asm["ptx"])


def test_paged_attention_compiles_for_hopper() -> None:
    # The compiled kernel loops to a bound loaded from memory, which the interpreter never runs.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=100
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["bf16:ok"]


if __name__ == "__main__":
    ptx = compile_for_hopper("bf16")
    print(f"bf16:{'ok' if 'ld.global' in ptx and 'st.global' in ptx else 'no-access'}")
