"""The modes of bench/bench_vllm.py about engine starts: seed A (a second engine started again and
again beside a serving one), a neighbour's release (a second engine starting while the first
leaves), and co-location beside a busy stock engine. See bench_vllm.py's docstring for what each
measures and why.
"""

from __future__ import annotations

import functools
import pathlib
import time
from collections.abc import Callable
from typing import Any

from _vllm_child import AFTER_SNAPSHOT
from _vllm_procs import (
    FAILURES,
    Died,
    Engine,
    LedgerSampler,
    OutOfTime,
    Run,
    Stalled,
    kill_all,
    parse_gib,
)

# -- seed A ------------------------------------------------------------------------------------


def mode_seed_a(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.work / "seed_a"
    kind = args.seed_kind
    share = f"bench-{run.tag}-seeda"
    # kvasync: both engines in one share of --seed-budget. kvcached has no share: each engine's KV
    # capacity is --seed-budget (vLLM's kv_cache_memory_bytes), mapped as it is used.
    capacity = parse_gib(args.seed_budget) if kind == "kvcached" else None
    stop, release = folder / "first.stop", folder / "first.release"
    first_args = {
        "batches": [[192, 1024, 64], [32, 256, 64]],
        "gap_s": 0.3,
        "stop": str(stop),
        "release": str(release),
        "max_s": 400.0,
    }
    env_first = run.env(kind, "seedA-first", share=share, budget=args.seed_budget)
    folder.mkdir(parents=True, exist_ok=True)
    stop.unlink(missing_ok=True)
    release.unlink(missing_ok=True)
    first_spec = run.spec(kind, "serve", first_args, kv_cache_bytes=capacity)
    first = Engine(folder, "first", first_spec, env_first)

    def starter(k: int) -> Engine:
        env = run.env(kind, f"seedA-second-{k}", share=share, budget=args.seed_budget)
        spec = run.spec(kind, "starter", {"serve": [8, 256, 32]}, kv_cache_bytes=capacity)
        return Engine(folder, f"second{k:02d}", spec, env)

    sampler = LedgerSampler(share) if kind == "kvasync" else None
    if sampler:
        sampler.start()
    starts: list[dict[str, Any]] = []
    data: dict[str, Any] = {
        "kind": kind,
        "share": share if kind == "kvasync" else None,
        "budget": args.seed_budget,
        "starts": starts,
    }
    upcoming: Engine | None = starter(1)
    try:
        first.go()
        try:
            data["first_start_s"] = first.wait("up", run.clock.by(90))["start_s"]
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
                done = engine.wait("done", run.clock.grace(30))
                record["shutdown_s"] = done["shutdown_s"]
                engine.wait_exit(run.clock.grace(15))
                hangs_in_a_row = 0
            except Stalled as error:
                if error.cut:
                    record["failure"] = str(error)
                else:
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
            first.wait("result", run.clock.grace(60))
        except FAILURES as error:
            data["first_failure"] = f"did not stop: {error}"
        data["first"] = first.result()
        data["first_batches"] = [
            {k: b[k] for k in ("begin", "end", "output_tokens")} for b in first.all("batch")
        ]
    finally:
        kill_all([first, upcoming])
        data["ledger"] = sampler.finish() if sampler else []
    return data


# -- a neighbour's release ---------------------------------------------------------------------


def mode_release(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.work / "release"
    folder.mkdir(parents=True, exist_ok=True)
    # Alternating, so that a run cut short by its deadline still has both.
    plan = [(v, a) for a in range(1, args.attempts + 1) for v in args.release_variants]

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
                run.clock.need(30, f"release {variant}{attempt}")
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
        record["first_start_s"] = first.wait("up", run.clock.by(90))["start_s"]
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
    exited = first.wait_exit(run.clock.grace(20))
    record["first_gone_at_s"] = None if exited is None else time.monotonic() - second.went
    spawn_next()
    try:
        up = second.wait("up", run.clock.by(run.args.start_deadline_s))
        record["started"] = True
        record["start_s"] = up["start_s"]
        served = second.wait("served", run.clock.by(30))
        record["served_tokens"] = served["output_tokens"]
        second.wait_exit(run.clock.grace(40))
    except Died as error:
        record["started"] = bool(second.event("up"))
        record["error"] = error.error
        record["failed_after_s"] = error.elapsed
    except (Stalled, OutOfTime) as error:
        record["started"] = bool(second.event("up"))
        record["error"] = f"hang: {error}"


# -- a second engine beside a busy stock one (the earlier RESULTS table) --------------------------


def mode_colocate(run: Run) -> dict[str, Any]:
    args = run.args
    folder = run.work / "colocate"
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
    seconds: list[dict[str, Any]] = []
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
