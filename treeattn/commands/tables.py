"""Tables that fit the terminal: key columns stay whole, the others drop out by priority.

A command's table names its columns once, marking the ones a reader cannot do without
(``key=True``: the algorithm or plan, its time, its speedup against the strongest baseline).
:func:`print_table` measures every cell, and when the table is wider than the console it
drops the non-key columns, the last declared first, until it fits, then says in one line
which columns it left out and that ``--wide`` shows them. Key columns never wrap or
truncate: on a console too narrow even for them, the table overflows rather than cutting a
number in half. ``--wide`` prints every column at its natural width whatever the terminal.

Rich sizes the console from the terminal, or from ``COLUMNS`` when output is not a terminal
(80 if unset), which is what the tests set. Prose printed beside the tables (notes, reasons
a row is missing) goes through :func:`say`, which wraps it to the same width.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.table import Table

#: Each column costs its cell width plus one space either side and one border to its right;
#: the table adds one border on the left (rich's default box).
CELL_PADDING = 3
TABLE_EDGE = 1


@dataclass(frozen=True)
class Column:
    header: str
    key: bool = False
    justify: str = "right"
    style: str | None = None


def say(text: str, file: TextIO | None = None) -> None:
    """Print one paragraph of prose wrapped to the terminal's width, sized as rich sizes the
    tables (the terminal, else ``COLUMNS``, else 80). Words are never split, so a path or a
    number longer than a line stays whole on a line of its own.

    >>> import io, os
    >>> out = io.StringIO()
    >>> os.environ["COLUMNS"] = "20"
    >>> say("Not priced: helix cannot split 4 heads over 8 ranks.", out)
    >>> print(out.getvalue(), end="")
    Not priced: helix
    cannot split 4 heads
    over 8 ranks.
    >>> del os.environ["COLUMNS"]
    """
    stream = sys.stdout if file is None else file
    width = max(20, shutil.get_terminal_size((80, 24)).columns)
    stream.write(textwrap.fill(text, width=width, break_long_words=False,
                               break_on_hyphens=False) + "\n")


def add_wide_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wide", action="store_true",
                        help="show every table column, whatever the terminal width")


def _width(text: str) -> int:
    return max((len(line) for line in str(text).splitlines()), default=0)


def fitted_columns(columns: list[Column], rows: list[list[str]], width: int,
                   wide: bool = False) -> list[int]:
    """Indices of the columns to show within ``width`` characters.

    >>> cols = [Column("name", key=True), Column("a"), Column("b"), Column("time", key=True)]
    >>> rows = [["tree", "x" * 30, "y" * 30, "1.0 µs"]]
    >>> fitted_columns(cols, rows, 200), fitted_columns(cols, rows, 60)
    ([0, 1, 2, 3], [0, 1, 3])
    >>> fitted_columns(cols, rows, 20), fitted_columns(cols, rows, 20, wide=True)
    ([0, 3], [0, 1, 2, 3])
    """
    need = [max([_width(c.header)] + [_width(r[i]) for r in rows]) + CELL_PADDING
            for i, c in enumerate(columns)]
    shown = list(range(len(columns)))
    if wide:
        return shown
    droppable = [i for i in reversed(shown) if not columns[i].key]
    while TABLE_EDGE + sum(need[i] for i in shown) > width and droppable:
        shown.remove(droppable.pop(0))
    return shown


def print_table(console: Console, columns: list[Column], rows: list[list[str]], *,
                title: str | None = None, caption: str | None = None, wide: bool = False,
                row_styles: list[str | None] | None = None, show_header: bool = True) -> None:
    """Print ``rows`` (cells as strings) under ``columns``, fitted to ``console.width``.

    A note after the table names the columns left out, if any."""
    width = console.width
    shown = fitted_columns(columns, rows, width, wide)
    table = Table(title=title, caption=caption, show_header=show_header)
    for i in shown:
        c = columns[i]
        table.add_column(c.header, justify=c.justify, style=c.style, no_wrap=c.key,
                         overflow="fold" if not c.key else "ellipsis")
    styles = row_styles or [None] * len(rows)
    for row, style in zip(rows, styles):
        table.add_row(*(row[i] for i in shown), style=style)
    natural = TABLE_EDGE + sum(
        max([_width(columns[i].header)] + [_width(r[i]) for r in rows]) + CELL_PADDING
        for i in shown)
    if natural > console.width:
        # --wide, or key columns wider than the terminal: the table keeps its natural width
        # (the terminal scrolls or wraps lines) rather than cutting a cell.
        console = Console(width=natural, file=console.file, force_terminal=console.is_terminal,
                          no_color=console.no_color)
    console.print(table)
    hidden = [columns[i].header for i in range(len(columns)) if i not in shown]
    if hidden:
        console.print(f"({len(hidden)} columns left out to fit {width} columns: "
                      f"{', '.join(hidden)}; --wide shows them)", highlight=False)
