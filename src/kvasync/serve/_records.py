"""What the engine reports: a finished request's record, a completion, the engine's stats."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Completion", "EngineStats", "RequestRecord"]


@dataclass(frozen=True)
class RequestRecord:
    """One finished (or failed) request, for benchmarks: times are ``time.monotonic()``."""

    request_id: int
    arrival: float
    first_token: float | None
    finish: float
    prompt_tokens: int
    output_tokens: int
    preemptions: int
    error: str | None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Completion:
    """The result of ``Engine.complete``."""

    text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    record: RequestRecord


@dataclass(frozen=True)
class EngineStats:
    """Counters and gauges of an engine (``kv`` is the allocator's snapshot)."""

    running: int
    waiting: int
    finished: int
    failed: int
    preemptions: int
    moved_blocks: int  # blocks moved out of the allocator's draining pages (Note [Limit policy])
    steps: int
    prompt_tokens: int
    output_tokens: int
    kv_used_blocks: int
    kv_mapped_bytes: int
