"""A decoder-only transformer with deterministic random weights and a byte vocabulary.

Note [Reference model]
~~~~~~~~~~~~~~~~~~~~~~
The engine needs a real model to compute attention over the blocks kvasync hands out, not a
trained one: its job is to exercise the KV cache exactly as a serving engine does. So the weights
are drawn from a seeded generator (the same seed gives the same model on every machine), the
vocabulary is the 256 byte values (text in, UTF-8 bytes as tokens, text out), and the
architecture is the common one of current open models: RMSNorm, rotary position embeddings,
grouped-query attention, a SwiGLU MLP.

``forward`` runs one batch of new tokens, of any mix of sequences, through the model and hands
each layer's q, k and v to an ``attend`` callback: the paged engine writes k and v into its blocks
and attends over them (serve/_attention.py), ``dense_forward`` attends over the whole sequence in
one tensor. Both call the same code for everything else, so comparing their logits tests the
paged KV path alone (tests/test_serve_model.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["PRESETS", "ModelConfig", "Transformer", "preset"]

VOCAB_SIZE = 256  # one token per byte value


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a model.

    Args:
        name: the preset's name.
        num_layers: transformer blocks.
        d_model: width of the residual stream.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention: divides num_heads).
        head_dim: elements per head (a power of two, for the attention kernel).
        ffn_dim: hidden width of the SwiGLU MLP.
        max_seq_len: the longest sequence (prompt + output) a request may have.
        block_size: tokens per KV block.
        seed: the seed the weights are drawn from.

    Raises:
        ValueError: a size out of range.
    """

    name: str
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_seq_len: int = 1024
    block_size: int = 16
    seed: int = 0
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim & (self.head_dim - 1):
            raise ValueError(f"ModelConfig.head_dim must be a power of two, got {self.head_dim}")
        if self.max_seq_len < 2 or self.block_size < 1:
            raise ValueError("ModelConfig.max_seq_len must be >= 2 and block_size >= 1")

    @property
    def num_params(self) -> int:
        """Parameters in all (embedding and output head included)."""
        attention = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.d_model * self.ffn_dim
        per_layer = attention + mlp + 2 * self.d_model
        return self.num_layers * per_layer + 2 * VOCAB_SIZE * self.d_model + self.d_model


PRESETS: dict[str, ModelConfig] = {
    # Runs on a CPU in milliseconds a step: CI, `make demo`.
    "tiny": ModelConfig(
        "tiny",
        num_layers=2,
        d_model=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        max_seq_len=512,
    ),
    # About 100M parameters (12 x 8.7M + embeddings), for a GPU.
    "small": ModelConfig(
        "small",
        num_layers=12,
        d_model=768,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        ffn_dim=3072,
        max_seq_len=4096,
    ),
}


def preset(name: str) -> ModelConfig:
    """The preset called ``name``.

    Raises:
        ValueError: no such preset.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; use one of {sorted(PRESETS)}") from None


# attend(layer, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Transformer:
    """The model's weights and its forward pass (no autograd: inference only).

    Args:
        config: the model's shape and seed.
        device: where the weights live.
        dtype: the weights' and activations' dtype (norms and softmax run in fp32).
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        # Drawn on the CPU in fp32 so that the same seed gives the same model on every device.
        gen = torch.Generator().manual_seed(config.seed)
        c = config

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen) / math.sqrt(rows)  # unit-variance outputs
            return w.to(self.device, dtype)

        self.embedding = torch.randn(VOCAB_SIZE, c.d_model, generator=gen).to(self.device, dtype)
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append(
                {
                    "wq": weight(c.d_model, c.num_heads * c.head_dim),
                    "wk": weight(c.d_model, c.num_kv_heads * c.head_dim),
                    "wv": weight(c.d_model, c.num_kv_heads * c.head_dim),
                    "wo": weight(c.num_heads * c.head_dim, c.d_model),
                    "w_gate": weight(c.d_model, c.ffn_dim),
                    "w_up": weight(c.d_model, c.ffn_dim),
                    "w_down": weight(c.ffn_dim, c.d_model),
                    "norm1": torch.ones(c.d_model, device=self.device, dtype=dtype),
                    "norm2": torch.ones(c.d_model, device=self.device, dtype=dtype),
                }
            )
        self.final_norm = torch.ones(c.d_model, device=self.device, dtype=dtype)
        self.head = weight(c.d_model, VOCAB_SIZE)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).double() / c.head_dim))
        angles = torch.outer(torch.arange(c.max_seq_len).double(), inv_freq)
        self._cos = angles.cos().float().to(self.device)
        self._sin = angles.sin().float().to(self.device)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Logits of a batch of new tokens.

        Args:
            tokens: ``[T]`` int64 byte values, the new tokens of every sequence in the batch.
            positions: ``[T]`` int64, each token's position in its sequence.
            attend: computes one layer's attention (see the module docstring).

        Returns:
            ``[T, 256]`` fp32 logits.
        """
        c = self.config
        x = self.embedding[tokens]
        num = tokens.shape[0]
        for index, w in enumerate(self.layers):
            h = _rms_norm(x, w["norm1"])
            q = self._rope((h @ w["wq"]).view(num, c.num_heads, c.head_dim), positions)
            k = self._rope((h @ w["wk"]).view(num, c.num_kv_heads, c.head_dim), positions)
            v = (h @ w["wv"]).view(num, c.num_kv_heads, c.head_dim)
            attn = attend(index, q, k, v)
            x = x + attn.reshape(num, c.num_heads * c.head_dim) @ w["wo"]
            h = _rms_norm(x, w["norm2"])
            x = x + (F.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        return (_rms_norm(x, self.final_norm) @ self.head).float()

    def dense_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of every position of one sequence, attending in one dense tensor (no cache).

        The reference the paged engine is tested against.

        Args:
            tokens: ``[L]`` int64 byte values.

        Returns:
            ``[L, 256]`` fp32 logits.
        """
        group = self.config.num_heads // self.config.num_kv_heads

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
                is_causal=True,
            )  # fmt: skip
            return out.transpose(0, 1).to(q.dtype)

        positions = torch.arange(tokens.shape[0], device=self.device)
        return self.forward(tokens.to(self.device), positions, attend)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Rotates the two halves of each head (the "rotate half" convention).
        cos = self._cos[positions][:, None, :]
        sin = self._sin[positions][:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
