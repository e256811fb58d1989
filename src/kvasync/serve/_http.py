"""The HTTP server: an OpenAI-compatible API over the engine, on FastAPI + uvicorn.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``"stream": true``: server-sent
events, ``data: {...}`` chunks then ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /metrics`` (Prometheus text: the engine's counters, TTFT and TPOT histograms, and the KV
cache's own metrics) and ``GET /health``. The engine is opened in the app's lifespan, so its
allocator belongs to uvicorn's event loop; the server logs its model, device and KV settings then.

What a request gets (every error is OpenAI's error object; the bodies, errors and answers' shapes
are in ``_openai_protocol``):

====================================================  ======  ========================
what happened                                         status  ``code``
====================================================  ======  ========================
body not JSON, a field missing, unknown or mistyped     400   (``param`` names it)
a parameter this server cannot honour (``n`` 2, ...)    400
prompt + ``max_tokens`` over the model or the KV cache  400
unknown ``model``                                       404   ``model_not_found``
the waiting queue is full (``max_waiting``)             429   ``queue_full``, Retry-After
the request's own deadline passed                       400   ``deadline_exceeded``
the engine is closed or stopped                         503   ``engine_closed``
the request failed in the engine (allocator, ...)       500
====================================================  ======  ========================

A deadline is the request's own (``timeout`` in the body, an extension, else the server's
``--request-timeout``): sending the same request again would meet the same deadline, so it ends
in a 400, which clients do not retry (the ``openai`` SDK retries 408, 409, 429 and 5xx; a 504
made it send every such request three times). A full queue is the one answer meant for a retry:
429 with ``Retry-After``.

Parameters: ``stop`` is honoured here, over the engine's text (``_stop_strings``), and the
request is aborted at the first stop string (``finish_reason`` ``"stop"``; else ``"length"``:
the byte model has no end-of-text token). ``echo`` and ``stream_options.include_usage`` are
honoured; ``n``, ``best_of``, ``logprobs``, ``top_p``, penalties, ``logit_bias``, tools and
``suffix`` are accepted only at their "off" value. ``temperature`` defaults to 0 (greedy) and
``max_tokens`` to 16, on both routes. The chat template is in ``_chat``.

``usage.completion_tokens`` counts the tokens generated, a stop string's included: the byte
model's tokens are bytes and it samples only ASCII, so each output character is one token.

A client that disconnects aborts its request, streaming or not: a non-streaming request runs
beside a task that waits for the disconnect message, which cancels it (its blocks go back then).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..integrations.metrics import register as register_kv_metrics
from ._chat import render_chat
from ._engine import Engine, EngineConfig
from ._errors import DeadlineExceeded, EngineClosed, RequestFailed
from ._openai_protocol import (
    CHAT,
    COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    ResponseShape,
    parse_body,
    sse,
)
from ._stop_strings import StopStrings

__all__ = ["create_app", "uvicorn_log_config"]

logger = logging.getLogger("kvasync.serve")

_T = TypeVar("_T")
_DEFAULT_MAX_TOKENS = 16
_RETRY_AFTER_S = 1  # a full queue drains in about a batch's run: ask to come back soon
_ABORT_WAIT_S = 5.0  # how long a handler waits for an aborted generation to unwind
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# The start of a ValueError's message from the engine names the field at fault.
_ENGINE_PARAMS = ("prompt", "max_tokens", "temperature", "seed", "timeout")


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's logging configuration with the ``kvasync`` loggers added, so that the server's
    start-up line (model, device, KV settings) and the allocator's appear beside uvicorn's."""
    from uvicorn.config import LOGGING_CONFIG

    config: dict[str, Any] = copy.deepcopy(LOGGING_CONFIG)  # never change uvicorn's own
    config["loggers"]["kvasync"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


@dataclass(frozen=True)
class _Params:
    """What the engine is asked for, read from either route's body."""

    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None
    timeout: float | None
    stops: list[str]


def _openai_error(error: BaseException) -> OpenAIError:
    """The OpenAI error for an exception of the engine (module docstring's table)."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, DeadlineExceeded):
        return OpenAIError(
            400,
            f"{error}; give the request a longer `timeout` (seconds), or fewer max_tokens",
            "timeout_error",
            code="deadline_exceeded",
        )
    if isinstance(error, EngineClosed):
        return OpenAIError(503, str(error), "server_error", code="engine_closed")
    if isinstance(error, ValueError):  # bad numbers, and a request that can never fit the KV
        message = str(error)
        param = next((p for p in _ENGINE_PARAMS if message.startswith(p)), None)
        return OpenAIError(400, message, param=param)
    if isinstance(error, RequestFailed):
        return OpenAIError(500, str(error), "server_error")
    return OpenAIError(500, f"internal error: {type(error).__name__}: {error}", "server_error")


class _Generation:
    """One request's run on the engine as the HTTP layer sees it: its text with stop strings
    applied, the tokens generated, why it finished; its TTFT and TPOT go to the histograms.

    ``start`` submits and waits for the first token (so that early failures get a status);
    ``pieces`` then yields the text. Leaving ``pieces`` early, or cancelling it, aborts the
    request in the engine.
    """

    def __init__(self, server: _Server, params: _Params) -> None:
        self._server = server
        self._params = params
        self._arrival = time.monotonic()
        self._stream = server.engine.generate(
            params.prompt,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            seed=params.seed,
            timeout=params.timeout,
        )
        self._stop = StopStrings(params.stops)
        self._first: str | None = None
        self._first_at: float | None = None
        self._last_at = 0.0
        self.prompt_tokens = len(params.prompt.encode())
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    async def start(self) -> None:
        """Submits the request and waits for its first token.

        Raises:
            OpenAIError: the queue is full, bad input, or the request failed before a token.
        """
        self._server.admit()
        try:
            self._first = await anext(self._stream)
        except StopAsyncIteration:
            self._first = None
        except Exception as error:
            await self._stream.aclose()
            raise _openai_error(error) from error
        if self._first is not None:
            self._first_at = self._last_at = time.monotonic()
            self._server.ttft.observe(self._first_at - self._arrival)

    async def pieces(self) -> AsyncIterator[str]:
        """The output text after ``start``; sets ``finish_reason`` at the end.

        Raises:
            OpenAIError: the request failed in the engine (its deadline, ...).
        """
        try:
            piece = self._first
            while piece is not None:
                self.completion_tokens += len(piece.encode())
                self._last_at = time.monotonic()
                text = self._stop.feed(piece)
                if text:
                    yield text
                if self._stop.stopped:
                    self.finish_reason = "stop"
                    return  # the finally aborts the rest of the request
                piece = await anext(self._stream, None)
            tail = self._stop.flush()
            if tail:
                yield tail
            self.finish_reason = "length"
        except (RequestFailed, ValueError) as error:
            raise _openai_error(error) from error
        finally:
            await self.close()  # NOTE: a request still running is aborted here
            self._observe_tpot()

    async def close(self) -> None:
        """Aborts the request in the engine if it still runs (idempotent)."""
        await self._stream.aclose()

    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage`` object: the tokens of the prompt and those generated."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def _observe_tpot(self) -> None:
        if self._first_at is not None and self.completion_tokens >= 2:
            per_token = (self._last_at - self._first_at) / (self.completion_tokens - 1)
            self._server.tpot.observe(per_token)


class _Server:
    """What the routes share: the engine, the metrics, the served model's name, the queue
    bound."""

    def __init__(self, engine: Engine, config: EngineConfig, max_waiting: int | None) -> None:
        self.engine = engine
        self.model_name = f"kvasync-{config.preset}"
        self.max_waiting = max_waiting
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        register_kv_metrics(engine.kv, self.registry, name=config.name)
        self.ttft = Histogram(
            "kvasync_serve_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first output token.",
            registry=self.registry,
            buckets=_TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            "kvasync_serve_time_per_output_token_seconds",
            "A request's mean seconds per output token after the first.",
            registry=self.registry,
            buckets=_TPOT_BUCKETS,
        )
        self.refused = Counter(
            "kvasync_serve_queue_full",
            "Requests refused with 429 because the waiting queue was full.",
            registry=self.registry,
        )

    def check_model(self, model: str | None) -> None:
        """Raises a 404 ``model_not_found`` unless ``model`` is the served one (or None)."""
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                "invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def admit(self) -> None:
        """Raises a 429 with Retry-After when ``max_waiting`` requests already wait."""
        if self.max_waiting is None:
            return
        waiting = self.engine.stats().waiting
        if waiting >= self.max_waiting:
            self.refused.inc()
            raise OpenAIError(
                429,
                f"the server's queue is full ({waiting} requests waiting, at most "
                f"{self.max_waiting}); retry after {_RETRY_AFTER_S} s",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(_RETRY_AFTER_S)},
            )

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvasync"}


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


class _GenerationResponse(StreamingResponse):
    """A stream of a generation's events that aborts the generation however the response
    ends: a client that leaves before the first event was sent never starts the iterator, so
    the iterator's own cleanup would not run."""

    def __init__(self, events: AsyncIterator[str], generation: _Generation) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generation.close()


class _ClientLeft(Exception):
    """The client disconnected before its answer was ready."""


async def _until_disconnected(request: Request) -> None:
    # After the body is read, uvicorn's receive() blocks until the client disconnects (or the
    # response is complete): an event, not a poll.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(request: Request, work: Coroutine[Any, Any, _T]) -> _T:
    """Runs ``work`` until it returns, or until the client disconnects: then cancels it
    (issue 18, defect 8: a non-streaming request whose client left must not go on generating).

    Raises:
        _ClientLeft: the client disconnected first.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        task.cancel()  # a no-op when it is done
        # The generation's unwinding (the engine's abort) is synchronous: this wait is short.
        await asyncio.wait((task, watch), timeout=_ABORT_WAIT_S)
    if task.cancelled():
        raise _ClientLeft
    return task.result()


async def _answer(
    server: _Server,
    request: Request,
    params: _Params,
    shape: ResponseShape,
    *,
    stream: bool,
    include_usage: bool,
    echo: str = "",
) -> Response:
    generation = _Generation(server, params)
    base = {
        "id": f"{shape.prefix}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": server.model_name,
    }
    if not stream:

        async def run() -> str:
            await generation.start()
            return "".join([piece async for piece in generation.pieces()])

        try:
            text = await _unless_client_leaves(request, run())
        except _ClientLeft:
            logger.info("%s: the client disconnected; the request was aborted", base["id"])
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        choice = shape.whole_choice(echo + text, generation.finish_reason)
        body = {**base, "object": shape.whole_object, "choices": [choice]}
        return JSONResponse({**body, "usage": generation.usage()})

    try:
        await _unless_client_leaves(request, generation.start())
    except _ClientLeft:
        return Response(status_code=499)
    chunk_base = {**base, "object": shape.chunk_object}
    if include_usage:
        chunk_base["usage"] = None  # OpenAI: null on every chunk but the last

    def chunk(text: str, finish: str | None) -> str:
        return sse({**chunk_base, "choices": [shape.chunk_choice(text, finish)]})

    async def events() -> AsyncIterator[str]:
        # NOTE: Starlette cancels this generator when the client disconnects; pieces() then
        # aborts the request.
        try:
            if shape.first_chunk is not None:
                yield sse({**chunk_base, "choices": [shape.first_chunk]})
            if echo:
                yield chunk(echo, None)
            async for piece in generation.pieces():
                yield chunk(piece, None)
            yield chunk("", generation.finish_reason)
            if include_usage:
                yield sse({**chunk_base, "choices": [], "usage": generation.usage()})
        except OpenAIError as error:
            yield sse(error.body())
        yield "data: [DONE]\n\n"

    return _GenerationResponse(events(), generation)


def _log_start(server: _Server, config: EngineConfig) -> None:
    engine, model = server.engine, config.model
    kv, layout = engine.kv, engine.kv.layout
    limit = "none" if kv.config.memory_limit is None else f"{kv.config.memory_limit} bytes"
    logger.info(
        "kvasync serve: model %s (%d layers, d_model %d, max_seq_len %d), device %s, %s; KV "
        "cache: %s backend, %d blocks of %d tokens, page %d bytes, memory limit %s, share %s, "
        "static %s; max batch %d, request timeout %g s, max waiting %s",
        server.model_name,
        model.num_layers,
        model.d_model,
        model.max_seq_len,
        config.resolved_device(),
        str(layout.dtype).removeprefix("torch."),
        kv.backend,
        kv.config.max_blocks,
        layout.block_size,
        kv.config.page_size,
        limit,
        config.share or "none",
        config.static,
        config.max_batch,
        config.request_timeout,
        "unbounded" if server.max_waiting is None else server.max_waiting,
    )


def _params(
    body: CompletionRequest | ChatCompletionRequest, prompt: str, max_tokens: int | None
) -> _Params:
    return _Params(
        prompt=prompt,
        max_tokens=_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        temperature=0.0 if body.temperature is None else body.temperature,
        seed=body.seed,
        timeout=body.timeout,
        stops=body.stop_strings(),
    )


def _install_error_handlers(app: FastAPI) -> None:
    """Every error is OpenAI's error object, those of the framework included."""

    async def openai_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, OpenAIError)
        return error.response()

    async def http_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, StarletteHTTPException)
        code = "not_found" if error.status_code == 404 else None
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        answer = OpenAIError(error.status_code, str(error.detail), kind, code=code)
        return answer.response()

    async def validation_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        return OpenAIError(400, str(error.errors()[:1])).response()

    async def unexpected(_: Request, error: Exception) -> Response:
        logger.exception("an unexpected error answered a request with 500")
        return _openai_error(error).response()

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


def create_app(config: EngineConfig, *, max_waiting: int | None = None) -> FastAPI:
    """The ASGI app; it opens an engine with ``config`` at startup and closes it at shutdown.

    Args:
        config: the engine's settings.
        max_waiting: requests that may wait for admission at once; one more is answered 429
            with ``Retry-After``. None = unbounded.

    Raises:
        ValueError: ``max_waiting`` below 1 (every request waits, however briefly).
    """
    if max_waiting is not None and (type(max_waiting) is not int or max_waiting < 1):
        raise ValueError(f"max_waiting must be an int >= 1 or None, got {max_waiting!r}")
    servers: list[_Server] = []  # the one server, once the lifespan opened its engine

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine = await Engine.open(config)
        try:
            servers.append(_Server(engine, config, max_waiting))
            _log_start(servers[0], config)
            yield
        finally:
            servers.clear()
            await engine.close()

    app = FastAPI(title="kvasync serve", lifespan=lifespan)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        engine = servers[0].engine
        if engine.error is not None:
            body = {"status": "error", "error": repr(engine.error)}
            return JSONResponse(body, status_code=503)
        s = engine.stats()
        return JSONResponse({"status": "ok", "running": s.running, "waiting": s.waiting})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(servers[0].registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [servers[0].model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        servers[0].check_model(model_id)
        return servers[0].model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        server = servers[0]
        body = parse_body(CompletionRequest, await request.body())
        server.check_model(body.model)
        body.refuse_unsupported()
        prompt = body.prompt_text()
        return await _answer(
            server,
            request,
            _params(body, prompt, body.max_tokens),
            COMPLETION,
            stream=body.stream,
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
            echo=prompt if body.echo else "",
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        server = servers[0]
        body = parse_body(ChatCompletionRequest, await request.body())
        server.check_model(body.model)
        body.refuse_unsupported()
        return await _answer(
            server,
            request,
            _params(body, render_chat(body.messages), body.output_limit()),
            CHAT,
            stream=body.stream,
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
        )

    return app
