"""vLLM 0.26 with kvasync's plugin beside stock vLLM, in one run: outputs, throughput, start time,
and the KV memory over time.

Each engine runs in its own process (``--engine stock|kvasync``), in order stock, kvasync, stock
again (the first start compiles Triton kernels into the on-disk cache; the later ones find them
there, so the start times to compare are the kvasync run's and the second stock run's). Every
engine serves the same greedy workload of token-id prompts on a Llama-architecture model with
random weights (no weights can be fetched; both engines get the same seed):

- ``warmup``: 32 requests of 128 + 16 (the first kernels' Triton JIT; not reported);
- ``burst``: 256 requests of 128 prompt and 128 output tokens;
- ``long``: 64 requests of 1024 prompt and 128 output tokens (more KV memory);
- ``idle``: 3 s with no requests, then ``trickle``: 8 requests of 128 + 32.

The device's used memory (``torch.cuda.mem_get_info``) is sampled every 50 ms in both, and the
kvasync allocator's mapped bytes in the kvasync run. Output token ids of both engines are
compared request by request.

``--colocate`` instead starts a stock engine at ``gpu_memory_utilization=0.85`` that keeps
serving, and then, beside it, a second engine: stock at 0.3, then kvasync with ``--limit``.

Usage (on the GPU machine, vLLM importable)::

    python3 bench/bench_vllm.py --out OUTDIR [--limit 38GiB]
    python3 bench/bench_vllm.py --out OUTDIR --colocate --limit 8GiB
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
from typing import Any

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Bytes of one 16-token block across all layers: K and V, 8 heads of 64, bf16, 16 layers.
BLOCK_BYTES = 2 * 16 * 8 * 64 * 2 * 16
PHASES = (
    ("warmup", 32, 128, 16),
    ("burst", 256, 128, 128),
    ("long", 64, 1024, 128),
    ("trickle", 8, 128, 32),
)
SAMPLE_PERIOD = 0.05
IDLE_SECONDS = 3.0


def prompts(count: int, length: int, salt: int) -> list[list[int]]:
    return [[(7 * i + 13 * salt + j) % 50000 + 10 for j in range(length)] for i in range(count)]


class Sampler(threading.Thread):
    """Samples the device's used memory (and kvasync's mapped bytes) until stopped."""

    def __init__(self, mapped: Any) -> None:
        super().__init__(daemon=True)
        self.mapped = mapped
        self.samples: list[tuple[float, float, float]] = []
        self.phase = "start"
        self.marks: list[tuple[float, str]] = []
        self.stop_event = threading.Event()
        self.t0 = time.monotonic()

    def mark(self, phase: str) -> None:
        self.marks.append((time.monotonic() - self.t0, phase))

    def run(self) -> None:
        import torch

        while not self.stop_event.wait(SAMPLE_PERIOD):
            free, total = torch.cuda.mem_get_info()
            mapped = self.mapped() if self.mapped is not None else float("nan")
            self.samples.append((time.monotonic() - self.t0, (total - free) / 2**30, mapped))


def run_engine(
    engine: str,
    out: pathlib.Path,
    utilization: float = 0.3,
    hold: float = 0.0,
    ready: pathlib.Path | None = None,
) -> None:
    """One engine's run (a child process); writes ``out``. With ``hold``, it signals ``ready``
    once up and serves bursts for ``hold`` seconds instead of the phases (a busy neighbour)."""
    model_dir = pathlib.Path.home() / "llama-1b-config"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(MODEL_CONFIG))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=utilization,
        max_model_len=2048,
        dtype="bfloat16",
        seed=0,
        attention_config={"backend": "TRITON_ATTN"},
    )
    start_s = time.monotonic() - started
    if hold:
        out.write_text(json.dumps({"engine": engine, "start_s": start_s}))
        if ready is not None:
            ready.write_text("up")
        params = SamplingParams(max_tokens=128, temperature=0, detokenize=False, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(256, 512, 99)]
        due = time.monotonic() + hold
        while time.monotonic() < due:
            llm.generate(batch, params, use_tqdm=False)
        return
    mapped = None
    kv_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    if engine == "kvasync":
        from kvasync.integrations.vllm._engine import current_engine

        registered = current_engine()
        if registered is None:
            raise SystemExit("the kvasync plugin did not register an allocator in this process")
        kv = registered.allocator
        mapped = lambda: kv.stats().mapped_bytes / 2**30  # noqa: E731
    sampler = Sampler(mapped)
    sampler.start()
    result: dict[str, Any] = {
        "engine": engine,
        "start_s": start_s,
        "kv_blocks": kv_blocks,
        "kv_capacity_gib": (kv_blocks or 0) * BLOCK_BYTES / 2**30,
        "phases": {},
        "tokens": {},
    }
    for salt, (phase, count, length, output) in enumerate(PHASES):
        if phase == "trickle":
            sampler.mark("idle")
            time.sleep(IDLE_SECONDS)
        sampler.mark(phase)
        params = SamplingParams(max_tokens=output, temperature=0, detokenize=False, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(count, length, salt)]
        t = time.monotonic()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.monotonic() - t
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        result["phases"][phase] = {
            "requests": count,
            "seconds": seconds,
            "tok_s": produced / seconds,
        }
        result["tokens"][phase] = [list(o.outputs[0].token_ids) for o in outs]
    sampler.mark("end")
    time.sleep(1.0)
    sampler.stop_event.set()
    sampler.join(2.0)
    result["samples"] = sampler.samples
    result["marks"] = sampler.marks
    out.write_text(json.dumps(result))


def child(engine: str, out: pathlib.Path, limit: str) -> dict[str, Any]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    for name in ("KVASYNC_VLLM", "KVASYNC_MEMORY_LIMIT", "KVASYNC_SHARE", "KVASYNC_DEVICE_BUDGET"):
        env.pop(name, None)
    if engine == "kvasync":
        # Freed blocks go back at once (no prefix reuse across requests: the prompts share none).
        env.update(KVASYNC_MEMORY_LIMIT=limit, KVASYNC_PREFIX_CACHE="0", KVASYNC_NAME="vllm-bench")
    else:
        env["KVASYNC_VLLM"] = "0"
    command = [sys.executable, __file__, "--engine", engine, "--json", str(out)]
    subprocess.run(command, env=env, check=True, timeout=420)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def during(run: dict[str, Any], phase: str, column: int) -> tuple[float, float]:
    """(max, last) of a sample column over ``phase``."""
    marks = run["marks"]
    names = [m[1] for m in marks]
    start = marks[names.index(phase)][0]
    later = [m[0] for m in marks if m[0] > start]
    end = later[0] if later else float("inf")
    values = [s[column] for s in run["samples"] if start <= s[0] < end]
    return (max(values), values[-1]) if values else (float("nan"), float("nan"))


def report(runs: list[dict[str, Any]], out: pathlib.Path) -> None:
    stock, plugin, stock_warm = runs
    same = total = 0
    for phase in ("burst", "long", "trickle"):
        for a, b in zip(stock["tokens"][phase], plugin["tokens"][phase], strict=True):
            total += 1
            same += a == b
    print(f"greedy outputs token-identical: {same}/{total} requests")
    print()
    print("| engine | start s | burst tok/s | long tok/s | trickle tok/s | KV capacity GiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for run in runs:
        p = run["phases"]
        print(
            f"| {run['engine']}{' (warm)' if run is stock_warm else ''} | {run['start_s']:.1f} "
            f"| {p['burst']['tok_s']:.0f} | {p['long']['tok_s']:.0f} | {p['trickle']['tok_s']:.0f} "
            f"| {run['kv_capacity_gib']:.1f} |"
        )
    print()
    print(
        "| phase | stock device used GiB (max) | kvasync device used GiB (max / at end) "
        "| kvasync mapped KV GiB (max / at end) |"
    )
    print("| --- | ---: | ---: | ---: |")
    for phase in ("burst", "long", "idle", "trickle"):
        s_max, _ = during(stock, phase, 1)
        k_max, k_end = during(plugin, phase, 1)
        m_max, m_end = during(plugin, phase, 2)
        print(f"| {phase} | {s_max:.2f} | {k_max:.2f} / {k_end:.2f} | {m_max:.2f} / {m_end:.2f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for run, label in ((stock, "stock: device used"), (plugin, "kvasync: device used")):
        ax.plot([s[0] for s in run["samples"]], [s[1] for s in run["samples"]], label=label)
    ax.plot(
        [s[0] for s in plugin["samples"]],
        [s[2] for s in plugin["samples"]],
        label="kvasync: mapped KV",
    )
    for t, phase in plugin["marks"]:
        ax.axvline(t, color="grey", lw=0.5)
        ax.text(t, ax.get_ylim()[1] * 0.95, phase, fontsize=7)
    ax.set_xlabel("seconds since the engine was up")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "vllm_memory.png", dpi=110)
    print(f"plot: {out / 'vllm_memory.png'}")


def colocate(out: pathlib.Path, limit: str) -> None:
    """A second engine started while a stock engine (``gpu_memory_utilization=0.85``) serves:
    stock vLLM at 0.3, then kvasync with ``limit``. Prints whether each started, and how fast."""
    base = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    ready = out / "neighbour.ready"
    ready.unlink(missing_ok=True)
    me = [sys.executable, __file__]
    neighbour_args = ["--engine", "stock", "--util", "0.85", "--hold", "150"]
    neighbour_args += ["--ready", str(ready), "--json", str(out / "neighbour.json")]
    neighbour = subprocess.Popen([*me, *neighbour_args], env=dict(base, KVASYNC_VLLM="0"))
    rows = []
    try:
        due = time.monotonic() + 300
        while not ready.exists():
            if neighbour.poll() is not None or time.monotonic() > due:
                raise SystemExit("the neighbour engine did not come up")
            time.sleep(0.5)
        for engine, env in (
            ("stock", dict(base, KVASYNC_VLLM="0")),
            ("kvasync", dict(base, KVASYNC_MEMORY_LIMIT=limit, KVASYNC_NAME="vllm-second")),
        ):
            result = out / f"second_{engine}.json"
            t = time.monotonic()
            done = subprocess.run(
                [*me, "--engine", engine, "--json", str(result)],
                env=env,
                timeout=300,
                capture_output=True,
                text=True,
            )
            wall = time.monotonic() - t
            if done.returncode == 0:
                data = json.loads(result.read_text())
                rows.append((engine, "yes", f"{data['start_s']:.1f}", "", data))
            else:
                lines = [x for x in done.stderr.splitlines() if "Error" in x or "error" in x]
                why = (lines[-1] if lines else done.stderr[-300:]).strip()[:160]
                rows.append((engine, "no", f"({wall:.1f} s to fail)", why, None))
            (out / f"second_{engine}.log").write_text(done.stdout + done.stderr)
    finally:
        neighbour.terminate()
        neighbour.wait(60)
    print("| second engine, while a stock engine at 0.85 serves | started | start s | error |")
    print("| --- | --- | ---: | --- |")
    for engine, started, start, why, data in rows:
        extra = ""
        if data:
            extra = f" (served: burst {data['phases']['burst']['tok_s']:.0f} tok/s)"
        print(f"| {engine} | {started}{extra} | {start} | {why} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--engine", choices=("stock", "kvasync"))
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("vllm-bench"))
    parser.add_argument("--limit", default="38GiB", help="the kvasync engine's KV memory limit")
    parser.add_argument("--util", type=float, default=0.3, help="gpu_memory_utilization")
    parser.add_argument("--hold", type=float, default=0.0, help="serve this long as neighbour")
    parser.add_argument("--ready", type=pathlib.Path, help="the file a neighbour writes once up")
    parser.add_argument(
        "--colocate", action="store_true", help="a second engine beside a busy stock one"
    )
    args = parser.parse_args()
    if args.engine:
        run_engine(args.engine, args.json, args.util, args.hold, args.ready)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.colocate:
        colocate(args.out, args.limit)
        return
    runs = []
    for index, engine in enumerate(("stock", "kvasync", "stock")):
        print(f"== {engine} engine", flush=True)
        try:
            runs.append(child(engine, args.out / f"run{index}_{engine}.json", args.limit))
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
            print(f"== {engine} engine failed: {error}", flush=True)
            raise SystemExit(1) from None
    report(runs, args.out)


if __name__ == "__main__":
    main()
