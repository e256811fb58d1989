"""The serving commands: ``kvasync serve`` (the HTTP server) and ``kvasync demo``.

Imports of the web stack and of the demo happen inside the commands, so that ``kvasync --help``
and the other commands start without them.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..cli import SHARE as _SHARE
from ..cli import SIZE as _SIZE
from ..cli import deprecated_memory_limit_mib as _DEPRECATED_MIB
from ..cli import memory_limit_of as _memory_limit
from ._engine import EngineConfig

__all__ = ["demo_command", "serve_command"]

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
) -> None:
    """Serve the reference engine over HTTP (OpenAI-compatible /v1/completions and
    /v1/chat/completions)."""
    import uvicorn

    from ._http import create_app, uvicorn_log_config

    if device_budget is not None and share is None:
        raise click.BadParameter("--device-budget needs --share", param_hint="--device-budget")
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
    # device and KV settings.
    uvicorn.run(app, host=host, port=port, log_level="info", log_config=uvicorn_log_config())


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
