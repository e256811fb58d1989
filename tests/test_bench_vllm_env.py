"""bench_vllm.py's engine environments: what each kind of engine is told (bench/_vllm_procs.py)."""

from __future__ import annotations

import argparse
import pathlib
import sys

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
