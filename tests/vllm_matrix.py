"""``make vllm-matrix``: kvasync's vLLM plugin against every vLLM release it is meant to serve.

For each version: a cached venv installed the way the README says for a CPU machine (torch's
CPU build, ``pip install --no-deps vllm==V``, then what vLLM's wheel requires minus the
GPU-only packages in ``EXCLUDED``, plus the test tools), vLLM's source tree for its tests (its
sdist), and this kvasync tree as one wheel built once per run. Then three suites, each under
pytest with ``--junitxml`` (outcomes per test), a per-test timeout and a deadline:

- ``plugin``: kvasync's own ``tests/test_vllm_*.py``;
- ``kvasync``: vLLM's KV-cache and block-pool tests from ``tests/v1/core`` with kvasync's pool in
  place (``-p kvasync.integrations.vllm.pytest_vllm``);
- ``stock``: the same vLLM tests on stock vLLM.

It prints one table (version x outcomes x differences), writes it to ``--results`` (Markdown)
and beside it as JSON, and exits 1 when a suite could not run, was skipped wholesale, a plugin
test failed, or a test stock passes and kvasync fails (or the reverse) is not in the documented
list (``docs/vllm/known-differences.toml``).

A plain script, not a pytest module: ``python tests/vllm_matrix.py --help``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import fnmatch
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomllib

REPO = Path(__file__).resolve().parent.parent
SUPPORT = REPO / "tests" / "vllm_matrix_support"
DEFAULT_VERSIONS = "0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0"
DEFAULT_CACHE = Path.home() / ".cache" / "kvasync" / "vllm-matrix"

# What vLLM's wheel requires but a CPU machine must not install, in one place. Everything here
# is either a CUDA build (torch's CUDA wheels and what they pull in are several GB, and torch
# itself is installed first as the CPU build), a GPU kernel library that imports CUDA at load
# time, or a distributed runtime the scheduler's tests never start. vLLM's scheduler-side
# modules (vllm.v1.core) and their tests import none of them.
EXCLUDED_NAMES = {
    "torch",  # installed first as the CPU build (--torch); vLLM's pin is a CUDA build
    "torchvision",  # pinned to vLLM's CUDA torch; multimodal only
    "torchaudio",
    "torchcodec",
    "xformers",
    "triton",  # comes with a CUDA torch; vLLM's CPU import path does not need it
    "ray",
    "pynvvideocodec",  # NVIDIA's video decoder
    "nvtx",
    "apache-tvm-ffi",  # tilelang's runtime
    "tilelang",
    "fastsafetensors",  # GPU-direct weight loading
    "instanttensor",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
    "b12x",
    "deep-gemm",
    "deep-ep",
    "numba",  # spec-decode kernels only; a 40 MB llvmlite for nothing these tests run
}
EXCLUDED_PREFIXES = ("nvidia-", "flashinfer", "cupy", "cuda-", "vllm-flash-attn", "zentorch")
# What must not be in a venv at all, even pulled in by a package kept above (xgrammar brings
# triton and apache-tvm-ffi, which install and import on a CPU): CUDA runtimes. torch's build is
# checked apart (torch.version.cuda is None).
FORBIDDEN = ("nvidia-", "cupy", "cuda-", "flashinfer", "xformers")

# The tools the test suites need beyond vLLM's own requirements (vLLM's test requirements are
# not in its wheel's metadata): pytest and its plugins that both pyproject.toml and vLLM's
# conftest use, and what vLLM's tests/ import at collection.
TEST_TOOLS = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-asyncio>=0.24",
    "pillow",
    "einops",
    "tblib",
    "hypothesis>=6.100",
    "click>=8.1",  # kvasync's own requirements (its wheel is installed with --no-deps)
    "rich>=13",
    "numpy",
]

# What vLLM's setup.py imports when pip reads the sdist's metadata (ensure_source).
SDIST_TOOLS = ["setuptools-rust", "setuptools-scm"]

# Which of vLLM's tests/v1/core files are KV-cache / block-pool tests: these names, and any file
# a release adds whose name says it is about the KV cache, blocks or prefix caching.
CORE_KV_FILES = (
    "test_prefix_caching.py",
    "test_single_type_kv_cache_manager.py",
    "test_kv_cache_utils.py",
)
KV_NAME = re.compile(r"kv|block|prefix|swa|evict")
# End-to-end tests load a model from the Hub and need a GPU: not the pool's tests.
E2E_NAME = re.compile(r"_e2e")
# The reduced set (--mode ends, between the two ends): prefix caching and the single-type manager.
REDUCED_FILES = ("test_prefix_caching.py", "test_single_type_kv_cache_manager.py")
# On a CPU test_scheduler.py's tests time out on stock vLLM too; --with-scheduler adds it.
SCHEDULER_FILE = "test_scheduler.py"
IMPORT_CHECK = "vllm.v1.core.sched.scheduler"
TORCH_IMPORT_WARNING = "`torch.jit.script_method` is deprecated"  # pytest's -W: literal
PYTEST_SUMMARY = re.compile(r"\b(passed|failed|skipped|errors?|no tests ran)\b.* in [0-9.]+s")


class SetupError(RuntimeError):
    """A version's venv or source tree could not be made: the version's row says why."""


@dataclass
class Suite:
    name: str
    files: list[str] = field(default_factory=list)
    rc: int | None = None
    seconds: float = 0.0
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> passed/failed/skipped
    skip_reasons: dict[str, str] = field(default_factory=dict)
    problem: str = ""  # why the suite did not run properly (empty: it ran)

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)


@dataclass
class Row:
    version: str
    mode: str = "full"  # full or reduced
    any_version: bool = False
    problem: str = ""  # setup failed: nothing ran
    suites: dict[str, Suite] = field(default_factory=dict)
    kvasync_only_fails: list[str] = field(default_factory=list)  # stock passes, kvasync does not
    stock_only_fails: list[str] = field(default_factory=list)
    undocumented: list[str] = field(default_factory=list)
    seconds: float = 0.0


# -- running things with a deadline -------------------------------------------------------------


def run(
    cmd: list[str],
    *,
    deadline_s: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> tuple[int, str]:
    """Runs ``cmd`` in its own process group; kills the whole group at ``deadline_s``.

    Returns (exit status, output); the status is 124 when the deadline passed. The output goes to
    ``log`` too, when given.
    """
    print(f"  $ {shlex.join(cmd)}" + (f"   (in {cwd})" if cwd else ""), flush=True)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=deadline_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        out += f"\n[vllm_matrix] killed after its deadline of {deadline_s:.0f} s\n"
        rc = 124
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {shlex.join(cmd)}\n{out}")
    return rc, out


def must(cmd: list[str], what: str, *, deadline_s: float, **kwargs: Any) -> str:
    rc, out = run(cmd, deadline_s=deadline_s, **kwargs)
    if rc != 0:
        tail = "\n".join(out.strip().splitlines()[-15:])
        raise SetupError(f"{what} failed (exit {rc}):\n{tail}")
    return out


# -- the kvasync wheel --------------------------------------------------------------------------


def build_kvasync_wheel(python: str, out_dir: Path, deadline_s: float) -> Path:
    """One wheel of this tree, built once per run (the C++ extension takes minutes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("kvasync-*.whl"):
        old.unlink()
    must(
        [
            python,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            str(REPO),
            "-w",
            str(out_dir),
        ],
        "building kvasync's wheel (needs scikit-build-core, pybind11 and cmake in --build-python)",
        deadline_s=deadline_s,
    )
    wheels = sorted(out_dir.glob("kvasync-*.whl"))
    if len(wheels) != 1:
        raise SetupError(f"expected one kvasync wheel in {out_dir}, found {len(wheels)}")
    return wheels[0]


# -- a version's venv and source tree ------------------------------------------------------------

REQUIREMENTS_PROBE = r"""
import importlib.metadata, json, sys
from pip._vendor.packaging.requirements import Requirement
out = []
for text in importlib.metadata.requires("vllm") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    out.append([req.name, str(req)])
print(json.dumps(out))
"""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def excluded(name: str) -> bool:
    n = normalize(name)
    return n in EXCLUDED_NAMES or n.startswith(EXCLUDED_PREFIXES)


def vllm_requirements(py: str, deadline_s: float) -> tuple[list[str], list[str]]:
    """vLLM's installed wheel's Requires-Dist (markers evaluated here): (kept, excluded)."""
    out = must([py, "-c", REQUIREMENTS_PROBE], "reading vLLM's requirements", deadline_s=deadline_s)
    keep: list[str] = []
    drop: list[str] = []
    for name, spec in json.loads(out.strip().splitlines()[-1]):
        (drop if excluded(name) else keep).append(spec)
    return keep, drop


def ensure_venv(version: str, vdir: Path, args: argparse.Namespace) -> Path:
    """The version's venv, made once and reused while its recipe is unchanged."""
    venv = vdir / "venv"
    py = str(venv / "bin" / "python")
    recipe = json.dumps(
        [args.torch, sorted(EXCLUDED_NAMES), EXCLUDED_PREFIXES, TEST_TOOLS, args.python]
    )
    stamp = venv / ".kvasync-matrix"
    if stamp.exists() and stamp.read_text() == recipe:
        return venv
    deadline = args.setup_deadline
    print(f"[{version}] making its venv in {venv}", flush=True)
    if not (venv / "bin" / "python").exists():
        must([args.python, "-m", "venv", str(venv)], "python -m venv", deadline_s=deadline)
    pip = [py, "-m", "pip", "install", "-q"]
    constraints = vdir / "constraints.txt"
    # Nothing may pull another torch: a constraint makes pip fail instead of downloading a
    # multi-GB CUDA build.
    constraints.write_text(f"{args.torch}\n")
    must([*pip, args.torch], f"installing {args.torch}", deadline_s=deadline)
    dist = vdir / "dist"
    wheels = sorted(dist.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        must(
            [py, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={version}", "-d", str(dist)],
            f"downloading vllm=={version}",
            deadline_s=deadline,
        )
        wheels = sorted(dist.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        raise SetupError(f"pip download left no vllm-{version} wheel in {dist}")
    must([*pip, "--no-deps", str(wheels[0])], f"installing vllm=={version}", deadline_s=deadline)
    keep, drop = vllm_requirements(py, deadline)
    print(f"[{version}] vLLM requires {len(keep) + len(drop)}; left out: {', '.join(drop)}")
    must(
        [*pip, "-c", str(constraints), *keep, *TEST_TOOLS],
        f"installing vLLM {version}'s requirements",
        deadline_s=deadline,
    )
    # A CUDA package here means an exclusion is missing: say which, rather than test on it.
    listed = must([py, "-m", "pip", "list", "--format=json"], "pip list", deadline_s=deadline)
    gpu = [p["name"] for p in json.loads(listed) if normalize(p["name"]).startswith(FORBIDDEN)]
    if gpu:
        raise SetupError(f"CUDA packages were installed (what pulled them in?): {gpu}")
    check_import(py, version, deadline)
    stamp.write_text(recipe)
    return venv


def check_import(py: str, version: str, deadline_s: float) -> None:
    probe = (
        f"import vllm, {IMPORT_CHECK}, torch\n"
        "assert torch.version.cuda is None, f'torch {torch.__version__} is a CUDA build'\n"
        "print(vllm.__version__, torch.__version__)"
    )
    rc, out = run([py, "-c", probe], deadline_s=deadline_s)
    if rc != 0:
        missing = re.findall(r"(ModuleNotFoundError: .*|ImportError: .*|AssertionError: .*)", out)
        raise SetupError(
            f"vLLM {version} does not import on this machine: import {IMPORT_CHECK} failed: "
            + (missing[-1] if missing else out.strip().splitlines()[-1])
        )
    got = out.strip().splitlines()[-1].split()[0]
    if got != version:
        raise SetupError(f"the venv's vLLM is {got}, not {version}")


def ensure_source(version: str, vdir: Path, py: str, deadline_s: float) -> Path:
    """vLLM's source tree (its sdist) for its tests. A plain ``pip download`` of the sdist
    builds its metadata in an isolated env, which installs torch; without isolation, in the
    version's venv, with VLLM_VERSION_OVERRIDE, it needs no build."""
    src = vdir / "src" / f"vllm-{version}"
    if (src / "tests" / "v1" / "core").is_dir():
        return src
    sdist_dir = vdir / "sdist"
    sdists = sorted(sdist_dir.glob(f"vllm-{version}.tar.gz"))
    if not sdists:
        # Its setup.py runs to give pip the sdist's metadata: what it imports must be here.
        must(
            [py, "-m", "pip", "install", "-q", *SDIST_TOOLS],
            "installing what vLLM's setup.py imports",
            deadline_s=deadline_s,
        )
        env = dict(os.environ, VLLM_VERSION_OVERRIDE=version, VLLM_TARGET_DEVICE="empty")
        must(
            [
                py,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-binary",
                ":all:",
                f"vllm=={version}",
                "-d",
                str(sdist_dir),
            ],
            f"downloading vLLM {version}'s sdist",
            deadline_s=deadline_s,
            env=env,
        )
        sdists = sorted(sdist_dir.glob(f"vllm-{version}.tar.gz"))
    if not sdists:
        raise SetupError(f"no vllm-{version}.tar.gz in {sdist_dir} after pip download")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(src.parent, filter="data")
    if not (src / "tests" / "v1" / "core").is_dir():
        raise SetupError(f"{sdists[0].name} has no tests/v1/core")
    return src


# -- which tests --------------------------------------------------------------------------------


def vllm_test_files(src: Path, reduced: bool, with_scheduler: bool) -> list[str]:
    core = src / "tests" / "v1" / "core"
    # Subfolders too (0.26's prefix_cache/ holds the partial prefix-cache hit tests).
    names = sorted(str(p.relative_to(core)) for p in core.rglob("test_*.py"))
    if reduced:
        picked = [n for n in names if n in REDUCED_FILES]
    else:
        picked = [
            n for n in names if n in CORE_KV_FILES or (KV_NAME.search(n) and not E2E_NAME.search(n))
        ]
        if with_scheduler and SCHEDULER_FILE in names:
            picked.append(SCHEDULER_FILE)
    return [f"tests/v1/core/{n}" for n in picked]


def plugin_test_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_vllm_*.py"))


def untested_version(py: str, deadline_s: float) -> tuple[bool, str]:
    """(whether the plugin refuses this vLLM without KVASYNC_VLLM_ANY_VERSION=1, its message).

    Asks the plugin itself, as the tests will use it (the pool alone), so the runner does not
    copy its table of tested versions."""
    probe = (
        "from kvasync.integrations.vllm import register, UnsupportedVLLM\n"
        "try:\n    register()\nexcept UnsupportedVLLM as e:\n    print('REFUSED', e)\n"
    )
    env = dict(os.environ, KVASYNC_VLLM="1", KVASYNC_VLLM_HOST_POOL="1")
    env.pop("KVASYNC_VLLM_ANY_VERSION", None)
    rc, out = run([py, "-c", probe], deadline_s=deadline_s, env=env)
    if rc != 0:
        raise SetupError("the plugin's register() failed:\n" + "\n".join(out.splitlines()[-8:]))
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    return bool(refused), refused[0][len("REFUSED ") :] if refused else ""


# -- running a suite and reading its junit ------------------------------------------------------


def read_junit(path: Path, suite: Suite, root: Path) -> None:
    """Outcome per test id (``file::name[param]``), the worst of its phases: a teardown error
    after a pass is a failure, as it is in pytest's own summary."""
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        parts = classname.split(".")
        # pytest's classname is the module path dotted (plus a class); rebuild file::name.
        file_parts = []
        for i in range(len(parts), 0, -1):
            candidate = "/".join(parts[:i]) + ".py"
            if (root / candidate).exists() or i == 1:
                file_parts = parts[:i]
                break
        test_id = f"{'/'.join(file_parts)}.py::{case.get('name', '')}"
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
            skipped = case.find("skipped")
            suite.skip_reasons[test_id] = skipped.get("message", "") if skipped is not None else ""
        if rank[outcome] >= rank[suite.outcomes.get(test_id, "passed")]:
            suite.outcomes[test_id] = outcome


def run_suite(
    suite: Suite,
    py: str,
    cwd: Path,
    extra: list[str],
    env: dict[str, str],
    logs: Path,
    args: argparse.Namespace,
) -> None:
    junit = logs / f"{suite.name}.xml"
    junit.unlink(missing_ok=True)
    cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    cmd += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    if suite.name == "plugin":
        # kvasync's own tests keep pyproject.toml's settings (its per-test timeout, warnings as
        # errors), less one warning torch emits while vLLM imports (torch/utils/mkldnn.py, on
        # torch 2.13 under vLLM 0.33): as an error it fails the tests' import of vLLM, and
        # they all skip as if vLLM were absent.
        cmd += ["-W", f"ignore:{TORCH_IMPORT_WARNING}:DeprecationWarning"]
    else:
        cmd += ["--timeout", str(args.test_timeout)]
    start = time.monotonic()
    suite.rc, out = run(
        cmd + extra + suite.files,
        deadline_s=args.suite_deadline,
        cwd=cwd,
        env=env,
        log=logs / f"{suite.name}.log",
    )
    suite.seconds = time.monotonic() - start
    summaries = [line for line in out.splitlines() if PYTEST_SUMMARY.search(line)]
    errors = [line for line in out.splitlines() if "Error" in line or "Exception" in line]
    if summaries:
        last = summaries[-1].strip("= ")
    else:  # pytest did not get to its summary (a plugin refused at start): say why
        last = "no pytest summary; " + (errors[-1].strip()[:300] if errors else "no error line")
    print(f"  {suite.name}: exit {suite.rc} in {suite.seconds:.0f} s: {last}", flush=True)
    if suite.rc not in (0, 1):
        suite.problem = f"pytest exit {suite.rc}: {last}"
    if not junit.exists():
        suite.problem = suite.problem or "no junit written"
        return
    read_junit(junit, suite, cwd)
    ran = suite.count("passed") + suite.count("failed")
    not_importable = [r for r in suite.skip_reasons.values() if "not importable" in r]
    if not suite.outcomes or ran == 0:
        suite.problem = suite.problem or f"nothing ran ({suite.count('skipped')} skipped)"
    elif not_importable:
        suite.problem = suite.problem or (
            f"{len(not_importable)} skipped because vLLM did not import: {not_importable[0]}"
        )


# -- known differences --------------------------------------------------------------------------


def load_known(path: Path) -> list[dict[str, Any]]:
    data = tomllib.loads(path.read_text())
    known: list[dict[str, Any]] = data.get("difference", [])
    for entry in known:
        for key in ("test", "versions", "direction", "why"):
            if key not in entry:
                raise SystemExit(f"{path}: a [[difference]] lacks {key!r}: {entry}")
    return known


def documented(test_id: str, version: str, direction: str, known: list[dict[str, Any]]) -> bool:
    return any(
        e["direction"] == direction
        and fnmatch.fnmatchcase(test_id, e["test"])
        and any(fnmatch.fnmatchcase(version, v) for v in e["versions"])
        for e in known
    )


# -- one version --------------------------------------------------------------------------------


def run_version(
    version: str, reduced: bool, wheel: Path, known: list[dict[str, Any]], args: argparse.Namespace
) -> Row:
    row = Row(version, mode="reduced" if reduced else "full")
    start = time.monotonic()
    vdir = args.cache_dir / version
    logs = args.cache_dir / "logs" / version
    try:
        venv = ensure_venv(version, vdir, args)
        py = str(venv / "bin" / "python")
        must(
            [py, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
            "installing kvasync's wheel",
            deadline_s=args.setup_deadline,
        )
        src = ensure_source(version, vdir, py, args.setup_deadline)
        row.any_version, refusal = untested_version(py, args.setup_deadline)
        if row.any_version:
            print(
                f"[{version}] the plugin refuses it untested ({refusal}): "
                "KVASYNC_VLLM_ANY_VERSION=1"
            )
    except SetupError as error:
        row.problem = str(error)
        row.seconds = time.monotonic() - start
        print(f"[{version}] SETUP FAILED: {error}", flush=True)
        return row
    env = dict(os.environ)
    for name in list(env):
        if name.startswith("KVASYNC_"):
            del env[name]
    # vLLM's test_kv_cache_utils asks huggingface.co for tokenizers and retries until its
    # timeout; offline, those tests fail at once (on both sides alike).
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    if row.any_version:
        env["KVASYNC_VLLM_ANY_VERSION"] = "1"
    files = vllm_test_files(src, reduced, args.with_scheduler)
    row.suites["plugin"] = Suite("plugin", plugin_test_files())
    row.suites["kvasync"] = Suite("kvasync", files)
    row.suites["stock"] = Suite("stock", files)
    print(f"[{version}] {row.mode}: vLLM tests {', '.join(Path(f).name for f in files)}")
    run_suite(row.suites["plugin"], py, REPO, [], env, logs, args)
    # vLLM's runs, both sides: the teardown shim for a machine with no accelerator (its
    # docstring says why), from its own folder so nothing else of tests/ is importable there.
    vllm_env = dict(env, PYTHONPATH=str(SUPPORT))
    cpu = ["-p", "kvasync_matrix_cpu"]
    pool = ["-p", "kvasync.integrations.vllm.pytest_vllm"]
    sides = [(row.suites["kvasync"], cpu + pool), (row.suites["stock"], cpu)]
    if args.sides_at_once:
        # Two pytest processes over one venv and source tree: each writes only its own junit,
        # log and (PYTHONDONTWRITEBYTECODE) no bytecode.
        with concurrent.futures.ThreadPoolExecutor(2) as pool_of_two:
            done = [
                pool_of_two.submit(run_suite, suite, py, src, extra, vllm_env, logs, args)
                for suite, extra in sides
            ]
            for future in done:
                future.result()
    else:
        for suite, extra in sides:
            run_suite(suite, py, src, extra, vllm_env, logs, args)
    compare(row)
    row.undocumented = undocumented(row, known)
    row.seconds = time.monotonic() - start
    return row


def compare(row: Row) -> None:
    """The tests one side passes and the other does not; none where a side did not run (its
    problem fails the row already, and every test would show as a difference)."""
    stock, ours = row.suites["stock"], row.suites["kvasync"]
    if stock.problem or ours.problem:
        row.kvasync_only_fails, row.stock_only_fails = [], []
        return
    row.kvasync_only_fails = sorted(
        t for t, o in stock.outcomes.items() if o == "passed" and ours.outcomes.get(t) != "passed"
    )
    row.stock_only_fails = sorted(
        t for t, o in ours.outcomes.items() if o == "passed" and stock.outcomes.get(t) != "passed"
    )


def undocumented(row: Row, known: list[dict[str, Any]]) -> list[str]:
    return [
        f"{t} (kvasync fails, stock passes)"
        for t in row.kvasync_only_fails
        if not documented(t, row.version, "kvasync-fails", known)
    ] + [
        f"{t} (stock fails, kvasync passes)"
        for t in row.stock_only_fails
        if not documented(t, row.version, "stock-fails", known)
    ]


def row_failures(row: Row) -> list[str]:
    """Why this row fails the run (empty: it passes)."""
    if row.problem:
        return [f"{row.version}: setup: {row.problem.splitlines()[0]}"]
    out = [f"{row.version}: {s.name}: {s.problem}" for s in row.suites.values() if s.problem]
    plugin = row.suites["plugin"]
    if plugin.count("failed"):
        out.append(f"{row.version}: plugin tests: {plugin.count('failed')} failed")
    out += [f"{row.version}: undocumented difference: {d}" for d in row.undocumented]
    return out


# -- the table ----------------------------------------------------------------------------------


def short(test_id: str) -> str:
    return test_id.rsplit("/", 1)[-1].replace(".py::", "::")


def table(rows: list[Row]) -> str:
    head = (
        "| vLLM | mode | plugin tests pass/fail/skip | stock pass/fail | kvasync pass/fail "
        "| kvasync fails, stock passes | stock fails, kvasync passes | minutes |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        name = r.version + (" (ANY_VERSION)" if r.any_version else "")
        if r.problem:
            why = r.problem.splitlines()[0].replace("|", "/")
            lines.append(
                f"| {name} | {r.mode} | setup failed: {why} | | | | | {r.seconds / 60:.1f} |"
            )
            continue
        p, s, k = r.suites["plugin"], r.suites["stock"], r.suites["kvasync"]

        def cell(suite: Suite, skip: bool = False) -> str:
            text = f"{suite.count('passed')}/{suite.count('failed')}"
            text += f"/{suite.count('skipped')}" if skip else ""
            return text + (f" ({suite.problem})" if suite.problem else "")

        def diffs(ids: list[str], undocumented: str = " ".join(r.undocumented)) -> str:
            marked = [
                short(t) + ("" if t not in undocumented else " **undocumented**") for t in ids
            ]
            return "<br>".join(marked) if marked else "none"

        lines.append(
            f"| {name} | {r.mode} | {cell(p, True)} | {cell(s)} | {cell(k)} "
            f"| {diffs(r.kvasync_only_fails)} | {diffs(r.stock_only_fails)} "
            f"| {r.seconds / 60:.1f} |"
        )
    return head + "\n".join(lines) + "\n"


def git(*cmd: str) -> str:
    rc, out = run(["git", "-C", str(REPO), *cmd], deadline_s=30)
    return out.strip() if rc == 0 else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default=DEFAULT_VERSIONS, help="space-separated releases")
    parser.add_argument(
        "--mode",
        choices=("full", "ends", "reduced"),
        default="full",
        help="full: every version's whole set; ends: the first and last version in full, the "
        "ones between on the plugin's tests + prefix caching + the single-type manager; "
        "reduced: every version on that smaller set",
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument(
        "--python", default=sys.executable, help="the Python the venvs are made from"
    )
    parser.add_argument("--build-python", default=sys.executable, help="builds kvasync's wheel")
    parser.add_argument("--wheel", type=Path, help="a kvasync wheel to use instead of building one")
    parser.add_argument(
        "--torch",
        default="torch==2.13.0",
        help="torch's CPU build, as pip finds it (a wheel file, or a pin its find-links serve)",
    )
    parser.add_argument("--with-scheduler", action="store_true", help="add test_scheduler.py")
    parser.add_argument(
        "--sides-at-once",
        action="store_true",
        help="run vLLM's tests with kvasync's pool and on stock at the same time (2 processes)",
    )
    parser.add_argument(
        "--setup-only", action="store_true", help="make the venvs and source trees, run nothing"
    )
    parser.add_argument("--test-timeout", type=int, default=20, help="seconds per test")
    parser.add_argument("--suite-deadline", type=float, default=1800, help="seconds per suite")
    parser.add_argument("--setup-deadline", type=float, default=1800, help="seconds per setup step")
    parser.add_argument(
        "--known", type=Path, default=REPO / "docs" / "vllm" / "known-differences.toml"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=REPO / "docs" / "vllm" / "matrix-results.md",
        help="the Markdown table (JSON beside it, .json)",
    )
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        help="make one table from these runs' JSON records instead of running anything",
    )
    args = parser.parse_args(argv)
    versions = args.versions.split()
    if not versions:
        parser.error("--versions is empty")
    known = load_known(args.known)
    if args.combine:
        return combine(args.combine, known, args.results)
    args.cache_dir = args.cache_dir.resolve()
    if args.setup_only:
        status = 0
        for version in versions:
            try:
                venv = ensure_venv(version, args.cache_dir / version, args)
                ensure_source(
                    version,
                    args.cache_dir / version,
                    str(venv / "bin" / "python"),
                    args.setup_deadline,
                )
                print(f"[{version}] ready")
            except SetupError as error:
                print(f"[{version}] SETUP FAILED: {error}", flush=True)
                status = 1
        return status
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.monotonic()
    if args.wheel is not None:
        wheel = args.wheel.resolve()
    else:
        print("building kvasync's wheel (once for every version)", flush=True)
        try:
            wheel = build_kvasync_wheel(
                args.build_python, Path(tempfile.mkdtemp(prefix="kvasync-wheel-")), 1800
            )
        except SetupError as error:
            print(f"FAILED: {error}")
            return 1
    build_s = time.monotonic() - t0
    mode_line = {
        "full": "every version in full",
        "ends": f"{versions[0]} and {versions[-1]} in full; the versions between on the plugin's "
        "tests, test_prefix_caching.py and test_single_type_kv_cache_manager.py",
        "reduced": "every version on the plugin's tests, test_prefix_caching.py and "
        "test_single_type_kv_cache_manager.py",
    }[args.mode]
    commit = git("rev-parse", "--short", "HEAD")
    dirty = " (uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    command = "python tests/vllm_matrix.py " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    run_record: dict[str, Any] = {
        "date": f"{started:%Y-%m-%d %H:%M} UTC",
        "commit": commit + dirty,
        "command": command,
        "mode": f"{mode_line}; per-test timeout {args.test_timeout} s; "
        f"{'with' if args.with_scheduler else 'without'} test_scheduler.py",
        "wall_min": None,  # the run's, when it ends
        "wheel_build_min": round(build_s / 60, 1),
    }
    rows = []
    for i, version in enumerate(versions):
        reduced = args.mode == "reduced" or (args.mode == "ends" and 0 < i < len(versions) - 1)
        print(f"[{version}] {'reduced' if reduced else 'full'}", flush=True)
        rows.append(run_version(version, reduced, wheel, known, args))
        # Each version's row as it ends, in the results' JSON form: a run cut short keeps what
        # it finished, and --combine can put rows of several runs into one table.
        row_file = args.cache_dir / "logs" / version / "row.json"
        row_file.parent.mkdir(parents=True, exist_ok=True)
        row_file.write_text(json.dumps({"runs": [run_record], "rows": [asdict(rows[-1])]}))
        print(f"[{version}] row written: {row_file}", flush=True)
    run_record["wall_min"] = round((time.monotonic() - t0) / 60, 1)
    for row in rows:  # the run ended: its rows say how long it took
        row_file = args.cache_dir / "logs" / row.version / "row.json"
        row_file.write_text(json.dumps({"runs": [run_record], "rows": [asdict(row)]}))
    return write_results([run_record], rows, args.results)


def write_results(runs: list[dict[str, Any]], rows: list[Row], results: Path) -> int:
    """Prints the table, writes it (Markdown) and the JSON record; 1 if the matrix failed."""
    failures = [f for r in rows for f in row_failures(r)]
    text = table(rows)
    header = (
        "# vLLM matrix results\n\n"
        "Generated by `make vllm-matrix` (tests/vllm_matrix.py); do not edit by hand.\n\n"
        + "".join(
            f"- Run {r['date']}, kvasync {r['commit']}: `{r['command']}`; {r['mode']}; "
            + (f"{r['wall_min']} min" if r["wall_min"] is not None else "cut short")
            + f" (wheel build {r['wheel_build_min']} min)\n"
            for r in runs
        )
        + "- Counts are tests (a teardown error counts as a failure). The differences are by "
        "test and explained in docs/vllm/known-differences.toml. (ANY_VERSION): a release the "
        "plugin does not list, run with KVASYNC_VLLM_ANY_VERSION=1. Minutes: the version's "
        "setup and suites.\n\n"
    )
    verdict = (
        "\n**Result: FAILED**\n\n" + "\n".join(f"- {f}" for f in failures) + "\n"
        if failures
        else "\n**Result: passed**\n"
    )
    print("\n" + header + text + verdict)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(header + text + verdict)
    record = {"runs": runs, "failures": failures, "rows": [asdict(r) for r in rows]}
    results.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {results} and {results.with_suffix('.json')}")
    return 1 if failures else 0


def combine(paths: list[Path], known: list[dict[str, Any]], results: Path) -> int:
    """One table from several runs' JSON (e.g. the two ends in full from one run, the releases
    between from another); differences are checked again against today's documented list."""
    runs: list[dict[str, Any]] = []
    rows: list[Row] = []
    for path in paths:
        record = json.loads(path.read_text())
        if "runs" not in record:  # a record from before runs were listed: one run
            record["runs"] = [
                {
                    "date": record["date"][:16].replace("T", " ") + " UTC",
                    "commit": record["commit"],
                    "command": record["command"],
                    "mode": record["mode"],
                    "wall_min": round(sum(r["seconds"] for r in record["rows"]) / 60, 1),
                    "wheel_build_min": 0.0,
                }
            ]
        runs += [r for r in record["runs"] if r not in runs]  # rows of one run: one line
        for data in record["rows"]:
            suites = {k: Suite(**v) for k, v in data.pop("suites").items()}
            row = Row(**data, suites=suites)
            if not row.problem:
                compare(row)
                row.undocumented = undocumented(row, known)
            rows.append(row)
    versions = [r.version for r in rows]
    if len(set(versions)) != len(versions):
        raise SystemExit(f"--combine: a version appears twice: {versions}")
    rows.sort(key=lambda r: tuple(int(x) for x in re.findall(r"\d+", r.version)))
    return write_results(runs, rows, results)


if __name__ == "__main__":
    sys.exit(main())
