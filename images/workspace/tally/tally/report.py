"""Rendering tables as aligned plain text or Markdown."""


def _cell(value, float_digits):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{float_digits}f}"
    return str(value)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def render_text(table, float_digits=2):
    """An aligned plain-text table: numbers right-aligned, text left-aligned."""
    cells = [[_cell(row[name], float_digits) for name in table.columns] for row in table.rows]
    widths = [len(name) for name in table.columns]
    for line in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, line)]
    numeric = [all(_is_number(row[name]) or row[name] is None for row in table.rows) and table.rows
               for name in table.columns]
    out = ["  ".join(name.ljust(w) for name, w in zip(table.columns, widths)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    for line in cells:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(line, widths, numeric)]
        out.append("  ".join(parts).rstrip())
    return "\n".join(out) + "\n"


def render_markdown(table, float_digits=2):
    """A GitHub-flavoured Markdown table; pipes in cells are escaped."""
    def esc(text):
        return text.replace("|", "\\|")

    out = ["| " + " | ".join(esc(name) for name in table.columns) + " |"]
    out.append("|" + "|".join(" --- " for _ in table.columns) + "|")
    for row in table.rows:
        out.append("| " + " | ".join(esc(_cell(row[name], float_digits)) for name in table.columns) + " |")
    return "\n".join(out) + "\n"
