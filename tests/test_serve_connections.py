"""kvasync serve's connection limits (Note [Connection limits]): the request-head deadline, the
keep-alive timeout and the connection cap, against a real ``kvasync serve`` process."""

import http.client
import resource
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import kvasync_serve

from kvasync.serve._connections import (
    DEFAULT_MAX_CONNECTIONS,
    RESERVED_FDS,
    ConnectionLimits,
    connection_cap,
)

HEAD_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 2  # longer than the head timeout: a test tells which of the two closed
OPEN_FILES = 256  # the server's RLIMIT_NOFILE: room for 128 connections
# What a loaded 2-core CI machine adds to a timer before the server's loop closes a connection.
GRACE_S = 5.0
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: kvasync\r\nContent-Type: applica"
BODY = b'{"model": "kvasync-tiny", "prompt": "hi", "max_tokens": 3}'


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    options = ("--timeout-header", str(HEAD_TIMEOUT_S), "--timeout-keep-alive", str(KEEP_ALIVE_S))
    with kvasync_serve(*options, open_files=OPEN_FILES) as base_url:
        yield base_url


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _closed_by_server(sock: socket.socket) -> bool:
    """Reads what is there: True once the server closed (FIN or RST); no data is expected."""
    try:
        data = sock.recv(4096)
    except ConnectionResetError:
        return True
    assert data == b"", f"the server sent {data[:80]!r} on a connection with no request"
    return True


def _wait_closed(
    sockets: dict[socket.socket, float], deadline: float
) -> dict[socket.socket, float]:
    """Waits (until ``deadline``) for the server to close each socket; returns when each was
    seen closed, against the time it was opened (``sockets``' values)."""
    waited: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        while len(waited) < len(sockets) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if _closed_by_server(sock):
                    waited[sock] = time.monotonic() - sockets[sock]
                    selector.unregister(sock)
    return waited


def _complete(url: str, deadline: float) -> httpx.Response:
    """A normal request, sent again while the server refuses its connection (at its cap, as the
    openai client retries one), until ``deadline``."""
    while True:
        try:
            return httpx.post(f"{url}/v1/completions", content=BODY, timeout=10.0)
        except httpx.TransportError:
            assert time.monotonic() < deadline, "no answer to a normal request by its deadline"
            time.sleep(0.05)  # a retry interval under a deadline


def test_stalled_connections_are_closed_at_the_head_timeout_and_normal_requests_served(
    url: str,
) -> None:
    # Issue 27, defect 10: 1,500 connections that never finished their heads held a server at
    # 1,024 fds for ever, and normal requests were reset meanwhile. Here the server may open 256
    # files (room for 128 connections) and 300 connections stall: 150 send nothing, 150 a part
    # of a head.
    stalled_count = 300
    cap = connection_cap(None, OPEN_FILES)
    stalled: dict[socket.socket, float] = {}
    try:
        for index in range(stalled_count):
            sock = socket.create_connection(_address(url), timeout=10.0)
            stalled[sock] = time.monotonic()
            if index % 2:
                sock.sendall(PARTIAL_HEAD)
        answer = _complete(url, deadline=time.monotonic() + HEAD_TIMEOUT_S + 20.0)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"][0]["text"]) == 3
        waited = _wait_closed(stalled, deadline=time.monotonic() + HEAD_TIMEOUT_S + GRACE_S)
    finally:
        for sock in stalled:
            sock.close()
    assert len(waited) == stalled_count, f"{stalled_count - len(waited)} stalled ones still open"
    assert max(waited.values()) < HEAD_TIMEOUT_S + GRACE_S
    # Closed before their deadline: only those refused over the cap; the rest held their head
    # deadline.
    early = sum(seconds < 0.9 * HEAD_TIMEOUT_S for seconds in waited.values())
    assert early <= stalled_count - cap


def test_a_request_whose_head_is_complete_is_not_cut_by_the_head_timeout(url: str) -> None:
    # The deadline is the head's: a request then takes as long as it needs (here its body comes
    # after 2.5 head timeouts), and its kept-alive connection waits for the next head anew.
    host, port = _address(url)
    connection = http.client.HTTPConnection(host, port, timeout=30.0)
    try:
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(len(BODY)))
        connection.endheaders(BODY[:10])
        sock = connection.sock
        assert isinstance(sock, socket.socket)
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            # NOTE: nothing may arrive: the server neither answers nor closes meanwhile.
            assert selector.select(timeout=2.5 * HEAD_TIMEOUT_S) == []
        sock.sendall(BODY[10:])
        response = connection.getresponse()
        assert response.status == 200
        response.read()
        # The next head stalls: the deadline applies again from its first byte (which stopped
        # the keep-alive timer), and closes the connection.
        sock.sendall(PARTIAL_HEAD)
        started = time.monotonic()
        waited = _wait_closed({sock: started}, deadline=started + HEAD_TIMEOUT_S + GRACE_S)
        assert sock in waited, "a stalled second head was not timed out"
        assert waited[sock] >= 0.9 * HEAD_TIMEOUT_S
    finally:
        connection.close()


def test_an_idle_connection_is_closed_at_the_keep_alive_timeout_not_the_head_timeout(
    url: str,
) -> None:
    host, port = _address(url)
    connection = http.client.HTTPConnection(host, port, timeout=30.0)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 200
        response.read()
        sock = connection.sock
        assert isinstance(sock, socket.socket)
        started = time.monotonic()
        waited = _wait_closed({sock: started}, deadline=started + KEEP_ALIVE_S + GRACE_S)
        assert sock in waited, "an idle kept-alive connection was not closed"
        # Between two requests no head is due: the head timeout (1 s) did not close it.
        assert waited[sock] >= 0.9 * KEEP_ALIVE_S
    finally:
        connection.close()


def test_a_connection_limit_over_the_open_file_limit_is_refused_at_start() -> None:
    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    command = [sys.executable, "-m", "kvasync", "serve", "--limit-connections", "5000"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=60, preexec_fn=limit_files
    )
    assert done.returncode == 2, done.stderr
    assert "--limit-connections 5000 needs 5128 open files" in done.stderr
    assert "the open-file limit is 256 (ulimit -n)" in done.stderr


def test_the_default_connection_cap_leaves_the_server_its_files() -> None:
    assert connection_cap(None, 1 << 20) == DEFAULT_MAX_CONNECTIONS
    assert connection_cap(None, 1024) == 1024 - RESERVED_FDS
    assert connection_cap(50, 1024) == 50
    with pytest.raises(ValueError, match="no room for connections"):
        connection_cap(None, RESERVED_FDS)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="--limit-connections must be a positive int"):
            connection_cap(bad, 1024)  # type: ignore[arg-type]


def test_connection_limits_refuse_values_that_are_not_positive() -> None:
    for fields, name in (
        ({"header_timeout": 0.0}, "header_timeout"),
        ({"header_timeout": float("inf")}, "header_timeout"),
        ({"keep_alive_timeout": 0}, "keep_alive_timeout"),
        ({"max_connections": 1.5}, "max_connections"),
    ):
        with pytest.raises(ValueError, match=name):
            ConnectionLimits(**fields)  # type: ignore[arg-type]
