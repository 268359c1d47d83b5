"""Reading CSV text into typed rows.

Values are converted to int, float, bool or None where the text says so unambiguously;
everything else stays a string. Column names come from the header row.
"""

import csv
import io

TRUE_WORDS = {"true", "yes"}
FALSE_WORDS = {"false", "no"}
NULL_WORDS = {"", "na", "n/a", "null", "none"}


def parse_value(text):
    """Convert one CSV cell to the narrowest Python value it clearly represents."""
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in NULL_WORDS:
        return None
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    try:
        return int(stripped)
    except ValueError:
        pass
    try:
        return float(stripped)
    except ValueError:
        return stripped


def read_rows(text, delimiter=","):
    """Parse CSV text into a list of dicts keyed by the header row."""
    reader = csv.reader(io.StringIO(text), delimiter=delimiter)
    try:
        header = [name.strip() for name in next(reader)]
    except StopIteration:
        return [], []
    if len(set(header)) != len(header):
        raise ValueError(f"duplicate column names in header: {header}")
    rows = []
    for line_no, record in enumerate(reader, start=2):
        if not record or all(not cell.strip() for cell in record):
            continue
        if len(record) != len(header):
            raise ValueError(f"line {line_no}: expected {len(header)} fields, got {len(record)}")
        rows.append({name: parse_value(cell) for name, cell in zip(header, record)})
    return header, rows


def read_csv(path, delimiter=","):
    """Read a CSV file into a Table."""
    from tally.table import Table

    with open(path, encoding="utf-8", newline="") as handle:
        header, rows = read_rows(handle.read(), delimiter=delimiter)
    return Table(header, rows)
