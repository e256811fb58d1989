"""vLLM 0.26 with kvasync's plugin against stock vLLM, on one GPU, in one call: outputs, throughput,
start time, memory over time, seed A, a neighbour's release, two engines on one budget.

Every engine is its own process (``--child``, bench/_vllm_child.py) on a Llama-architecture 1B
config with random weights (no weights can be fetched; every engine gets the same seed), greedy,
token-id prompts that share no prefix, ``enforce_eager``, TRITON_ATTN, bf16,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``. ``--executor uni|mp`` is vLLM's
``distributed_executor_backend`` for every engine ("mp": the worker in its own process). The
driver holds a deadline on every engine start, request batch and shutdown (bench/_vllm_procs.py):
an engine that hangs is reported as a hang with its elapsed time and killed, never waited out.

Modes (``--mode``, several allowed; ``--all`` runs the four in order within ``--budget-s``):

``identity`` (default)
    Engines one after another: stock, kvasync, stock, kvasync (``--runs``), and with
    ``--with-mp`` kvasync on the multiprocess executor as a third variant. Each: warm-up (every
    shape the rounds use), ``--rounds`` equal rounds of 256 requests of 512 + 128 tokens (output
    tok/s per round; each output's digest), 2 s idle, a trickle of 8. Reports the outputs that are
    token-identical to the first stock run's, each run's rounds and the spread (max-min over mean)
    of stock runs and of kvasync runs, start times, the KV memory over time (plot). The next
    engine imports vLLM while the current one idles, so a run costs its start plus ~15 s.
    kvasync: ``KVASYNC_MEMORY_LIMIT=--limit`` (38GiB, stock's 0.3 of an H200),
    ``KVASYNC_PREFIX_CACHE=0``.
``seed-a``
    A first kvasync engine serves bursts (192 requests of 1024 + 64 tokens, then 32 short ones,
    0.3 s idle between: it maps and unmaps) in one share (``KVASYNC_SHARE`` +
    ``KVASYNC_DEVICE_BUDGET=--seed-budget``, 8GiB: its bursts alone reach about that, so a
    second engine's pages come from what the first gives back). Beside it a second kvasync engine
    is started ``--starts`` (10) times: start, 8 requests, shut down. Reports each start's time,
    hangs (a start has ``--start-deadline-s``), that the first kept serving (its batches during
    each start) and the share's mapped memory over time (plot).
``release``
    The stock failure of issue 19: a second engine starts while the first finishes and releases
    its memory. The second's log is watched; once it says it is loading the model (its memory
    snapshot is taken by then, the profile that compares free memory against it comes next) the
    first leaves at once. Stock (both ``gpu_memory_utilization=0.35``) is the baseline, kvasync
    (both in one share, ``--release-budget``) the subject, ``--attempts`` (2) each. Reports starts
    that succeeded and the errors seen, with when the release landed.
``two``
    Two engines at once, ``--two-budget`` (6GiB) of KV between them, on a trace where KV memory
    binds: 4 bursts alternating between the engines (96 requests of 1536 + 256 tokens within 1 s,
    every 6 s), timed arrivals through vLLM's engine loop so each request's TTFT is seen.
    Variants (``--two-variants``): ``shared`` (kvasync, one share, the budget between them),
    ``static-stock`` (stock, ``kv_cache_memory_bytes`` = half each), ``static-kvasync`` (kvasync,
    one share, ``KVASYNC_MEMORY_LIMIT`` = half each). Reports requests within ``--slo-s`` (2 s)
    TTFT, TTFT percentiles, output tok/s, preemptions (vLLM's ``vllm:num_preemptions``), and the
    KV memory of each engine over time (plot).
    Why memory binds: a request holds 1792 tokens x 32 KiB = 56 MiB of KV at its end, so a 3 GiB
    half holds ~54 of a burst's 96 and the rest wait a whole request lifetime (256 decode steps,
    several seconds), while one engine alone in the shared 6 GiB holds them all. The compute
    stays well below the GPU's: a burst's prefill is 147k tokens (~1 s on an H200 for a 1B
    model), decode batches are at most 128 (``max_num_seqs``), where the GPU is launch-bound.
``colocate``
    A second engine beside a stock engine at ``gpu_memory_utilization=0.85`` that keeps serving:
    stock at 0.3, then kvasync with ``--limit 8GiB`` (the earlier RESULTS table).

Expected wall time on an H200 with vLLM's Triton kernels in the on-disk cache (a cold cache adds
~45 s to the first engine): identity with mp ~150 s, seed-a ~130 s, release ~90 s, two ~45 s a
variant. ``--all`` (identity with mp, seed-a, release, two: shared and static-stock, then
static-kvasync if time is left) stops starting steps when ``--budget-s`` (520) would be passed,
and says what it did not run. The reference allocator (kvcached) is not run here: building it on
the device is not scripted in bench/.

Usage (on the GPU machine, vLLM importable)::

    PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python3 bench/bench_vllm.py --all --out OUT
    python3 bench/bench_vllm.py --out OUT [--mode identity] [--executor mp] [--with-mp]
    python3 bench/bench_vllm.py --out OUT --mode seed-a release two
    python3 bench/bench_vllm.py --report OUT   # the tables and plots again, from OUT's JSON

Output: markdown tables on stdout, ``OUT/summary.json`` (every mode's data, written after each
mode), ``OUT/*.png``, and each engine's spec, events, log and result under ``OUT/<mode>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import _vllm_report as report
from _vllm_child import AFTER_SNAPSHOT, alternating_trace, write_model_config
from _vllm_procs import (
    Clock,
    Died,
    Engine,
    LedgerSampler,
    OutOfTime,
    Stalled,
    kill_all,
    write_atomically,
)

MODES = ("identity", "seed-a", "release", "two", "colocate")
GIB = 2**30
FAILURES = (Stalled, Died, OutOfTime)


def parse_gib(text: str) -> int:
    from kvasync._sizes import parse_size

    return parse_size(text)


class Run:
    """What every mode needs: the arguments, the clock, the model, a base spec."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.clock = Clock(args.budget_s)
        self.out: pathlib.Path = args.out
        self.model_dir = write_model_config(pathlib.Path.home() / "llama-1b-config")
        self.tag = f"{os.getpid()}"

    def spec(self, kind: str, task: str, task_args: dict[str, Any], **extra: Any) -> dict[str, Any]:
        executor = extra.pop("executor", self.args.executor)
        return {
            "kind": kind,
            "task": task,
            "args": task_args,
            "model_dir": str(self.model_dir),
            "executor": executor,
            "utilization": extra.pop("utilization", 0.3),
            "max_model_len": extra.pop("max_model_len", 2048),
            **extra,
        }

    @staticmethod
    def env(
        kind: str,
        name: str,
        *,
        limit: str | None = None,
        share: str | None = None,
        budget: str | None = None,
    ) -> dict[str, str]:
        """The plugin's configuration: none for stock (``KVASYNC_VLLM=0`` makes it inert)."""
        if kind == "stock":
            return {"KVASYNC_VLLM": "0"}
        env = {"KVASYNC_NAME": name, "KVASYNC_PREFIX_CACHE": "0"}
        if limit:
            env["KVASYNC_MEMORY_LIMIT"] = limit
        if share:
            env["KVASYNC_SHARE"] = share
        if budget:
            env["KVASYNC_DEVICE_BUDGET"] = budget
        return env


def variant_parts(variant: str, default_executor: str) -> tuple[str, str]:
    """``kvasync-mp`` -> (``kvasync``, ``mp``); ``stock`` -> (``stock``, the default)."""
    kind, _, executor = variant.partition("-")
    if kind not in ("stock", "kvasync") or executor not in ("", "uni", "mp"):
        raise ValueError(
            f"an engine variant is stock or kvasync, optionally -uni or -mp: {variant}"
        )
    return kind, executor or default_executor


# -- identity, throughput, start, memory -------------------------------------------------------


def mode_identity(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.out / "identity"
    variants = list(args.runs)
    if args.with_mp:  # third: if the run's time runs short, what is cut is a repeat
        variants.insert(min(2, len(variants)), "kvasync-mp")
    task_args = {
        # Every shape the rounds use, so no round pays a kernel's first compile.
        "warmup": [[32, 128, 16], [16, 1024, 16], [64, 512, 32]],
        "rounds": args.rounds,
        "round": [256, 512, 128],
        "idle_s": 2.0,
        "trickle": [8, 128, 32],
    }

    def spawn(index: int) -> Engine:
        kind, executor = variant_parts(variants[index], args.executor)
        name = f"run{index}_{variants[index]}"
        share = f"bench-{run.tag}-{name}" if kind == "kvasync" and executor == "mp" else None
        env = run.env(kind, f"bench-{name}", limit=args.limit, share=share)
        return Engine(folder, name, run.spec(kind, "phases", task_args, executor=executor), env)

    runs: list[dict[str, Any]] = []
    upcoming: Engine | None = spawn(0)
    try:
        for index, variant in enumerate(variants):
            engine, upcoming = upcoming, None
            assert engine is not None
            print(f"== identity: {engine.name}", flush=True)
            record: dict[str, Any] = {"variant": variant, "name": engine.name}
            try:
                run.clock.need(40, engine.name)
            except OutOfTime as error:
                record["failure"] = f"not run: {error}"
                runs.append(record)
                engine.kill()
                break
            try:
                engine.go()
                up = engine.wait("up", run.clock.by(170 if index == 0 else 100))
                record["start_s"] = up["start_s"]
                engine.wait("measured", run.clock.by(60 + 30 * args.rounds))
                if index + 1 < len(variants):
                    upcoming = spawn(index + 1)
                engine.wait("result", run.clock.by(30))
                record["result"] = engine.result()
                try:
                    record["shutdown_s"] = engine.wait("done", run.clock.by(30))["shutdown_s"]
                except FAILURES as error:
                    record["shutdown_error"] = str(error)
                engine.wait_exit(run.clock.by(15))
            except FAILURES as error:
                record["failure"] = str(error)
                print(f"   {error}", flush=True)
            finally:
                engine.kill()
            imported = engine.event("imported")
            record["import_s"] = imported["seconds"] if imported else None
            runs.append(record)
            if upcoming is None and index + 1 < len(variants):
                upcoming = spawn(index + 1)
    finally:
        kill_all([upcoming])
    return {"variants": variants, "runs": runs, "rounds": args.rounds}


# -- seed A ------------------------------------------------------------------------------------


def mode_seed_a(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.out / "seed_a"
    share = f"bench-{run.tag}-seeda"
    stop, release = folder / "first.stop", folder / "first.release"
    first_args = {
        "batches": [[192, 1024, 64], [32, 256, 64]],
        "gap_s": 0.3,
        "stop": str(stop),
        "release": str(release),
        "max_s": 400.0,
    }
    env_first = run.env("kvasync", "seedA-first", share=share, budget=args.seed_budget)
    folder.mkdir(parents=True, exist_ok=True)
    stop.unlink(missing_ok=True)
    release.unlink(missing_ok=True)
    first = Engine(folder, "first", run.spec("kvasync", "serve", first_args), env_first)

    def starter(k: int) -> Engine:
        env = run.env("kvasync", f"seedA-second-{k}", share=share, budget=args.seed_budget)
        spec = run.spec("kvasync", "starter", {"serve": [8, 256, 32]})
        return Engine(folder, f"second{k:02d}", spec, env)

    sampler = LedgerSampler(share)
    sampler.start()
    starts: list[dict[str, Any]] = []
    data: dict[str, Any] = {"share": share, "budget": args.seed_budget, "starts": starts}
    upcoming: Engine | None = starter(1)
    try:
        first.go()
        try:
            data["first_start_s"] = first.wait("up", run.clock.by(150))["start_s"]
            first.wait("batch", run.clock.by(60))
        except FAILURES as error:
            data["first_failure"] = str(error)
            return data
        hangs_in_a_row = 0
        for k in range(1, args.starts + 1):
            engine, upcoming = upcoming, None
            assert engine is not None
            record: dict[str, Any] = {"start": k}
            starts.append(record)
            try:
                run.clock.need(args.start_deadline_s / 3, f"seed A start {k}")
                engine.wait("imported", run.clock.by(90))
            except FAILURES as error:
                record["failure"] = f"not started: {error}"
                engine.kill()
                break
            if k < args.starts:
                upcoming = starter(k + 1)
            record["go_wall"] = time.time()
            engine.go()
            print(f"== seed A: start {k}", flush=True)
            try:
                up = engine.wait("up", run.clock.by(args.start_deadline_s))
                record["start_s"] = up["start_s"]
                record["up_wall"] = up["wall"]
                served = engine.wait("served", run.clock.by(30))
                record["served_s"] = served["seconds"]
                record["output_tokens"] = served["output_tokens"]
                done = engine.wait("done", run.clock.by(30))
                record["shutdown_s"] = done["shutdown_s"]
                engine.wait_exit(run.clock.by(15))
                hangs_in_a_row = 0
            except Stalled as error:
                record["hang"] = {"what": error.what, "elapsed_s": error.elapsed}
                hangs_in_a_row += 1
                print(f"   {error}", flush=True)
            except (Died, OutOfTime) as error:
                record["failure"] = str(error)
                print(f"   {error}", flush=True)
            finally:
                engine.kill()
                record["end_wall"] = time.time()
            record["first_alive"] = first.alive()
            if not first.alive():
                data["first_failure"] = f"the first engine ended: {first.error_line()}"
                break
            if hangs_in_a_row >= 2:
                data["stopped"] = "two hangs in a row"
                break
        stop.write_text("stop")
        try:
            first.wait("result", run.clock.by(60))
        except FAILURES as error:
            data["first_failure"] = f"did not stop: {error}"
        data["first"] = first.result()
        data["first_batches"] = [
            {k: b[k] for k in ("begin", "end", "output_tokens")} for b in first.all("batch")
        ]
    finally:
        kill_all([first, upcoming])
        data["ledger"] = sampler.finish()
    return data


# -- a neighbour's release ---------------------------------------------------------------------


def mode_release(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.out / "release"
    folder.mkdir(parents=True, exist_ok=True)
    # Alternating, so that a run cut short by its deadline still has both.
    plan = [(v, a) for a in range(1, args.attempts + 1) for v in ("stock", "kvasync")]

    def pair(variant: str, attempt: int) -> tuple[Engine, Engine, pathlib.Path]:
        name = f"{variant}{attempt}"
        share = f"bench-{run.tag}-release-{attempt}"
        stop, release = folder / f"{name}.stop", folder / f"{name}.release"
        stop.unlink(missing_ok=True)
        release.unlink(missing_ok=True)
        serve = {
            "batches": [[128, 1024, 64]],
            "gap_s": 0.1,
            "stop": str(stop),
            "release": str(release),
            "max_s": 300.0,
        }
        budget = args.release_budget if variant == "kvasync" else None
        first = Engine(
            folder,
            f"{name}_first",
            run.spec(variant, "serve", serve, utilization=0.35),
            run.env(variant, f"release-first-{attempt}", share=share, budget=budget),
        )
        second = Engine(
            folder,
            f"{name}_second",
            run.spec(variant, "starter", {"serve": [8, 256, 32]}, utilization=0.35),
            run.env(variant, f"release-second-{attempt}", share=share, budget=budget),
        )
        return first, second, release

    def spawn_into(
        box: list[tuple[Engine, Engine, pathlib.Path]], later: tuple[str, int] | None
    ) -> None:
        """The next attempt's engines start importing vLLM (no GPU until their go)."""
        if later is not None:
            box.append(pair(*later))

    attempts: list[dict[str, Any]] = []
    upcoming: tuple[Engine, Engine, pathlib.Path] | None = None
    try:
        for index, (variant, attempt) in enumerate(plan):
            record: dict[str, Any] = {"variant": variant, "attempt": attempt}
            attempts.append(record)
            try:
                run.clock.need(40, f"release {variant}{attempt}")
            except OutOfTime as error:
                record["failure"] = str(error)
                continue
            print(f"== release: {variant}{attempt}", flush=True)
            current, upcoming = upcoming or pair(variant, attempt), None
            first, second, release = current
            spawned: list[tuple[Engine, Engine, pathlib.Path]] = []
            later = plan[index + 1] if index + 1 < len(plan) else None
            spawn_next = functools.partial(spawn_into, spawned, later)
            try:
                release_attempt(run, first, second, release, record, spawn_next)
            finally:
                kill_all([first, second])
                upcoming = spawned[0] if spawned else None
    finally:
        if upcoming is not None:
            kill_all(upcoming[:2])
    return {"attempts": attempts, "release_budget": args.release_budget}


def release_attempt(
    run: Run,
    first: Engine,
    second: Engine,
    release: pathlib.Path,
    record: dict[str, Any],
    spawn_next: Callable[[], None],
) -> None:
    """One attempt; ``spawn_next()`` starts the next attempt's engines importing, once this
    attempt's release has landed."""
    try:
        first.go()
        record["first_start_s"] = first.wait("up", run.clock.by(150))["start_s"]
        first.wait("batch", run.clock.by(60))
        second.wait("imported", run.clock.by(60))
    except FAILURES as error:
        record["failure"] = f"setup: {error}"
        return
    second.go()
    assert second.went is not None
    trigger = None
    due = run.clock.by(90)
    while time.monotonic() < due and second.alive() and second.event("up") is None:
        trigger = second.log_has(AFTER_SNAPSHOT)
        if trigger is not None:
            break
        time.sleep(0.02)
    record["trigger"] = trigger or "none (released when the second was up, ended or late)"
    record["release_at_s"] = time.monotonic() - second.went
    release.write_text("release")
    exited = first.wait_exit(run.clock.by(20))
    record["first_gone_at_s"] = None if exited is None else time.monotonic() - second.went
    spawn_next()
    try:
        up = second.wait("up", run.clock.by(120))
        record["started"] = True
        record["start_s"] = up["start_s"]
        served = second.wait("served", run.clock.by(30))
        record["served_tokens"] = served["output_tokens"]
        second.wait_exit(run.clock.by(40))
    except Died as error:
        record["started"] = bool(second.event("up"))
        record["error"] = error.error
        record["failed_after_s"] = error.elapsed
    except (Stalled, OutOfTime) as error:
        record["started"] = bool(second.event("up"))
        record["error"] = f"hang: {error}"


# -- two engines on one budget -----------------------------------------------------------------

TWO_VARIANTS = ("shared", "static-stock", "static-kvasync")


def mode_two(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.out / "two"
    budget = parse_gib(args.two_budget)
    half = budget // 2
    plan = alternating_trace(
        engines=2,
        bursts=args.bursts,
        period_s=args.period_s,
        requests=args.burst_requests,
        window_s=1.0,
        prompt_len=1536,
        output_len=256,
    )
    trace_end = max(r["at"] for engine in plan for r in engine)
    variants: dict[str, Any] = {}
    data: dict[str, Any] = {
        "budget_gib": budget / GIB,
        "slo_s": args.slo_s,
        "plan": plan,
        "variants": variants,
    }
    folder.mkdir(parents=True, exist_ok=True)

    def spawn(variant: str) -> list[Engine]:
        kind = "stock" if variant == "static-stock" else "kvasync"
        share = f"bench-{run.tag}-two-{variant}" if kind == "kvasync" else None
        trace_go = folder / f"{variant}.trace_go"
        trace_go.unlink(missing_ok=True)
        engines = []
        for index, label in enumerate(("A", "B")):
            spec = run.spec(
                kind,
                "trace",
                {
                    "warmup": [16, 1536, 16],
                    "trace_go": str(trace_go),
                    "plan": plan[index],
                    "max_s": trace_end + 60,
                },
                utilization=0.2 if kind == "stock" else 0.3,
                max_num_seqs=128,
                stats=True,
                kv_cache_bytes=half if variant == "static-stock" else None,
            )
            limit = f"{half // 2**20}MiB" if variant == "static-kvasync" else None
            env = run.env(kind, f"two-{label}", share=share, budget=args.two_budget, limit=limit)
            engines.append(Engine(folder, f"{variant}_{label}", spec, env))
        return engines

    upcoming: list[Engine] = []
    try:
        for index, variant in enumerate(args.two_variants):
            record: dict[str, Any] = {}
            variants[variant] = record
            try:
                run.clock.need(trace_end + 35, f"two engines, {variant}")
            except OutOfTime as error:
                record["failure"] = str(error)
                continue
            print(f"== two engines: {variant}", flush=True)
            engines, upcoming = upcoming or spawn(variant), []
            share = engines[0].spec["env"].get("KVASYNC_SHARE")
            sampler = LedgerSampler(share) if share else None
            if sampler:
                sampler.start()
            try:
                for engine in engines:
                    engine.go()
                if index + 1 < len(args.two_variants):
                    # The next pair imports vLLM while this one starts, and is idle (waiting for
                    # its go) before this trace begins: the trace shares the CPU with nothing.
                    upcoming = spawn(args.two_variants[index + 1])
                for engine in engines:
                    up = engine.wait("up", run.clock.by(150))
                    record[f"start_s_{engine.name[-1]}"] = up["start_s"]
                for engine in engines:
                    engine.wait("warm", run.clock.by(60))
                for engine in upcoming:
                    with contextlib.suppress(*FAILURES):  # it is waited for again as current
                        engine.wait("imported", run.clock.by(60))
                trace_go = pathlib.Path(engines[0].spec["args"]["trace_go"])
                write_atomically(trace_go, repr(time.time() + 1.0))
                for engine in engines:
                    engine.wait("result", run.clock.by(trace_end + 90))
                record["engines"] = {engine.name[-1]: engine.result() for engine in engines}
            except FAILURES as error:
                record["failure"] = str(error)
                print(f"   {error}", flush=True)
            finally:
                kill_all(engines)
                if sampler:
                    record["ledger"] = sampler.finish()
    finally:
        kill_all(upcoming)
    return data


# -- a second engine beside a busy stock one (the earlier RESULTS table) --------------------------


def mode_colocate(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.out / "colocate"
    stop, release = folder / "neighbour.stop", folder / "neighbour.release"
    folder.mkdir(parents=True, exist_ok=True)
    stop.unlink(missing_ok=True)
    release.unlink(missing_ok=True)
    serve = {
        "batches": [[256, 512, 128]],
        "gap_s": 0.0,
        "stop": str(stop),
        "release": str(release),
        "max_s": 300.0,
    }
    neighbour = Engine(
        folder,
        "neighbour",
        run.spec("stock", "serve", serve, utilization=0.85),
        run.env("stock", ""),
    )
    seconds = []
    data: dict[str, Any] = {"seconds": seconds}
    try:
        neighbour.go()
        data["neighbour_start_s"] = neighbour.wait("up", run.clock.by(150))["start_s"]
        for kind in ("stock", "kvasync"):
            env = run.env(kind, "vllm-second", limit=args.colocate_limit)
            second = Engine(
                folder, f"second_{kind}", run.spec(kind, "starter", {"serve": [64, 512, 128]}), env
            )
            record: dict[str, Any] = {"kind": kind}
            seconds.append(record)
            try:
                second.go()
                record["start_s"] = second.wait("up", run.clock.by(120))["start_s"]
                served = second.wait("served", run.clock.by(60))
                record["tok_s"] = served["output_tokens"] / served["seconds"]
            except FAILURES as error:
                record["error"] = error.error if isinstance(error, Died) else str(error)
            finally:
                second.kill()
    except FAILURES as error:
        data["failure"] = str(error)
    finally:
        neighbour.kill()
    return data


# What each mode needs at least (s, warm kernel cache): the modes before it leave it this much.
RESERVE_S = {"identity": 150.0, "two": 100.0, "seed-a": 100.0, "release": 80.0, "colocate": 60.0}

RUNNERS = {
    "identity": mode_identity,
    "seed-a": mode_seed_a,
    "release": mode_release,
    "two": mode_two,
    "colocate": mode_colocate,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n", 1)[0].replace("\n", " "),
        epilog="Modes and sizes: see the module's docstring.",
    )
    parser.add_argument("--child", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("vllm-bench"))
    parser.add_argument("--mode", nargs="+", choices=MODES, default=["identity"])
    parser.add_argument(
        "--all", action="store_true", help="identity (with mp), seed-a, release, two"
    )
    parser.add_argument("--report", type=pathlib.Path, help="print and plot OUT/summary.json again")
    parser.add_argument("--budget-s", type=float, default=520.0, help="the whole run's deadline")
    parser.add_argument("--executor", choices=("uni", "mp"), default="uni")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["stock", "kvasync", "stock", "kvasync"],
        help="identity: the engines in order (stock|kvasync, optionally -uni|-mp)",
    )
    parser.add_argument("--with-mp", action="store_true", help="identity: add kvasync-mp")
    parser.add_argument("--rounds", type=int, default=3, help="identity: rounds per engine")
    parser.add_argument("--limit", default="38GiB", help="identity: kvasync's memory limit")
    parser.add_argument("--starts", type=int, default=10, help="seed-a: second-engine starts")
    parser.add_argument("--start-deadline-s", type=float, default=60.0)
    parser.add_argument("--seed-budget", default="8GiB", help="seed-a: the share's budget")
    parser.add_argument("--attempts", type=int, default=2, help="release: attempts per variant")
    parser.add_argument("--release-budget", default="80GiB", help="release: kvasync's share")
    parser.add_argument("--two-budget", default="6GiB", help="two: the KV of both engines")
    parser.add_argument(
        "--two-variants", nargs="+", choices=TWO_VARIANTS, default=list(TWO_VARIANTS)
    )
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--period-s", type=float, default=6.0)
    parser.add_argument("--burst-requests", type=int, default=96)
    parser.add_argument(
        "--slo-s", type=float, help="two: the TTFT SLO (2 s; with --report: judge again by it)"
    )
    parser.add_argument("--colocate-limit", default="8GiB")
    args = parser.parse_args()
    if args.child is not None:
        from _vllm_child import run_child

        run_child(args.child)
        return
    if args.report is not None:
        summary = json.loads((args.report / "summary.json").read_text())
        if args.slo_s is not None and "two" in summary["modes"]:
            summary["modes"]["two"]["slo_s"] = args.slo_s
        report.report_all(summary, args.report)
        return
    if args.slo_s is None:
        args.slo_s = 2.0
    if args.all:
        args.mode = ["identity", "two", "seed-a", "release"]
        args.with_mp = True
    for variant in args.runs:
        variant_parts(variant, args.executor)  # a bad variant fails before any engine starts
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    summary: dict[str, Any] = {
        "argv": sys.argv[1:],
        "executor": args.executor,
        "budget_s": args.budget_s,
        "modes": {},
    }
    whole = run.clock
    for index, mode in enumerate(args.mode):
        t = time.monotonic()
        # A mode may use the run's time but what the modes after it need at least.
        later = sum(RESERVE_S[m] for m in args.mode[index + 1 :])
        run.clock = whole.until(max(whole.end - later, t + RESERVE_S[mode]))
        try:
            run.clock.need(30, mode)
            data = RUNNERS[mode](run)
        except OutOfTime as error:
            data = {"not_run": str(error)}
        except Exception as error:  # one mode's bug must not cost the call the other modes
            data = {"failure": f"{type(error).__name__}: {error}"}
        data["wall_s"] = time.monotonic() - t
        summary["modes"][mode] = data
        summary["wall_s"] = time.monotonic() - whole.t0
        (args.out / "summary.json").write_text(json.dumps(summary))
        report.report_mode(mode, data, args.out)
    print(f"\nwhole run: {time.monotonic() - whole.t0:.0f} s; data in {args.out}", flush=True)


if __name__ == "__main__":
    main()
