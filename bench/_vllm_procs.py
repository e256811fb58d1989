"""The driver's hold on the engine processes of bench/bench_vllm.py: spawn, wait for an event
with a deadline, read the error a dead engine printed, kill.

Every wait here has a deadline. A wait that runs out raises ``Stalled`` with the elapsed time, and
the caller reports it as a hang; an engine that exits before the event raises ``Died`` with the
last error line of its log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any

import _vllm_reference as reference
from _vllm_child import write_model_config
from _vllm_reference import is_reference_key

BENCH = pathlib.Path(__file__).resolve().parent / "bench_vllm.py"


class Stalled(Exception):
    """An engine did not reach an event within its deadline (``cut``: the deadline was the
    run's end, shorter than the step's own, so this is no evidence of a hang)."""

    def __init__(self, name: str, what: str, elapsed: float, cut: bool = False) -> None:
        why = "the run's --budget-s ended the wait, not a hang" if cut else "hang"
        super().__init__(f"{name}: no '{what}' within {elapsed:.1f} s ({why})")
        self.what = what
        self.elapsed = elapsed
        self.cut = cut


class Deadline(float):
    """A ``time.monotonic`` deadline that knows whether the run's end shortened it."""

    cut: bool = False


class Died(Exception):
    """An engine's process ended before the event it was waited for."""

    def __init__(self, name: str, what: str, elapsed: float, error: str) -> None:
        super().__init__(f"{name}: exited before '{what}' after {elapsed:.1f} s: {error}")
        self.what = what
        self.elapsed = elapsed
        self.error = error


class OutOfTime(Exception):
    """The run's overall deadline leaves no time for this step."""


def write_atomically(path: pathlib.Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text)
    os.replace(staging, path)


class Clock:
    """The whole run's deadline (``--budget-s``): every wait is cut to it."""

    def __init__(self, budget_s: float) -> None:
        self.t0 = time.monotonic()
        self.end = self.t0 + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()

    def until(self, end: float) -> Clock:
        """A clock for one part of the run: its deadline ``end``, never past this one's."""
        part = Clock(0.0)
        part.end = min(end, self.end)
        return part

    def by(self, seconds: float) -> Deadline:
        """An absolute deadline ``seconds`` from now, never past the run's end."""
        own = time.monotonic() + seconds
        deadline = Deadline(min(own, self.end))
        deadline.cut = own > self.end
        return deadline

    def grace(self, seconds: float) -> Deadline:
        """A deadline for winding down (an engine told to stop reports what it did): up to 20 s
        past the run's end, so that a run out of time still keeps its engines' results."""
        own = time.monotonic() + seconds
        deadline = Deadline(min(own, self.end + 20.0))
        deadline.cut = own > self.end + 20.0
        return deadline

    def need(self, seconds: float, what: str) -> None:
        """Raises OutOfTime when fewer than ``seconds`` are left for ``what``."""
        if self.left() < seconds:
            raise OutOfTime(f"{what}: {self.left():.0f} s left of the run, it needs ~{seconds:.0f}")


class Engine:
    """One engine process (``bench_vllm.py --child SPEC``, or another bench's ``script``), its
    files under ``folder``."""

    def __init__(
        self,
        folder: pathlib.Path,
        name: str,
        spec: dict[str, Any],
        env: dict[str, str],
        *,
        go_within_s: float = 300.0,
        script: pathlib.Path = BENCH,
    ) -> None:
        self.name = name
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.events_path = folder / f"{name}.events.jsonl"
        self.log_path = folder / f"{name}.log"
        self.result_path = folder / f"{name}.json"
        self.go_path = folder / f"{name}.go"
        for stale in (self.events_path, self.result_path, self.go_path):
            stale.unlink(missing_ok=True)
        self.spec = dict(
            spec,
            name=name,
            events=str(self.events_path),
            result=str(self.result_path),
            go=str(self.go_path),
            go_within_s=go_within_s,
            env={k: v for k, v in env.items() if k.startswith("KVASYNC_") or is_reference_key(k)},
        )
        spec_path = folder / f"{name}.spec.json"
        spec_path.write_text(json.dumps(self.spec, indent=1))
        full_env = dict(os.environ)
        # Each engine gets only its own allocator's settings (kvcached's too: a kvcached variable
        # left in the driver's environment must not turn a stock engine into a kvcached one).
        for key in [k for k in full_env if k.startswith("KVASYNC_") or is_reference_key(k)]:
            del full_env[key]
        full_env.update(env, PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        self._log = self.log_path.open("w")
        self.spawned = time.monotonic()
        # Its own session: the multiprocess executor's workers die with it on a kill.
        self.process = subprocess.Popen(
            [sys.executable, str(script), "--child", str(spec_path)],
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.went: float | None = None

    # -- what it said ------------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        try:
            lines = self.events_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        found = []
        for line in lines:
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
        return found

    def event(self, what: str) -> dict[str, Any] | None:
        for record in self.events():
            if record["event"] == what:
                return record
        return None

    def all(self, what: str) -> list[dict[str, Any]]:
        return [r for r in self.events() if r["event"] == what]

    def result(self) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self.result_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return data

    def error_line(self) -> str:
        """The engine's own error event, else the last line of its log that names an error."""
        said = self.event("error")
        if said is not None:
            return str(said["error"])
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        marked = [
            line
            for line in lines
            if "Error" in line or "error" in line or "Assertion" in line or "Exception" in line
        ]
        return ((marked or lines or ["(empty log)"])[-1]).strip()[:400]

    def log_has(self, needles: Iterable[str]) -> str | None:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return None
        for needle in needles:
            if needle in text:
                return needle
        return None

    # -- what it is asked --------------------------------------------------------------------

    def go(self) -> None:
        self.went = time.monotonic()
        write_atomically(self.go_path, "go")

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait(self, what: str, deadline: float) -> dict[str, Any]:
        """The first ``what`` event, waiting until ``deadline`` (``time.monotonic``).

        Raises:
            Stalled: not there by the deadline (the engine keeps running: the caller kills).
            Died: the process ended without it.
        """
        since = self.went if self.went is not None else self.spawned
        while True:
            found = self.event(what)
            if found is not None:
                return found
            if not self.alive():
                found = self.event(what)  # written just before it ended
                if found is not None:
                    return found
                raise Died(self.name, what, time.monotonic() - since, self.error_line())
            if time.monotonic() > deadline:
                cut = bool(getattr(deadline, "cut", False))
                raise Stalled(self.name, what, time.monotonic() - since, cut)
            time.sleep(0.05)

    def wait_exit(self, deadline: float) -> float | None:
        """Seconds until the process ended, or None (then it is killed)."""
        t = time.monotonic()
        while self.alive():
            if time.monotonic() > deadline:
                self.kill()
                return None
            time.sleep(0.05)
        return time.monotonic() - t

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        self._log.close()


def kill_all(engines: Iterable[Engine | None]) -> None:
    for engine in engines:
        if engine is not None:
            engine.kill()


class LedgerSampler(threading.Thread):
    """The driver's view of a kvasync share: each member's mapped GiB by name, every 100 ms
    (the ledger is read from any process; no CUDA in the driver)."""

    def __init__(self, share: str, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.share = share
        self.period = period
        self.samples: list[dict[str, Any]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        from kvasync import share as shares

        while not self.stop_event.wait(self.period):
            try:
                entries = shares.snapshot(self.share, timeout=0.5)
            except Exception:  # no ledger yet (no member joined), or between members
                continue
            self.samples.append(self.sample(entries))

    def sample(self, entries: list[Any]) -> dict[str, Any]:
        """One sample of the ledger's ``entries`` (a subclass records more)."""
        from kvasync import share as shares

        return {
            "wall": time.time(),
            "mapped_gib": {e.name: e.mapped_bytes / 2**30 for e in entries},
            "budget_gib": (shares.budget(entries) or 0) / 2**30,
        }

    def finish(self) -> list[dict[str, Any]]:
        self.stop_event.set()
        self.join(5.0)
        return self.samples


class GpuSampler(threading.Thread):
    """The GPU's busy share (NVML's utilization, % of time a kernel ran) every 100 ms, from the
    driver process (NVML needs no CUDA context); no samples where NVML is missing."""

    def __init__(self, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.samples: list[tuple[float, float]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML here: the report says so
            return
        while not self.stop_event.wait(self.period):
            try:
                busy = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                continue
            self.samples.append((time.time(), busy))

    def finish(self) -> list[tuple[float, float]]:
        self.stop_event.set()
        self.join(5.0)
        return self.samples


# -- what every mode of bench_vllm.py needs ----------------------------------------------------

GIB = 2**30
# The engine kinds: stock vLLM, vLLM with kvasync's plugin, vLLM with the reference (kvcached).
KINDS = ("stock", "kvasync", "kvcached")
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
        # Each engine's spec, events, log and result: many files, so not in ``out`` (a device
        # call brings back at most 8 files); ``archive`` packs them into one.
        self.work: pathlib.Path = args.work or pathlib.Path(tempfile.mkdtemp(prefix="vllm-bench-"))
        model = getattr(args, "model", "1b")
        self.model_dir = write_model_config(pathlib.Path.home() / f"llama-{model}-config", model)
        self.tag = f"{os.getpid()}"

    def archive(self) -> pathlib.Path:
        """``out/engines.tar.gz``: every engine's files so far."""
        target = self.out / "engines.tar.gz"
        staging = self.out / ".engines.tar.gz.tmp"
        with tarfile.open(staging, "w:gz") as tar:
            tar.add(self.work, arcname="engines")
        os.replace(staging, target)
        return target

    def spec(self, kind: str, task: str, task_args: dict[str, Any], **extra: Any) -> dict[str, Any]:
        executor = extra.pop("executor", self.args.executor)
        if kind == "kvcached":  # where the child finds kvcached (bench/_vllm_reference.py)
            extra["kvcached_site"] = str(self.args.kvcached_site)
        return {
            "kind": kind,
            "task": task,
            "args": task_args,
            "model_dir": str(self.model_dir),
            "executor": executor,
            "utilization": extra.pop("utilization", 0.3),
            "max_model_len": extra.pop("max_model_len", 2048),
            "attention": self.args.attention,
            "tensor_parallel_size": self.args.tp,
            "cuda_graphs": self.args.cuda_graphs,
            **extra,
        }

    def env(
        self,
        kind: str,
        name: str,
        *,
        limit: str | None = None,
        share: str | None = None,
        budget: str | None = None,
    ) -> dict[str, str]:
        """The plugin's configuration: none for stock (``KVASYNC_VLLM=0`` makes it inert); for
        kvcached, kvcached's switches (its capacity is vLLM's: the spec's utilization or
        ``kv_cache_bytes``; it has no share: ``limit``, ``share``, ``budget`` do not apply)."""
        if kind == "stock":
            return {"KVASYNC_VLLM": "0"}
        if kind == "kvcached":
            return reference.engine_env(name, self.tag)
        env = {"KVASYNC_NAME": name, "KVASYNC_PREFIX_CACHE": "0"}
        linger = getattr(self.args, "linger", None)  # bench_vllm.py --linger
        if linger:
            env["KVASYNC_LINGER"] = f"{linger:g}"
        if limit:
            env["KVASYNC_MEMORY_LIMIT"] = limit
        if share:
            env["KVASYNC_SHARE"] = share
        if budget:
            env["KVASYNC_DEVICE_BUDGET"] = budget
        return env


def die_with_parent() -> None:
    """An SGLang engine child ends when its driver does, however the driver ends: a driver
    killed by a device call's limit left both engines running, holding GPU memory (seen on the
    H200, 2026-12-03). Linux's parent-death signal; elsewhere, nothing. (The vLLM child watches
    its parent instead: ``_vllm_child.run_child``.) Call it on the child's main thread, before
    anything else: the signal follows the thread that spawned the child, here the driver's."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the driver died while the signal was being asked for
        os.kill(os.getpid(), signal.SIGTERM)


def variant_parts(variant: str, default_executor: str) -> tuple[str, str]:
    """``kvasync-mp`` -> (``kvasync``, ``mp``); ``stock`` -> (``stock``, the default)."""
    kind, _, executor = variant.partition("-")
    if kind not in KINDS or executor not in ("", "uni", "mp"):
        raise ValueError(
            f"an engine variant is stock, kvasync or kvcached, optionally -uni or -mp: {variant}"
        )
    return kind, executor or default_executor
