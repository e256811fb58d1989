"""Many vLLM engines on one GPU, each its own process and its own model, one KV budget between
them: kvasync's share (the fair-share policy) against static splits of it (issue 28).

Cases (``--cases``, in this order by default; the lead may run them in two calls):

``memory4``
    N = 4 engines: two 1B, one 3B, one 8B (Llama-architecture configs, dummy weights; KV bytes
    per token 32, 32, 112, 128 KiB), ``--budget4`` (8 GiB) of KV between them, on the
    memory-bound trace of bench/_vllm_many.py (one hot model at a time, changing every
    ``--period`` s, its burst sized to ``--hot-fill`` of the budget at its own bytes per token;
    the others cold, then trickling with Zipf popularity; long prompts and outputs). Variants:
    ``stock-1N`` (stock vLLM, ``kv_cache_memory_bytes`` = budget / N each), ``stock-size``
    (stock, the budget split by KV bytes per token), ``kvasync-1N`` (kvasync, one share,
    ``KVASYNC_MEMORY_LIMIT`` = budget / N each), ``shared`` (kvasync, one share with the budget,
    no limit of its own: the fair-share policy divides it), ``hindsight`` (stock, the best
    static split with hindsight: bench/_vllm_many_sim.py simulates each engine's trace at every
    capacity on a grid of the budget, with each engine's step model fitted to the steps the
    variants before it logged, and a dynamic programme picks the split with the most requests
    within SLO; ``--hindsight-runs 2`` also runs the split proportional to the shared run's
    mean KV in use). Every split gives each engine at least one ``max_model_len`` request.
``memory8``
    N = 8 small models (1B and 0.5B, 32 and 48 KiB a token), ``--budget8`` (8 GiB), the same
    kind of trace; ``stock-1N`` and ``shared`` (``--variants8``).
``compute4``
    The memory4 engines on the compute-bound trace (steady prefill-heavy arrivals at
    ``--overload`` x the GPU's prefill rate, budget sized so that a static 1/N holds each
    engine's full batch of its longest requests): ``stock-1N`` and ``shared``.

Each variant: its N engines start together (``go``), warm up, then start the trace at one wall
time; each engine runs bench_vllm.py's child protocol with this bench's task (bench/
_vllm_many_child.py: timed arrivals through vLLM's engine loop, a step log, clients that give
up on a request with no token ``--give-up`` s after arrival). The next variant's engines import
vLLM while the current ones start. The driver samples the share's ledger every 0.1 s (every
member's committed, mapped, used, limit in force, demand) and NVML's busy share. Every wait has
a deadline (bench/_vllm_procs.py); a variant that would pass ``--budget-s`` is not started.

Checked and reported (bench/_vllm_many_checks.py, _vllm_many_report.py): requests within SLO
(TTFT and TPOT) per engine and in all, goodput (within SLO a second of arrivals), preemptions,
queued request-seconds by what held the queue (memory, or compute: the step's token budget or
the batch), the crest's step time, NVML busy; in kvasync runs the ledger's most committed
against the budget, each cold model's first request's TTFT (and the share of the budget
another member held when it came), each idle spell's release back to the null block's page and
the reserve within ``IDLE_BOUND_S`` (1 s), each member's limit turns; a plot per case of each
engine's mapped KV over time; the issue's goals beside their baselines.

Expected wall time on an H200 (engine start ~10-15 s in parallel, a variant ~60-70 s with its
trace of ~40 s and its give-ups): memory4 with its 5 variants ~330 s (+45 s on a cold Triton
cache), memory8 2 variants ~150 s, compute4 2 variants ~120 s. The plan is printed first.

Usage (on the GPU machine, vLLM importable)::

    PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python3 bench/bench_vllm_many.py \\
        --cases memory4 --out $OUT/m4
    python3 bench/bench_vllm_many.py --cases memory8 compute4 --out $OUT/m8c
    python3 bench/bench_vllm_many.py --dry --out /tmp/dry   # no vLLM: simulated engines
    python3 bench/bench_vllm_many.py --report OUT           # tables and plots again

Output: the tables on stdout and in OUT/report.md, OUT/summary.json (written after each
variant), OUT/vllm_many_<case>.png, OUT/engines.tar.gz (each engine's spec, events, log).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import threading
import time
from typing import Any

import _vllm_many as plan_
import _vllm_many_report as report
import _vllm_many_sim as sim
from _vllm_many_child import DRY_SCALE
from _vllm_procs import (
    FAILURES,
    GIB,
    Engine,
    GpuSampler,
    OutOfTime,
    Run,
    kill_all,
    write_atomically,
)

HERE = pathlib.Path(__file__).resolve()
CASES = ("memory4", "memory8", "compute4")
VARIANTS = ("stock-1N", "stock-size", "kvasync-1N", "shared", "hindsight")
# Engines stay this long past the last arrival of all (an idle one is watched giving back).
HOLD_S = 3.0
START_S = 25.0  # a variant's engines up and warm, when the machine is warm (the plan's figure)


def stamp() -> str:
    return time.strftime("%H:%M:%S")


def say(text: str) -> None:
    print(f"[{stamp()}] {text}", flush=True)


class ShareWatch(threading.Thread):
    """The share's ledger every ``period`` s: each member's committed, mapped, used bytes, limit
    in force, demand and blocked waiters (real bytes: ``scale`` undoes a dry run's)."""

    def __init__(self, share: str, scale: int, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.share, self.scale, self.period = share, scale, period
        self.samples: list[dict[str, Any]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        from kvasync import share as shares

        while not self.stop_event.wait(self.period):
            try:
                entries = shares.snapshot(self.share, timeout=0.5)
            except Exception:  # no member yet, or between members
                continue
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
            self.samples.append({"wall": time.time(), "members": members})

    def finish(self) -> list[dict[str, Any]]:
        self.stop_event.set()
        self.join(5.0)
        return self.samples


def case_spec(name: str, args: argparse.Namespace) -> plan_.CaseSpec:
    common: dict[str, Any] = {
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
        "seed": args.seed,
        "period_s": args.period,
        "hot_fill": args.hot_fill,
        "cold_rate": args.cold_rate,
        "prompt_median": args.prompt_median,
        "prompt_range": tuple(args.prompt_range),
        "output_range": tuple(args.output_range),
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_batched_tokens,
    }
    if name == "memory4":
        return plan_.CaseSpec(
            name,
            "memory",
            tuple(args.models4),
            plan_.parse_size(args.budget4),
            args.duration,
            **common,
        )
    if name == "memory8":
        return plan_.CaseSpec(
            name,
            "memory",
            tuple(args.models8),
            plan_.parse_size(args.budget8),
            args.duration,
            **common,
        )
    compute = dict(
        common,
        prompt_median=args.compute_prompt[0],
        prompt_range=(args.compute_prompt[1], args.compute_prompt[2]),
        output_range=tuple(args.compute_output),
        max_num_seqs=args.compute_max_seqs,
        overload=args.overload,
    )
    draft = plan_.CaseSpec(
        name, "compute", tuple(args.models4), GIB, args.compute_duration, **compute
    )
    return plan_.CaseSpec(
        name, "compute", draft.models, plan_.compute_budget(draft), args.compute_duration, **compute
    )


def variants_for(name: str, args: argparse.Namespace) -> list[str]:
    chosen: list[str] = {
        "memory4": args.variants4,
        "memory8": args.variants8,
        "compute4": args.compute_variants,
    }[name]
    return chosen


def prior(model: str) -> sim.StepModel:
    return sim.StepModel(
        plan_.DECODE_BASE_S[model], plan_.DECODE_PER_SEQ_S[model], 1 / plan_.PREFILL_TOK_S[model]
    )


def horizon(case: plan_.CaseSpec, plan: list[list[dict[str, Any]]], give_up: float) -> float:
    """Where an engine stops its trace: past it no request can still be within both SLOs."""
    return (
        plan_.trace_end(plan)
        + max(give_up, case.slo_ttft_s)
        + case.output_range[1] * case.slo_tpot_s
        + 1.0
    )


def simulate_engine(
    case: plan_.CaseSpec,
    plan: list[list[dict[str, Any]]],
    engine: int,
    capacity: int,
    model: sim.StepModel,
    give_up: float,
) -> int:
    """The engine's requests within SLO with a static KV cache of ``capacity`` bytes, simulated."""
    return sim.count_within(
        plan[engine],
        capacity // (plan_.token_kv_bytes(case.models[engine]) * plan_.BLOCK_TOKENS),
        model,
        horizon_s=horizon(case, plan, give_up),
        give_up_s=give_up,
        ttft_s=case.slo_ttft_s,
        tpot_s=case.slo_tpot_s,
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
    )


def simulated(
    case: plan_.CaseSpec,
    plan: list[list[dict[str, Any]]],
    split: list[int],
    models: list[sim.StepModel],
    give_up: float,
) -> list[int]:
    """Each engine's requests within SLO under a static ``split`` (bytes), simulated."""
    return [simulate_engine(case, plan, e, split[e], models[e], give_up) for e in range(case.n)]


def fitted_models(case: plan_.CaseSpec, variants: dict[str, Any]) -> list[sim.StepModel]:
    """Each engine's step model fitted to every step its engine logged in the variants so far."""
    found = []
    for e, model in enumerate(case.models):
        steps: list[dict[str, Any]] = []
        for record in variants.values():
            for engine in record.get("engines") or []:
                if engine.get("index") == e:
                    log = engine["steps"]
                    steps += [
                        dict(zip(log, row, strict=True)) for row in zip(*log.values(), strict=True)
                    ]
        found.append(sim.fit_step_model(steps, prior(model)))
    return found


def hindsight_splits(
    case: plan_.CaseSpec,
    plan: list[list[dict[str, Any]]],
    variants: dict[str, Any],
    runs: int,
    give_up: float,
) -> tuple[list[list[int]], dict[str, Any]]:
    """The best static split with hindsight (and, for ``runs`` 2, the split by the shared run's
    mean KV in use), with what the search saw."""
    models = fitted_models(case, variants)
    minima = [plan_.min_engine_bytes(case, e) for e in range(case.n)]

    def score(e: int, capacity: int) -> int:
        return simulate_engine(case, plan, e, capacity, models[e], give_up)

    search = sim.best_split(case.budget, minima, score)
    splits = [search.split]
    info: dict[str, Any] = {
        "models": [[m.base_s, m.per_seq_s, m.per_token_s] for m in models],
        "best": search.split,
        "best_within": search.within,
        "best_per_engine": search.per_engine,
        "curves": search.curves,
        "grid_bytes": search.grid_bytes,
    }
    shared = variants.get("shared", {}).get("engines")
    if runs > 1 and shared:
        means = []
        for engine in shared:
            used = [s.get("kv_used_gib", 0.0) for s in engine.get("samples", [])]
            means.append(max(1e-6, sum(used) / max(1, len(used))))
        by_demand = plan_.split_by_weights(case, means)
        info["by_demand"] = by_demand
        info["by_demand_within"] = sum(simulated(case, plan, by_demand, models, give_up))
        splits.append(by_demand)
    return splits, info


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
                results.append(engine.result())
            record["engines"] = results
        except FAILURES as error:
            record["failure"] = str(error)
            say(f"   {variant}: {error}")
        finally:
            kill_all(engines)
            record["gpu_busy"] = gpu.finish()
            if watch:
                record["ledger"] = watch.finish()
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
    paper_sim = {}
    if case.kind == "memory":
        models = [prior(m) for m in case.models]
        for label, parts in (
            ("static 1/N", plan_.equal_split(case)),
            ("by size", plan_.size_split(case)),
            ("alone", [case.budget] * case.n),
        ):
            paper_sim[label] = sum(simulated(case, cr.plan, parts, models, cr.give_up))
    data["paper"] = {
        "columns": plan_.PAPER_COLUMNS,
        "rows": plan_.paper_rows(case, cr.plan),
        "simulated": paper_sim,
    }
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
            within = report.summaries({**data, "variants": {variant: record}}).get(variant)
            say(
                f"   {variant}: "
                + (
                    f"{within['within_slo']}/{within['requests']} within SLO"
                    if within
                    else record.get("failure", "")
                )
                + f" ({record['wall_s']:.0f} s)"
            )
            (run.out / "summary.json").write_text(json.dumps(summary))
            index += 1
    finally:
        kill_all(upcoming)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Many vLLM engines on one GPU, one KV budget (issue 28).",
        epilog="See the module's docstring.",
    )
    p.add_argument("--child", type=pathlib.Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("vllm-many"))
    p.add_argument(
        "--work", type=pathlib.Path, help="each engine's files (default: a new folder in /tmp)"
    )
    p.add_argument("--report", type=pathlib.Path, help="print and plot OUT/summary.json again")
    p.add_argument(
        "--dry",
        action="store_true",
        help="no vLLM: engines simulated in real processes (kvasync kinds on the host backend)",
    )
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--budget-s", type=float, default=560.0, help="the whole run's deadline")
    p.add_argument("--variants4", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--variants8", nargs="+", choices=VARIANTS, default=["stock-1N", "shared"])
    p.add_argument(
        "--compute-variants", nargs="+", choices=VARIANTS, default=["stock-1N", "shared"]
    )
    p.add_argument(
        "--models4",
        nargs="+",
        choices=sorted(plan_.MODEL_CONFIGS),
        default=["1b", "1b", "3b", "8b"],
    )
    p.add_argument(
        "--models8", nargs="+", choices=sorted(plan_.MODEL_CONFIGS), default=["1b", "0.5b"] * 4
    )
    p.add_argument("--budget4", default="8GiB")
    p.add_argument("--budget8", default="8GiB")
    p.add_argument("--duration", type=float, default=32.0, help="memory cases: seconds of arrivals")
    p.add_argument(
        "--period", type=float, default=10.0, help="memory cases: seconds between bursts"
    )
    p.add_argument("--hot-fill", type=float, default=0.8)
    p.add_argument("--cold-rate", type=float, default=0.4)
    p.add_argument("--prompt-median", type=int, default=1536)
    p.add_argument("--prompt-range", type=int, nargs=2, default=[1024, 2048])
    p.add_argument("--output-range", type=int, nargs=2, default=[192, 320])
    p.add_argument("--max-model-len", type=int, default=2560)
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=4096,
        help="vLLM's max_num_batched_tokens (kvasync's reserve keeps a step's blocks mapped: "
        "fewer tokens, a smaller reserve)",
    )
    p.add_argument("--compute-duration", type=float, default=25.0)
    p.add_argument(
        "--compute-prompt",
        type=int,
        nargs=3,
        default=[1024, 768, 1280],
        metavar=("MEDIAN", "LOW", "HIGH"),
    )
    p.add_argument("--compute-output", type=int, nargs=2, default=[32, 64])
    p.add_argument("--compute-max-seqs", type=int, default=64)
    p.add_argument("--overload", type=float, default=1.2)
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument(
        "--give-up-factor",
        type=float,
        default=3.0,
        help="a client leaves after this many TTFT SLOs",
    )
    p.add_argument("--hindsight-runs", type=int, choices=(1, 2), default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", choices=("TRITON_ATTN", "FLASH_ATTN"), default="TRITON_ATTN")
    return p


def child(spec_path: pathlib.Path) -> None:
    spec = json.loads(spec_path.read_text())
    if spec.get("dry"):
        from _vllm_many_child import run_dry_child

        run_dry_child(spec_path)
        return
    from _vllm_child import TASKS, run_child
    from _vllm_many_child import task_many

    TASKS["many"] = task_many
    run_child(spec_path)


def main() -> None:
    args = parser().parse_args()
    if args.child is not None:
        child(args.child)
        return
    if args.report is not None:
        report.report_all(json.loads((args.report / "summary.json").read_text()), args.report)
        return
    # What bench/_vllm_procs.Run reads of a bench_vllm.py run.
    args.executor, args.tp, args.cuda_graphs, args.model = "uni", 1, False, "1b"
    cases = [case_spec(name, args) for name in args.cases]  # bad sizes fail before any engine
    args.out.mkdir(parents=True, exist_ok=True)
    from bench_vllm import Tee

    sys.stdout = Tee(sys.stdout, (args.out / "report.md").open("w"))
    say(
        f"bench_vllm_many: cases {', '.join(args.cases)}"
        f"{' (dry: simulated engines)' if args.dry else ''}; budget {args.budget_s:.0f} s"
    )
    run = Run(args)
    summary: dict[str, Any] = {"argv": sys.argv[1:], "dry": args.dry, "cases": {}}
    for case in cases:
        try:
            run_case(run, case, args, summary)
        except Exception as error:  # one case's bug must not cost the call the others
            summary["cases"].setdefault(case.name, {})["failure"] = (
                f"{type(error).__name__}: {error}"
            )
            say(f"{case.name}: {type(error).__name__}: {error}")
        summary["wall_s"] = time.monotonic() - run.clock.t0
        (args.out / "summary.json").write_text(json.dumps(summary))
        run.archive()
    report.report_all(summary, args.out)
    say(f"whole run {time.monotonic() - run.clock.t0:.0f} s; data in {args.out}")


if __name__ == "__main__":
    main()
