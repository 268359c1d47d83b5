"""The daemon's systemd unit: rendered for this interpreter, and valid to systemd."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from azqemu.errors import ConfigError
from azqemu.host import service


def _parse(text: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str   # type: ignore[assignment,method-assign]
    cp.read_string(text)
    return cp


def test_the_unit_runs_this_interpreter_and_keeps_the_run_dir() -> None:
    unit = _parse(service.render())
    assert unit["Service"]["ExecStart"] == f"{sys.executable} -m azqemu daemon"
    assert unit["Service"]["Environment"] == "AZQ_LOG_DIR=/var/log/azqemu"
    assert "RuntimeDirectory" not in unit["Service"]   # it would delete sandboxes' sockets on stop
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "libvirtd.service" in unit["Unit"]["After"]


def test_a_relative_interpreter_is_refused() -> None:
    with pytest.raises(ConfigError, match="absolute path"):
        service.render("python3")


def test_install_writes_the_unit_without_enabling_it(tmp_path: Path) -> None:
    dest = service.install(tmp_path, reload=False)
    assert dest == tmp_path / "azqemu.service"
    assert dest.read_text() == service.render() and dest.stat().st_mode & 0o777 == 0o644
    assert not (tmp_path / "multi-user.target.wants").exists()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify_accepts_it(tmp_path: Path) -> None:
    dest = service.install(tmp_path, reload=False)
    r = subprocess.run(["systemd-analyze", "verify", str(dest)], capture_output=True, text=True)
    problems = [ln for ln in r.stderr.splitlines() if "azqemu.service" in ln]
    assert r.returncode == 0 and not problems, r.stderr
