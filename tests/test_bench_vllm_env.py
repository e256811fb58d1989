"""bench_vllm.py's engine environments: what each kind of engine is told (bench/_vllm_procs.py)."""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from _vllm_procs import Run  # noqa: E402


def run_with(tmp_path: pathlib.Path, monkeypatch, **options: object) -> Run:
    monkeypatch.setenv("HOME", str(tmp_path))  # the model config goes under ~
    args = argparse.Namespace(
        budget_s=60.0, out=tmp_path / "out", work=tmp_path / "work", **options
    )
    return Run(args)


def test_linger_goes_to_kvasync_engines_only(tmp_path, monkeypatch) -> None:
    run = run_with(tmp_path, monkeypatch, linger=2.0)
    assert run.env("kvasync", "a", limit="38GiB")["KVASYNC_LINGER"] == "2"
    assert run.env("stock", "b") == {"KVASYNC_VLLM": "0"}


def test_no_linger_asked_none_set(tmp_path, monkeypatch) -> None:
    for options in ({"linger": 0.0}, {}):
        run = run_with(tmp_path, monkeypatch, **options)
        assert "KVASYNC_LINGER" not in run.env("kvasync", "a", limit="38GiB")


def test_a_child_that_asked_ends_when_its_driver_is_killed() -> None:
    # A driver (a real process) starts a child in its own session that calls die_with_parent
    # and then waits; once the child says so, the driver is killed with SIGKILL, and the child
    # must end within the deadline (without it, it would sleep on for two minutes).
    child_code = (
        f"import sys, time; sys.path.insert(0, {str(BENCH)!r}); "
        "from _vllm_procs import die_with_parent; die_with_parent(); "
        "print('ready', flush=True); time.sleep(120)"
    )
    driver_code = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', {child_code!r}], start_new_session=True); "
        "print(p.pid, flush=True); time.sleep(120)"
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", driver_code], stdout=subprocess.PIPE, text=True
    )
    assert driver.stdout is not None
    child_pid = int(driver.stdout.readline())
    try:
        assert driver.stdout.readline().strip() == "ready"  # the driver's pipe is the child's too
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        deadline = time.monotonic() + 30.0
        while not _gone(child_pid):
            assert time.monotonic() < deadline, "the child outlived its killed driver"
            time.sleep(0.01)  # polling under a deadline for the event expected
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)
        driver.kill()
        driver.wait(timeout=30)
        driver.stdout.close()


def _gone(pid: int) -> bool:
    try:
        return "Z (zombie)" in pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
