"""One case (memory or compute) at one N: its variants (static 1/N, shared, the splits with
hindsight), run in turn on the same traces."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from _colocate_many.analysis import summarize_variant
from _colocate_many.harness import Harness, VariantRun
from _colocate_many.shapes import Geometry, Regime
from _colocate_many.traces import TraceRequest, demand_series


def split_pages(weights: Sequence[float], total: int, floor: int) -> list[int]:
    """Pages per engine proportional to ``weights``, each at least ``floor``, summing to at most
    ``total`` (the remainder to the heaviest)."""
    n = len(weights)
    spare = total - floor * n
    share = [w / sum(weights) for w in weights]
    pages = [floor + int(spare * s) for s in share]
    order = sorted(range(n), key=lambda i: -share[i])
    k = 0
    while sum(pages) < total:
        pages[order[k % n]] += 1
        k += 1
    return pages


class Case:
    """One case (memory or compute) at one N: its traces, its variants, its tables."""

    def __init__(
        self,
        harness: Harness,
        name: str,
        engines: int,
        traces: list[list[TraceRequest]],
        regime: Regime,
        budget: int,
        geo: Geometry,
        duration: float,
        phases: list[tuple[float, int]] | None,
    ) -> None:
        self.harness = harness
        self.name = name
        self.n = engines
        self.traces = traces
        self.regime = regime
        self.budget = budget
        self.geo = geo
        self.duration = duration
        self.phases = phases
        self.runs: list[VariantRun] = []
        self.summaries: list[dict[str, Any]] = []
        self.verdict = "-"  # the regime check's ("yes" or "NO"), once run
        self.give_up_s = regime.give_up_factor * regime.slo_ttft_s
        longest_output = max(r.max_tokens for t in traces for r in t)
        self.horizon_s = regime.slo_ttft_s + longest_output * regime.slo_tpot_s + 1.0
        self.total_pages = budget // geo.page_bytes
        longest = max(r.prompt_tokens + r.max_tokens for t in traces for r in t)
        # A static partition holds at least the longest request (else it refuses it).
        self.floor_pages = -(-longest // geo.tokens_per_page) + 1

    def config(self, index: int, **changes: Any) -> dict[str, Any]:
        # Every variant's engines hold admission above the step target (compute counts too).
        return self.harness.base_config(
            self.regime.max_batch,
            self.regime.max_batch_tokens,
            name=f"e{index}",
            step_target=self.regime.step_target_frac * self.regime.slo_tpot_s,
            **changes,
        )

    def run_static(self, label: str, pages: list[int]) -> dict[str, Any]:
        configs = [
            self.config(i, memory_limit=p * self.geo.page_bytes, static=True)
            for i, p in enumerate(pages)
        ]
        return self._run(label, configs, None)

    def run_shared(self) -> dict[str, Any]:
        share = f"bench-many-{os.getpid()}-{self.harness.runs + 1}"
        configs = [
            self.config(i, memory_limit=None, share=share, device_budget=self.budget)
            for i in range(self.n)
        ]
        return self._run("shared", configs, share)

    def _run(self, label: str, configs: list[dict[str, Any]], share: str | None) -> dict[str, Any]:
        began = time.monotonic()
        run = self.harness.run(
            label, self.traces, configs, share, self.give_up_s, self.horizon_s, self.duration
        )
        self.runs.append(run)
        summary = summarize_variant(
            run,
            self.regime,
            self.geo.page_bytes,
            self.duration,
            self.budget,
        )
        self.summaries.append(summary)
        print(
            f"  {self.name} N={self.n} {label}: {summary['within SLO']} within SLO of "
            f"{summary['requests']} ({time.monotonic() - began:.0f} s)",
            flush=True,
        )
        return summary

    def best_static_candidates(
        self, lifetime: Callable[[TraceRequest], float], order: list[str]
    ) -> list[tuple[str, list[int]]]:
        demand = [
            demand_series(t, lifetime, self.geo.token_bytes, self.duration) for t in self.traces
        ]
        weights = {
            "peak demand": [float(d.max()) for d in demand],
            "mean demand": [float(d.mean()) for d in demand],
        }
        shared = next((r for r in self.runs if r.variant == "shared"), None)
        if shared is not None:
            weights["shared peaks"] = [float(max(b for _, b in e.memory)) for e in shared.engines]
        uniform = [self.total_pages // self.n] * self.n
        seen = [uniform]
        candidates = []
        for label in order:
            w = weights.get(label)
            if w is None:
                continue
            if min(w) <= 0:
                w = [max(x, 1.0) for x in w]
            pages = split_pages(w, self.total_pages, self.floor_pages)
            if pages in seen:
                continue
            seen.append(pages)
            candidates.append((f"static by {label}", pages))
        return candidates
