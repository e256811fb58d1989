"""The command line as a new user meets it: a command that needs an extra says which one, at
once, before any work."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
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
        "limit": "none",  # no limit in force (the column showed the capacity: issue 29)
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


# -- issue 29, part 5: the share commands on the machine they run on ------------------------------

LAYOUT = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
# A page id of LAYOUT on the host backend: 2 MiB (HOST_PAGE_SIZE) in each of its 4 ranges (2
# layers, K and V) holds 512 blocks: a limit counts whole ones; max_blocks=4096 is 8 of them.
PAGE = 8 << 20


@pytest.fixture
def share_name() -> Iterator[str]:
    """A fresh share name; its ledger file (if any is left) is removed at the end."""
    chosen = f"test-cli-{uuid.uuid4().hex[:10]}"
    yield chosen
    if os.path.lexists(kvasync.share.path(chosen)):
        os.unlink(kvasync.share.path(chosen))


def kvasync_without_cuda(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvasync ARGS`` as on a machine without CUDA: no device visible, no $KVASYNC_SHARE."""
    env = {k: v for k, v in os.environ.items() if k != "KVASYNC_SHARE"}
    return subprocess.run(
        [sys.executable, "-m", "kvasync", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": ""},
    )


def wait_until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.01)  # polls the allocator's state, bounded by the deadline


def test_limit_without_a_share_acts_on_the_host_share_on_a_machine_without_cuda():
    # Issue 29: on a CPU machine the default share was cuda0, so `kvasync limit PID 1MiB`
    # failed ("no allocator has joined share 'cuda0'") although the allocators there are host's.
    config = kvasync.Config(backend="host", share="host", reserve_pages=(0, 0))
    with kvasync.open_allocator_sync(LAYOUT, config) as kv:
        done = kvasync_without_cuda("limit", str(os.getpid()), "8MiB")
        assert done.returncode == 0, done.stderr
        assert done.stdout == (
            f"limit of 8.0 MiB set on 1 allocator(s) of process {os.getpid()} on share 'host'\n"
        )
        wait_until(lambda: kv.stats().memory_limit_pages == 1, 5.0, "the limit applied")
        listed = kvasync_without_cuda("ls", "--json")
        assert listed.returncode == 0, listed.stderr
        assert os.getpid() in [e["pid"] for e in json.loads(listed.stdout)["allocators"]]


def test_a_share_picked_by_default_is_named_with_why_when_it_has_no_such_process(share_name):
    # The command says which share it picked, and why, where that share is not the one meant.
    done = kvasync_without_cuda("limit", "1", "8MiB")
    assert done.returncode == 1
    assert "share 'host' (the default on a machine without CUDA:" in done.stderr, done.stderr
    assert "--share NAME" in done.stderr


def test_limit_none_gives_a_process_its_configured_limit_back(share_name):
    # Issue 29: `kvasync limit PID none` was refused ("not a size"), although `None` is how
    # share.set_limit restores the configured limit.
    config = kvasync.Config(
        backend="host",
        share=share_name,
        memory_limit=4 * PAGE,
        reserve_pages=(0, 0),
    )
    with kvasync.open_allocator_sync(LAYOUT, config) as kv:
        assert kv.stats().memory_limit_pages == 4
        pid = str(os.getpid())
        lowered = run_kvasync("limit", "--share", share_name, pid, "8MiB")
        assert lowered.returncode == 0, lowered.stderr
        wait_until(lambda: kv.stats().memory_limit_pages == 1, 5.0, "the limit applied")
        restored = run_kvasync("limit", "--share", share_name, pid, "none")
        assert restored.returncode == 0, restored.stderr
        assert restored.stdout == (
            f"limit removed from 1 allocator(s) of process {pid} on share {share_name!r}: each "
            "is back to its configured memory limit\n"
        )
        wait_until(lambda: kv.stats().memory_limit_pages == 4, 5.0, "the configured limit back")
    bad = run_kvasync("limit", "--share", share_name, pid, "nothing")
    assert bad.returncode == 2, bad.stderr
    assert "not a size: 'nothing'" in bad.stderr and "; or none, to go back" in bad.stderr


def leave_a_stale_ledger(share: str) -> None:
    """A process joins ``share`` and dies without leaving: its ledger file stays, no one in it."""
    code = f"from kvasync import _share_names; m = _share_names.join({share!r}, 'x', 0, 1 << 21)"
    subprocess.run(
        [sys.executable, "-c", code + "; import os; os._exit(0)"], check=True, timeout=60
    )
    assert os.path.exists(kvasync.share.path(share))


def test_ls_and_top_say_a_share_is_stale_and_how_to_prune_it(share_name):
    # Issue 29: ls and top listed leftover ledgers ("0 allocator(s)") with no word of --prune.
    leave_a_stale_ledger(share_name)
    hint = (
        f"share {share_name!r} has no live allocator: its ledger file is left over from "
        f"processes that exited without leaving; `kvasync ls --prune --share {share_name}` "
        "removes it"
    )
    listed = run_kvasync("ls", "--share", share_name)
    assert listed.returncode == 0, listed.stderr
    assert f"kvasync: {hint}" in listed.stderr
    as_json = run_kvasync("ls", "--json", "--share", share_name)
    assert json.loads(as_json.stdout)["allocators"] == []  # the hint is not in the JSON
    assert f"kvasync: {hint}" in as_json.stderr
    top = run_kvasync("top", "--share", share_name, "--count", "1", "--interval", "0.05")
    assert top.returncode == 0, top.stderr
    assert hint in " ".join(top.stdout.split()), top.stdout
    assert os.path.exists(kvasync.share.path(share_name))  # said, not done


def test_ls_of_every_share_names_the_stale_ones_apart(share_name):
    leave_a_stale_ledger(share_name)
    # No share named, and none by default here: ls lists every share of the machine.
    assert not os.path.exists(kvasync.share.path("host"))
    listed = kvasync_without_cuda("ls")
    assert listed.returncode == 0, listed.stderr
    assert f"kvasync share {share_name!r}" not in listed.stdout  # no empty table for it
    stale = re.search(
        r"^kvasync: \d+ stale ledger file\(s\) \(no live allocator\): (.*); "
        r"`kvasync ls --prune` removes them$",
        listed.stderr,
        re.M,
    )
    assert stale is not None, listed.stderr
    assert share_name in stale.group(1).split(", ")


def test_the_limit_column_shows_the_limit_in_force(share_name):
    # Issue 29: with no limit the column showed the pool's capacity, as if it were a limit.
    config = kvasync.Config(backend="host", share=share_name, reserve_pages=(0, 0))
    with kvasync.open_allocator_sync(LAYOUT, config):

        def limit_cell() -> str:
            listed = run_kvasync("ls", "--share", share_name)
            assert listed.returncode == 0, listed.stderr
            row = next(x for x in listed.stdout.splitlines() if f" {os.getpid()} " in x)
            return row.split("│")[7].strip()  # pid, name, used, mapped, reserve, demand, limit

        def published(limit: int) -> bool:
            return kvasync.share.snapshot(share_name)[0].limit_bytes == limit

        wait_until(lambda: published(8 * PAGE), 5.0, "the first figures published")
        assert limit_cell() == "none"
        listed = json.loads(run_kvasync("ls", "--json", "--share", share_name).stdout)
        (entry,) = listed["allocators"]
        # The JSON keeps the figures: no limit is a limit in force of the whole capacity.
        assert entry["limit_bytes"] == entry["capacity_bytes"] == 8 * PAGE
        kvasync.share.set_limit(share_name, os.getpid(), 2 * PAGE)
        wait_until(lambda: published(2 * PAGE), 5.0, "the limit applied")
        assert limit_cell() == "16.0 MiB"
