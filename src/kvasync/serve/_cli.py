"""The serving commands: ``kvasync serve`` (the HTTP server) and ``kvasync demo``.

Imports of the web stack and of the demo happen inside the commands, so that ``kvasync --help``
and the other commands start without them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import click

from ..cli import SHARE as _SHARE
from ..cli import SIZE as _SIZE
from ..cli import deprecated_memory_limit_mib as _DEPRECATED_MIB
from ..cli import memory_limit_of as _memory_limit
from ._engine import EngineConfig

__all__ = ["demo_command", "serve_command"]

_STARTUP_FAILURE = 3  # uvicorn.run's exit status when the server did not start
_DEMO_LIMIT = 2 << 20  # below the demo burst's peak demand, so the engine preempts


@click.command("serve")
@click.option("--preset", default="tiny", show_default=True, help="model: tiny (CPU) or small.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"])
)
@click.option("--max-blocks", default=2048, show_default=True, type=click.IntRange(1))
@click.option(
    "--memory-limit",
    default=None,
    type=_SIZE,
    help="KV memory cap: bytes the KV cache may map (512MiB, 2GiB, ...; default: none).",
)
@_DEPRECATED_MIB
@click.option("--max-batch", default=64, show_default=True, type=click.IntRange(1))
@click.option(
    "--request-timeout", default=60.0, show_default=True, type=click.FloatRange(min=0.001)
)
@click.option(
    "--share",
    default=None,
    type=_SHARE,
    help="co-location: share one device budget with the other engines that name this share.",
)
@click.option(
    "--device-budget",
    default=None,
    type=_SIZE,
    help="with --share: bytes the share's engines may map together (12GiB, 512MiB, ...).",
)
@click.option("--name", default="kvasync-serve", show_default=True, help="name in the share.")
@click.option(
    "--max-waiting",
    default=None,
    type=click.IntRange(1),
    help="requests that may wait for admission; one more is answered 429 with Retry-After "
    "(default: unbounded).",
)
@click.option(
    "--timeout-header",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0.001),
    help="seconds a connection may take to send a complete request head; then it is closed "
    "(slow or stalled clients).",
)
@click.option(
    "--timeout-keep-alive",
    default=5,
    show_default=True,
    type=click.IntRange(1),
    help="seconds an idle connection is kept open between two requests (uvicorn's).",
)
@click.option(
    "--limit-connections",
    default=None,
    type=click.IntRange(1),
    help="connections open at once; one more is closed at once (default: 1000, or fewer to "
    "leave 128 of the open-file limit, ulimit -n, to the server).",
)
def serve_command(
    preset: str,
    host: str,
    port: int,
    device: str,
    max_blocks: int,
    memory_limit: int | None,
    memory_limit_mib: int | None,
    max_batch: int,
    request_timeout: float,
    share: str | None,
    device_budget: int | None,
    name: str,
    max_waiting: int | None,
    timeout_header: float,
    timeout_keep_alive: int,
    limit_connections: int | None,
) -> None:
    """Serve the reference engine over HTTP (OpenAI-compatible /v1/completions and
    /v1/chat/completions)."""
    import resource

    import uvicorn

    from ._connections import ConnectionLimits, ServeConfig, connection_cap, log_limits
    from ._http import create_app, uvicorn_log_config

    if device_budget is not None and share is None:
        raise click.BadParameter("--device-budget needs --share", param_hint="--device-budget")
    open_files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if open_files == resource.RLIM_INFINITY:
        open_files = 1 << 20  # Linux's own ceiling (nr_open) by default
    try:
        cap = connection_cap(limit_connections, open_files)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--limit-connections") from None
    limits = ConnectionLimits(timeout_header, timeout_keep_alive, cap)
    try:
        config = EngineConfig(
            preset=preset,
            device=device,
            max_blocks=max_blocks,
            memory_limit=_memory_limit(memory_limit, memory_limit_mib, "serve"),
            max_batch=max_batch,
            request_timeout=request_timeout,
            share=share,
            device_budget=device_budget,
            name=name,
        )
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    app = create_app(config, max_waiting=max_waiting)
    # uvicorn's log configuration with kvasync's loggers: the start-up line names the model,
    # device and KV settings. Connections are guarded: Note [Connection limits].
    server = uvicorn.Server(
        ServeConfig(
            app,
            limits=limits,
            host=host,
            port=port,
            log_level="info",
            log_config=uvicorn_log_config(),
        )
    )
    log_limits(limits, open_files)
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: ^C is a clean stop
        server.run()
    if not server.started:  # the engine did not open, the port is taken, ...
        raise SystemExit(_STARTUP_FAILURE)


@click.command("demo")
@click.option("--requests", default=96, show_default=True, type=click.IntRange(1, 10000))
@click.option("--max-tokens", default=48, show_default=True, type=click.IntRange(1, 256))
@click.option(
    "--memory-limit",
    default=None,
    type=_SIZE,
    help="KV memory cap: below the burst's peak demand, so the engine preempts  [default: 2MiB]",
)
@_DEPRECATED_MIB
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--plot",
    default="kvasync-demo.png",
    show_default=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="where to write the plot (PNG).",
)
def demo_command(
    requests: int,
    max_tokens: int,
    memory_limit: int | None,
    memory_limit_mib: int | None,
    seed: int,
    plot: Path,
) -> None:
    """Serve a burst of concurrent requests with the tiny model; live progress, then a table."""
    from ._demo import run_demo_command

    limit = _memory_limit(memory_limit, memory_limit_mib, "demo")
    run_demo_command(requests, max_tokens, _DEMO_LIMIT if limit is None else limit, seed, plot)
