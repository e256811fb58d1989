"""The presets: each case's budget, request shapes and SLOs (``Regime`` for the memory case,
``ComputeShape`` for the compute case), and what a page id of an engine's KV cache holds
(``Geometry``)."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


SAMPLE_S = 0.02  # the workers' sampling interval


# The ledger's: each snapshot takes the share's lock the members' grants take, so the observer
# samples at 50 ms (members publish their used bytes and waiters every 100 ms anyway).
LEDGER_SAMPLE_S = 0.05


READY_TIMEOUT_S = 180.0  # a worker's import, engine open (static: maps its whole limit), warm-up


# Scheduler.held_for as sampled: 0 while it admits or nothing waits.
HELD_CODES = {"memory": 1, "batch": 2, "compute": 3, "tokens": 4}


@dataclass(frozen=True)
class Regime:
    """The memory-bound case of a preset: the budget, the request shapes and the SLOs."""

    budget_mib: int  # the device's KV budget, all engines together
    prompt_median: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    max_batch: int
    max_batch_tokens: int
    slo_ttft_s: float
    slo_tpot_s: float
    hot_fill: float = 0.75  # the hot engine's working set, as a share of the whole budget
    cold_weight: float = 0.05  # a cold engine's arrival rate, as a share of the hot one's
    burst_factor: float = 1.3  # arrivals during a burst, times the rate outside it
    burst_s: float = 1.5
    bursts_per_min: float = 6.0  # per engine, Poisson
    give_up_factor: float = 3.0  # a client leaves after this many TTFT SLOs without a token
    hot_phases: int = 2  # engines hot in turn (0, 1, ...), for 2/3 and 1/3 of the run with 2
    # Admission holds while the engine's recent step time is above this share of the TPOT SLO
    # (EngineConfig.step_target): the rest is room for the steps that carry prefills and for
    # the other engines' kernels between its steps.
    step_target_frac: float = 0.8


REGIMES = {
    # tiny, host backend: 256 KiB page ids of 512 tokens (512 B a token); 8 MiB = 32 page ids
    # = 16k tokens. Decode-heavy like small, scaled to a CPU (which is compute-bound anyway:
    # this preset checks the harness end to end, not the regime).
    "tiny": Regime(8, 64, (32, 128), (48, 128), 64, 1024, 2.0, 0.1),
    # small, cuda: 48 MiB page ids of 4096 tokens (12 KiB a token); 1536 MiB = 32 page ids =
    # 128k tokens. Decode-heavy (the docstring's arithmetic): prompts of 160-640 tokens, outputs
    # of 192-448; TPOT SLO 75 ms (13 tokens/s, faster than anyone reads; the steps of a loaded
    # engine, 30-45 ms on the H200 with prefills in them, leave room), so that the SLO horizon
    # stays short (2 + 448 x 0.075 + 1 = 37 s).
    "small": Regime(1536, 320, (160, 640), (192, 448), 256, 4096, 2.0, 0.075),
}


@dataclass(frozen=True)
class ComputeShape:
    """The compute-bound case of a preset: prefill-heavy requests, so that compute binds at a
    batch far below ``max_batch`` while the KV of a whole batch fits a static half."""

    prompt_median: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    burst_batch: int  # the calibration burst at these shapes (prefill rate, decode step)
    # The crest's arrival rate, times what one engine alone serves at the step target.
    overload: float = 1.75


COMPUTE_SHAPES = {
    # tiny: within the model's 512 positions, prefill-heavy enough that a CPU's compute binds
    # below the batch of 64; checks the harness (and the regime check's "yes") end to end.
    "tiny": ComputeShape(400, (320, 480), (4, 12), 16),
    # small: a request costs the device its prefill (1536 tokens: about 32 ms of an H200 at the
    # 48k tok/s measured) and little decode (64 tokens at <= 60 ms a step: 4 s), so one engine
    # alone serves about 20 req/s at a batch of about 80 (the docstring's arithmetic), and a
    # static half holding a whole batch (256 x 1600 tokens: 4.7 GiB) cannot run out of memory.
    "small": ComputeShape(1536, (1024, 2048), (32, 96), 64),
}


@dataclass(frozen=True)
class Geometry:
    """What a page id of an engine's KV cache holds, on the device the run uses."""

    page_bytes: int  # page_size x ranges: the budget's unit
    tokens_per_page: int
    block_size: int

    @property
    def token_bytes(self) -> float:
        return self.page_bytes / self.tokens_per_page


def geometry(preset: str, device: str) -> Geometry:
    import torch

    import kvasync
    from kvasync.serve._model import preset as model_preset

    model = model_preset(preset)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layout = kvasync.KVLayout(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=model.block_size,
        dtype=dtype,
    )
    page_size = (2 << 20) if device == "cuda" else (64 << 10)  # kv_config's defaults
    blocks = layout.blocks_per_page(page_size)
    return Geometry(page_size * layout.num_ranges, blocks * model.block_size, model.block_size)
