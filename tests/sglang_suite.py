"""``make sglang-test``: SGLang's own memory-pool, allocator and radix-cache unit tests on the CPU,
with kvasync's SGLang plugin in place and on stock SGLang, beside the plugin's own tests.

For the release (``--version``, 0.5.17): a cached venv made by the recipe below, this kvasync
tree as one wheel, SGLang's unit tests from ``--sglang-tests``, then three suites, each under
pytest with ``--junitxml``, a per-test timeout and a deadline:

- ``plugin``: kvasync's own ``tests/test_sglang_plugin.py`` against the venv's real SGLang;
- ``kvasync``: SGLang's tests with kvasync in place
  (``-p kvasync.integrations.sglang.pytest_sglang``);
- ``stock``: the same tests on stock SGLang.

It prints each suite's pytest summary, one table and the differences, writes them to
``--results`` (Markdown, and JSON beside it), and exits 1 when a suite did not run, was skipped
wholesale, a plugin test failed, or a test one side passes and the other does not is not in
``docs/sglang/known-differences.toml``.

The venv's recipe (``ensure_venv``), for a CPU machine:

1. ``python -m venv`` (``--python``; SGLang 0.5.17's only wheel is cp312, and it is pure Python
   but for three Rust extensions these modules never import, so a 3.11 venv runs it);
2. ``--torch`` (torch's CPU build: ``torch==2.13.0`` where pip's find-links serve it, or a wheel
   file), with a constraint so nothing pulls another torch;
3. SGLang's wheel, ``pip download --no-deps`` for cp312 and unpacked into the venv's
   site-packages (``pip install`` refuses a cp312 wheel on 3.11), dist-info included;
4. ``--torchvision`` with ``--no-deps`` (SGLang imports it at module import; PyPI's build is
   CUDA-linked, so ``tests/sglang_suite_support/kvasync_sglang_cpu.py`` defines the two schemas
   its Python part needs when its ops do not load; its docstring says why);
5. of SGLang's requirements, those the modules under test import (``IMPORTED``, at SGLang's
   pins), plus ``EXTRA_IMPORTS`` (imported but not declared) and ``TEST_TOOLS``; the rest
   (CUDA kernels, model-serving extras) are left out, and a CUDA package in the venv fails it;
6. an import probe of ``IMPORT_CHECK`` with the CPU shim loaded.

SGLang's tests are not in its wheel and 0.5.17 has no sdist, and the CI machine reaches no code
host: ``--sglang-tests`` is a folder laid out as SGLang's repository (``test/registered/...``),
checked file by file against ``tests/sglang_suite_support/sglang-<version>-tests.toml`` (each
file's upstream commit and sha256). The runner never fetches them.

A plain script, not a pytest module: ``python tests/sglang_suite.py --help``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shlex
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_matrix import (
    FORBIDDEN,
    PYTEST_SUMMARY,
    Row,
    SetupError,
    Suite,
    build_kvasync_wheel,
    git,
    load_known,
    must,
    normalize,
    run,
    run_suite,
    short,
    undocumented,
)

REPO = Path(__file__).resolve().parent.parent
SUPPORT = REPO / "tests" / "sglang_suite_support"
DEFAULT_VERSION = "0.5.17"
DEFAULT_CACHE = Path.home() / ".cache" / "kvasync" / "sglang"
WHEEL_TAGS = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
WHEEL_PLATFORM = "manylinux_2_34_x86_64"

# SGLang's declared requirements that sglang.srt.mem_cache.*, the scheduler, the plugin API and
# sglang.test.test_utils import on this path (found by importing them: IMPORT_CHECK).
IMPORTED = [
    "aiohttp",
    "compressed-tensors",
    "distro",
    "easydict",
    "einops",
    "fastapi",
    "gguf",
    "interegular",
    "ipython",
    "msgspec",
    "numpy",
    "nvidia-ml-py",
    "openai",
    "orjson",
    "packaging",
    "partial-json-parser",
    "pillow",
    "psutil",
    "py-spy",
    "pybase64",
    "pydantic",
    "python-multipart",
    "pyzmq",
    "requests",
    "scipy",
    "sentencepiece",
    "setproctitle",
    "tqdm",
    "transformers",
    "uvicorn",
    "uvloop",
    "xgrammar",
    "xxhash",
    "zstandard",
]
# Imported at module import but not in SGLang's requirements: dill
# (sglang.srt.sampling.custom_logit_processor), datasets (sglang.test.test_utils, through
# sglang.benchmark).
EXTRA_IMPORTS = ["dill", "datasets"]
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "pytest-asyncio>=0.24", "click>=8.1", "rich>=13"]
IMPORT_CHECK = [
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.allocator.paged",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.kv_cache_configurator",
    "sglang.srt.managers.scheduler",
    "sglang.srt.plugins.hook_registry",
    "sglang.test.test_utils",
]
PLUGIN_TESTS = ["tests/test_sglang_plugin.py"]
# Named like a CUDA package but pure Python: NVML's bindings (SGLang imports pynvml; the library
# it wraps is loaded only when called).
NOT_CUDA = {"nvidia-ml-py"}

REQUIREMENTS_PROBE = r"""
import importlib.metadata, json
from pip._vendor.packaging.requirements import Requirement
print(json.dumps([str(r) for r in map(Requirement, importlib.metadata.requires("sglang") or [])
                  if r.marker is None or r.marker.evaluate({"extra": ""})]))
"""


# -- the venv -----------------------------------------------------------------------------------


def site_packages(py: str, deadline_s: float) -> Path:
    out = must(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        "finding the venv's site-packages",
        deadline_s=deadline_s,
    )
    return Path(out.strip().splitlines()[-1])


def sglang_wheel(version: str, vdir: Path, py: str, deadline_s: float) -> Path:
    dist = vdir / "dist"
    wheels = sorted(dist.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        must(
            [
                *[py, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"],
                *[*WHEEL_TAGS, "--platform", WHEEL_PLATFORM, f"sglang=={version}", "-d", str(dist)],
            ],
            f"downloading sglang=={version}'s wheel",
            deadline_s=deadline_s,
        )
        wheels = sorted(dist.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        raise SetupError(f"pip download left no sglang-{version} wheel in {dist}")
    return wheels[0]


def pinned(requirements: list[str], names: list[str]) -> list[str]:
    """SGLang's own requirement (with its pin) for each name; a name it lacks, as is."""
    by_name = {normalize(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]): r for r in requirements}
    return [by_name.get(normalize(name), name) for name in names]


def ensure_venv(version: str, vdir: Path, args: argparse.Namespace) -> Path:
    """The release's venv, made once and reused while its recipe is unchanged."""
    venv = vdir / "venv"
    py = str(venv / "bin" / "python")
    recipe = json.dumps(
        [args.torch, args.torchvision, IMPORTED, EXTRA_IMPORTS, TEST_TOOLS, args.python, version]
    )
    stamp = venv / ".kvasync-sglang"
    if stamp.exists() and stamp.read_text() == recipe:
        return venv
    deadline = args.setup_deadline
    print(f"[{version}] making its venv in {venv}", flush=True)
    if not (venv / "bin" / "python").exists():
        must([args.python, "-m", "venv", str(venv)], "python -m venv", deadline_s=deadline)
    pip = [py, "-m", "pip", "install", "-q"]
    constraints = vdir / "constraints.txt"
    constraints.write_text(f"{args.torch}\n")
    must([*pip, args.torch], f"installing {args.torch}", deadline_s=deadline)
    wheel = sglang_wheel(version, vdir, py, deadline)
    purelib = site_packages(py, deadline)
    if not (purelib / f"sglang-{version}.dist-info").is_dir():
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(purelib)
    must(
        [*pip, "--no-deps", args.torchvision],
        f"installing {args.torchvision}",
        deadline_s=deadline,
    )
    out = must([py, "-c", REQUIREMENTS_PROBE], "reading SGLang's requirements", deadline_s=60)
    requirements: list[str] = json.loads(out.strip().splitlines()[-1])
    wanted = pinned(requirements, IMPORTED) + EXTRA_IMPORTS + TEST_TOOLS
    print(f"[{version}] of SGLang's {len(requirements)} requirements: {len(IMPORTED)} installed")
    must(
        [*pip, "-c", str(constraints), *wanted],
        f"installing what SGLang {version}'s memory modules import",
        deadline_s=deadline,
    )
    listed = must([py, "-m", "pip", "list", "--format=json"], "pip list", deadline_s=deadline)
    gpu = [
        p["name"]
        for p in json.loads(listed)
        if normalize(p["name"]).startswith(FORBIDDEN) and normalize(p["name"]) not in NOT_CUDA
    ]
    if gpu:
        raise SetupError(f"CUDA packages were installed (what pulled them in?): {gpu}")
    check_import(py, version, deadline)
    stamp.write_text(recipe)
    return venv


def check_import(py: str, version: str, deadline_s: float) -> None:
    probe = (
        "import kvasync_sglang_cpu, importlib, torch, sglang.version\n"
        f"for name in {IMPORT_CHECK!r}: importlib.import_module(name)\n"
        "assert torch.version.cuda is None, f'torch {torch.__version__} is a CUDA build'\n"
        "print(sglang.version.__version__, torch.__version__)"
    )
    env = dict(os.environ, PYTHONPATH=str(SUPPORT))
    rc, out = run([py, "-c", probe], deadline_s=deadline_s, env=env)
    if rc != 0:
        missing = re.findall(r"(ModuleNotFoundError: .*|ImportError: .*|AssertionError: .*)", out)
        raise SetupError(
            f"SGLang {version}'s memory modules do not import here: "
            + (missing[-1] if missing else out.strip().splitlines()[-1])
        )
    got = out.strip().splitlines()[-1].split()[0]
    if got != version:
        raise SetupError(f"the venv's SGLang is {got}, not {version}")


# -- SGLang's tests -----------------------------------------------------------------------------


def manifest_path(version: str) -> Path:
    return SUPPORT / f"sglang-{version}-tests.toml"


def check_tests(version: str, root: Path) -> list[str]:
    """SGLang's test files for ``version`` under ``root``, each checked against the manifest."""
    path = manifest_path(version)
    if not path.exists():
        raise SetupError(f"no manifest of SGLang {version}'s tests ({path})")
    files: list[dict[str, str]] = tomllib.loads(path.read_text())["file"]
    problems = []
    for entry in files:
        local = root / entry["path"]
        if not local.exists():
            problems.append(f"{entry['path']} is missing")
        elif hashlib.sha256(local.read_bytes()).hexdigest() != entry["sha256"]:
            problems.append(f"{entry['path']} differs from the manifest's sha256")
    if problems:
        raise SetupError(
            f"SGLang's tests under {root}: {'; '.join(problems)}. Lay out the files {path.name} "
            "lists (sgl-project/sglang at the commits it names, same paths) and pass "
            "--sglang-tests: the runner cannot fetch them (not in SGLang's wheel, no sdist)"
        )
    return [entry["path"] for entry in files]


# -- one release --------------------------------------------------------------------------------


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVASYNC_", "SGLANG_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    # Triton's interpreter runs SGLang's allocator kernels (alloc_extend/alloc_decode) on the
    # CPU; Triton decides at kernel definition, so it is set before any process starts.
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(SUPPORT)
    return env


def run_release(version: str, wheel: Path, args: argparse.Namespace) -> Row:
    row = Row(version)
    start = time.monotonic()
    vdir = args.cache_dir / version
    logs = vdir / "logs"
    try:
        venv = ensure_venv(version, vdir, args)
        py = str(venv / "bin" / "python")
        must(
            [py, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
            "installing kvasync's wheel",
            deadline_s=args.setup_deadline,
        )
        tests_root = (args.sglang_tests or vdir / "tests").resolve()
        files = check_tests(version, tests_root)
    except SetupError as error:
        row.problem = str(error)
        row.seconds = time.monotonic() - start
        print(f"[{version}] SETUP FAILED: {error}", flush=True)
        return row
    env = clean_env()
    cpu = ["-p", "kvasync_sglang_cpu"]
    row.suites["plugin"] = Suite("plugin", PLUGIN_TESTS)
    row.suites["kvasync"] = Suite("kvasync", files)
    row.suites["stock"] = Suite("stock", files)
    print(f"[{version}] SGLang tests: {', '.join(Path(f).name for f in files)}", flush=True)
    # The plugin's tests keep pyproject.toml's settings (warnings are errors there), less the
    # warnings SGLang's own import raises on a CPU machine.
    plugin_extra = [*cpu, "-W", "ignore::DeprecationWarning", "-W", "ignore::UserWarning"]
    run_suite(row.suites["plugin"], py, REPO, plugin_extra, env, logs, args)
    read_outcomes(row.suites["plugin"], logs, REPO)
    # kvasync's own pytest plugin (pytest11) is loaded on both sides alike: it only adds fixtures.
    pool = ["-p", "kvasync.integrations.sglang.pytest_sglang"]
    for name, extra in (("kvasync", cpu + pool), ("stock", cpu)):
        run_suite(row.suites[name], py, tests_root, extra, env, logs, args)
        read_outcomes(row.suites[name], logs, tests_root)
    compare(row)
    row.seconds = time.monotonic() - start
    return row


def read_outcomes(suite: Suite, logs: Path, root: Path) -> None:
    """Outcome per ``file::Class::name`` from the suite's junit, the worst of its phases.

    vllm_matrix's reader keys ``file::name``; SGLang's unittest classes reuse test names
    (``TestRadixKey`` and ``TestTreeNode`` both have ``test_init_basic``), so the class is kept.
    """
    junit = logs / f"{suite.name}.xml"
    if not junit.exists():
        return
    suite.outcomes.clear()
    suite.skip_reasons.clear()
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        cut = next(
            (
                i
                for i in range(len(parts), 0, -1)
                if (root / ("/".join(parts[:i]) + ".py")).exists()
            ),
            len(parts),
        )
        test_id = "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], case.get("name", "")])
        outcome = "passed"
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif skipped is not None:
            outcome = "skipped"
            suite.skip_reasons[test_id] = skipped.get("message", "")
        if rank[outcome] >= rank[suite.outcomes.get(test_id, "passed")]:
            suite.outcomes[test_id] = outcome


def compare(row: Row) -> None:
    stock, ours = row.suites["stock"], row.suites["kvasync"]
    if stock.problem or ours.problem:
        return
    row.kvasync_only_fails = sorted(
        t for t, o in stock.outcomes.items() if o == "passed" and ours.outcomes.get(t) != "passed"
    )
    row.stock_only_fails = sorted(
        t for t, o in ours.outcomes.items() if o == "passed" and stock.outcomes.get(t) != "passed"
    )


def summary_of(suite: Suite, logs: Path) -> str:
    """pytest's own closing line for ``suite`` (from its log), or why there is none."""
    log = logs / f"{suite.name}.log"
    lines = log.read_text().splitlines() if log.exists() else []
    found = [line.strip("= ") for line in lines if PYTEST_SUMMARY.search(line)]
    return found[-1] if found else (suite.problem or "no pytest summary")


def failures(row: Row) -> list[str]:
    if row.problem:
        return [f"setup: {row.problem.splitlines()[0]}"]
    out = [f"{s.name}: {s.problem}" for s in row.suites.values() if s.problem]
    if row.suites["plugin"].count("failed"):
        out.append(f"plugin tests: {row.suites['plugin'].count('failed')} failed")
    return out + [f"undocumented difference: {d}" for d in row.undocumented]


def report(row: Row, logs: Path, record: dict[str, Any], results: Path) -> int:
    lines = [
        "# SGLang suite results",
        "",
        "Generated by `make sglang-test` (tests/sglang_suite.py); do not edit by hand.",
        "",
        f"- Run {record['date']}, kvasync {record['commit']}: `{record['command']}`; "
        f"SGLang {row.version}; {row.seconds / 60:.1f} min.",
        "- Counts are tests (a teardown error counts as a failure). The differences are "
        "explained in docs/sglang/known-differences.toml.",
        "",
    ]
    if not row.problem:
        lines += ["| suite | files | passed | failed | skipped | pytest's summary |"]
        lines += ["|---|---|---|---|---|---|"]
        for suite in row.suites.values():
            names = ", ".join(Path(f).name for f in suite.files)
            lines.append(
                f"| {suite.name} | {names} | {suite.count('passed')} | {suite.count('failed')} "
                f"| {suite.count('skipped')} | {summary_of(suite, logs)} |"
            )
        lines += ["", "Tests kvasync fails and stock passes:", ""]
        lines += [f"- {short(t)}" for t in row.kvasync_only_fails] or ["- none"]
        lines += ["", "Tests stock fails and kvasync passes:", ""]
        lines += [f"- {short(t)}" for t in row.stock_only_fails] or ["- none"]
        both = sorted(
            t
            for t, o in row.suites["stock"].outcomes.items()
            if o == "failed" and row.suites["kvasync"].outcomes.get(t) == "failed"
        )
        lines += ["", f"Tests both sides fail ({len(both)}, SGLang's own on this machine):", ""]
        lines += [f"- {short(t)}" for t in both] or ["- none"]
    found = failures(row)
    lines += ["", "**Result: FAILED**" if found else "**Result: passed**", ""]
    lines += [f"- {f}" for f in found]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(text)
    data = {"run": record, "failures": found, "row": asdict(row)}
    results.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"written: {results} and {results.with_suffix('.json')}")
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="the SGLang release")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--python", default=sys.executable, help="makes the venv")
    parser.add_argument("--build-python", default=sys.executable, help="builds kvasync's wheel")
    parser.add_argument("--wheel", type=Path, help="a kvasync wheel to use instead of building one")
    parser.add_argument(
        "--torch", default="torch==2.13.0", help="torch's CPU build, as pip finds it"
    )
    parser.add_argument(
        "--torchvision", default="torchvision==0.28.0", help="the torchvision of --torch"
    )
    parser.add_argument(
        "--sglang-tests",
        type=Path,
        help="SGLang's tests, laid out as its repository (default: CACHE/VERSION/tests)",
    )
    parser.add_argument("--setup-only", action="store_true", help="make the venv, run nothing")
    parser.add_argument("--test-timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--suite-deadline", type=float, default=1800, help="seconds per suite")
    parser.add_argument("--setup-deadline", type=float, default=1800, help="seconds per setup step")
    parser.add_argument(
        "--known", type=Path, default=REPO / "docs" / "sglang" / "known-differences.toml"
    )
    parser.add_argument(
        "--results", type=Path, default=REPO / "docs" / "sglang" / "suite-results.md"
    )
    args = parser.parse_args(argv)
    args.cache_dir = args.cache_dir.resolve()
    known = load_known(args.known)
    if args.setup_only:
        try:
            ensure_venv(args.version, args.cache_dir / args.version, args)
        except SetupError as error:
            print(f"[{args.version}] SETUP FAILED: {error}", flush=True)
            return 1
        print(f"[{args.version}] ready")
        return 0
    started = datetime.datetime.now(datetime.UTC)
    if args.wheel is not None:
        wheel = args.wheel.resolve()
    else:
        print("building kvasync's wheel", flush=True)
        try:
            wheel = build_kvasync_wheel(
                args.build_python, Path(tempfile.mkdtemp(prefix="kvasync-wheel-")), 1800
            )
        except SetupError as error:
            print(f"FAILED: {error}")
            return 1
    row = run_release(args.version, wheel, args)
    row.undocumented = [] if row.problem else undocumented(row, known)
    dirty = " (uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    record = {
        "date": f"{started:%Y-%m-%d %H:%M} UTC",
        "commit": git("rev-parse", "--short", "HEAD") + dirty,
        "command": "python tests/sglang_suite.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "python": sysconfig.get_python_version(),
    }
    return report(row, args.cache_dir / args.version / "logs", record, args.results)


if __name__ == "__main__":
    sys.exit(main())
