"""The simulation (``python -m kvasync simulate``): it finishes, serves requests, leaks nothing."""

import io
import subprocess
import sys

import pytest

from kvasync.simulate import DemoOptions, format_report, run_demo

TINY = DemoOptions(
    requests=40, concurrency=20, memory_limit=8 << 20, seconds=10.0, token_time_ms=0.5, seed=1
)


@pytest.mark.asyncio
async def test_demo_serves_requests_and_leaks_no_blocks() -> None:
    out = io.StringIO()
    report = await run_demo(TINY, out)
    assert report.done > 0
    assert report.done + report.dropped + report.cut_off + report.not_started == TINY.requests
    assert report.leaked_blocks == 0
    assert report.corrupt_blocks == 0
    assert report.blocks_verified > 0
    assert report.maps > 0
    assert "leaked blocks" in format_report(report)


@pytest.mark.asyncio
async def test_demo_time_cap_cancels_running_requests_without_leaks() -> None:
    # Requests need ~16 blocks x 16 steps x 20 ms = 5 s each; the 0.3 s cap cuts them all off.
    options = DemoOptions(
        requests=30, concurrency=30, memory_limit=8 << 20, seconds=0.3, token_time_ms=20.0
    )
    report = await run_demo(options)
    assert report.cut_off > 0
    assert report.leaked_blocks == 0
    assert report.seconds < 5.0


@pytest.mark.asyncio
async def test_demo_preempts_requests_whose_allocs_time_out() -> None:
    # Admission over-commits 4x a limit of 128 blocks: growing requests run out and time out.
    options = DemoOptions(
        requests=60,
        concurrency=60,
        memory_limit=8 << 20,
        seconds=10.0,
        alloc_timeout=0.05,
        token_time_ms=0.5,
        overcommit=4.0,
    )
    report = await run_demo(options)
    assert report.timeouts > 0
    assert report.preemptions + report.dropped > 0
    assert report.leaked_blocks == 0
    assert report.corrupt_blocks == 0


def test_python_m_kvasync_simulate_exits_zero() -> None:
    command = [
        sys.executable,
        "-m",
        "kvasync",
        "simulate",
        "--requests",
        "20",
        "--concurrency",
        "10",
    ]
    command += ["--memory-limit", "8MiB", "--seconds", "10", "--token-time-ms", "0.5"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "requests done" in result.stdout
    assert "| leaked blocks" in result.stdout


@pytest.mark.parametrize("option", [("--memory-limit", "1MiB"), ("--memory-limit-mib", "1")])
def test_python_m_kvasync_rejects_a_memory_limit_below_one_request(option) -> None:
    # The limit is a size as serve and demo take it; the old --memory-limit-mib N still works.
    command = [sys.executable, "-m", "kvasync", "simulate", *option]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "memory_limit 1048576 bytes (1.0 MiB) holds 0 blocks" in result.stderr
    deprecated = "--memory-limit-mib is deprecated: use --memory-limit 1MiB"
    assert (deprecated in result.stderr) == (option[0] == "--memory-limit-mib"), result.stderr


def test_simulate_refuses_a_limit_that_is_not_a_size_or_given_twice_and_hides_the_old_one() -> None:
    base = [sys.executable, "-m", "kvasync", "simulate"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)

    lots = run("--memory-limit", "lots")
    assert lots.returncode == 2
    assert "Invalid value for '--memory-limit': not a size: 'lots'" in lots.stderr
    both = run("--memory-limit", "8MiB", "--memory-limit-mib", "8")
    assert both.returncode == 2 and "give --memory-limit alone" in both.stderr
    shown = run("--help").stdout
    assert "--memory-limit SIZE" in shown and "[default: 128MiB]" in shown
    assert "--memory-limit-mib" not in shown
