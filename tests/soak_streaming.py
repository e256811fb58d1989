"""The streaming soak behind ``make soak`` (not in CI): HTTP streams, many dropped mid-stream.

Note [Streaming soak]
~~~~~~~~~~~~~~~~~~~~~
``kvasync serve`` runs as its own process (the tiny model on CPU, in a share of its own so that
its ledger entry shows its close). ``CONNECTIONS`` clients at a time open streaming requests
(``/v1/completions`` and ``/v1/chat/completions``) over real TCP connections until
``SOAK_SECONDS`` have passed. Each connection meets one fate:

- *complete*: the ``openai`` client reads the stream to its end; the text must be as long as
  ``max_tokens`` (the byte model has no end token) and ``finish_reason`` ``length``;
- *close*: after a few chunks the client closes the stream (``httpx`` closes the connection, FIN);
- *reset*: after a few chunks a raw socket is closed with ``SO_LINGER`` 0 (the peer sees RST);
- *early*: the client leaves before the first chunk (the request sent, nothing read).

Every connection has a deadline. When the load ends, the server must come back to rest within
``REST_DEADLINE_S``: no request running or waiting, no KV block in use, no waiter, and no token
generated for nobody afterwards. Its open fds and RSS are sampled from /proc against their
values after a warm-up; one more request must complete; SIGINT must stop it within
``SHUTDOWN_DEADLINE_S`` with status 0, its ledger file gone, and no traceback in its log.

It fails (exit status 1) on any of these, on a connection past its deadline, on an HTTP error
status, on a completed stream whose text or finish reason is wrong, and on the run overrunning
SOAK_SECONDS by ``RUN_GRACE_S``.

Usage: ``SOAK_SECONDS=60 python tests/soak_streaming.py`` (default 600).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from rich.console import Console
from rich.table import Table

from kvasync import share

MODEL = "kvasync-tiny"
CONNECTIONS = 16  # streams open at once (2 shared cores: the model's steps are the cost)
MAX_TOKENS = (8, 48)
FATES = {"complete": 0.45, "close": 0.25, "reset": 0.2, "early": 0.1}
CONNECTION_DEADLINE_S = 60.0
START_DEADLINE_S = 90.0
REST_DEADLINE_S = 10.0
QUIET_S = 1.0  # no token generated for this long once at rest
SHUTDOWN_DEADLINE_S = 20.0
WARM_CONNECTIONS = 64  # fds and RSS are measured from here on
RSS_GROWTH_MIB = 64.0
FD_GROWTH = 4
SAMPLE_EVERY_S = 1.0
RUN_GRACE_S = 120.0  # the run's deadline past SOAK_SECONDS (the last connections, rest, checks)
BUDGET = "256MiB"
MAX_BLOCKS = 24


@dataclass
class Figures:
    connections: int = 0
    fates: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FATES, 0))
    chunks: int = 0
    longest_s: float = 0.0
    warm_fds: int = 0
    warm_rss_mib: float = 0.0
    max_fds: int = 0
    max_rss_mib: float = 0.0
    end_fds: int = 0
    end_rss_mib: float = 0.0
    engine: dict[str, float] = field(default_factory=dict)  # its counters at rest
    rest_s: float = 0.0
    shutdown_s: float = 0.0
    exit_code: int | None = None
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)


class Server:
    """``python -m kvasync serve`` as a child process, its output in a file."""

    def __init__(self, share_name: str) -> None:
        with socket.socket() as probe:  # NOTE: a small race for the port with other processes
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        log_fd, self.log_path = tempfile.mkstemp(prefix="soak-serve-", suffix=".log")
        command = [sys.executable, "-m", "kvasync", "serve", "--preset", "tiny", "--device", "cpu"]
        command += ["--port", str(self.port), "--max-batch", "32", "--request-timeout", "30"]
        # Fewer blocks than the connections want at once: requests wait and are preempted, and
        # drops land on requests in every state.
        command += ["--max-blocks", str(MAX_BLOCKS)]
        command += ["--share", share_name, "--device-budget", BUDGET, "--name", "soak-serve"]
        try:
            self.proc = subprocess.Popen(command, stdout=log_fd, stderr=subprocess.STDOUT)
        finally:
            os.close(log_fd)  # the child has its own copy

    async def started(self, client: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvasync serve exited {self.proc.returncode}: {self.output()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvasync serve did not answer in {START_DEADLINE_S} s")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(f"{self.url}/health", timeout=2.0)).status_code == 200:
                    return
            await asyncio.sleep(0.1)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def output(self) -> str:
        with open(self.log_path, errors="replace") as log:
            return log.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.unlink(self.log_path)


class Load:
    def __init__(self, server: Server, figures: Figures) -> None:
        self.server = server
        self.figures = figures
        self.rng = random.Random()
        self.openai = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", timeout=30.0, max_retries=0
        )
        self.http = httpx.AsyncClient(base_url=server.url, timeout=30.0)
        self.closed = False

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await self.openai.close()
            await self.http.aclose()

    def request(self) -> tuple[str, dict[str, Any]]:
        max_tokens = self.rng.randint(*MAX_TOKENS)
        prompt = "".join(self.rng.choice("abcdefgh ") for _ in range(self.rng.randint(4, 40)))
        if self.rng.random() < 0.5:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
            return "/v1/completions", body
        messages = [{"role": "user", "content": prompt}]
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True}
        return "/v1/chat/completions", body

    async def connection(self) -> None:
        fate = self.rng.choices(list(FATES), weights=list(FATES.values()))[0]
        route, body = self.request()
        started = time.monotonic()
        try:
            async with asyncio.timeout(CONNECTION_DEADLINE_S):
                if fate == "complete":
                    await self.complete(route, body)
                elif fate == "close":
                    await self.close_mid_stream(route, body)
                else:
                    await self.raw_drop(route, body, reset=fate == "reset")
        except TimeoutError:
            self.figures.problem(f"a {fate} connection to {route} passed its deadline")
        except (openai.APIError, httpx.HTTPError, OSError) as error:
            self.figures.problem(f"a {fate} connection to {route}: {type(error).__name__}: {error}")
        self.figures.connections += 1
        self.figures.fates[fate] += 1
        self.figures.longest_s = max(self.figures.longest_s, time.monotonic() - started)

    async def complete(self, route: str, body: dict[str, Any]) -> None:
        text, finish = "", None
        if route == "/v1/completions":
            stream = await self.openai.completions.create(**body)
            async for chunk in stream:
                self.figures.chunks += 1
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        else:
            chat = await self.openai.chat.completions.create(**body)
            async for piece in chat:
                self.figures.chunks += 1
                text += piece.choices[0].delta.content or ""
                finish = piece.choices[0].finish_reason or finish
        if len(text) != body["max_tokens"] or finish != "length":
            self.figures.problem(
                f"{route}: {len(text)} characters for max_tokens {body['max_tokens']}, "
                f"finish_reason {finish!r}"
            )

    async def close_mid_stream(self, route: str, body: dict[str, Any]) -> None:
        keep = self.rng.randint(1, body["max_tokens"] // 2)
        async with self.http.stream("POST", route, json=body) as response:
            if response.status_code != 200:
                self.figures.problem(f"{route} answered {response.status_code}")
                return
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    self.figures.chunks += 1
                    keep -= 1
                    if keep == 0:
                        break
        # Leaving the block with the body unread closes the connection (httpx cannot reuse it).

    async def raw_drop(self, route: str, body: dict[str, Any], *, reset: bool) -> None:
        """Sends the request on a socket of its own and leaves: ``reset`` after a few events,
        with RST; else at once, before any answer."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
        try:
            payload = httpx.Request("POST", f"{self.server.url}{route}", json=body).read()
            head = (
                f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n"
            )
            writer.write(head.encode() + payload)
            await writer.drain()
            if reset:
                status = await reader.readline()
                if not status.startswith(b"HTTP/1.1 200"):
                    self.figures.problem(f"{route} answered {status!r}")
                    return
                wanted = self.rng.randint(1, 4)
                while wanted > 0 and (line := await reader.readline()):
                    if line.startswith(b"data: "):
                        self.figures.chunks += 1
                        wanted -= 1
        finally:
            sock = writer.get_extra_info("socket")
            if reset and sock is not None:
                # Linger 0: close() sends RST instead of FIN, as a client that crashed would.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        warm = False

        async def client() -> None:
            nonlocal warm
            while time.monotonic() < end:
                await self.connection()
                if not warm and self.figures.connections >= WARM_CONNECTIONS:
                    warm = True
                    self.figures.warm_fds = self.server.fds()
                    self.figures.warm_rss_mib = self.server.rss_mib()

        async def sample() -> None:
            while time.monotonic() < end:
                self.figures.max_fds = max(self.figures.max_fds, self.server.fds())
                self.figures.max_rss_mib = max(self.figures.max_rss_mib, self.server.rss_mib())
                await asyncio.sleep(SAMPLE_EVERY_S)

        await asyncio.gather(sample(), *(client() for _ in range(CONNECTIONS)))
        if not warm:
            self.figures.problem(f"fewer than {WARM_CONNECTIONS} connections: no leak measured")

    async def metrics(self) -> dict[str, float]:
        text = (await self.http.get("/metrics")).text
        values: dict[str, float] = {}
        for name, value in re.findall(r"^(kvasync_\w+)(?:\{[^}]*\})? ([-+.\deE]+)$", text, re.M):
            values[name] = values.get(name, 0.0) + float(value)
        return values

    async def at_rest(self) -> None:
        """Waits until nothing runs and no block is used; then checks nothing is generated."""
        started = time.monotonic()
        keys = ("engine_requests_running", "engine_requests_waiting", "used_blocks", "waiters")
        while True:
            values = await self.metrics()
            busy = {k: values.get(f"kvasync_{k}", -1.0) for k in keys}
            if not any(busy.values()):
                break
            if time.monotonic() - started > REST_DEADLINE_S:
                self.figures.problem(f"not at rest {REST_DEADLINE_S} s after the load: {busy}")
                return
            await asyncio.sleep(0.05)
        self.figures.rest_s = time.monotonic() - started
        self.figures.engine = values
        tokens = values["kvasync_engine_generation_tokens_total"]
        await asyncio.sleep(QUIET_S)  # NOTE: the event awaited is that nothing happens
        later = (await self.metrics())["kvasync_engine_generation_tokens_total"]
        if later != tokens:
            self.figures.problem(f"{later - tokens:.0f} tokens generated at rest, for nobody")

    async def still_serves(self) -> None:
        result = await self.openai.completions.create(model=MODEL, prompt="after", max_tokens=5)
        if len(result.choices[0].text) != 5:
            self.figures.problem(f"after the load: {result.choices[0].text!r} for max_tokens 5")


async def soak(seconds: float, console: Console) -> Figures:
    figures = Figures()
    share_name = f"soak-serve-{uuid.uuid4().hex[:8]}"
    server = Server(share_name)
    load = Load(server, figures)
    try:
        try:
            async with asyncio.timeout(START_DEADLINE_S + seconds + RUN_GRACE_S):
                await server.started(load.http)
                console.print(
                    f"streaming soak: {seconds:.0f} s, {CONNECTIONS} connections at once, "
                    f"kvasync serve (tiny, cpu) pid {server.proc.pid} on port {server.port}"
                )
                await load.run(seconds)
                await load.at_rest()
                figures.end_fds, figures.end_rss_mib = server.fds(), server.rss_mib()
                await load.still_serves()
        except TimeoutError:
            figures.problem(f"the soak did not end within {seconds + RUN_GRACE_S:.0f} s of load")
        await load.aclose()
        began = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        try:
            figures.exit_code = server.proc.wait(SHUTDOWN_DEADLINE_S)
        except subprocess.TimeoutExpired:
            figures.problem(f"kvasync serve did not stop within {SHUTDOWN_DEADLINE_S} s of SIGINT")
        figures.shutdown_s = time.monotonic() - began
        check_end(server, share_name, figures)
    finally:
        await load.aclose()
        server.close()
    return figures


def check_end(server: Server, share_name: str, figures: Figures) -> None:
    if figures.exit_code not in (0, None):
        figures.problem(f"kvasync serve exited {figures.exit_code}")
    if share_name in share.shares():
        figures.problem(f"the share's ledger file stayed after the server left: {share_name}")
    log = server.output()
    if "Traceback" in log:
        start = log.index("Traceback")
        figures.problem(f"a traceback in the server's log: {log[start : start + 1500]}")
    if figures.end_fds - figures.warm_fds > FD_GROWTH:
        figures.problem(f"the server's fds grew from {figures.warm_fds} to {figures.end_fds}")
    if figures.end_rss_mib - figures.warm_rss_mib > RSS_GROWTH_MIB:
        figures.problem(
            f"the server's RSS grew from {figures.warm_rss_mib:.0f} "
            f"to {figures.end_rss_mib:.0f} MiB"
        )


def print_report(figures: Figures, console: Console) -> int:
    f = figures
    table = Table(title="streaming soak", title_justify="left")
    table.add_column("what")
    table.add_column("seen", justify="right")
    dropped = f.fates["close"] + f.fates["reset"] + f.fates["early"]
    table.add_row("streaming connections", f"{f.connections}")
    table.add_row("  read to the end", f"{f.fates['complete']}")
    table.add_row("  dropped", f"{dropped}")
    table.add_row("    closed mid-stream (FIN)", f"{f.fates['close']}")
    table.add_row("    reset mid-stream (RST)", f"{f.fates['reset']}")
    table.add_row("    left before the first chunk", f"{f.fates['early']}")
    table.add_row("chunks read", f"{f.chunks}")
    for name, what in (
        ("requests_finished", "engine: requests finished"),
        ("requests_failed", "engine: requests failed (aborted)"),
        ("preemptions", f"engine: preemptions (KV of {MAX_BLOCKS} blocks)"),
        ("generation_tokens", "engine: tokens generated"),
    ):
        table.add_row(what, f"{f.engine.get(f'kvasync_engine_{name}_total', 0):.0f}")
    table.add_row("longest connection", f"{f.longest_s:.2f} s")
    table.add_row("at rest after the load (no run, block, waiter)", f"{f.rest_s * 1e3:.0f} ms")
    table.add_row("server fds: warm / max / end", f"{f.warm_fds} / {f.max_fds} / {f.end_fds}")
    table.add_row(
        "server RSS: warm / max / end",
        f"{f.warm_rss_mib:.0f} / {f.max_rss_mib:.0f} / {f.end_rss_mib:.0f} MiB",
    )
    table.add_row("SIGINT to exit (status)", f"{f.shutdown_s * 1e3:.0f} ms ({f.exit_code})")
    table.add_row("problems", f"{len(f.problems)}")
    console.print(table)
    for problem in f.problems:
        console.print(f"PROBLEM: {problem}", markup=False)
    console.print("streaming soak: FAILED" if f.problems else "streaming soak: passed")
    return 1 if f.problems else 0


def main() -> int:
    seconds = float(os.environ.get("SOAK_SECONDS", "600"))
    console = Console()
    return print_report(asyncio.run(soak(seconds, console)), console)


if __name__ == "__main__":
    sys.exit(main())
