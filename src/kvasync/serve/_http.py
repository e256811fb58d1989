"""The HTTP server: an OpenAI-compatible ``/v1/completions`` (streaming by server-sent events),
``/v1/models``, ``/metrics`` (Prometheus text: the engine's counters and kvasync.metrics of its
KV cache) and ``/health``, on FastAPI + uvicorn.

The engine is opened in the app's lifespan, so its allocator belongs to uvicorn's event loop.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, Field

from ..integrations.metrics import register as register_kv_metrics
from ._engine import Engine, EngineConfig
from ._errors import DeadlineExceeded, EngineClosed, RequestFailed

__all__ = ["create_app"]


class CompletionRequest(BaseModel):
    """The fields of OpenAI's completions request that this engine honours (others ignored)."""

    model: str | None = None
    prompt: str | list[str]
    max_tokens: int = Field(default=16)
    temperature: float = 0.0
    stream: bool = False
    seed: int | None = None
    timeout: float | None = None  # an extension: seconds until the request's deadline


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def _status_of(error: Exception) -> tuple[int, str]:
    if isinstance(error, ValueError):
        return 400, "invalid_request_error"
    if isinstance(error, DeadlineExceeded):
        return 504, "timeout"
    if isinstance(error, EngineClosed):
        return 503, "server_error"
    return 507, "insufficient_storage" if isinstance(error, RequestFailed) else "server_error"


class _EngineCollector:
    """Reads the engine's counters at scrape time (prometheus_client custom collector)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Any:
        s = self._engine.stats()
        for name, value, help_text in (
            ("requests_finished", s.finished, "requests that finished"),
            ("requests_failed", s.failed, "requests that ended with an error"),
            ("preemptions", s.preemptions, "requests preempted (blocks freed, requeued)"),
            ("moved_blocks", s.moved_blocks, "KV blocks moved out of draining pages"),
            ("steps", s.steps, "engine steps (forward passes)"),
            ("prompt_tokens", s.prompt_tokens, "prompt tokens of requests that started"),
            ("generation_tokens", s.output_tokens, "tokens generated"),
        ):
            yield CounterMetricFamily(f"kvasync_engine_{name}", help_text, value=value)
        for name, value, help_text in (
            ("requests_running", s.running, "requests in the running batch"),
            ("requests_waiting", s.waiting, "requests waiting for admission"),
        ):
            yield GaugeMetricFamily(f"kvasync_engine_{name}", help_text, value=value)


def create_app(config: EngineConfig) -> FastAPI:
    """The ASGI app; it opens an engine with ``config`` at startup and closes it at shutdown.

    Args:
        config: the engine's settings.
    """
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine = await Engine.open(config)
        registry = CollectorRegistry()
        registry.register(_EngineCollector(engine))
        register_kv_metrics(engine.kv, registry, name=config.name)  # the KV cache's own metrics
        state.update(engine=engine, registry=registry)
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="kvasync serve", lifespan=lifespan)
    model_name = f"kvasync-{config.preset}"

    @app.get("/health")
    async def health() -> Any:
        engine: Engine = state["engine"]
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(engine.error)}, status_code=503)
        s = engine.stats()
        return {"status": "ok", "running": s.running, "waiting": s.waiting}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(state["registry"]).decode())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "kvasync"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, _: Request) -> Any:
        engine: Engine = state["engine"]
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                return _error(400, "prompt must be one string", "invalid_request_error", "prompt")
            prompt = prompt[0]
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        base = {"id": completion_id, "object": "text_completion", "created": created}
        base["model"] = model_name
        stream = engine.generate(
            prompt,
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            seed=body.seed,
            timeout=body.timeout,
        )
        try:
            first = await anext(stream)  # bad input and early failures answer with a status
        except StopAsyncIteration:
            first = ""
        except (ValueError, RequestFailed) as error:
            status, kind = _status_of(error)
            return _error(status, str(error), kind)
        if not body.stream:
            try:
                text = first + "".join([piece async for piece in stream])
            except RequestFailed as error:
                status, kind = _status_of(error)
                return _error(status, str(error), kind)
            finally:
                await stream.aclose()
            prompt_tokens = len(prompt.encode())
            output_tokens = body.max_tokens
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": "length"}
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": output_tokens,
                "total_tokens": prompt_tokens + output_tokens,
            }
            return {**base, "choices": [choice], "usage": usage}

        async def events() -> AsyncIterator[str]:
            def chunk(text: str, finish: str | None) -> str:
                choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
                return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

            try:
                yield chunk(first, None)
                async for piece in stream:
                    yield chunk(piece, None)
                yield chunk("", "length")
            except RequestFailed as error:
                status, kind = _status_of(error)
                payload = {"error": {"message": str(error), "type": kind, "code": status}}
                yield f"data: {json.dumps(payload)}\n\n"
            finally:
                await stream.aclose()  # a client gone away aborts the request
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
