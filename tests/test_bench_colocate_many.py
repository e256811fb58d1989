"""bench/bench_colocate_many.py's calibration on the CPU (tiny preset, host backend, real engine
processes): a calibration window too short for a stream's requests."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from _colocate_many import calibration  # noqa: E402
from _colocate_many.shapes import REGIMES  # noqa: E402

TINY = ["--preset", "tiny", "--device", "cpu", "--engines", "2", "--cases", "memory"]


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "bench_colocate_many.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(300)
def test_a_cold_engine_without_calibration_requests_replays_nothing_and_is_said_so(
    tmp_path: pathlib.Path,
) -> None:
    # A cold weight of 1e-6 gives the cold engine's calibration stream (1e-6 of a hot rate of
    # tens of req/s, over 1 s) no request, while the hot engine's streams get dozens: the case
    # that raised IndexError in the worker (trace[-1] of an empty trace) and stopped the bench.
    done = bench(
        *TINY,
        "--calibration-s",
        "1",
        "--cold-weight",
        "1e-6",
        "--duration",
        "1",
        "--best-static",
        "--out",
        str(tmp_path),
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads((tmp_path / "summary.json").read_text())["calibration"]
    assert measured["coloc_cold_requests"] == [0]
    hot = measured["coloc_stream"]
    assert hot["requests"] >= calibration.MIN_STREAM_REQUESTS
    assert hot["mean_kv_life_s"] > 0
    assert measured["hot_rate"] == pytest.approx(measured["capped_batch"] / measured["lifetime_s"])
    assert "Cold engine e1 got no request in the 1 s" in done.stdout
    assert "it added no contention to this lifetime" in done.stdout


@pytest.mark.timeout(60)
def test_a_calibration_of_no_seconds_is_an_argparse_error(tmp_path: pathlib.Path) -> None:
    for seconds in ("0", "-1", "nan"):
        done = bench(*TINY, "--calibration-s", seconds, "--out", str(tmp_path), timeout=50)
        assert done.returncode == 2, (seconds, done.stderr[-3000:])
        assert "argument --calibration-s: must be a number of seconds > 0" in done.stderr
        assert not (tmp_path / "summary.json").exists()  # nothing ran


@pytest.mark.timeout(300)
def test_a_calibration_too_short_for_the_hot_stream_names_the_seconds_it_needs(
    tmp_path: pathlib.Path,
) -> None:
    # 10 ms: the stream on one engine would need 1000 req/s to hold 10 requests; the tiny
    # preset's hot rate on a CPU is a few hundred at most (64 requests over steps of ms).
    done = bench(*TINY, "--calibration-s", "0.01", "--out", str(tmp_path), timeout=280)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: argument --calibration-s: 0.01 s is too short: the stream on one engine" in (
        done.stderr
    )
    assert "use --calibration-s" in done.stderr
    assert "IndexError" not in done.stderr


def test_a_hot_stream_below_the_minimum_names_twice_the_seconds_that_hold_it() -> None:
    regime = REGIMES["tiny"]
    # 5 req/s over 1 s: a handful of requests; 10 of them take 2 s on average, 4 s with margin.
    with pytest.raises(calibration.CalibrationTooShort) as raised:
        calibration.hot_stream(regime, 1.0, 5.0, 0, "the stream on one engine")
    message = str(raised.value)
    assert message.startswith("1 s is too short: the stream on one engine at the 5.00 req/s")
    assert "use --calibration-s 4 or more at this rate" in message
    # Long enough: the stream itself, every arrival within the window.
    stream = calibration.hot_stream(regime, 10.0, 5.0, 0, "the stream on one engine")
    assert len(stream) >= calibration.MIN_STREAM_REQUESTS
    assert all(0 < r.arrival < 10.0 for r in stream)
