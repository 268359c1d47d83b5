"""The one size formatter: the exact text each unit and edge gives (the CLI tables and the
benchmark reports print these strings, so a change here changes their output)."""

from __future__ import annotations

import pytest

from azqemu.units import GIB, KIB, MIB, fmt_bytes, fmt_mib


@pytest.mark.parametrize("size_bytes,text", [
    (0, "0 B"), (1023, "1023 B"), (KIB, "1.0 KiB"), (MIB - 1, "1024.0 KiB"), (MIB, "1.0 MiB"),
    (3 << 19, "1.5 MiB"), (GIB, "1.0 GiB"), (5 << 40, "5120.0 GiB"), (512.4, "512 B"),
    (-(3 << 19), "-1.5 MiB"),
])
def test_fmt_bytes(size_bytes: float, text: str) -> None:
    assert fmt_bytes(size_bytes) == text


def test_fmt_mib() -> None:
    assert fmt_mib(3 << 19) == "1.5 MiB"
    assert fmt_mib(0) == "0.0 MiB"
    assert fmt_mib(1536 * MIB, thousands=True, unit=False) == "1,536.0"
    assert fmt_mib(1536 * MIB + MIB // 2 + 1, 0, thousands=True, unit=False) == "1,537"
    assert fmt_mib(1536 * MIB) == "1536.0 MiB"


def test_units_is_ground_level() -> None:
    import ast
    import inspect

    import azqemu.units

    tree = ast.parse(inspect.getsource(azqemu.units))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("azqemu")]
