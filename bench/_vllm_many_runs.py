"""One case of bench/bench_vllm_many.py on the device: its variants' engines started together,
the trace run, what they recorded collected, the share's ledger watched, the hindsight runs
planned from the runs before them."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import time
from typing import Any

import _vllm_many as plan_
import _vllm_many_report as report
from _vllm_many_child import DRY_SCALE
from _vllm_many_hindsight import fitted_models, hindsight_splits, horizon, paper, prior, simulated
from _vllm_procs import (
    FAILURES,
    GIB,
    Died,
    Engine,
    GpuSampler,
    LedgerSampler,
    OutOfTime,
    Run,
    kill_all,
    write_atomically,
)

from kvasync import share as shares

HERE = pathlib.Path(__file__).resolve().parent / "bench_vllm_many.py"
# Engines stay this long past the last arrival of all (an idle one is watched giving back).
HOLD_S = 3.0
START_S = 25.0  # a variant's engines up and warm, when the machine is warm (the plan's figure)


def variants_for(name: str, args: argparse.Namespace) -> list[str]:
    chosen: list[str] = {
        "memory4": args.variants4,
        "memory8": args.variants8,
        "compute4": args.compute_variants,
    }[name]
    return chosen


def compact(value: Any) -> Any:
    """``value`` with its floats rounded to 0.1 ms or 0.1 MiB (4 decimals): a whole run's
    summary.json stays a few MiB (a device call brings back files of 16 MiB at most)."""
    if isinstance(value, float):
        return value if math.isnan(value) or math.isinf(value) else round(value, 4)
    if isinstance(value, dict):
        return {k: compact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [compact(v) for v in value]
    return value


def write_summary(path: pathlib.Path, summary: dict[str, Any]) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(compact(summary)))
    staging.replace(path)


def stamp() -> str:
    return time.strftime("%H:%M:%S")


def say(text: str) -> None:
    print(f"[{stamp()}] {text}", flush=True)


class ShareWatch(LedgerSampler):
    """The share's ledger every ``period`` s: each member's committed, mapped, used bytes, limit
    in force, demand and blocked waiters (real bytes: ``scale`` undoes a dry run's)."""

    def __init__(self, share: str, scale: int, period: float = 0.1) -> None:
        super().__init__(share, period)
        self.scale = scale

    def sample(self, entries: list[Any]) -> dict[str, Any]:
        members: dict[str, dict[str, int]] = {}
        for e in entries:
            m = members.setdefault(
                e.name,
                dict.fromkeys(("committed", "mapped", "used", "limit", "demand", "blocked"), 0),
            )
            m["committed"] += e.committed_bytes * self.scale
            m["mapped"] += e.mapped_bytes * self.scale
            m["used"] += e.used_bytes * self.scale
            m["limit"] += e.limit_bytes * self.scale
            m["demand"] += e.demand_bytes * self.scale
            m["blocked"] += e.blocked
        return {"wall": time.time(), "members": members}


class CaseRun:
    """One case: its plan, its variants' engines, what they recorded."""

    def __init__(self, run: Run, case: plan_.CaseSpec, args: argparse.Namespace) -> None:
        self.run, self.case, self.args = run, case, args
        self.plan = plan_.traces(case)
        self.folder = run.work / case.name
        self.give_up = args.give_up_factor * case.slo_ttft_s
        self.max_s = horizon(case, self.plan, self.give_up)
        self.scale = DRY_SCALE if args.dry else 1
        self.model_dirs = {
            m: plan_.write_model_config(pathlib.Path.home() / f"llama-{m}-many-config", m)
            for m in set(case.models)
        }
        self.first = True

    def names(self) -> list[str]:
        return [f"e{e}-{m}" for e, m in enumerate(self.case.models)]

    def spawn(self, variant: str, split: list[int] | None) -> list[Engine]:
        case, args = self.case, self.args
        kind = "stock" if variant.startswith(("stock", "hindsight")) else "kvasync"
        share = f"many-{self.run.tag}-{case.name}-{variant}" if kind == "kvasync" else None
        trace_go = self.folder / f"{variant}.trace_go"
        trace_go.unlink(missing_ok=True)
        engines = []
        for e, model in enumerate(case.models):
            burst = plan_.burst_sizes(case)[e] if case.kind == "memory" else 8
            spec = self.run.spec(
                kind,
                "many",
                {
                    "warmup": [min(8, burst), case.prompt_median, 8],
                    "trace_go": str(trace_go),
                    "plan": self.plan[e],
                    "salt": f"{case.name}-e{e}",  # the same prompts in every variant
                    "max_s": self.max_s,
                    "give_up_s": self.give_up,
                    "hold_s": plan_.trace_end(self.plan) + HOLD_S,
                },
                model_dir=str(self.model_dirs[model]),
                utilization=0.05,  # only vLLM's start check reads it where the KV size is given
                max_model_len=case.max_model_len,
                max_num_seqs=case.max_num_seqs,
                engine_kwargs={"max_num_batched_tokens": case.max_num_batched_tokens},
                stats=True,
                kv_cache_bytes=split[e] if kind == "stock" and split else None,
                token_kv_bytes=plan_.token_kv_bytes(model),
                index=e,
                dry=args.dry,
                step_model=list(vars(prior(model)).values()),
            )

            def size(value: int) -> str:
                return f"{value // self.scale // 1024}KiB"

            limit = size(split[e]) if kind == "kvasync" and split else None
            budget = size(case.budget) if share else None
            env = self.run.env(kind, self.names()[e], share=share, budget=budget, limit=limit)
            engines.append(Engine(self.folder, f"{variant}_e{e}", spec, env, script=HERE))
        return engines

    def split_for(self, variant: str) -> list[int] | None:
        if variant in ("stock-1N", "kvasync-1N"):
            return plan_.equal_split(self.case)
        if variant == "stock-size":
            return plan_.size_split(self.case)
        return None

    def run_variant(
        self, variant: str, split: list[int] | None, engines: list[Engine], upcoming: list[Engine]
    ) -> dict[str, Any]:
        """Starts ``engines``, runs the trace, collects each engine's result."""
        record: dict[str, Any] = {"split": split, "names": self.names()}
        share = engines[0].spec["env"].get("KVASYNC_SHARE")
        watch = ShareWatch(share, self.scale) if share else None
        gpu = GpuSampler()
        t = time.monotonic()
        try:
            for engine in engines:
                engine.go()
            if watch:
                watch.start()
            gpu.start()
            up_s = 240.0 if self.first else 150.0
            for engine in engines:
                engine.wait("up", self.run.clock.by(up_s))
            for engine in engines:
                engine.wait("warm", self.run.clock.by(120.0 if self.first else 60.0))
            record["start_wall_s"] = time.monotonic() - t
            for engine in upcoming:  # imported before the trace: it shares the CPU with nothing
                engine.wait("imported", self.run.clock.by(60.0))
            say(
                f"   {variant}: {len(engines)} engines up and warm in "
                f"{record['start_wall_s']:.1f} s; trace starts"
            )
            write_atomically(self.folder / f"{variant}.trace_go", repr(time.time() + 1.0))
            results = []
            for engine in engines:
                engine.wait("result", self.run.clock.grace(self.max_s + 60.0))
                result = engine.result()
                if result is None:  # its "result" event came, its file did not parse
                    raise Died(engine.name, "result", time.monotonic() - t, "no result file")
                results.append(result)
            record["engines"] = results
        except FAILURES as error:
            record["failure"] = str(error)
            say(f"   {variant}: {error}")
        finally:
            kill_all(engines)
            record["gpu_busy"] = gpu.finish()
            if watch:
                record["ledger"] = watch.finish()
            if share:
                record["share"] = share
                # Its engines are gone (killed after their results): their ledger file too.
                with contextlib.suppress(Exception):
                    shares.prune(share, timeout=2.0)
        record["wall_s"] = time.monotonic() - t
        return record

    def need_s(self) -> float:
        return START_S + self.max_s + 10.0


def run_case(
    run: Run, case: plan_.CaseSpec, args: argparse.Namespace, summary: dict[str, Any]
) -> None:
    cr = CaseRun(run, case, args)
    cr.folder.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"spec": {**vars(case), "n": case.n}, "plan": cr.plan, "variants": {}}
    summary["cases"][case.name] = data
    data["paper"] = paper(case, cr.plan, cr.give_up)
    report.print_paper(data)
    wanted = variants_for(case.name, args)
    say(
        f"== {case.name}: variants {', '.join(wanted)}; each ~{cr.need_s():.0f} s at most "
        f"(trace horizon {cr.max_s:.0f} s)"
    )
    queue: list[tuple[str, list[int] | None]] = []
    for variant in wanted:
        if variant == "hindsight":
            queue.append((variant, None))  # its splits come from the runs before it
        else:
            queue.append((variant, cr.split_for(variant)))
    upcoming: list[Engine] = []
    index = 0
    try:
        while index < len(queue):
            variant, split = queue[index]
            if variant == "hindsight":
                splits, info = hindsight_splits(
                    case, cr.plan, data["variants"], args.hindsight_runs, cr.give_up
                )
                data["hindsight"] = info
                names = [f"hindsight-{k + 1}" for k in range(len(splits))]
                queue[index : index + 1] = [
                    (n, list(b)) for n, b in zip(names, splits, strict=True)
                ]
                say(
                    f"   hindsight: best split {[f'{b / GIB:.2f}' for b in info['best']]} GiB, "
                    f"simulated within SLO {info['best_within']}"
                )
                continue
            try:
                run.clock.need(cr.need_s(), f"{case.name} {variant}")
            except OutOfTime as error:
                data["variants"][variant] = {"failure": f"not run: {error}"}
                say(f"   {variant}: not run ({error})")
                kill_all(upcoming)
                upcoming = []
                index += 1
                continue
            say(
                f"== {case.name} {variant}"
                + (f": split {[f'{b / GIB:.2f}' for b in split]} GiB" if split else "")
            )
            engines, upcoming = upcoming or cr.spawn(variant, split), []
            nxt = queue[index + 1] if index + 1 < len(queue) else None
            if nxt and nxt[0] != "hindsight":
                upcoming = cr.spawn(*nxt)
            record = cr.run_variant(variant, split, engines, upcoming)
            cr.first = False
            if split and variant.startswith(("stock", "hindsight", "kvasync")):
                models = fitted_models(
                    case, {k: v for k, v in data["variants"].items()} | {variant: record}
                )
                record["simulated"] = sum(simulated(case, cr.plan, split, models, cr.give_up))
            data["variants"][variant] = record
            try:
                within = report.summaries({**data, "variants": {variant: record}}).get(variant)
                done = (
                    f"{within['within_slo']}/{within['requests']} within SLO"
                    if within
                    else record.get("failure", "")
                )
            except Exception as error:  # the report's bug must not cost the run its next variant
                done = f"(no summary: {type(error).__name__}: {error})"
            say(f"   {variant}: {done} ({record['wall_s']:.0f} s)")
            write_summary(run.out / "summary.json", summary)
            index += 1
    finally:
        kill_all(upcoming)
