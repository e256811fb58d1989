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

Expected wall time on an H200 (unmeasured: from the ``two`` mode's starts, 7-10 s an engine,
and the simulation's step priors): a variant's engines up and warm in 15-25 s in parallel (the
call's first variant ~45 s more on a cold Triton cache), its trace ~45 s (arrivals end at 32 s;
the engines stay until the last arrival + 3 s, the static variants' last clients give up 6 s
after arriving, the last admitted requests end a few seconds later); so memory4 with its 5
variants ~6 min, memory8 with 2 variants ~2.5 min, compute4 with 2 ~2 min. Each variant is
started only if ``--budget-s`` leaves it its most (``need_s``: start 25 s + the trace's SLO
horizon + 10 s, ~110 s); one not started is reported as not run. The plan (``--plan``, no
engine) prints each case's arithmetic, on paper: at the defaults memory4 static 1/N 115 of 291
requests within SLO, each engine alone 291 (the bound for shared); memory8 90 of 422 against
422; compute4's prompts ask 115% of the GPU's prefill time (priors).

Device calls (after the two calls that copy vLLM's c1 and c2, ../shared/vllm-on-device/
README.md; carry ``["build/vllm-device/c3"]``; a device command may run 10 minutes, so two;
``--budget-s`` is what is left of about 9 minutes after the set-up and the build)::

    bash build/vllm-device/c3/setup.sh && CC=/usr/bin/gcc CXX=/usr/bin/g++ python3 -m pip \
      install -q --no-build-isolation --no-deps -e . && PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/vsite \
      VLLM_USE_FLASHINFER_SAMPLER=0 python3 bench/bench_vllm_many.py --cases memory4 \
      --budget-s 450 --out $OUT/m4
    (the same set-up) python3 bench/bench_vllm_many.py --cases memory8 compute4 \
      --budget-s 450 --out $OUT/m8c

Elsewhere::

    python3 bench/bench_vllm_many.py --plan                 # the arithmetic, no engine
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
import time
import traceback
from typing import Any

import _vllm_many as plan_
import _vllm_many_report as report
from _vllm_many_hindsight import horizon, paper
from _vllm_many_runs import START_S, run_case, say, variants_for, write_summary
from _vllm_procs import GIB, Run

CASES = ("memory4", "memory8", "compute4")
VARIANTS = ("stock-1N", "stock-size", "kvasync-1N", "shared", "hindsight")


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
        "--plan", action="store_true", help="print each case's plan and arithmetic, start nothing"
    )
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
    if args.plan:
        for case in cases:
            trace = plan_.traces(case)
            give_up = args.give_up_factor * case.slo_ttft_s
            report.print_paper({"spec": vars(case), "paper": paper(case, trace, give_up)})
            need = START_S + horizon(case, trace, give_up) + 10.0
            print(f"{len(variants_for(case.name, args))} variants, each ~{need:.0f} s at most")
        return
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
        write_summary(args.out / "summary.json", summary)
        run.archive()
    try:
        report.report_all(json.loads((args.out / "summary.json").read_text()), args.out)
    except Exception:  # the data is in summary.json: --report OUT prints it again
        traceback.print_exc()
    say(f"whole run {time.monotonic() - run.clock.t0:.0f} s; data in {args.out}")


if __name__ == "__main__":
    main()
