"""SGLang with kvasync's plugin beside stock SGLang, on one GPU (issue 26's H200 runs).

Modes (``--modes``, in order; each prints its table, and everything goes to ``--out``):

- ``identity``: a stock and a kvasync engine, both up at once with the same KV capacity
  (``max_total_tokens``), run the same prompts (mixed lengths 16-1,500, half of them in families
  that share long prefixes; mixed output lengths; greedy) in ``--rounds`` rounds each,
  interleaved (stock, kvasync, kvasync, stock, ...), never at the same time. Reports: token
  identity round by round, prefix-cache hits, output tok/s per round and the kvasync/stock ratio
  of adjacent rounds with its 95% confidence interval, start time, each engine's device memory
  over time (nvidia-smi, per process group) and kvasync's mapped KV (the share's ledger).
- ``release``: a kvasync engine serves, ``release_memory_occupation(["kv_cache"])``, sleeps,
  ``resume_memory_occupation``, serves again: the latencies, and the engine's device memory and
  mapped KV before, while released, and after.
- ``seed-a``: seed A of the allocator kvasync replaces: a first engine serves a steady load; a
  second engine is started beside it ``--seed-starts`` times (each: start, serve a request, shut
  down), every wait with a deadline. Stock SGLang sizes its pool from free memory, with its
  default ``mem_fraction_static``; kvasync's engines share one budget.
- ``two``: two engines, bursts alternating between them (``--bursts`` of ``--burst-requests``,
  1,536-token prompts, ``--output-len`` output tokens), on one budget (``--budget-gib``):
  ``shared`` (one kvasync share), ``static-kvasync`` (each ``KVASYNC_MEMORY_LIMIT`` =
  budget/2) and ``static-stock`` (each ``max_total_tokens`` = budget/2 in tokens). Requests
  within the TTFT SLO (``--slo-s``).

- ``mixed``: the same bursts alternating between a vLLM engine (``--vllm-site``) and an SGLang
  engine: ``shared`` (both in one kvasync share) against ``static`` (stock vLLM's
  ``kv_cache_memory_bytes`` and stock SGLang's ``max_total_tokens``, budget/2 each).

``--candidate kvcached``: the reference allocator, kvcached (github.com/ovg-project/kvcached,
built from source: bench/reference/README.md), in kvasync's place, in ``identity`` (the same
``max_total_tokens`` as stock; its mapped KV from its shared-memory segment) and ``two`` (variant
``kvcached``: each engine's capacity the whole budget, as kvcached shares none between engines;
the most both map at once is the table's joint peak), with ``static-stock`` beside it. The other
modes measure what only kvasync has. It is built before the first engine (``--kvcached-pack``,
``--kvcached-site``; a build of the same commit is kept), and enabled as its README says
(``ENABLE_KVCACHED=true KVCACHED_AUTOPATCH=1``; its import hook patches SGLang) in the engine's
process and in the processes SGLang spawns, where its pool lives; whether the scheduler process
was patched is probed and recorded (``kvcached`` in the mode's record; bench/_sglang_reference.py).
kvcached caps SGLang's radix cache at 16,000 tokens by default (``--kvcached-max-cached-tokens``).
kvasync's SGLang plugin is for SGLang 0.5.17; kvcached's last tested SGLang is 0.5.15.post1, so a
kvcached run compares kvcached with stock on 0.5.15.post1.

``--linger SECONDS``: ``KVASYNC_LINGER`` for every kvasync SGLang engine of every mode (as
``bench_vllm.py --linger`` for vLLM's): the pages in use at a recent peak stay mapped that long
after use falls, also for the vLLM engine of ``mixed``. Off (0) by default, and then no engine gets
the variable: each engine's ``KVASYNC_*`` are its own, never the driver's.

Run on the device (see bench/engines/sglang/README.md for carrying SGLang there):
    SGLANG_SITE=$HOME/ssite python3 bench/bench_sglang.py --out $OUT --modes identity release
    SGLANG_SITE=$HOME/ssite515 python3 bench/bench_sglang.py --out $OUT --candidate kvcached \
        --modes identity --prompts 64 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _sglang_reference as kvcached_ref
from _sglang_plot import plot_identity

if __name__ == "__mp_main__" or sys.argv[1:2] == ["--child"]:
    # A kvcached engine's processes, the child and SGLang's spawned ones (which import this script
    # as __mp_main__): kvcached's import hook before SGLang's import (bench/_sglang_reference.py).
    kvcached_ref.enter_if_kvcached(spawned=__name__ == "__mp_main__")

from _tables import print_table
from _vllm_child import MODEL_CONFIGS, alternating_trace, prompt_tokens, write_model_config
from _vllm_procs import FAILURES, Engine, LedgerSampler, kill_all, write_atomically
from _vllm_reference import ensure_built

HERE = pathlib.Path(__file__).resolve()
BENCH_VLLM = HERE.parent / "bench_vllm.py"
GIB = 2**30
MODES = ("identity", "release", "seed-a", "two", "mixed")
TWO_VARIANTS = ("shared", "static-kvasync", "static-stock", "kvcached")


def token_kv_bytes(model: str) -> int:
    """SGLang's KV bytes of one token across all layers (its configurator's cell size), bf16: K
    and V of every KV head (an MHA model), or one latent row of ``kv_lora_rank +
    qk_rope_head_dim`` (an MLA model); stock's ``max_total_tokens`` is a budget in these."""
    config = MODEL_CONFIGS[model]
    layers = int(config["num_hidden_layers"])
    if "kv_lora_rank" in config:
        return (int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])) * 2 * layers
    return 2 * int(config["num_key_value_heads"]) * int(config["head_dim"]) * 2 * layers


class ProcessMemory(threading.Thread):
    """Each engine's device memory (MiB, summed over its process group) every 0.5 s, from
    ``nvidia-smi --query-compute-apps`` (no CUDA in the driver)."""

    def __init__(self, engines: dict[str, int], period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.engines = engines  # name -> process group id (the child's pid)
        self.period = period
        self.samples: list[dict[str, Any]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.period):
            try:
                text = subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-compute-apps=pid,used_memory",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            used = dict.fromkeys(self.engines, 0.0)
            for line in text.splitlines():
                try:
                    pid_text, mib_text = (part.strip() for part in line.split(","))
                    group = os.getpgid(int(pid_text))
                except (ValueError, ProcessLookupError):
                    continue
                for name, leader in self.engines.items():
                    if group == leader:
                        used[name] += float(mib_text)
            self.samples.append({"wall": time.time(), "mib": used})

    def finish(self) -> list[dict[str, Any]]:
        self.stop_event.set()
        self.join(5.0)
        return self.samples

    def peak_gib(self, name: str) -> float:
        return max((s["mib"].get(name, 0.0) for s in self.samples), default=0.0) / 1024


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student's t)."""
    if len(values) < 2:
        return (values[0] if values else float("nan"), float("nan"))
    t95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
    n = len(values)
    half = t95.get(n - 1, 2.0) * statistics.stdev(values) / math.sqrt(n)
    return statistics.fmean(values), half


def identity_prompts(count: int, seed: int = 7) -> list[dict[str, Any]]:
    """Half without shared prefixes (random lengths 16-1,500), half in families of 8 that share a
    prefix of 512-1,024 tokens; outputs of 16-256 tokens."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count // 2):
        prompts.append(
            {
                "ids": prompt_tokens("solo", index, rng.randint(16, 1500)),
                "max_new": rng.randint(16, 256),
            }
        )
    for family in range(count // 2 // 8):
        prefix = prompt_tokens("family", family, rng.randint(512, 1024))
        for member in range(8):
            tail = prompt_tokens(f"family-{family}", member, rng.randint(8, 400))
            prompts.append({"ids": prefix + tail, "max_new": rng.randint(16, 256)})
    return prompts


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = pathlib.Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = self.out / "work"
        self.model_dir = self.work / "model"
        self.tag = f"{os.getpid()}"
        self.results: dict[str, Any] = {"args": vars(args), "started": time.time()}

    def spawn(
        self, folder: pathlib.Path, name: str, task: str, env: dict[str, str], **spec: Any
    ) -> Engine:
        base = {"task": task, "model_dir": str(self.model_dir), "model": self.args.model}
        base.update(spec)
        if self.args.sglang_site:  # SGLang's packages, kept apart from vLLM's (other pins)
            env = dict(env, PYTHONPATH=self.args.sglang_site)
        return Engine(folder, name, base, env, script=HERE)

    def kvasync_env(
        self, name: str, *, share: str | None, budget: int | None, limit: int | None
    ) -> dict[str, str]:
        env = {"KVASYNC_SGLANG": "1", "KVASYNC_NAME": name}
        if self.args.linger:  # as bench_vllm.py --linger: the engine's own, not the driver's
            env["KVASYNC_LINGER"] = f"{self.args.linger:g}"
        if share:
            env["KVASYNC_SHARE"] = share
        if budget is not None:
            env["KVASYNC_DEVICE_BUDGET"] = f"{budget // 2**20}MiB"
        if limit is not None:
            env["KVASYNC_MEMORY_LIMIT"] = f"{limit // 2**20}MiB"
        return env

    def kvcached_env(self, folder: pathlib.Path, name: str) -> dict[str, str]:
        return kvcached_ref.engine_env_in(folder, name, self.tag, self.args)

    def kvcached_report(self, engine: Engine) -> dict[str, Any]:
        return kvcached_ref.report(engine.name, engine.spec["env"], engine.log_path)

    def save(self) -> None:
        (self.out / "bench_sglang.json").write_text(json.dumps(self.results, indent=1, default=str))

    # -- identity, throughput, start, memory ------------------------------------------------------

    def mode_identity(self) -> None:
        args = self.args
        folder = self.work / "identity"
        kv_bytes = int(args.kv_gib * GIB)
        tokens = kv_bytes // token_kv_bytes(self.args.model) // 16 * 16
        prompts = identity_prompts(args.prompts)
        share = f"sgl-id-{self.tag}"
        cand = args.candidate
        common = {
            "prompts": prompts,
            "rounds": args.rounds,
            "gated": True,
            "engine_args": {"max_total_tokens": tokens, "cuda_graph_max_bs_decode": 64},
        }
        stock = self.spawn(folder, "stock", "prompts", {"KVASYNC_SGLANG": "0"}, **common)
        if cand == "kvcached":  # the same max_total_tokens: kvcached maps what SGLang uses of it
            env = self.kvcached_env(folder, cand)
        else:
            env = self.kvasync_env("sgl-id", share=share, budget=kv_bytes, limit=None)
        ours = self.spawn(folder, cand, "prompts", env, **common)
        memory = ProcessMemory({"stock": stock.process.pid, cand: ours.process.pid})
        ledger: LedgerSampler | kvcached_ref.KvcachedSampler = (
            kvcached_ref.KvcachedSampler({cand: env["KVCACHED_IPC_NAME"]})
            if cand == "kvcached"
            else LedgerSampler(share)
        )
        record: dict[str, Any] = {
            "kv_gib": args.kv_gib,
            "tokens": tokens,
            "prompts": len(prompts),
            "candidate": cand,
        }
        self.results["identity"] = record
        memory.start()
        ledger.start()
        try:
            for engine in (stock, ours):  # one at a time: each start measured alone
                engine.wait("imported", time.monotonic() + 180)
                engine.go()
                record[f"start_s_{engine.name}"] = engine.wait("up", time.monotonic() + 300)[
                    "start_s"
                ]
                print(f"{engine.name} up in {record[f'start_s_{engine.name}']:.1f} s", flush=True)
            for index in range(args.rounds):
                order = (stock, ours) if index % 2 == 0 else (ours, stock)
                for engine in order:
                    (engine.folder / f"{engine.name}.go.{index}").write_text("go")
                    deadline = time.monotonic() + 300
                    while not [e for e in engine.all("round") if e["index"] == index]:
                        if not engine.alive() or time.monotonic() > deadline:
                            raise RuntimeError(
                                f"{engine.name}: round {index}: {engine.error_line()}"
                            )
                        time.sleep(0.01)
                print(f"round {index} done", flush=True)
            for engine in (stock, ours):
                engine.wait("done", time.monotonic() + 120)
        finally:
            record["memory"] = memory.finish()
            record["ledger"] = ledger.finish()
            kill_all([stock, ours])
            if cand == "kvcached":
                record["kvcached"] = self.kvcached_report(ours)
        results = {e.name: e.result() or {} for e in (stock, ours)}
        rows = []
        identical_rounds = 0
        ratios = []
        for index in range(args.rounds):
            s = results["stock"]["rounds"][index]
            k = results[cand]["rounds"][index]
            same = results["stock"]["outputs"][index] == results[cand]["outputs"][index]
            identical_rounds += same
            ratio = k["tok_s"] / s["tok_s"]
            if index > 0:  # round 0 is each engine's warm-up (first kernels, empty cache)
                ratios.append(ratio)
            rows.append(
                [
                    index,
                    f"{s['tok_s']:.0f}",
                    f"{k['tok_s']:.0f}",
                    f"{ratio:.3f}",
                    s["cached"],
                    k["cached"],
                    "yes" if same else "NO",
                ]
            )
        table(
            "SGLang identity and throughput",
            [
                "round",
                "stock tok/s",
                f"{cand} tok/s",
                "ratio",
                "stock cached",
                f"{cand} cached",
                "identical",
            ],
            rows,
        )
        mean, half = mean_ci(ratios)
        record.update(
            identical_rounds=identical_rounds,
            rounds=args.rounds,
            ratio_mean=mean,
            ratio_ci95=half,
            results=results,
            peak_gib={"stock": memory.peak_gib("stock"), cand: memory.peak_gib(cand)},
            mapped_peak_gib=max(
                (max(s["mapped_gib"].values(), default=0.0) for s in record["ledger"]), default=0.0
            ),
        )
        print(
            f"identical {identical_rounds}/{args.rounds} rounds ({len(prompts)} prompts each); "
            f"throughput {cand}/stock over rounds 1..: {mean:.3f} +- {half:.3f} (95% CI); "
            f"start stock {record['start_s_stock']:.1f} s, "
            f"{cand} {record[f'start_s_{cand}']:.1f} s; "
            f"device memory peak stock {record['peak_gib']['stock']:.2f} GiB, {cand} "
            f"{record['peak_gib'][cand]:.2f} GiB (KV capacity {args.kv_gib} GiB each); "
            f"{cand} mapped KV peak {record['mapped_peak_gib']:.2f} GiB",
            flush=True,
        )

    # -- release / resume ------------------------------------------------------------------------

    def mode_release(self) -> None:
        args = self.args
        folder = self.work / "release"
        kv_bytes = int(args.kv_gib * GIB)
        share = f"sgl-rel-{self.tag}"
        prompts = identity_prompts(64, seed=11)
        engine = self.spawn(
            folder,
            "kvasync",
            "release",
            self.kvasync_env("sgl-rel", share=share, budget=kv_bytes, limit=None),
            prompts=prompts,
            released_for_s=2.0,
        )
        memory = ProcessMemory({"kvasync": engine.process.pid})
        ledger = LedgerSampler(share)
        record: dict[str, Any] = {}
        self.results["release"] = record
        memory.start()
        ledger.start()
        try:
            engine.wait("imported", time.monotonic() + 180)
            engine.go()
            engine.wait("up", time.monotonic() + 300)
            engine.wait("done", time.monotonic() + 300)
        finally:
            record["memory"] = memory.finish()
            record["ledger"] = ledger.finish()
            kill_all([engine])
        result = engine.result() or {}
        record.update(result)
        marks = {e["event"]: e["wall"] for e in engine.events()}

        def mapped_at(wall: float) -> float:
            before = [s for s in record["ledger"] if s["wall"] <= wall]
            return max(before[-1]["mapped_gib"].values(), default=0.0) if before else float("nan")

        def device_at(wall: float) -> float:
            before = [s for s in record["memory"] if s["wall"] <= wall]
            return before[-1]["mib"]["kvasync"] / 1024 if before else float("nan")

        points = [
            ("served", marks.get("served", 0.0)),
            ("released", marks.get("released", 0.0) + 1.0),
            ("resumed+served", marks.get("done", 0.0)),
        ]
        rows = [[name, f"{mapped_at(wall):.2f}", f"{device_at(wall):.2f}"] for name, wall in points]
        table(
            "SGLang release_memory_occupation / resume with kvasync",
            ["point", "mapped KV GiB", "device GiB"],
            rows,
        )
        print(
            f"release {result.get('release_s', float('nan')) * 1000:.1f} ms, resume "
            f"{result.get('resume_s', float('nan')) * 1000:.1f} ms, first request after resume "
            f"{result.get('first_request_after_resume_s', float('nan')) * 1000:.1f} ms",
            flush=True,
        )
        record["points"] = {
            name: {"mapped_gib": mapped_at(w), "device_gib": device_at(w)} for name, w in points
        }

    # -- seed A ----------------------------------------------------------------------------------

    def mode_seed_a(self) -> None:
        args = self.args
        folder = self.work / "seed_a"
        record: dict[str, Any] = {}
        self.results["seed_a"] = record
        hold = {
            "ids": [prompt_tokens("hold", i, 1024) for i in range(16)],
            "max_new": 128,
            "concurrency": 16,
        }
        budget = int(args.kv_gib * GIB)
        for kind in args.seed_kinds:
            share = f"sgl-seed-{kind}-{self.tag}"
            env = (
                self.kvasync_env("first", share=share, budget=budget, limit=None)
                if kind == "kvasync"
                else {"KVASYNC_SGLANG": "0"}
            )
            stop = folder / f"{kind}.stop"
            stop.unlink(missing_ok=True)
            first = self.spawn(
                folder,
                f"{kind}_first",
                "hold",
                env,
                hold=hold,
                stop=str(stop),
                engine_args={"cuda_graph_max_bs_decode": 16},
            )
            starts = []
            try:
                first.wait("imported", time.monotonic() + 180)
                first.go()
                first.wait("up", time.monotonic() + 300)
                first.wait("serving", time.monotonic() + 60)
                for attempt in range(args.seed_starts):
                    second_env = (
                        self.kvasync_env(f"second{attempt}", share=share, budget=budget, limit=None)
                        if kind == "kvasync"
                        else {"KVASYNC_SGLANG": "0"}
                    )
                    second = self.spawn(
                        folder,
                        f"{kind}_second{attempt}",
                        "prompts",
                        second_env,
                        prompts=[{"ids": prompt_tokens("second", attempt, 256), "max_new": 16}],
                        rounds=1,
                        engine_args={"cuda_graph_max_bs_decode": 16},
                    )
                    outcome: dict[str, Any] = {"attempt": attempt}
                    try:
                        second.wait("imported", time.monotonic() + 180)
                        second.go()
                        outcome["start_s"] = second.wait(
                            "up", time.monotonic() + args.seed_deadline_s
                        )["start_s"]
                        second.wait("done", time.monotonic() + 60)
                        outcome["ok"] = True
                    except FAILURES as failure:
                        outcome["ok"] = False
                        outcome["failure"] = str(failure)
                        outcome["hang"] = "hang" in str(failure)
                    finally:
                        second.wait_exit(time.monotonic() + 30)
                        kill_all([second])
                    starts.append(outcome)
                    print(f"seed A {kind} start {attempt}: {outcome}", flush=True)
            finally:
                stop.write_text("stop")
                with contextlib.suppress(*FAILURES):
                    first.wait("done", time.monotonic() + 60)
                kill_all([first])
            served = (first.result() or {}).get("served")
            record[kind] = {"starts": starts, "first_served": served}
        rows = [
            [
                kind,
                f"{sum(s['ok'] for s in r['starts'])}/{len(r['starts'])}",
                sum(bool(s.get("hang")) for s in r["starts"]),
                r["first_served"],
            ]
            for kind, r in record.items()
        ]
        table(
            "Seed A on SGLang",
            ["engines", "second starts ok", "hangs", "first engine served"],
            rows,
        )

    # -- two engines on one budget ---------------------------------------------------------------

    def burst_plan(self) -> list[list[dict[str, Any]]]:
        """Two engines' arrivals: ``--bursts`` bursts of ``--burst-requests`` requests of 1,536 +
        ``--output-len`` tokens, ``--period-s`` apart, alternating between the engines."""
        args = self.args
        return alternating_trace(
            engines=2,
            bursts=args.bursts,
            period_s=args.period_s,
            requests=args.burst_requests,
            window_s=1.0,
            prompt_len=1536,
            output_len=args.output_len,
        )

    def mode_two(self) -> None:
        args = self.args
        folder = self.work / "two"
        budget = int(args.budget_gib * GIB)
        half = budget // 2
        plan = self.burst_plan()
        record: dict[str, Any] = {"budget_gib": args.budget_gib, "slo_s": args.slo_s}
        self.results["two"] = record
        for variant in args.two_variants:
            share = f"sgl-two-{variant}-{self.tag}"
            trace_go = folder / f"{variant}.trace_go"
            trace_go.unlink(missing_ok=True)
            engines = []
            for index, label in enumerate(("A", "B")):
                requests = [
                    {
                        "at": r["at"],
                        "ids": prompt_tokens(f"two-{label}", n, r["prompt_len"]),
                        "max_new": r["output_len"],
                    }
                    for n, r in enumerate(plan[index])
                ]
                engine_args: dict[str, Any] = {"cuda_graph_max_bs_decode": 64}
                if variant == "static-stock":
                    env = {"KVASYNC_SGLANG": "0"}
                    engine_args["max_total_tokens"] = (
                        half // token_kv_bytes(self.args.model) // 16 * 16
                    )
                    engine_args["mem_fraction_static"] = 0.3
                elif variant == "static-kvasync":
                    env = self.kvasync_env(f"two-{label}", share=None, budget=None, limit=half)
                elif variant == "kvcached":
                    # kvcached has no budget shared between engines: each may map up to all of it
                    # (as in bench_vllm.py); the table gives the most A and B held at once.
                    env = self.kvcached_env(folder, f"{variant}_{label}")
                    engine_args["max_total_tokens"] = (
                        budget // token_kv_bytes(self.args.model) // 16 * 16
                    )
                    engine_args["mem_fraction_static"] = 0.3
                else:
                    env = self.kvasync_env(f"two-{label}", share=share, budget=budget, limit=None)
                engines.append(
                    self.spawn(
                        folder,
                        f"{variant}_{label}",
                        "trace",
                        env,
                        requests=requests,
                        engine_args=engine_args,
                        trace_go=str(trace_go),
                    )
                )
            ledger: LedgerSampler | kvcached_ref.KvcachedSampler | None = None
            if variant == "shared":
                ledger = LedgerSampler(share)
            elif variant == "kvcached":
                ledger = kvcached_ref.KvcachedSampler(
                    {e.name: e.spec["env"]["KVCACHED_IPC_NAME"] for e in engines}
                )
            if ledger:
                ledger.start()
            result: dict[str, Any] = {}
            record[variant] = result
            try:
                for engine in engines:
                    engine.wait("imported", time.monotonic() + 180)
                for engine in engines:  # together: each start is reported, both under load
                    engine.go()
                for engine in engines:
                    result[f"start_s_{engine.name[-1]}"] = engine.wait(
                        "up", time.monotonic() + 300
                    )["start_s"]
                for engine in engines:
                    engine.wait("warm", time.monotonic() + 120)
                write_atomically(trace_go, f"{time.time() + 1.0}")
                for engine in engines:
                    engine.wait("done", time.monotonic() + plan_end(plan) + 120)
            except FAILURES as failure:
                result["failure"] = str(failure)
            finally:
                if ledger:
                    result["ledger"] = ledger.finish()
                kill_all(engines)
                if variant == "kvcached":
                    result["kvcached"] = {e.name: self.kvcached_report(e) for e in engines}
            served = []
            for engine in engines:
                served.extend((engine.result() or {}).get("requests", []))
            within = sum(
                1
                for r in served
                if r["ttft_s"] is not None and r["ttft_s"] <= args.slo_s and not r["error"]
            )
            ttfts = sorted(r["ttft_s"] for r in served if r["ttft_s"] is not None)
            result.update(
                requests=len(served),
                within_slo=within,
                errors=sum(1 for r in served if r["error"]),
                ttft_p50=ttfts[len(ttfts) // 2] if ttfts else None,
                ttft_p99=ttfts[int(len(ttfts) * 0.99)] if ttfts else None,
                mapped_peak_gib=max(
                    (sum(s["mapped_gib"].values()) for s in result.get("ledger", [])), default=None
                ),
                served=served,
            )
            print(
                f"two engines {variant}: {within}/{len(served)} within {args.slo_s} s TTFT",
                flush=True,
            )
        rows = [
            [
                v,
                f"{r.get('within_slo')}/{r.get('requests')}",
                r.get("errors"),
                fmt(r.get("ttft_p50")),
                fmt(r.get("ttft_p99")),
                fmt(r.get("mapped_peak_gib")),
                r.get("failure", ""),
            ]
            for v, r in record.items()
            if isinstance(r, dict)
        ]
        table(
            f"Two SGLang engines on {args.budget_gib} GiB",
            [
                "variant",
                "within SLO",
                "errors",
                "TTFT p50 s",
                "TTFT p99 s",
                "joint mapped peak GiB",
                "failure",
            ],
            rows,
        )

    # -- a vLLM engine and an SGLang engine on one share ----------------------------------------

    def mixed_vllm_env(self, share: str | None, budget: int) -> dict[str, str]:
        """The environment of mixed's vLLM engine: in ``share`` (of ``budget`` bytes) through
        kvasync's vLLM plugin, lingering as the run's kvasync SGLang engines do; stock without."""
        env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
        if self.args.vllm_site:
            env["PYTHONPATH"] = self.args.vllm_site
        if share is None:
            env["KVASYNC_VLLM"] = "0"
            return env
        env.update(
            KVASYNC_NAME="vllm",
            KVASYNC_PREFIX_CACHE="0",
            KVASYNC_SHARE=share,
            KVASYNC_DEVICE_BUDGET=f"{budget // 2**20}MiB",
        )
        if self.args.linger:
            env["KVASYNC_LINGER"] = f"{self.args.linger:g}"
        return env

    def mode_mixed(self) -> None:
        """Bursts alternate between a vLLM engine (0.26, kvasync's vLLM plugin) and an SGLang
        engine; ``shared``: both in one kvasync share of ``--budget-gib``; ``static``: stock
        vLLM with ``kv_cache_memory_bytes`` = budget/2 beside stock SGLang with
        ``max_total_tokens`` = budget/2 in tokens."""
        args = self.args
        folder = self.work / "mixed"
        budget = int(args.budget_gib * GIB)
        half = budget // 2
        write_model_config(self.model_dir, args.model)
        plan = self.burst_plan()
        end = plan_end(plan)
        record: dict[str, Any] = {"budget_gib": args.budget_gib, "slo_s": args.slo_s}
        self.results["mixed"] = record
        for variant in args.mixed_variants:
            shared = variant == "shared"
            share = f"sgl-mixed-{self.tag}"
            trace_go = folder / f"{variant}.trace_go"
            trace_go.unlink(missing_ok=True)
            venv = self.mixed_vllm_env(share if shared else None, budget)
            vspec = {
                "kind": "kvasync" if shared else "stock",
                "task": "trace",
                "args": {
                    "warmup": [32, 1536, 32],
                    "trace_go": str(trace_go),
                    "plan": plan[0],
                    "salt": "trace-A",
                    "max_s": end + 60,
                },
                "model_dir": str(self.model_dir),
                "executor": "uni",
                "utilization": 0.3 if shared else 0.2,
                "max_model_len": 2048,
                "attention": "TRITON_ATTN",
                "tensor_parallel_size": 1,
                "cuda_graphs": False,
                "max_num_seqs": 128,
                "stats": True,
                "kv_cache_bytes": None if shared else half,
            }
            vllm = Engine(folder, f"{variant}_vllm", vspec, venv, script=BENCH_VLLM)
            requests = [
                {
                    "at": r["at"],
                    "ids": prompt_tokens("trace-B", n, r["prompt_len"]),
                    "max_new": r["output_len"],
                }
                for n, r in enumerate(plan[1])
            ]
            engine_args: dict[str, Any] = {"cuda_graph_max_bs_decode": 64}
            if shared:
                senv = self.kvasync_env("sglang", share=share, budget=budget, limit=None)
            else:
                senv = {"KVASYNC_SGLANG": "0"}
                engine_args["max_total_tokens"] = half // token_kv_bytes(self.args.model) // 16 * 16
                engine_args["mem_fraction_static"] = 0.3
            sgl = self.spawn(
                folder,
                f"{variant}_sglang",
                "trace",
                senv,
                requests=requests,
                engine_args=engine_args,
                trace_go=str(trace_go),
            )
            ledger = LedgerSampler(share) if shared else None
            if ledger:
                ledger.start()
            result: dict[str, Any] = {}
            record[variant] = result
            try:
                for engine in (vllm, sgl):
                    engine.wait("imported", time.monotonic() + 180)
                for engine in (vllm, sgl):
                    engine.go()
                    result[f"start_s_{engine.name.split('_')[-1]}"] = engine.wait(
                        "up", time.monotonic() + 300
                    )["start_s"]
                for engine in (vllm, sgl):
                    engine.wait("warm", time.monotonic() + 120)
                write_atomically(trace_go, f"{time.time() + 1.0}")
                for engine in (vllm, sgl):
                    engine.wait("done", time.monotonic() + end + 120)
            except FAILURES as failure:
                result["failure"] = str(failure)
            finally:
                if ledger:
                    result["ledger"] = ledger.finish()
                kill_all([vllm, sgl])
            vreqs = ((vllm.result() or {}).get("requests") or {}).values()
            v_ttft = [None if r["first"] is None else r["first"] - r["arrived"] for r in vreqs]
            s_ttft = [r["ttft_s"] for r in (sgl.result() or {}).get("requests", [])]
            for engine_name, ttfts in (("vllm", v_ttft), ("sglang", s_ttft)):
                result[engine_name] = {
                    "requests": len(ttfts),
                    "within_slo": sum(1 for t in ttfts if t is not None and t <= args.slo_s),
                    "ttft": ttfts,
                }
            result["mapped_peak_gib"] = max(
                (sum(x["mapped_gib"].values()) for x in result.get("ledger", [])), default=None
            )
            print(
                f"mixed {variant}: vLLM {result['vllm']['within_slo']}/"
                f"{result['vllm']['requests']}, SGLang {result['sglang']['within_slo']}/"
                f"{result['sglang']['requests']} within {args.slo_s} s TTFT",
                flush=True,
            )
        rows = []
        for variant, r in record.items():
            if not isinstance(r, dict):
                continue
            total = r["vllm"]["within_slo"] + r["sglang"]["within_slo"]
            count = r["vllm"]["requests"] + r["sglang"]["requests"]
            rows.append(
                [
                    variant,
                    f"{r['vllm']['within_slo']}/{r['vllm']['requests']}",
                    f"{r['sglang']['within_slo']}/{r['sglang']['requests']}",
                    f"{total}/{count}",
                    fmt(r.get("mapped_peak_gib")),
                    r.get("failure", ""),
                ]
            )
        table(
            f"A vLLM and an SGLang engine on {args.budget_gib} GiB",
            [
                "variant",
                "vLLM within SLO",
                "SGLang within SLO",
                "total",
                "joint mapped peak GiB",
                "failure",
            ],
            rows,
        )


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    print(f"\n### {title}\n", flush=True)
    print_table(columns, [[str(cell) for cell in row] for row in rows])


def plan_end(plan: list[list[dict[str, Any]]]) -> float:
    return float(max(r["at"] for engine in plan for r in engine))


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


CANDIDATE_MODES = {"kvasync": MODES, "kvcached": ("identity", "two")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        help="default: identity release (--candidate kvcached: identity two)",
    )
    parser.add_argument(
        "--candidate",
        default="kvasync",
        choices=sorted(CANDIDATE_MODES),
        help="the allocator compared with stock SGLang: kvasync's plugin, or the reference "
        "allocator kvcached (identity and two only; see bench/reference/README.md)",
    )
    parser.add_argument(
        "--model",
        default="1b",
        choices=sorted(MODEL_CONFIGS),
        help="1b, 8b: Llama-shaped (SGLang's MHA pool); mla: DeepSeek-V2-Lite's attention, dense "
        "MLP (SGLang's MLA pool)",
    )
    parser.add_argument("--kv-gib", type=float, default=6.0)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed-starts", type=int, default=6)
    parser.add_argument("--seed-kinds", nargs="+", default=["kvasync", "stock"])
    parser.add_argument("--seed-deadline-s", type=float, default=120.0)
    parser.add_argument("--budget-gib", type=float, default=6.0)
    parser.add_argument("--bursts", type=int, default=4)
    # A burst's KV (64 x (1,536 + 768) tokens x 32 KiB = 4.5 GiB) is over half of the default
    # 6 GiB budget and within all of it: static halves queue, a share need not. The first run
    # (96 x (1,536 + 256), 8 s apart) did not bind: SGLang finished each burst too fast.
    parser.add_argument("--burst-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=768)
    parser.add_argument("--period-s", type=float, default=10.0)
    parser.add_argument("--slo-s", type=float, default=2.0)
    parser.add_argument(
        "--two-variants",
        nargs="+",
        choices=TWO_VARIANTS,
        help="default: shared static-kvasync static-stock (--candidate kvcached: kvcached "
        "static-stock)",
    )
    parser.add_argument("--mixed-variants", nargs="+", default=["shared", "static"])
    parser.add_argument(
        "--linger",
        type=float,
        default=0.0,
        help="KVASYNC_LINGER for every kvasync engine (mixed's vLLM one too): seconds the "
        "recent peak stays mapped (0: none, and none set; a KVASYNC_LINGER in the driver's "
        "environment never reaches an engine)",
    )
    parser.add_argument(
        "--sglang-site",
        default=os.environ.get("SGLANG_SITE"),
        help="SGLang's packages (PYTHONPATH)",
    )
    parser.add_argument(
        "--vllm-site", default=os.environ.get("VLLM_SITE"), help="vLLM's packages (PYTHONPATH)"
    )
    kvcached_ref.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.modes is None:
        args.modes = (
            ["identity", "two"] if args.candidate == "kvcached" else ["identity", "release"]
        )
    if args.two_variants is None:
        args.two_variants = (
            ["kvcached", "static-stock"]
            if args.candidate == "kvcached"
            else ["shared", "static-kvasync", "static-stock"]
        )
    unfit = [m for m in args.modes if m not in CANDIDATE_MODES[args.candidate]]
    if unfit:
        parser.error(
            f"--candidate {args.candidate} runs only {', '.join(CANDIDATE_MODES[args.candidate])}"
            f" (not {', '.join(unfit)}): the others measure what only kvasync has"
        )
    return args


def plans_kvcached(args: argparse.Namespace) -> bool:
    """Whether any engine of this run is a kvcached one."""
    return ("identity" in args.modes and args.candidate == "kvcached") or (
        "two" in args.modes and "kvcached" in args.two_variants
    )


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        import _sglang_child
        from _vllm_procs import die_with_parent

        die_with_parent()
        _sglang_child.main(sys.argv[2])
        return
    args = parse_args()
    bench = Bench(args)
    try:
        if plans_kvcached(args):
            print(f"== kvcached: from {args.kvcached_pack} into {args.kvcached_site}", flush=True)
            build = ensure_built(
                args.kvcached_pack, args.kvcached_site, args.kvcached_build_deadline_s
            )
            bench.results["kvcached_build"] = build
            print(f"kvcached build: {build.get('error') or build}", flush=True)
            if "error" in build:
                bench.results.setdefault("failures", {})["kvcached-build"] = build["error"]
                raise SystemExit(1)  # after the finally below has saved the results
        for mode in args.modes:
            print(f"== {mode} ({time.strftime('%H:%M:%S')})", flush=True)
            try:
                getattr(bench, f"mode_{mode.replace('-', '_')}")()
            except Exception as error:  # one mode's failure is reported; the next still runs
                bench.results.setdefault("failures", {})[mode] = f"{type(error).__name__}: {error}"
                print(f"{mode} FAILED: {error}", flush=True)
            bench.save()
    finally:
        bench.save()
        plot_identity(bench.results, args.out / "identity_memory.png")


if __name__ == "__main__":
    main()
