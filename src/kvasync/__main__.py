"""The command line: ``kvasync COMMAND`` (or ``python -m kvasync COMMAND``).

Each command lives in the module of its subsystem and is registered on the ``main`` group here,
so this file only lists them.
"""

from __future__ import annotations

import click

from . import __version__
from ._demo import simulate_command
from ._ledger_cli import limit_command, ls_command, top_command
from .serve._cli import demo_command, serve_command

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="kvasync")
def main() -> None:
    """kvasync: an elastic, virtual-memory-backed paged KV-cache allocator."""


main.add_command(simulate_command)
main.add_command(demo_command)
main.add_command(serve_command)
main.add_command(top_command)
main.add_command(ls_command)
main.add_command(limit_command)


if __name__ == "__main__":
    main(prog_name="kvasync")
