"""An in-memory table of rows with the few relational operations scripts need."""

import statistics

AGGREGATES = {
    "count": len,
    "sum": sum,
    "min": min,
    "max": max,
    "mean": statistics.fmean,
    "median": statistics.median,
}


class Table:
    """Rows (dicts) with a fixed column order. Operations return new tables."""

    def __init__(self, columns, rows=()):
        self.columns = list(columns)
        self.rows = [dict(row) for row in rows]
        for row in self.rows:
            missing = [name for name in self.columns if name not in row]
            if missing:
                raise KeyError(f"row lacks columns {missing}")

    def __len__(self):
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __eq__(self, other):
        return isinstance(other, Table) and self.columns == other.columns and self.rows == other.rows

    def __repr__(self):
        return f"Table(columns={self.columns!r}, rows={len(self.rows)})"

    def column(self, name):
        """All values of one column, in row order."""
        self._check(name)
        return [row[name] for row in self.rows]

    def select(self, *names):
        """Keep only the named columns, in the given order."""
        for name in names:
            self._check(name)
        return Table(names, ({name: row[name] for name in names} for row in self.rows))

    def where(self, predicate=None, **equals):
        """Rows for which predicate(row) is true and every column=value matches."""
        for name in equals:
            self._check(name)

        def keep(row):
            if predicate is not None and not predicate(row):
                return False
            return all(row[name] == value for name, value in equals.items())

        return Table(self.columns, (row for row in self.rows if keep(row)))

    def sort_by(self, name, reverse=False):
        """Rows ordered by one column; None sorts first (last when reversed)."""
        self._check(name)

        def key(row):
            value = row[name]
            return (value is not None, value if value is not None else 0)

        return Table(self.columns, sorted(self.rows, key=key, reverse=reverse))

    def add_column(self, name, func):
        """A new column computed from each row."""
        if name in self.columns:
            raise ValueError(f"column {name!r} already exists")
        rows = [{**row, name: func(row)} for row in self.rows]
        return Table(self.columns + [name], rows)

    def group_by(self, key, **aggregates):
        """One row per distinct key value; aggregates map output name to (func, column).

        Example: table.group_by("region", total=("sum", "amount"), n=("count", "amount")).
        None values are left out of an aggregate; an empty group aggregates to None.
        """
        self._check(key)
        groups = {}
        for row in self.rows:
            groups.setdefault(row[key], []).append(row)
        out_rows = []
        for value, members in groups.items():
            out = {key: value}
            for out_name, (func_name, column) in aggregates.items():
                self._check(column)
                func = AGGREGATES.get(func_name)
                if func is None:
                    raise ValueError(f"unknown aggregate {func_name!r} (have {sorted(AGGREGATES)})")
                values = [m[column] for m in members if m[column] is not None]
                out[out_name] = func(values) if values or func_name == "count" else None
            out_rows.append(out)
        return Table([key] + list(aggregates), out_rows)

    def to_csv(self, delimiter=","):
        """The table as CSV text (None as empty, booleans as true/false)."""
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.writer(buffer, delimiter=delimiter, lineterminator="\n")
        writer.writerow(self.columns)
        for row in self.rows:
            writer.writerow([_format_cell(row[name]) for name in self.columns])
        return buffer.getvalue()

    def _check(self, name):
        if name not in self.columns:
            raise KeyError(f"no column {name!r} (have {self.columns})")


def _format_cell(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
