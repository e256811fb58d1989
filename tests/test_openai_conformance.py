"""``kvasync serve`` behaves like an OpenAI server (issue 18), driven by the real ``openai`` client
against a real uvicorn server on a free port."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import serving, wait_until_sync
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from kvasync.serve import EngineConfig

MODEL = "kvasync-tiny"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(EngineConfig(preset="tiny", device="cpu", request_timeout=20.0)) as url:
        yield url


def _client(base_url: str, **options: Any) -> openai.OpenAI:
    options = {"timeout": 20, "max_retries": 0, **options}
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", **options)


def _post(base_url: str, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{base_url}{path}", content=body, timeout=20)
    return httpx.post(f"{base_url}{path}", json=body, timeout=20)


@contextlib.contextmanager
def _posted(base_url: str, body: dict[str, Any]) -> Iterator[None]:
    """A POST to /v1/completions sent on a raw socket, whose client leaves when the block ends
    (without reading the answer)."""
    content = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(content)}\r\n\r\n"
    )
    port = int(base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + content)
        yield


def _health(base_url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{base_url}/health", timeout=10).json()
    return body


def _assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    error: dict[str, Any] = body["error"]
    return error


def _metrics(base_url: str) -> dict[str, float]:
    """The server's /metrics, one value per sample name (label-free samples)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# -- errors ----------------------------------------------------------------------------------


def test_a_body_that_is_not_json_is_a_400_openai_error(base_url: str) -> None:
    error = _assert_openai_error(_post(base_url, "/v1/completions", b"{not json"), 400)
    assert error["type"] == "invalid_request_error"
    assert "not valid JSON" in error["message"]


def test_a_missing_field_is_a_400_that_names_it(base_url: str) -> None:
    response = _post(base_url, "/v1/completions", {"model": MODEL, "max_tokens": 2})
    assert _assert_openai_error(response, 400)["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="messages"):
        _client(base_url).chat.completions.create(model=MODEL, messages=None)  # type: ignore[arg-type]


def test_an_unknown_model_is_a_404_model_not_found(base_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        _client(base_url).completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert raised.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as raised:
        _client(base_url).models.retrieve("gpt-4")
    assert raised.value.code == "model_not_found"


@pytest.mark.parametrize(
    ("field", "value"), [("max_tokens", "4"), ("stream", "yes"), ("temperature", "0.5")]
)
def test_a_mistyped_field_is_a_400_never_converted(base_url: str, field: str, value: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, field: value}
    assert _assert_openai_error(_post(base_url, "/v1/completions", body), 400)["param"] == field


@pytest.mark.parametrize("temperature", [1e308, 1e-300, -1.0])
def test_a_temperature_the_sampler_cannot_use_is_a_400_and_the_server_serves_on(
    base_url: str, temperature: float
) -> None:
    client = _client(base_url)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=temperature)
    assert raised.value.param == "temperature"
    assert len(client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text)


def test_an_unknown_route_is_an_openai_error(base_url: str) -> None:
    error = _assert_openai_error(_post(base_url, "/v1/embeddings", {"model": MODEL}), 404)
    assert error["code"] == "not_found"


# -- honour or refuse ------------------------------------------------------------------------


def _greedy(base_url: str, prompt: str, max_tokens: int) -> str:
    result = _client(base_url).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
    return result.choices[0].text


def test_stop_ends_the_output_before_the_first_stop_string(base_url: str) -> None:
    whole = _greedy(base_url, "stop here", 24)
    stop = whole[6:8]  # greedy is deterministic: this string comes back at its first occurrence
    end = whole.index(stop)
    result = _client(base_url).completions.create(
        model=MODEL, prompt="stop here", max_tokens=24, stop=[stop, "never-in-the-output"]
    )
    assert result.choices[0].text == whole[:end]
    assert result.choices[0].finish_reason == "stop"
    assert result.usage is not None
    assert result.usage.completion_tokens == end + len(stop)  # generated, the stop string's too


def test_stop_holds_back_a_stop_string_across_streamed_pieces(base_url: str) -> None:
    whole = _greedy(base_url, "stream stop", 24)
    stop = whole[5:9]  # four tokens: it arrives in four pieces
    chunks = list(
        _client(base_url).completions.create(
            model=MODEL, prompt="stream stop", max_tokens=24, stop=stop, stream=True
        )
    )
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == whole[: whole.index(stop)]
    assert not any(stop[0] in text for text in texts[whole.index(stop) :])
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("option", "value"),
    [("n", 2), ("best_of", 2), ("logprobs", 1), ("top_p", 0.5), ("presence_penalty", 1.0)],
)
def test_an_option_this_server_cannot_honour_is_refused(
    base_url: str, option: str, value: object
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        _client(base_url).completions.create(
            model=MODEL, prompt="x", max_tokens=2, **{option: value}
        )
    assert raised.value.param == option


def test_chat_logprobs_and_an_unknown_field_are_refused(base_url: str) -> None:
    client = _client(base_url)
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=messages, logprobs=True)
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"min_p": 0.1})


def test_echo_puts_the_prompt_before_the_output(base_url: str) -> None:
    whole = _greedy(base_url, "echo me", 5)
    client = _client(base_url)
    result = client.completions.create(model=MODEL, prompt="echo me", max_tokens=5, echo=True)
    assert result.choices[0].text == "echo me" + whole
    chunks = client.completions.create(
        model=MODEL, prompt="echo me", max_tokens=5, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == "echo me" + whole


def test_include_usage_ends_the_stream_with_the_usage(base_url: str) -> None:
    chunks = list(
        _client(base_url).completions.create(
            model=MODEL,
            prompt="usage",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 6)
    assert all(c.usage is None for c in chunks[:-1])


# -- routes ----------------------------------------------------------------------------------


def test_a_model_is_retrieved_by_its_id(base_url: str) -> None:
    card = _client(base_url).models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")


def test_chat_answers_the_documented_template(base_url: str) -> None:
    # The byte model's template (serve/_chat.py): "<role>: <content>\n" per message, then
    # "assistant:".
    rendered = "system: Be brief.\nuser: Hi\nassistant:"
    expected = _greedy(base_url, rendered, 8)
    messages: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    client = _client(base_url)
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(rendered), 8)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=8, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


# -- capacity, deadlines and load ------------------------------------------------------------


def test_a_request_that_can_never_fit_the_kv_cache_is_refused_at_once() -> None:
    # 4 blocks of 16 tokens hold 64; a 53-byte prompt and 200 tokens can never fit.
    config = EngineConfig(preset="tiny", device="cpu", max_blocks=4, request_timeout=5.0)
    with serving(config) as url:
        with pytest.raises(openai.BadRequestError):
            _client(url).completions.create(model=MODEL, prompt="p" * 53, max_tokens=200)
        assert _metrics(url)["kvasync_engine_generation_tokens_total"] == 0  # refused, not run


def test_a_passed_deadline_is_answered_once_and_not_retried(base_url: str) -> None:
    posts: list[httpx.Request] = []
    with httpx.Client(event_hooks={"request": [posts.append]}) as http:
        client = _client(base_url, max_retries=2, http_client=http)
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(
                model=MODEL, prompt="late", max_tokens=400, extra_body={"timeout": 0.05}
            )
    assert raised.value.code == "deadline_exceeded"
    assert len(posts) == 1


def test_a_full_queue_answers_429_with_retry_after() -> None:
    config = EngineConfig(preset="tiny", device="cpu", max_batch=1, request_timeout=20.0)
    with serving(config, max_waiting=1) as url:
        body = {"model": MODEL, "prompt": "hold", "max_tokens": 400}
        with _posted(url, body), _posted(url, body):
            # one running, one waiting: the queue (bound 1) is full
            wait_until_sync(lambda: _health(url)["waiting"] == 1, "one request waiting")
            with pytest.raises(openai.RateLimitError) as raised:
                _client(url).completions.create(model=MODEL, prompt="more", max_tokens=2)
            assert raised.value.response.headers["retry-after"] == "1"
            assert raised.value.code == "queue_full"


# -- observability ---------------------------------------------------------------------------


def test_metrics_are_prometheus_text_with_ttft_and_tpot_histograms(base_url: str) -> None:
    _client(base_url).completions.create(model=MODEL, prompt="observe", max_tokens=4)
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in (
        "kvasync_serve_time_to_first_token_seconds",
        "kvasync_serve_time_per_output_token_seconds",
    ):
        assert families[name].type == "histogram"
        counts = [s.value for s in families[name].samples if s.name == f"{name}_count"]
        assert counts and counts[0] >= 1


def test_the_server_logs_its_model_device_and_kv_settings_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvasync.serve")
    config = EngineConfig(preset="tiny", device="cpu", max_blocks=64, memory_limit=1 << 20)
    with serving(config):
        pass
    [line] = [r.getMessage() for r in caplog.records if r.name == "kvasync.serve"]
    for part in (MODEL, "device cpu", "host backend", "64 blocks of 16 tokens", "1048576 bytes"):
        assert part in line, line


# -- a client that leaves (defect 8) ---------------------------------------------------------


def test_a_non_streaming_request_whose_client_left_is_aborted(base_url: str) -> None:
    before = _metrics(base_url)
    body = {"model": MODEL, "prompt": "nobody reads this", "max_tokens": 450}
    with _posted(base_url, body):
        wait_until_sync(
            lambda: (
                _metrics(base_url)["kvasync_engine_generation_tokens_total"]
                > before["kvasync_engine_generation_tokens_total"]
            ),
            "the request to generate",
        )
    # The client is gone: the request ends (aborted: a failure), its blocks go back.
    wait_until_sync(
        lambda: (
            _metrics(base_url)["kvasync_engine_requests_failed_total"]
            == before["kvasync_engine_requests_failed_total"] + 1
        ),
        "the request to be aborted",
    )
    after = _metrics(base_url)
    generated = after["kvasync_engine_generation_tokens_total"]
    assert generated - before["kvasync_engine_generation_tokens_total"] < 450
    assert after["kvasync_engine_requests_running"] == 0
    assert after["kvasync_used_blocks"] == 0
    assert _metrics(base_url)["kvasync_engine_generation_tokens_total"] == generated
