"""``kvasync demo`` (what ``make demo`` runs): it serves every request and writes its plot."""

import subprocess
import sys
from pathlib import Path


def test_python_m_kvasync_demo_serves_a_burst_and_writes_a_plot(tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    command = [sys.executable, "-m", "kvasync", "demo", "--requests", "24", "--max-tokens", "12"]
    command += ["--memory-limit-mib", "1", "--plot", str(plot)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "requests done" in result.stdout
    assert "plot written to" in result.stdout
    assert plot.stat().st_size > 10_000  # a PNG with three panels


def test_kvasync_demo_rejects_a_bad_option() -> None:
    command = [sys.executable, "-m", "kvasync", "demo", "--requests", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--requests" in result.stderr
