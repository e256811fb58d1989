"""The command line as a new user meets it: a command that needs an extra says which one, at
once, before any work."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

import kvasync
import kvasync.share
from kvasync import cli
from kvasync._sizes import format_bytes

ROOT = Path(__file__).resolve().parent.parent

# Runs a command with some modules made unimportable (a None entry in sys.modules is how Python
# spells "not installed" to an import), then reports whether torch was imported: the check must
# come before any work, and any work of these commands imports torch.
PROBE = """
import sys
for module in sys.argv[2:]:
    sys.modules[module] = None
from kvasync.cli import main
try:
    main([sys.argv[1]], prog_name="kvasync")
finally:
    print("torch imported:", "torch" in sys.modules)
"""


def run_without(command: str, *modules: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, command, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.parametrize(
    ("command", "missing"),
    [("serve", "uvicorn"), ("serve", "fastapi"), ("demo", "matplotlib")],
)
def test_a_command_names_the_extra_it_needs_before_any_work(command, missing):
    # Issue 18: after `pip install ".[metrics,trio]"`, serve died on ModuleNotFoundError:
    # uvicorn, and the demo ran its whole burst before dying on matplotlib.
    done = run_without(command, missing)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        f"Error: kvasync {command} needs the serve extra (missing: {missing}): "
        'pip install "kvasync[serve]"'
    )
    assert "torch imported: False" in done.stdout


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them: ``prometheus_client`` is
    ``prometheus-client``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_extras_the_commands_name_install_the_modules_they_check():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    distributions = importlib.metadata.packages_distributions()
    for command, (extra, modules) in cli._EXTRAS.items():
        named = {normalized(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in extras[extra]}
        for module in modules:
            (distribution,) = {normalized(d) for d in distributions[module]}
            assert distribution in named, f"kvasync {command}: {module} is not in [{extra}]"


def run_kvasync(*args: str, columns: int = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvasync", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": str(columns)},
    )


def serve_start_line(tmp_path: Path, *options: str) -> tuple[str, str]:
    """Starts ``kvasync serve`` on a free port, waits (60 s at most) for its start-up line
    (model, device, KV settings), stops it; returns that line and everything it printed."""
    output = tmp_path / "serve.log"
    command = [sys.executable, "-m", "kvasync", "serve", "--port", "0", *options]
    with open(output, "wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (lines := [x for x in output.read_text().splitlines() if "cache:" in x]):
            assert server.poll() is None, output.read_text()
            assert time.monotonic() < deadline, "no start-up line within 60 s"
            time.sleep(0.05)  # polls the log for the line, bounded by the deadline
    finally:
        server.terminate()
        server.wait(timeout=15)
    return lines[0], output.read_text()


@pytest.mark.parametrize(
    "options",
    [("--memory-limit", "3MiB"), ("--memory-limit", "3145728"), ("--memory-limit-mib", "3")],
)
def test_serve_takes_its_memory_limit_as_a_size_like_device_budget(tmp_path, options):
    # Issue 18: --memory-limit-mib took an integer while --device-budget took a size string.
    line, output = serve_start_line(tmp_path, *options)
    assert "memory limit 3145728 bytes" in line, line
    deprecated = "--memory-limit-mib is deprecated: use --memory-limit 3MiB"
    assert (deprecated in output) == (options[0] == "--memory-limit-mib"), output


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_a_memory_limit_that_is_not_a_size_is_refused_by_name(command):
    done = run_kvasync(command, "--memory-limit", "lots")
    assert done.returncode == 2
    assert "Invalid value for '--memory-limit': not a size: 'lots'" in done.stderr
    both = run_kvasync(command, "--memory-limit", "3MiB", "--memory-limit-mib", "3")
    assert both.returncode == 2 and "give --memory-limit alone" in both.stderr
    shown = run_kvasync(command, "--help").stdout
    assert "--memory-limit SIZE" in shown and "--memory-limit-mib" not in shown


def test_ls_stays_readable_in_a_narrow_terminal():
    # Issue 18: at 60 columns the table cut every header and the name to "map…", "lla…".
    share = f"test-narrow-{uuid.uuid4().hex[:8]}"
    name = "llama-3-70b-instruct-engine-on-the-left-half"  # more than a 60-column row holds
    layout = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    config = kvasync.Config(
        backend="host", share=share, device_budget=64 << 20, name=name, reserve_pages=(0, 0)
    )
    with kvasync.open_allocator_sync(layout, config) as kv:
        blocks = kv.alloc(600, timeout=5.0)
        kv.set_demand(900)  # an engine's running and waiting need, which `ls` shows
        mapped = kv.stats().mapped_bytes

        def settled(entry: kvasync.share.LedgerEntry) -> bool:
            # The watcher publishes every 100 ms: wait for the view after the map, op and all.
            return (
                bool(entry.used_bytes)
                and entry.mapped_bytes == mapped
                and not entry.op
                and entry.demand_bytes > 0
            )

        deadline = time.monotonic() + 5.0
        while not settled(entry := kvasync.share.snapshot(share)[0]):
            assert time.monotonic() < deadline, f"the ledger did not settle within 5 s: {entry}"
            time.sleep(0.01)
        narrow = run_kvasync("ls", "--share", share, columns=60)
        wide = run_kvasync("ls", "--share", share, columns=200)
        kv.free(blocks)
    assert narrow.returncode == 0 and wide.returncode == 0, narrow.stderr + wide.stderr
    assert max(map(len, narrow.stdout.splitlines())) <= 60, narrow.stdout
    assert "…" not in narrow.stdout
    assert name in "".join(narrow.stdout.split()), narrow.stdout  # folded, never cut
    fields = {
        "pid": str(entry.pid),
        "used": format_bytes(entry.used_bytes),
        "mapped": format_bytes(entry.mapped_bytes),
        "reserve": format_bytes(entry.reserved_bytes),
        "demand": format_bytes(entry.demand_bytes),
        "limit": format_bytes(entry.limit_bytes),
        "mapper op": "idle",
    }
    for field, value in fields.items():  # a line per column, its value in full
        assert re.search(rf"^\s*{field}\s+{re.escape(value)}\s*$", narrow.stdout, re.M), field
    # Where it fits, a row per allocator, as before.
    header = next(line for line in wide.stdout.splitlines() if "mapper op" in line)
    assert all(column in header for column in fields)
    assert name in wide.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "--share", ""],
        ["ls", "--json", "--share", ""],
        ["ls", "--prune", "--share", ""],
        ["top", "--count", "1", "--share", ""],
        ["limit", "--share", "", "1", "8MiB"],
        ["serve", "--share", ""],
        ["ls", "--share", "../etc"],
    ],
)
def test_every_command_taking_a_share_refuses_a_bad_name_before_any_work(args):
    # Issue 27, defect 9: `kvasync ls --share ''` listed "0 allocator(s)" and exited 0 (and
    # `ls --prune --share ''` went on to prune every share of the machine).
    done = CliRunner().invoke(cli.main, args)
    assert done.exit_code == 2, done.output
    assert "Invalid value for '--share'" in done.output
    assert "share must be 1-100 characters" in done.output
