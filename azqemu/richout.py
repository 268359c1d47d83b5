"""A console for rich tables that prints them whole where the output is not a terminal.

rich fits a table to its console's width, and a console that is not a terminal (a log, a pipe,
``make demo > demo.log``) counts as 80 columns: the density table's headers came out as "×c…",
"qe…" and "sl…". Such output has no width to fit, so the console is made as wide as the widest
table it is about to print. A terminal keeps its own width (``COLUMNS`` too: rich reads it).
"""

from __future__ import annotations

from typing import Any

# Bound on the width a table is measured against: wider than any table here, so the measure
# is the table's own.
MEASURE_COLUMNS = 1000


def table_console(*renderables: Any) -> Any:
    """A rich Console wide enough for ``renderables`` when stdout is not a terminal."""
    from rich.console import Console
    console = Console()
    if not console.is_terminal and renderables:
        wide = console.options.update_width(MEASURE_COLUMNS)
        console.width = max(console.width, *(console.measure(r, options=wide).maximum for r in renderables))
    return console
