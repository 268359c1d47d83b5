"""Settings read from the environment (azqemu/config.py)."""

from __future__ import annotations

import pytest

from azqemu import config
from azqemu.errors import ConfigError


def test_fault_spin_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZQ_FAULT_SPIN_US", "0")
    assert config.fault_spin_us() == 0
    monkeypatch.delenv("AZQ_FAULT_SPIN_US")
    assert config.fault_spin_us() == config.DEFAULT_FAULT_SPIN_US
    for bad in ("fast", "-1", "2.5", str(config.MAX_FAULT_SPIN_US + 1)):
        monkeypatch.setenv("AZQ_FAULT_SPIN_US", bad)
        with pytest.raises(ConfigError, match="AZQ_FAULT_SPIN_US"):
            config.fault_spin_us()
