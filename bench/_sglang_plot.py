"""The identity mode's memory over time, from bench_sglang's JSON: each engine's device memory
(nvidia-smi, per process) and the allocator's mapped KV (kvasync's ledger, or kvcached's own
count), on one time axis from the first sample.

    python bench/_sglang_plot.py bench/sglang/2026-12-02/identity_two_301da36.json OUT.png

bench_sglang.py draws it after a run with an identity mode (``identity_memory.png`` beside its
JSON).
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

from _vllm_report import pyplot, save_plot

GIB = 2**30


def memory_series(identity: dict[str, Any]) -> dict[str, tuple[list[float], list[float]]]:
    """Label -> (seconds since the first sample, GiB): ``<engine>: device`` for each engine in
    the samples, ``<name>: mapped KV`` for each allocator in the ledger's."""
    memory = identity.get("memory") or []
    ledger = identity.get("ledger") or []
    walls = [s["wall"] for s in memory] + [s["wall"] for s in ledger]
    if not walls:
        return {}
    t0 = min(walls)
    series: dict[str, tuple[list[float], list[float]]] = {}
    for sample in memory:
        for engine, mib in sample.get("mib", {}).items():
            xs, ys = series.setdefault(f"{engine}: device", ([], []))
            xs.append(sample["wall"] - t0)
            ys.append(float(mib) / 1024)
    for sample in ledger:
        for name, gib in sample.get("mapped_gib", {}).items():
            xs, ys = series.setdefault(f"{name}: mapped KV", ([], []))
            xs.append(sample["wall"] - t0)
            ys.append(float(gib))
    return series


def plot_identity(results: dict[str, Any], path: pathlib.Path) -> bool:
    """Draws the identity mode's memory to ``path``; False when there is nothing to draw (no
    identity mode, no samples) or no matplotlib."""
    series = memory_series(results.get("identity") or {})
    if not series:
        return False
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for label, (xs, ys) in sorted(series.items()):
        ax.plot(xs, ys, label=label, linestyle="--" if "mapped" in label else "-")
    ax.set_xlabel("seconds since the first sample")
    ax.set_ylabel("GiB")
    ax.set_title("SGLang identity: device memory per engine and mapped KV")
    ax.legend(fontsize=7)
    save_plot(plt, fig, path)
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    results = json.loads(pathlib.Path(argv[1]).read_text())
    return 0 if plot_identity(results, pathlib.Path(argv[2])) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
