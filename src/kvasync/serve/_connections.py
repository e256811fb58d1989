"""``kvasync serve``'s connection limits: a deadline on each request head, the keep-alive timeout
and a cap on open connections, in a subclass of uvicorn's h11 protocol.

Note [Connection limits]
~~~~~~~~~~~~~~~~~~~~~~~~
Rationale: uvicorn times out only an idle keep-alive connection between two requests. A
connection that never sends a byte, or sends part of a request head and stalls (slowloris), is
kept open for ever: it holds a file descriptor, and once the process's open-file limit is
reached no new connection can be accepted, so normal requests are reset for as long as the
stalled ones stay (issue 27: 1,500 of them against a server at 1,024 fds). uvicorn's
``limit_concurrency`` does not help: it answers 503 once a request's head is complete, which a
stalled connection never reaches, and it counts the stalled connections against the requests.
ASGI middleware cannot help either: the app sees a request only once its head is complete.

Approach, as the servers around uvicorn do it:

- *Head deadline* (``--timeout-header``, 10 s): a connection must deliver a complete request
  head within this time of being opened, or of the first byte of its next request on a kept-alive
  connection; else it is closed. Go's ``ReadHeaderTimeout``, nginx's ``client_header_timeout``
  (60 s), Node's ``headersTimeout`` (60 s), Apache's ``mod_reqtimeout`` (20-40 s); 10 s is what
  uvicorn's maintainers proposed for their own ``--timeout-request-start`` (encode/uvicorn#157):
  the clients of an inference server are programs that send a head in one write.
- *Keep-alive* (``--timeout-keep-alive``, 5 s): uvicorn's own timer, unchanged: an idle
  connection between two requests is closed after it (uvicorn's and Node's default; gunicorn
  2 s, nginx 75 s).
- *Connection cap* (``--limit-connections``): at most this many connections are open at once;
  one more is closed as soon as it is accepted, as nginx does when its ``worker_connections`` are
  used up (the ``openai`` client retries a closed connection). The default is gunicorn's
  ``worker_connections``, 1000, lowered to leave ``RESERVED_FDS`` of the process's open-file
  limit (``RLIMIT_NOFILE``, ``ulimit -n``) to the engine (its allocator's memfds and eventfd,
  torch, the ledger, /metrics reading /proc), so that connections alone never exhaust it. A cap
  above what the limit leaves is refused at start.

Together: a stalled connection holds its descriptor for at most the head deadline, at most
the cap of them at once, and the server always has descriptors left for itself. Each closed or
refused connection is counted; a warning with the counts so far is logged at most every
``_LOG_EVERY_S``.

Implementation: ``GuardedH11Protocol`` subclasses uvicorn's ``H11Protocol`` (``Config.http``
takes a protocol class: uvicorn's own seam) and reads its settings from ``ServeConfig``, a
``uvicorn.Config`` that carries them. A request's head is complete when uvicorn starts a new
request cycle (``self.cycle`` changes); a connection waits for a head when it has no cycle yet or
its last one's response is complete.

Limitations: the deadline covers the head, not the body (this server's bodies are small JSON
documents read at once). A client that keeps reopening stalled connections still holds up to the
cap of them; per-client limits belong in a reverse proxy in front. The server speaks HTTP/1.1
through h11 even where httptools is installed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

__all__ = [
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_KEEP_ALIVE_S",
    "DEFAULT_MAX_CONNECTIONS",
    "RESERVED_FDS",
    "ConnectionLimits",
    "GuardedH11Protocol",
    "ServeConfig",
    "connection_cap",
    "log_limits",
]

logger = logging.getLogger("kvasync.serve")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_S = 5  # uvicorn's default
DEFAULT_MAX_CONNECTIONS = 1000  # gunicorn's worker_connections
RESERVED_FDS = 128  # left to the engine; `kvasync serve` holds about 20 at rest on a CPU
_LOG_EVERY_S = 10.0


def connection_cap(requested: int | None, open_files: int) -> int:
    """The most connections the server keeps open (Note [Connection limits]).

    Args:
        requested: ``--limit-connections``; None = ``DEFAULT_MAX_CONNECTIONS``, lowered to what
            the open-file limit leaves.
        open_files: the process's open-file limit (the soft ``RLIMIT_NOFILE``).

    Returns:
        The cap.

    Raises:
        ValueError: the open-file limit leaves no room for connections, or ``requested`` needs
            more files than it allows.
    """
    room = open_files - RESERVED_FDS
    if room < 1:
        raise ValueError(
            f"the open-file limit is {open_files} (ulimit -n), and kvasync serve keeps "
            f"{RESERVED_FDS} for itself: no room for connections; raise it (ulimit -n 4096)"
        )
    if requested is None:
        return min(DEFAULT_MAX_CONNECTIONS, room)
    if type(requested) is not int or requested < 1:
        raise ValueError(f"--limit-connections must be a positive int, got {requested!r}")
    if requested > room:
        raise ValueError(
            f"--limit-connections {requested} needs {requested + RESERVED_FDS} open files "
            f"({RESERVED_FDS} kept for the server itself), but the open-file limit is "
            f"{open_files} (ulimit -n): raise it, or ask for at most {room} connections"
        )
    return requested


def log_limits(limits: ConnectionLimits, open_files: int) -> None:
    """Logs the limits in force (at start, beside the engine's settings)."""
    logger.info(
        "kvasync serve: connections: request head within %g s, keep-alive %d s, at most %d open "
        "(open-file limit %d)",
        limits.header_timeout,
        limits.keep_alive_timeout,
        limits.max_connections,
        open_files,
    )


class _Counts:
    """Connections closed by the guard: a warning with the counts so far at most every
    ``_LOG_EVERY_S``, and one at the end of a quiet window with the ones it held back."""

    def __init__(self) -> None:
        self.timed_out = 0
        self.refused = 0
        self._logged_at = -math.inf
        self._pending: asyncio.TimerHandle | None = None

    def note(self, limits: ConnectionLimits, loop: asyncio.AbstractEventLoop) -> None:
        if self._pending is not None:
            return  # the line due at the end of the window will count this one
        wait = self._logged_at + _LOG_EVERY_S - time.monotonic()
        if wait <= 0:
            self._log(limits)
        else:
            self._pending = loop.call_later(wait, self._log, limits)

    def _log(self, limits: ConnectionLimits) -> None:
        self._pending = None
        self._logged_at = time.monotonic()
        logger.warning(
            "kvasync serve: %d connection(s) closed so far for sending no complete request head "
            "within %g s (--timeout-header), %d refused at the limit of %d open connections "
            "(--limit-connections): slow or stalled clients",
            self.timed_out,
            limits.header_timeout,
            self.refused,
            limits.max_connections,
        )


@dataclass(frozen=True)
class ConnectionLimits:
    """The server's connection limits (Note [Connection limits]).

    Args:
        header_timeout: seconds a connection may take to deliver a complete request head.
        keep_alive_timeout: seconds an idle connection is kept between two requests (uvicorn's
            ``timeout_keep_alive``).
        max_connections: connections open at once; ``connection_cap`` gives the default.

    Raises:
        ValueError: a value that is not positive (or not finite).
    """

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_timeout: int = DEFAULT_KEEP_ALIVE_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        timeout = self.header_timeout
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"header_timeout must be positive seconds, got {timeout!r}")
        for name in ("keep_alive_timeout", "max_connections"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


class ServeConfig(uvicorn.Config):
    """uvicorn's configuration with ``limits``, served by ``GuardedH11Protocol``.

    Args:
        app: the ASGI app.
        limits: the connection limits.
        **options: the rest of ``uvicorn.Config``'s arguments (host, port, logging, ...).
    """

    def __init__(self, app: Any, *, limits: ConnectionLimits, **options: Any) -> None:
        super().__init__(
            app, http=GuardedH11Protocol, timeout_keep_alive=limits.keep_alive_timeout, **options
        )
        self.limits = limits
        self.closed = _Counts()  # by the guard, over every connection


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a connection cap (Note
    [Connection limits]); uvicorn makes one per connection."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not isinstance(config, ServeConfig):
            raise TypeError(f"GuardedH11Protocol needs a ServeConfig, got {type(config).__name__}")
        super().__init__(config, server_state, app_state, _loop)
        self._limits = config.limits
        self._closed = config.closed
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections:
            # NOTE: closed at once (connection_lost forgets it): the descriptor comes back now.
            self._closed.refused += 1
            self._closed.note(self._limits, self.loop)
            transport.close()
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        between_requests = before is None or before.response_complete
        super().data_received(data)
        if self.cycle is not before:  # a head was complete: uvicorn started its request
            self._stop_waiting()
        elif between_requests and self._head_deadline is None:
            self._await_head()  # the first bytes of the next request on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._head_deadline = self.loop.call_later(
            self._limits.header_timeout, self._head_timed_out
        )

    def _stop_waiting(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self._closed.timed_out += 1
            self._closed.note(self._limits, self.loop)
            self.transport.close()
