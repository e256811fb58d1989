"""The model runner: one forward pass over requests' paged KV, and sampling each next token.

The compute side of the engine (Note [Engine scheduling] in _scheduler.py): it knows blocks only
as the block tables it is handed, and nothing of scheduling. ``execute`` runs in the engine's worker
thread.

Note [Sampling failures]
~~~~~~~~~~~~~~~~~~~~~~~~
A forward pass that raises is a device error: every request of the batch is lost with it, and the
engine stops. Sampling is per request: non-finite logits (a row of NaN) or a sampler's error
(``torch.multinomial`` on a distribution that is not one) belong to that request alone, so
``sample`` hands back the exception in that request's place and the engine fails it alone, while
the others get their tokens. The engine validates what it samples with at submission (a
temperature of 0 or in ``TEMPERATURE_RANGE``), so these are faults, not bad input.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .._allocator import Allocator
from ._attention import PagedBatch, attend_paged, paged_attention_kernel
from ._model import Transformer

__all__ = ["TEMPERATURE_RANGE", "ModelRunner", "SamplingParams"]

# Sampled tokens are printable ASCII and newline, so that outputs read as text; the logits (and
# the correctness test) cover all 256 byte values.
_SAMPLEABLE = [10, *range(32, 127)]
# Temperatures sampling accepts besides 0 (greedy): below, logits / t overflows to inf for
# ordinary logits; above, the distribution is uniform to within float precision.
TEMPERATURE_RANGE = (1e-3, 100.0)
_SEED_LIMIT = 1 << 63  # torch.Generator.manual_seed takes seeds below 2**64; 63 bits suffice


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token: greedy when ``temperature`` is 0, else sampled
    from ``softmax(logits / temperature)`` with ``generator``."""

    temperature: float = 0.0
    generator: torch.Generator | None = None

    @classmethod
    def of(cls, temperature: float, seed: int | None, device: torch.device) -> SamplingParams:
        """Validated parameters, with a generator on ``device`` seeded by ``seed`` (0 if None)
        when sampling.

        Raises:
            ValueError: a temperature that is neither 0 nor within ``TEMPERATURE_RANGE``, or a
                seed that is not None or an int in [0, 2**63).
        """
        low, high = TEMPERATURE_RANGE
        if not (
            isinstance(temperature, (int, float))
            and not isinstance(temperature, bool)
            and (temperature == 0 or low <= temperature <= high)
        ):
            raise ValueError(
                f"temperature must be 0 (greedy) or within [{low:g}, {high:g}], got {temperature!r}"
            )
        if seed is not None and (type(seed) is not int or not 0 <= seed < _SEED_LIMIT):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {seed!r}")
        if temperature == 0:
            return cls()
        generator = torch.Generator(device)
        generator.manual_seed(seed if seed is not None else 0)
        return cls(float(temperature), generator)


class ModelRunner:
    """Runs the model over requests' paged KV: the piece the correctness test drives directly.

    Args:
        model: the transformer.
        kv: the allocator whose blocks hold the K/V.
        use_kernel: attend with the Triton kernel (else the torch reference).
    """

    def __init__(self, model: Transformer, kv: Allocator, use_kernel: bool) -> None:
        self.model = model
        self.kv = kv
        self.use_kernel = use_kernel
        if use_kernel:
            paged_attention_kernel()  # no Triton: a KVAsyncError naming the extra, at start
        self._layers = [kv.layer(i) for i in range(model.config.num_layers)]
        mask = torch.full((256,), float("-inf"))
        mask[_SAMPLEABLE] = 0.0
        self._sample_mask = mask.to(model.device)

    def step(
        self, tokens: list[list[int]], starts: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """Computes positions ``starts[s]..`` of each sequence, writing their K/V into blocks.

        Args:
            tokens: each sequence's tokens so far (its KV covers ``tokens[s][:starts[s]]``).
            starts: tokens of each sequence already in the cache.
            tables: each sequence's block ids, in order, enough for all its tokens.

        Returns:
            ``[T, 256]`` logits of every computed position, sequence after sequence.
        """
        device = self.model.device
        ends = [len(t) for t in tokens]
        batch = PagedBatch.build(tables, starts, ends, self.model.config.block_size, device)
        new = [t for seq, start in zip(tokens, starts, strict=True) for t in seq[start:]]
        token_tensor = torch.tensor(new, dtype=torch.int64).to(device, non_blocking=True)
        positions = batch.query_positions.long()

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attend_paged(q, k, v, self._layers[layer], batch, self.use_kernel)

        return self.model.forward(token_tensor, positions, attend)

    def execute(
        self,
        tokens: list[list[int]],
        starts: list[int],
        tables: list[list[int]],
        sampling: list[SamplingParams],
    ) -> list[int | Exception]:
        """One step: the forward pass (``step``), then each sequence's next token.

        Returns:
            Each sequence's sampled token, or the exception its sampling raised (Note [Sampling
            failures]).

        Raises:
            Exception: the forward pass failed (the whole batch is lost).
        """
        logits = self.step(tokens, starts, tables)
        ends = list(itertools.accumulate(len(t) - s for t, s in zip(tokens, starts, strict=True)))
        last = logits[torch.tensor([e - 1 for e in ends], device=logits.device)]
        return self.sample(last, sampling)

    def sample(self, last: torch.Tensor, sampling: list[SamplingParams]) -> list[int | Exception]:
        """Each sequence's next token from the logits of its last position (``[S, 256]``).

        Returns:
            A token, or the exception that sampling that sequence raised.
        """
        last = last + self._sample_mask
        # One transfer for the greedy tokens and for which rows are not finite.
        finite = torch.isfinite(last[:, _SAMPLEABLE]).all(-1)
        greedy, ok = torch.stack((last.argmax(-1), finite.long())).tolist()
        result: list[int | Exception] = []
        for i, params in enumerate(sampling):
            if not ok[i]:
                result.append(FloatingPointError("the logits are not finite"))
                continue
            if params.temperature == 0:
                result.append(int(greedy[i]))
                continue
            try:
                probs = torch.softmax(last[i] / params.temperature, -1)
                token = torch.multinomial(probs, 1, generator=params.generator)[0]
                result.append(int(token))
            except RuntimeError as error:  # not a distribution; the others go on
                result.append(error)
        return result
