"""The OpenAI wire protocol of ``kvasync serve``: request bodies, the error object, and how each
route spells its answers (``ResponseShape``: whole or as server-sent event chunks).

Request bodies are validated strictly (``"max_tokens": "4"`` and ``"stream": "yes"`` are refused,
never converted) and unknown fields are refused: a client that asks for something this server
does not do hears so, rather than getting an answer that silently ignored it. A parameter the
engine cannot honour is accepted only at the value that means "off" (``n`` 1, ``top_p`` 1,
``logprobs`` null, penalties 0, ...); any other value is a 400 that names the parameter.

Every error, bad JSON and unknown routes included, is OpenAI's error object:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "CHAT",
    "COMPLETION",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "OpenAIError",
    "ResponseShape",
    "StreamOptions",
    "TextPart",
    "parse_body",
    "sse",
]

MAX_STOP_STRINGS = 4  # OpenAI's own bound on ``stop``
_Model = TypeVar("_Model", bound=BaseModel)


class OpenAIError(Exception):
    """An error answered as OpenAI's error object, with its HTTP status.

    Args:
        status: the HTTP status.
        message: what went wrong and what to do.
        kind: the object's ``type`` (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, if one is.
        code: a machine-readable code (``model_not_found``, ``deadline_exceeded``, ...).
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The error object (also sent as a server-sent event when a stream fails)."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """The error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _Body(BaseModel):
    # strict: no "4" -> 4, no "yes" -> True; forbid: an unknown field is refused, never ignored.
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices."""

    include_usage: bool = False


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: str | None = None  # None: the one model served (as vLLM does)
    temperature: float | None = None  # None: the server's default, 0 (greedy)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the caller's end user: metadata, nothing to honour
    timeout: float | None = None  # an extension: seconds until the request's deadline

    def stop_strings(self) -> list[str]:
        """``stop`` as a list, checked (at most 4 strings, none empty)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise _refuse("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise _refuse("stop", "a stop string must not be empty")
        return stops

    def refuse_unsupported(self) -> None:
        """Raises a 400 for every parameter set to a value this server cannot honour."""
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options", "stream_options is only allowed with stream: true")
        _only(self.n, 1, "n", "one choice per request (n 1)")
        _only(self.top_p, 1.0, "top_p", "no nucleus sampling (top_p 1)")
        _only(self.presence_penalty, 0.0, "presence_penalty", "no penalties (0)")
        _only(self.frequency_penalty, 0.0, "frequency_penalty", "no penalties (0)")
        if self.logit_bias:
            raise _refuse("logit_bias", "this server does not support logit_bias")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: OpenAI's fields, each honoured or refused."""

    prompt: str | list[str]
    max_tokens: int | None = None  # None: 16, OpenAI's default
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompt_text(self) -> str:
        """The one prompt (a list must hold exactly one string)."""
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise _refuse("prompt", f"one prompt per request, got a list of {len(self.prompt)}")
        return self.prompt[0]

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None:
            raise _refuse("logprobs", "this server does not return logprobs")
        _only(self.best_of, 1, "best_of", "one candidate per request (best_of 1)")
        if self.suffix:
            raise _refuse("suffix", "this server does not support suffix (insertion)")


class TextPart(_Body):
    """A text part of a message's content (``{"type": "text", "text": ...}``)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One message of a chat: its role and its text."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: OpenAI's fields, each honoured or refused."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def output_limit(self) -> int | None:
        """``max_completion_tokens``, or the older ``max_tokens`` (not both)."""
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise _refuse("max_tokens", "give max_completion_tokens or max_tokens, not both")
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise _refuse("messages", "messages must hold at least one message")
        if self.logprobs or self.top_logprobs is not None:
            raise _refuse("logprobs", "this server does not return logprobs")
        if self.tools:
            raise _refuse("tools", "this server does not call tools")
        if self.tool_choice not in (None, "none"):
            raise _refuse("tool_choice", "this server does not call tools")
        if self.response_format not in (None, {"type": "text"}):
            raise _refuse("response_format", "only response_format {'type': 'text'} is supported")


def parse_body(model: type[_Model], raw: bytes) -> _Model:
    """The request body as ``model``, or a 400 OpenAI error that names the field at fault.

    Raises:
        OpenAIError: the body is not JSON, or a field is missing, unknown or of the wrong type.
    """
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        if first["type"] == "json_invalid":
            message = f"the request body is not valid JSON: {first['msg']}"
        elif first["type"] == "missing":
            message = f"missing required field {where!r}"
        elif first["type"] == "extra_forbidden":
            message = f"unknown field {where!r}: this server does not support it"
        elif where:
            message = f"{where}: {first['msg']} (got {first['input']!r:.60})"
        else:
            message = f"the request body must be a JSON object: {first['msg']}"
        raise OpenAIError(400, message, param=where or None) from None


def _refuse(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def _only(value: float | None, neutral: float, param: str, what: str) -> None:
    if value is not None and value != neutral:
        raise _refuse(param, f"this server supports only {what}, got {param} {value!r}")


# -- answers ------------------------------------------------------------------------------------


def sse(payload: dict[str, Any]) -> str:
    """``payload`` as one server-sent event (``data: {...}`` and a blank line)."""
    return f"data: {json.dumps(payload)}\n\n"


@dataclass(frozen=True)
class ResponseShape:
    """How one route spells its answers: completions (``text``) or chat (``message``/``delta``)."""

    prefix: str  # of the id
    whole_object: str
    chunk_object: str
    whole_choice: Callable[[str, str | None], dict[str, Any]]
    chunk_choice: Callable[[str, str | None], dict[str, Any]]
    first_chunk: dict[str, Any] | None  # chat's opening delta


def _text_choice(text: str, finish: str | None) -> dict[str, Any]:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}


def _message_choice(text: str, finish: str | None) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}


def _delta_choice(text: str, finish: str | None) -> dict[str, Any]:
    delta = {"content": text} if text else {}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


COMPLETION = ResponseShape(
    "cmpl", "text_completion", "text_completion", _text_choice, _text_choice, None
)
CHAT = ResponseShape(
    "chatcmpl",
    "chat.completion",
    "chat.completion.chunk",
    _message_choice,
    _delta_choice,
    {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    },
)
