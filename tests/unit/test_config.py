"""Settings read from the environment (azqemu/config.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from azqemu import config
from azqemu.errors import ConfigError


@pytest.mark.parametrize(("var", "read", "default", "top"), [
    ("AZQ_TCG_TB_CACHE_MIB", config.tcg_tb_cache_mib, config.DEFAULT_TCG_TB_CACHE_MIB, config.MAX_TCG_TB_CACHE_MIB),
    ("AZQ_FAULT_SPIN_US", config.fault_spin_us, config.DEFAULT_FAULT_SPIN_US, config.MAX_FAULT_SPIN_US),
])
def test_integer_settings_are_checked(monkeypatch: pytest.MonkeyPatch, var: str, read: Callable[[], int],
                                      default: int, top: int) -> None:
    monkeypatch.setenv(var, "0")
    assert read() == 0
    monkeypatch.setenv(var, str(top))
    assert read() == top
    monkeypatch.delenv(var)
    assert read() == default
    for bad in ("lots", "-1", "2.5", "1e3", str(top + 1)):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ConfigError, match=var):
            read()
