"""The HTTP server, started for real on a free port, driven by the real ``openai`` client."""

import contextlib
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import kvasync_serve, serving

from kvasync import share as ledger
from kvasync.serve import EngineConfig

MODEL = "kvasync-tiny"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(EngineConfig(preset="tiny", device="cpu", request_timeout=20.0)) as url:
        yield url


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=20, max_retries=0)


def test_openai_client_completes(base_url: str) -> None:
    result = _client(base_url).completions.create(model=MODEL, prompt="Hello", max_tokens=7)
    assert len(result.choices[0].text) == 7
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 7
    again = _client(base_url).completions.create(model=MODEL, prompt="Hello", max_tokens=7)
    assert again.choices[0].text == result.choices[0].text  # greedy: deterministic


def test_openai_client_streams(base_url: str) -> None:
    client = _client(base_url)
    whole = client.completions.create(model=MODEL, prompt="stream me", max_tokens=9)
    chunks = list(
        client.completions.create(model=MODEL, prompt="stream me", max_tokens=9, stream=True)
    )
    assert len(chunks) >= 9
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_framing_ends_with_done(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=20) as response:
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_bad_request_is_a_400_with_an_openai_error(base_url: str) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        _client(base_url).completions.create(model=MODEL, prompt="x", max_tokens=0)


def test_health_and_metrics(base_url: str) -> None:
    _client(base_url).completions.create(model=MODEL, prompt="m", max_tokens=2)
    assert httpx.get(f"{base_url}/health", timeout=10).json()["status"] == "ok"
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    assert "kvasync_engine_generation_tokens_total" in metrics
    assert (
        "kvasync_mapped_bytes" in metrics
    )  # the allocator's collector (kvasync.integrations.metrics)


def test_python_m_kvasync_serve_starts_and_answers() -> None:
    with kvasync_serve() as url:
        result = _client(url).completions.create(model=MODEL, prompt="cli", max_tokens=3)
        assert len(result.choices[0].text) == 3


def test_serve_logs_its_model_device_and_kv_settings_at_start(tmp_path: Path) -> None:
    output = tmp_path / "serve.log"
    with kvasync_serve("--max-blocks", "64", "--max-waiting", "3", output=output):
        pass
    [line] = [line for line in output.read_text().splitlines() if "kvasync serve: model" in line]
    assert re.search(r"model kvasync-tiny .* device (cpu|cuda)", line), line
    assert "64 blocks of 16 tokens" in line and "max waiting 3" in line, line
    assert "kvasync: opened a" in output.read_text()  # the allocator's own line (kvasync._log)


def test_two_servers_share_one_device_budget() -> None:
    # Co-location as an operator runs it: two `kvasync serve` processes naming one share.
    share = f"test-serve-{uuid.uuid4().hex[:12]}"
    options = ("--share", share, "--device-budget", "4MiB")
    try:
        with (
            kvasync_serve(*options, "--name", "engine-a") as a,
            kvasync_serve(*options, "--name", "engine-b") as b,
        ):
            for url in (a, b):
                result = _client(url).completions.create(model=MODEL, prompt="co", max_tokens=3)
                assert len(result.choices[0].text) == 3
            entries = ledger.snapshot(share)
            assert sorted(e.name for e in entries) == ["engine-a", "engine-b"]
            assert ledger.budget(entries) == 4 << 20
            assert sum(e.committed_bytes for e in entries) <= 4 << 20
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ledger.path(share))


def test_serve_refuses_a_device_budget_without_a_share() -> None:
    command = [sys.executable, "-m", "kvasync", "serve", "--device-budget", "1GiB"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--device-budget needs --share" in done.stderr
