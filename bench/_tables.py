"""The benchmarks' tables: rich tables in the Markdown box, so that a run's output pastes into
bench/RESULTS.md as it is.

Imported by the scripts of this folder (``python bench/bench_x.py`` puts it on ``sys.path``).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

__all__ = ["markdown", "print_table"]

# A table is never wrapped to the terminal: a wrapped Markdown row is no row.
_WIDTH = 10_000


def markdown(
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    justify: Sequence[str] | None = None,
) -> str:
    """The table as Markdown text.

    Args:
        columns: the header.
        rows: the cells, one string each, as many as ``columns``.
        justify: "left" or "right" per column; the first left and the others right when None.
    """
    table = Table(box=box.MARKDOWN)
    sides = [
        justify[k] if justify is not None else ("left" if k == 0 else "right")
        for k in range(len(columns))
    ]
    for name, side in zip(columns, sides, strict=True):
        table.add_column(name, justify="left" if side == "left" else "right")
    for row in rows:
        assert len(row) == len(columns), f"bug: a row of {len(row)} cells for {len(columns)}"
        table.add_row(*row)
    console = Console(file=io.StringIO(), width=_WIDTH, color_system=None)
    with console.capture() as capture:
        console.print(table)
    # The Markdown box draws an empty bottom edge: not part of the table.
    lines = [line.rstrip() for line in capture.get().splitlines() if line.strip()]
    # ... and no alignment in its rule: a right-justified column's rule ends with ":".
    rules = lines[1].strip("|").split("|")
    lines[1] = (
        "|"
        + "|".join(
            rule[:-1] + ":" if side == "right" else rule
            for rule, side in zip(rules, sides, strict=True)
        )
        + "|"
    )
    return "\n".join(lines)


def print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    justify: Sequence[str] | None = None,
) -> None:
    """Prints ``markdown(columns, rows, justify=justify)``."""
    print(markdown(columns, rows, justify=justify))
