"""The command line: ``kvasync COMMAND`` (or ``python -m kvasync COMMAND``).

Each command lives in the subpackage it belongs to; this group only names them, and imports a
command's module when that command runs, so ``--help`` and ``--version`` load none of them. The
option types the commands share live here too (``SIZE``: one size syntax everywhere).
"""

from __future__ import annotations

import importlib
import importlib.util

import click

from . import __version__
from ._sizes import parse_size

__all__ = ["SHARE", "SIZE", "deprecated_memory_limit_mib", "main", "memory_limit_of"]

# command name -> (module, attribute) of its click command
_COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("kvasync.simulate", "simulate_command"),
    "demo": ("kvasync.serve._cli", "demo_command"),
    "serve": ("kvasync.serve._cli", "serve_command"),
    "top": ("kvasync.share._cli", "top_command"),
    "ls": ("kvasync.share._cli", "ls_command"),
    "limit": ("kvasync.share._cli", "limit_command"),
}
_SUMMARIES = {
    "simulate": "A simulated serving load over one allocator, rising and falling.",
    "demo": "Serve a burst of concurrent requests with the tiny model.",
    "serve": "Serve the reference engine over HTTP (OpenAI-compatible).",
    "top": "Show every allocator on a device share, refreshing until ^C.",
    "ls": "List every allocator on a device share once.",
    "limit": "Set the memory limit of a process's allocators.",
}

# command name -> (the extra it needs, the modules of that extra it imports). Checked before the
# command's module is imported, so a missing extra is named at once rather than as an import
# error after the work has started (the demo's plot comes after its whole burst).
_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "serve": ("serve", ("fastapi", "uvicorn", "prometheus_client")),
    "demo": ("serve", ("matplotlib",)),
}


# click >= 8.3 makes ParamType generic; subscripting it would break the click 8.1 we support.
class _Size(click.ParamType):  # type: ignore[type-arg]
    """A size in bytes as every kvasync command takes one: ``512MiB``, ``12GiB``, ``4096``."""

    name = "size"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as error:
            self.fail(str(error), param, ctx)


SIZE = _Size()
"""The click type of a size option (``--memory-limit``, ``--device-budget``)."""


class _Share(click.ParamType):  # type: ignore[type-arg]
    """A share name as every kvasync command takes one (``kvasync._share_names.check_share``)."""

    name = "share"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> str:
        # Here, not at the top: _share_names loads the extension, which --help must not.
        from ._share_names import check_share

        try:
            return check_share(value)
        except (TypeError, ValueError) as error:
            self.fail(str(error), param, ctx)


SHARE = _Share()
"""The click type of ``--share``: an empty or malformed name is refused before any work."""

# The old ``--memory-limit-mib N`` of serve, demo and simulate, kept (hidden) so that scripts keep
# working; memory_limit_of reads it.
deprecated_memory_limit_mib = click.option(
    "--memory-limit-mib",
    default=None,
    type=click.IntRange(1),
    hidden=True,
    help="deprecated: --memory-limit NMiB.",
)


def memory_limit_of(size: int | None, mib: int | None, command: str) -> int | None:
    """``--memory-limit``'s bytes, or its deprecated spelling ``--memory-limit-mib``'s.

    Args:
        size: the ``--memory-limit`` value (bytes), or None when not given.
        mib: the ``--memory-limit-mib`` value, or None when not given.
        command: the command's name, for the deprecation line.

    Returns:
        The limit in bytes; None when neither was given.

    Raises:
        click.BadParameter: both were given.
    """
    if mib is None:
        return size
    if size is not None:
        raise click.BadParameter(
            "give --memory-limit alone (--memory-limit-mib is its old spelling)",
            param_hint="--memory-limit-mib",
        )
    click.echo(
        f"kvasync {command}: --memory-limit-mib is deprecated: use --memory-limit {mib}MiB",
        err=True,
    )
    return mib << 20


def _check_extra(name: str) -> None:
    extra, modules = _EXTRAS.get(name, ("", ()))
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise click.ClickException(
            f"kvasync {name} needs the {extra} extra (missing: {', '.join(missing)}): "
            f'pip install "kvasync[{extra}]"'
        )


class _LazyGroup(click.Group):
    """A group whose commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _COMMANDS:
            return None
        if not ctx.resilient_parsing:  # shell completion lists commands: it runs none
            _check_extra(cmd_name)
        module, attribute = _COMMANDS[cmd_name]
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command), f"bug: {module}.{attribute} is not a command"
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # The summaries are written here so that --help does not import every command's module.
        with formatter.section("Commands"):
            formatter.write_dl([(name, _SUMMARIES[name]) for name in _COMMANDS])


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="kvasync")
def main() -> None:
    """kvasync: an elastic, virtual-memory-backed paged KV-cache allocator."""
