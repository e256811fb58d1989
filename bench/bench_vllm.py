"""vLLM (0.26.0 to 0.33.0) with kvasync's plugin against stock vLLM, on one GPU, in one call:
outputs, throughput, start time, memory over time, seed A, a neighbour's release, two engines on
one budget.

Every engine is its own process (``--child``, bench/_vllm_child.py) on a Llama-architecture 1B
config with random weights (no weights can be fetched; every engine gets the same seed), greedy,
token-id prompts that share no prefix, ``enforce_eager``, TRITON_ATTN, bf16,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``. ``--attention FLASH_ATTN`` and ``--cuda-graphs`` (CUDA
graphs captured at start, no ``enforce_eager``) change that for every engine of the run, and
``--tp N`` runs every engine at ``tensor_parallel_size`` N on the multiprocess executor (one GPU
per rank: issue 17's token identity against stock at TP=2 is ``--mode identity --tp 2`` on a
two-GPU machine).
``--executor uni|mp`` is vLLM's ``distributed_executor_backend`` for every engine ("mp": the
worker in its own process). The driver holds a deadline on every engine start, request batch
and shutdown (bench/_vllm_procs.py): an engine that hangs is reported as a hang with its elapsed
time and killed, never waited out.

``throughput`` and ``limit-memory`` (bench/_vllm_paired.py, which says how): a stock and a
kvasync engine up at once, running equal rounds in turn (``--pairs``, ``--pair-round``), for the
mean kvasync/stock ratio with its 95% confidence interval; and each engine's device memory, torch
reserved and kvasync mapped peaks under one KV limit (``--limit-memory``, 1GiB).

Modes (``--mode``, several allowed; ``--all`` runs identity with mp, two, seed-a, release in
that order within ``--budget-s``):

``identity`` (default)
    Engines one after another: stock, kvasync, stock, kvasync (``--runs``); ``--with-mp`` puts
    kvasync on the multiprocess executor third. Each: a warm-up of every shape the rounds use,
    ``--rounds`` (3) equal rounds of 256 requests of 512 + 128 tokens (output tok/s of each; each
    output's digest), 1.5 s idle, a trickle of 8. Reports the outputs token-identical to the first
    stock run's (3 x 256 + 8 requests), each run's rounds, the spread (max - min over the mean) of
    the stock runs and of the kvasync runs next to their ratio, start times, and the device's used
    memory and kvasync's mapped KV over time (plot). The next engine imports vLLM while the
    current one idles after its rounds. kvasync: ``KVASYNC_MEMORY_LIMIT=--limit`` (38GiB, stock's
    KV at 0.3 of an H200), ``KVASYNC_PREFIX_CACHE=0``; the mp engine also joins a share of its
    own so that its mapped KV is read from the ledger (the pages are mapped in its worker).
``two`` (bench/_vllm_two.py)
    Two engines at once, ``--two-budget`` (6GiB) of KV between them, on a trace where KV memory
    binds: 4 bursts alternating between the engines (96 requests of 1536 + 256 tokens arriving
    within 1 s, one burst every 7 s: A, B, A, B), timed arrivals through vLLM's engine loop so
    each request's TTFT is seen when its first token leaves a step. Variants (``--two-variants``):
    ``shared`` (kvasync, one share, the budget between them), ``static-stock`` (stock,
    ``kv_cache_memory_bytes`` = half each), ``static-kvasync`` (kvasync, one share,
    ``KVASYNC_MEMORY_LIMIT`` = half each). All with ``max_num_seqs=128``. Reports requests within
    ``--slo-s`` (2 s) TTFT, TTFT percentiles, output tok/s, preemptions (vLLM's
    ``vllm:num_preemptions`` counter), and each engine's KV over time (plot).
    Why memory binds: a request holds (1536 + 256) x 32 KiB = 56 MiB of KV at its end, so a 3 GiB
    half holds about 54 of a burst's 96 (vLLM admits 64 on their prompts, then preempts as they
    grow) and the rest wait a whole request lifetime (256 decode steps, seconds), while one engine
    alone in the shared 6 GiB holds the whole burst. Compute should not bind first: a burst's
    prefill is 147k tokens (about a second for a 1B model on an H200) and decode batches are at
    most 128 sequences, where an eager-mode step is launch-bound; the table gives the GPU's busy
    share over the trace (NVML) to check it.
``seed-a``
    A first kvasync engine serves bursts (192 requests of 1024 + 64 tokens, then 32 short ones,
    0.3 s idle between: it maps and unmaps) in one share (``KVASYNC_SHARE`` +
    ``KVASYNC_DEVICE_BUDGET=--seed-budget``, 8GiB: its bursts alone reach about that, so a
    second engine's pages come from what the first gives back). Beside it a second kvasync engine
    is started ``--starts`` (10) times: start, 8 requests, shut down; the next one imports vLLM
    meanwhile. Reports each start's time, hangs (each start has ``--start-deadline-s``; two hangs
    in a row end the mode), that the first kept serving (its batches during each start, the
    longest time between two of its batches, its map and unmap counts) and the share's mapped
    memory over time (plot).
``release``
    Issue 19's stock failure: a second engine starts while the first finishes and releases its
    memory. The second's log is watched; once it says it is loading the model (its start-up
    memory snapshot is taken by then, and the profile that compares free memory against it comes
    next) the first leaves at once (``os._exit``: the CUDA driver frees its memory as it ends).
    Stock, both at ``gpu_memory_utilization=0.35``, is the baseline; kvasync, both in one share
    (``--release-budget``, 80GiB), the subject; ``--attempts`` (2) each, alternating. Reports the
    starts that succeeded, the errors seen, and when the release landed.
``colocate``
    A second engine beside a stock engine at ``gpu_memory_utilization=0.85`` that keeps serving:
    stock at 0.3, then kvasync with ``--colocate-limit`` (8GiB) (the earlier RESULTS table).

Expected wall time on an H200 with vLLM's Triton kernels already in the on-disk cache (a cold
cache adds about 45 s to the first engine), assuming about 10 s to import vLLM and 8 s to start
an engine: identity with mp ~150-200 s, two ~110 s for two variants (~50 s more for the third),
seed-a ~150 s, release ~40 s an attempt pair. ``--all`` gives each mode the run's time less what
the modes after it need at least (``RESERVE_S``); a step that would pass ``--budget-s`` (520) is
not started and is reported as not run; a wait the run's end cuts short is reported as cut,
not as a hang, and winding down (engines told to stop report what they did) takes at most 20 s
more, so ``--all`` ends within about 545 s.

The reference allocator, kvcached (github.com/ovg-project/kvcached at the commit the earlier
benches used, e8e6406; bench/_vllm_reference.py), is an engine kind beside ``stock`` and
``kvasync``: ``--runs stock kvcached``, ``--release-variants stock kvcached``, ``--seed-kind
kvcached``, ``--two-variants static-stock kvcached``. It is enabled as its README says for vLLM
(``ENABLE_KVCACHED=true KVCACHED_AUTOPATCH=1``; its import hook patches vLLM), with vLLM's own
arguments as for stock (``gpu_memory_utilization``; where stock's KV is fixed, kvcached's capacity
is ``kv_cache_memory_bytes``) and kvasync's plugin inert. It has no budget shared between engines:
in ``two`` each kvcached engine may map up to the whole ``--two-budget`` and the table gives the
most A + B held at once; in seed A each engine's capacity is ``--seed-budget``. kvcached says it is
tested up to vLLM 0.24 and this is 0.26: it is run as it behaves, with the same deadlines (a hang
is reported with its elapsed time); the lines kvcached logs on patching vLLM are in the report.
``kvcached-mp`` is untried: its import hook runs in the engine's process, so vLLM's workers
carry its patches only when forked. It is built from its own source in the call, before the first
kvcached engine (``bench/reference/build_kvcached.sh``, about a minute; the run's budget pays for
it; a build already in ``--kvcached-site`` from the same commit is kept). ``--reference`` is the
reference's call: identity (stock, kvcached; 2 rounds), release (kvcached, 2 attempts; stock's
failure is in the earlier calls), seed A (kvcached, 4 starts), two (static-stock, kvcached);
about 450 s with the build when nothing hangs. A hang costs its step's deadline and the modes
after it keep their minimum (``RESERVE_S``); with ``--mode`` it runs only the modes named, so
two calls (``--mode identity release``, then ``--mode seed-a two``) give each more room.

The reference's device call (on the CPU machine first: ``bash bench/reference/pack_kvcached.sh``,
which writes ``build/kvcached``, 0.6 MiB; and ``bash ../shared/vllm-on-device/pack.sh``). After
the two calls that copy vLLM's ``c1`` and ``c2`` (../shared/vllm-on-device/README.md), one call
with carry ``["build/vllm-device/c3", "build/kvcached"]`` (about 55 MiB with the tree)::

    bash build/vllm-device/c3/setup.sh && CC=/usr/bin/gcc CXX=/usr/bin/g++ pip install -q \
      --no-build-isolation --no-deps -e . && PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 \
      python3 bench/bench_vllm.py --reference --budget-s 480 --out $OUT/ref

(on a machine where ``$HOME/vsite`` is already set up, carry only ``["build/kvcached"]`` and leave
out ``setup.sh``). The build's log is ``$HOME/kvcached-build.log`` (its tail is in summary.json).

Usage (on the GPU machine, vLLM importable)::

    PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python3 bench/bench_vllm.py --all --out OUT
    python3 bench/bench_vllm.py --out OUT [--mode identity] [--executor mp] [--with-mp]
    python3 bench/bench_vllm.py --out OUT --mode seed-a release two
    python3 bench/bench_vllm.py --out OUT --reference --budget-s 480   # kvcached (see above)
    python3 bench/bench_vllm.py --report OUT   # the tables and plots again, from OUT's JSON

Output (at most 6 files, so that a device call brings all of them back): the Markdown tables on
stdout and in ``OUT/report.md``, ``OUT/summary.json`` (every mode's data, written after each
mode), ``OUT/vllm_*.png``, and ``OUT/engines.tar.gz`` (each engine's spec, events, log and
result, by mode; the engines write them under ``--work``).
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import sys
import time
from typing import Any, TextIO

import _vllm_reference as reference
import _vllm_report as report
from _vllm_paired import mode_limit_memory, mode_throughput
from _vllm_procs import (
    FAILURES,
    KINDS,
    Engine,
    OutOfTime,
    Run,
    kill_all,
    variant_parts,
)
from _vllm_starts import mode_colocate, mode_release, mode_seed_a
from _vllm_two import TWO_VARIANTS, mode_two

MODES = ("identity", "throughput", "limit-memory", "seed-a", "release", "two", "colocate")


# -- identity, throughput, start, memory -------------------------------------------------------


def mode_identity(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.work / "identity"
    variants = list(args.runs)
    if args.with_mp:  # third: if the run's time runs short, what is cut is a repeat
        variants.insert(min(2, len(variants)), "kvasync-mp")
    task_args = {
        # Every shape the rounds use, so no round pays a kernel's first compile.
        "warmup": [[32, 128, 16], [16, 1024, 16], [256, 512, 16]],
        "rounds": args.rounds,
        "round": [256, 512, 128],
        "idle_s": 1.5,
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
                up = engine.wait("up", run.clock.by(170 if index == 0 else 90))
                record["start_s"] = up["start_s"]
                engine.wait("measured", run.clock.by(60 + 30 * args.rounds))
                if index + 1 < len(variants):
                    upcoming = spawn(index + 1)
                engine.wait("result", run.clock.grace(30))
                record["result"] = engine.result()
                try:
                    record["shutdown_s"] = engine.wait("done", run.clock.grace(30))["shutdown_s"]
                except FAILURES as error:
                    record["shutdown_error"] = str(error)
                engine.wait_exit(run.clock.grace(15))
            except FAILURES as error:
                record["failure"] = str(error)
                record["rounds_done"] = [e["tok_s"] for e in engine.all("round")]
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


RESERVE_S = {
    "identity": 170.0,
    "throughput": 240.0,
    "limit-memory": 150.0,
    "two": 100.0,
    "seed-a": 130.0,
    "release": 80.0,
    "colocate": 60.0,
}

RUNNERS = {
    "identity": mode_identity,
    "throughput": mode_throughput,
    "limit-memory": mode_limit_memory,
    "seed-a": mode_seed_a,
    "release": mode_release,
    "two": mode_two,
    "colocate": mode_colocate,
}


def plans_kvcached(args: argparse.Namespace) -> bool:
    """Whether any engine of this run is a kvcached one."""
    modes = set(args.mode)
    return (
        ("identity" in modes and any(v.startswith("kvcached") for v in args.runs))
        or ("release" in modes and "kvcached" in args.release_variants)
        or ("seed-a" in modes and args.seed_kind == "kvcached")
        or ("two" in modes and "kvcached" in args.two_variants)
    )


def use_reference(args: argparse.Namespace) -> None:
    """``--reference``: kvcached engines in place of kvasync's, beside stock, in the modes where
    the comparison means something (sizes trimmed so that the build and all four fit one call;
    an explicit ``--mode`` runs only those)."""
    if args.mode is None:
        args.mode = ["identity", "release", "seed-a", "two"]
    args.runs = ["stock", "kvcached"]
    args.with_mp = False
    args.rounds = 2
    # Stock's release failure is measured in the earlier calls (RESULTS.md); its time goes to
    # a second kvcached attempt.
    args.release_variants = ["kvcached"]
    args.attempts = 2
    args.seed_kind = "kvcached"
    args.starts = 4
    args.two_variants = ["static-stock", "kvcached"]


class Tee(io.TextIOBase):
    """Writes to the terminal and to a file."""

    def __init__(self, terminal: TextIO, copy: TextIO) -> None:
        self.terminal = terminal
        self.copy = copy

    def write(self, text: str) -> int:
        self.terminal.write(text)
        self.copy.write(text)
        return len(text)

    def flush(self) -> None:
        self.terminal.flush()
        self.copy.flush()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n", 1)[0].replace("\n", " "),
        epilog="Modes and sizes: see the module's docstring.",
    )
    parser.add_argument("--child", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("vllm-bench"),
        help="summary.json, report.md, the plots, engines.tar.gz (6 files at most)",
    )
    parser.add_argument(
        "--work", type=pathlib.Path, help="each engine's files (default: a new folder in /tmp)"
    )
    parser.add_argument("--mode", nargs="+", choices=MODES, help="default: identity")
    parser.add_argument(
        "--all", action="store_true", help="identity (with mp), seed-a, release, two"
    )
    parser.add_argument("--report", type=pathlib.Path, help="print and plot OUT/summary.json again")
    parser.add_argument("--budget-s", type=float, default=520.0, help="the whole run's deadline")
    parser.add_argument("--executor", choices=("uni", "mp"), default="uni")
    parser.add_argument(
        "--attention",
        choices=("TRITON_ATTN", "FLASH_ATTN"),
        default="TRITON_ATTN",
        help="vLLM's attention backend, for every engine",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="vLLM's tensor_parallel_size for every engine (above 1: the multiprocess executor, "
        "one GPU per rank)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture CUDA graphs (no enforce_eager), for every engine",
    )
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["stock", "kvasync", "stock", "kvasync"],
        help="identity: the engines in order (stock|kvasync|kvcached, optionally -uni|-mp)",
    )
    parser.add_argument(
        "--linger",
        type=float,
        default=0.0,
        help="KVASYNC_LINGER for every kvasync engine: seconds the recent peak stays mapped",
    )
    parser.add_argument("--with-mp", action="store_true", help="identity: add kvasync-mp")
    parser.add_argument("--rounds", type=int, default=3, help="identity: rounds per engine")
    parser.add_argument(
        "--limit", default="38GiB", help="identity, throughput: kvasync's memory limit"
    )
    parser.add_argument(
        "--model",
        choices=("1b", "8b"),
        default="1b",
        help="the Llama-architecture config with dummy weights (8b: for throughput, GPU-bound)",
    )
    parser.add_argument("--pairs", type=int, default=40, help="throughput: pairs of rounds (most)")
    parser.add_argument(
        "--pair-round",
        type=int,
        nargs=3,
        default=[256, 512, 128],
        metavar=("REQUESTS", "PROMPT", "OUTPUT"),
        help="throughput: one round's requests and their prompt and output tokens",
    )
    parser.add_argument(
        "--limit-memory", default="1GiB", help="limit-memory: both engines' KV limit"
    )
    parser.add_argument("--starts", type=int, default=10, help="seed-a: second-engine starts")
    parser.add_argument("--start-deadline-s", type=float, default=60.0)
    parser.add_argument("--seed-budget", default="8GiB", help="seed-a: the share's budget")
    parser.add_argument(
        "--seed-kind",
        choices=("kvasync", "kvcached"),
        default="kvasync",
        help="seed-a: the engines' allocator (kvcached: each engine's KV capacity --seed-budget)",
    )
    parser.add_argument("--attempts", type=int, default=2, help="release: attempts per variant")
    parser.add_argument("--release-budget", default="80GiB", help="release: kvasync's share")
    parser.add_argument(
        "--release-variants",
        nargs="+",
        choices=KINDS,
        default=["stock", "kvasync"],
        help="release: the engine pairs tried, alternating",
    )
    parser.add_argument("--two-budget", default="6GiB", help="two: the KV of both engines")
    parser.add_argument(
        "--two-variants", nargs="+", choices=TWO_VARIANTS, default=list(TWO_VARIANTS)
    )
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--period-s", type=float, default=7.0)
    parser.add_argument("--burst-requests", type=int, default=96)
    parser.add_argument(
        "--slo-s", type=float, help="two: the TTFT SLO (2 s; with --report: judge again by it)"
    )
    parser.add_argument("--colocate-limit", default="8GiB")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="the reference allocator's call: kvcached engines beside stock in identity, release, "
        "seed-a, two (see the docstring)",
    )
    parser.add_argument(
        "--kvcached-pack",
        type=pathlib.Path,
        default=reference.DEFAULT_PACK,
        help="kvcached's source and wheels (bench/reference/pack_kvcached.sh)",
    )
    parser.add_argument(
        "--kvcached-site",
        type=pathlib.Path,
        default=reference.DEFAULT_SITE,
        help="where kvcached is built (bench/reference/build_kvcached.sh)",
    )
    args = parser.parse_args()
    if args.child is not None:
        from _vllm_child import run_child

        run_child(args.child)
        return
    if args.report is not None:
        finished = json.loads((args.report / "summary.json").read_text())
        if args.slo_s is not None and "two" in finished["modes"]:
            finished["modes"]["two"]["slo_s"] = args.slo_s
        report.report_all(finished, args.report)
        return
    if args.slo_s is None:
        args.slo_s = 2.0
    if args.all:
        args.mode = ["identity", "two", "seed-a", "release"]
        args.with_mp = True
    if args.reference:
        use_reference(args)
    if args.mode is None:
        args.mode = ["identity"]
    if args.tp < 1:
        parser.error(f"--tp must be at least 1, got {args.tp}")
    if args.tp > 1:
        # vLLM runs TP > 1 on its multiprocess executor; so does the plugin (its ranks map the
        # scheduler's pages through kvasync's tensor-parallel group).
        if any(variant.endswith("-uni") for variant in args.runs):
            parser.error("--tp above 1 needs the multiprocess executor: drop -uni from --runs")
        args.executor = "mp"
    for variant in args.runs:
        variant_parts(variant, args.executor)  # a bad variant fails before any engine starts
    args.out.mkdir(parents=True, exist_ok=True)
    # What is printed is also kept (a device call returns only the end of the output).
    sys.stdout = Tee(sys.stdout, (args.out / "report.md").open("w"))
    graphs = "CUDA graphs" if args.cuda_graphs else "eager"
    print(
        f"engines: {args.attention}, {graphs}, executor {args.executor}, TP={args.tp}", flush=True
    )
    summary: dict[str, Any] = {
        "argv": sys.argv[1:],
        "executor": args.executor,
        "attention": args.attention,
        "cuda_graphs": args.cuda_graphs,
        "tp": args.tp,
        "budget_s": args.budget_s,
        "modes": {},
    }
    built = None
    if plans_kvcached(args):
        # Built before the run's clock starts, within the run's budget: its time is taken off.
        t = time.monotonic()
        print(f"== reference: kvcached from {args.kvcached_pack} into {args.kvcached_site}")
        built = reference.ensure_built(
            args.kvcached_pack,
            args.kvcached_site,
            min(reference.BUILD_DEADLINE_S, args.budget_s / 3),
        )
        print(f"   {reference.summary_line(built)}", flush=True)
        args.budget_s -= time.monotonic() - t
        summary["reference"] = built
    run = Run(args)
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
        run.archive()
    print(f"\nreference allocator (kvcached): {reference.summary_line(built)}")
    if built is not None:
        summary["reference_patches"] = reference.patch_report(run.work)
        (args.out / "summary.json").write_text(json.dumps(summary))
        for line in summary["reference_patches"]:
            print(f"  kvcached: {line}")
    print(
        f"\nwhole run: {time.monotonic() - whole.t0:.0f} s; data in {args.out} (each engine's "
        f"files in {args.out / 'engines.tar.gz'})",
        flush=True,
    )


if __name__ == "__main__":
    main()
