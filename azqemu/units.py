"""Byte counts for people: the one place sizes are turned into text.

Ground level (imports nothing of azqemu): the CLI, the benchmark reports and error messages
all format sizes through these two functions, so the same size reads the same everywhere.
Binary units throughout (1 MiB = 2**20 bytes), as the kernel's own tools and QEMU print them.
"""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

_UNITS = (("GiB", GIB), ("MiB", MIB), ("KiB", KIB))


def fmt_bytes(size_bytes: float) -> str:
    """The largest binary unit that keeps the number at 1 or more, one decimal, GiB at most:
    ``512 B``, ``4.0 KiB``, ``1.5 MiB``, ``2048.0 GiB``. Below 1 KiB the bytes are rounded
    to a whole number. A negative size is scaled by its magnitude (``-1.5 MiB``)."""
    for unit, scale in _UNITS:
        if abs(size_bytes) >= scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{size_bytes:.0f} B"


def fmt_mib(size_bytes: float, decimals: int = 1, *, thousands: bool = False, unit: bool = True) -> str:
    """A size in MiB with ``decimals`` decimals: ``fmt_mib(3 << 19)`` is ``1.5 MiB``.
    ``thousands`` groups the digits with commas (``1,024.0``); ``unit=False`` leaves the
    unit out, for a table whose header names it."""
    text = f"{size_bytes / MIB:{',' if thousands else ''}.{decimals}f}"
    return f"{text} MiB" if unit else text
