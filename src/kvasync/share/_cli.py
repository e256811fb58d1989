"""``kvasync top``, ``kvasync ls`` and ``kvasync limit``: the share ledger from the command line.

Named by the ``kvasync`` command group (``kvasync/cli.py``), which imports this module when one of
them runs. Each takes ``--share NAME`` (default: the ``KVASYNC_SHARE`` environment variable, else
the share of the machine's device: CUDA device 0's where CUDA is usable, else the host backend's;
``choose_share``). A size is read by ``kvasync.cli.SIZE``, as every command reads one, and written
by ``kvasync._sizes``.
"""

from __future__ import annotations

import json
import os
import time

import click
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from .. import _core
from .._errors import KVAsyncError
from .._sizes import format_bytes as format_bytes
from .._sizes import parse_size as parse_size
from ..cli import SHARE, SIZE
from . import _ledger as ledger

__all__ = [
    "choose_share",
    "format_bytes",
    "limit_command",
    "ls_command",
    "parse_size",
    "top_command",
]

STALLED_AFTER_S = 1.0  # a mapper op older than this is shown as stalled


def choose_share(share: str | None) -> tuple[str, str]:
    """The share a command acts on, and why that one ("" when ``--share`` named it).

    Without ``--share``: ``$KVASYNC_SHARE``, else the share of this machine's device, CUDA
    device 0's where the cuda backend can be used, else the host backend's (``"host"``): where
    the allocators of a machine without CUDA are.
    """
    if share is not None:
        return share, ""
    named = os.environ.get("KVASYNC_SHARE")
    if named:
        return named, "from $KVASYNC_SHARE"
    problem = _core.cuda_problem(0)
    if problem is None:
        return ledger.default_share(0), "the default: CUDA device 0's"
    return ledger.default_share("host"), f"the default on a machine without CUDA: {problem}"


def _share_option() -> click.Option:
    return click.Option(
        ["--share"],
        default=None,
        type=SHARE,
        help="The share's name (default: $KVASYNC_SHARE, else the share of CUDA device 0, or "
        "'host' on a machine without CUDA).",
    )


def _why_text(command: str, share: str, why: str) -> str:
    """What an error adds when the share was not named: which one the command took, and why."""
    if not why:
        return ""
    return (
        f"; kvasync {command} used share {share!r} ({why}): name another with --share NAME "
        "or $KVASYNC_SHARE"
    )


def _stale_text(share: str) -> str:
    return (
        f"share {share!r} has no live allocator: its ledger file is left over from processes "
        f"that exited without leaving; `kvasync ls --prune --share {share}` removes it"
    )


def _snapshot(share: str, why_text: str) -> list[ledger.LedgerEntry]:
    try:
        return ledger.snapshot(share)
    except (KVAsyncError, ValueError, TypeError) as error:
        raise click.ClickException(_failure_text(share, error, why_text)) from error


def _failure_text(share: str, error: Exception, why_text: str) -> str:
    message = str(error)
    if not os.path.exists(ledger.path(share)):
        message += f" ({_shares_text()})"
    return message + why_text


def _snapshot_if_any(share: str) -> list[ledger.LedgerEntry] | None:
    """The share's entries, or None when it has no ledger file (nobody joined, or all left)."""
    if not os.path.exists(ledger.path(share)):
        return None
    try:
        return ledger.snapshot(share)
    except KVAsyncError:
        if not os.path.exists(ledger.path(share)):  # its last member left meanwhile
            return None
        raise


def _shares_text() -> str:
    names = ledger.shares()
    if not names:
        return f"no share on this machine: no {ledger.path('NAME').replace('NAME', '*')} file"
    return "shares on this machine: " + ", ".join(names)


def _op_text(entry: ledger.LedgerEntry) -> Text:
    if not entry.op:
        return Text("idle", style="dim")
    text = f"{entry.op} ({entry.op_age_s:.1f} s)"
    return Text(text, style="bold red" if entry.op_age_s >= STALLED_AFTER_S else "")


_COLUMNS = (
    "pid",
    "name",
    "used",
    "mapped",
    "reserve",
    "demand",
    "limit",
    "waiters",
    "mapper op",
)


def _cells(e: ledger.LedgerEntry) -> list[str | Text]:
    """An entry's cells, in the order of ``_COLUMNS``."""
    waiters = f"{e.waiters}" + (f" ({e.blocked} on budget)" if e.blocked else "")
    return [
        str(e.pid),
        e.name,
        format_bytes(e.used_bytes),
        format_bytes(e.mapped_bytes),
        format_bytes(e.reserved_bytes),
        format_bytes(e.demand_bytes),
        format_bytes(e.limit_bytes) if e.limited else "none",
        Text(waiters, style="yellow" if e.waiters else ""),
        _op_text(e),
    ]


def _width(console: Console, table: Table) -> int:
    """The columns ``table`` takes with no cell cut or wrapped (unbounded by the terminal)."""
    return Measurement.get(console, console.options.update_width(1 << 20), table).maximum


def render(share: str, entries: list[ledger.LedgerEntry], console: Console | None = None) -> Group:
    """The share's table, with a line for its budget and what is committed against it.

    A row per allocator where it fits ``console``'s width; in a narrower terminal, a section per
    allocator with a line per column, whose values fold rather than being cut.
    """
    title = f"kvasync share {share!r} ({ledger.path(share)})"
    table = Table(title=title, expand=False)
    for column in _COLUMNS:
        table.add_column(column, justify="left" if column in ("name", "mapper op") else "right")
    for e in entries:
        table.add_row(*_cells(e))
    if console is not None and _width(console, table) > console.width:
        table = Table(title=title, expand=False, show_header=False, box=box.SIMPLE)
        table.add_column("column", no_wrap=True)
        table.add_column("value", overflow="fold")
        for i, e in enumerate(entries):
            if i:
                table.add_section()
            for column, cell in zip(_COLUMNS, _cells(e), strict=True):
                table.add_row(column, cell)
    total = sum(e.committed_bytes for e in entries)
    budget = ledger.budget(entries)
    footer = f"{len(entries)} allocator(s); committed {format_bytes(total)}"
    footer += f" of a budget of {format_bytes(budget)}" if budget else " (no budget set)"
    return Group(table, Text(footer))


def _summary(share: str, entries: list[ledger.LedgerEntry]) -> dict[str, object]:
    return {
        "share": share,
        "path": ledger.path(share),
        "budget_bytes": ledger.budget(entries),
        "committed_bytes": sum(e.committed_bytes for e in entries),
        "allocators": [e.as_dict() for e in entries],
    }


def _waiting(share: str, why: str) -> Text:
    about = f" ({why})" if why else ""
    return Text(
        f"kvasync share {share!r}{about}: waiting for allocators to join ({_shares_text()})"
    )


def _prune(names: list[str]) -> None:
    failed = False
    for name in names:
        try:
            removed = ledger.prune(name)
        except (KVAsyncError, ValueError) as error:
            click.echo(f"{name}: kept: {error}", err=True)
            failed = True
            continue
        click.echo(f"{name}: " + ("removed (no live allocator)" if removed else "in use, kept"))
    if failed:
        raise click.ClickException("some ledger files could not be checked (see above)")


@click.command("ls", params=[_share_option()])
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option(
    "--prune",
    is_flag=True,
    help="Remove the ledger files of shares with no live allocator (all shares, or --share).",
)
def ls_command(share: str | None, as_json: bool, prune: bool) -> None:
    """Lists every allocator on a device share once.

    Without --share or $KVASYNC_SHARE, and with no ledger for this machine's default share (CUDA
    device 0's, or 'host' without CUDA), lists every share on this machine instead. A share
    with no live allocator (a ledger file left by processes that died) is named apart, with
    the command that removes it.
    """
    if prune:
        _prune([share] if share is not None else ledger.shares())
        return
    name, why = choose_share(share)
    # No share named and none by default here: say what there is instead of failing.
    named = share is not None or bool(os.environ.get("KVASYNC_SHARE"))
    every_share = not named and not os.path.exists(ledger.path(name))
    names = ledger.shares() if every_share else [name]
    found: list[tuple[str, list[ledger.LedgerEntry]]] = []
    unusable = []
    for n in names:
        if not every_share:
            found.append((n, _snapshot(n, _why_text("ls", n, why))))  # it must exist
            continue
        try:
            entries = _snapshot_if_any(n)
        except (KVAsyncError, ValueError) as error:
            unusable.append(f"{n}: {error}")  # one bad file does not hide the others
            continue
        if entries is not None:  # None: its last allocator left since it was listed
            found.append((n, entries))
    stale = [n for n, entries in found if not entries]
    if as_json:
        summaries = [_summary(n, entries) for n, entries in found]
        click.echo(json.dumps({"shares": summaries} if every_share else summaries[0], indent=2))
    else:
        console = Console()
        if every_share and not found and not unusable:
            console.print(Text(f"kvasync: {_shares_text()}"))
        for n, entries in found:
            if entries or not every_share:  # in the overview, the stale ones are listed below
                console.print(render(n, entries, console))
    # An overview nobody asked of one share: a file it cannot read is reported, not a failure.
    for line in unusable:
        click.echo(f"kvasync: cannot read share {line}", err=True)
    if stale and every_share:
        click.echo(
            f"kvasync: {len(stale)} stale ledger file(s) (no live allocator): "
            f"{', '.join(stale)}; `kvasync ls --prune` removes them",
            err=True,
        )
    elif stale:
        click.echo(f"kvasync: {_stale_text(stale[0])}", err=True)


@click.command("top", params=[_share_option()])
@click.option(
    "--interval",
    default=0.5,
    show_default=True,
    type=click.FloatRange(min=0.05),
    help="Seconds between refreshes.",
)
@click.option(
    "--count",
    default=0,
    type=click.IntRange(min=0),
    help="Stop after this many refreshes (default: until ^C).",
)
def top_command(share: str | None, interval: float, count: int) -> None:
    """Shows every allocator on a device share, refreshing until ^C.

    A share nobody has joined yet (or whose allocators all left) is shown as waiting: top keeps
    refreshing until allocators join.
    """
    name, why = choose_share(share)
    console = Console()
    refreshes = 0

    def view() -> Group | Text:
        try:
            entries = _snapshot_if_any(name)
        except (KVAsyncError, ValueError) as error:
            raise click.ClickException(str(error) + _why_text("top", name, why)) from error
        if entries == []:  # a file, nobody in it
            return Text(f"kvasync: {_stale_text(name)}; waiting for allocators to join")
        return render(name, entries, console) if entries else _waiting(name, why)

    try:
        with Live(view(), console=console, auto_refresh=False) as live:
            while count == 0 or refreshes < count:
                time.sleep(interval)
                live.update(view(), refresh=True)
                refreshes += 1
    except KeyboardInterrupt:
        pass


NO_LIMIT = "none"
"""``kvasync limit PID none``: back to each allocator's configured limit."""


# click >= 8.3 makes ParamType generic; subscripting it would break the click 8.1 we support.
class _Limit(click.ParamType):  # type: ignore[type-arg]
    """A size (as ``SIZE``), or ``none``. Not None for none: click takes a required argument
    converted to None for a missing one."""

    name = "size"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | str:
        if isinstance(value, str) and value.strip().lower() == NO_LIMIT:
            return NO_LIMIT
        try:
            return SIZE.convert(value, param, ctx)
        except click.BadParameter as error:
            self.fail(f"{error.message}; or none, to go back to the configured limit", param, ctx)


@click.command("limit", params=[_share_option()])
@click.argument("pid", type=click.IntRange(min=1))
@click.argument("size", type=_Limit())
def limit_command(share: str | None, pid: int, size: int | str) -> None:
    """Sets the memory limit of process PID's allocators to SIZE (12GiB, 512MiB, ...); SIZE
    none removes the limit set from outside (each allocator goes back to its configured one).

    The allocators apply it in the background: they stop growing above it and give back free
    pages at once and others as blocks are freed; raised or removed, they grow again.
    """
    name, why = choose_share(share)
    limit = None if size == NO_LIMIT else int(size)
    try:
        count = ledger.set_limit(name, pid, limit)
    except (KVAsyncError, ValueError) as error:
        why_text = _why_text("limit", name, why)
        raise click.ClickException(_failure_text(name, error, why_text)) from error
    where = f"{count} allocator(s) of process {pid} on share {name!r}"
    if limit is None:
        click.echo(f"limit removed from {where}: each is back to its configured memory limit")
    else:
        click.echo(f"limit of {format_bytes(limit)} set on {where}")
