"""The daemon's one log file, and the CLI's logging set-up that used to log nothing."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from azqemu import config as config_mod
from azqemu.daemon.logsetup import log_to_daemon_log


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        for h in root.handlers:
            if h not in handlers:
                h.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def test_the_daemon_log_is_under_azq_log_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AZQ_LOG_DIR", str(tmp_path / "log"))
    assert config_mod.load().daemon_log == tmp_path / "log" / "daemon.log"
    monkeypatch.delenv("AZQ_LOG_DIR")
    assert config_mod.load().daemon_log == Path("/var/log/azqemu/daemon.log")


def test_info_lines_reach_the_daemon_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         root_logging: None) -> None:
    monkeypatch.setenv("AZQ_LOG_DIR", str(tmp_path / "log"))
    logging.getLogger().addHandler(logging.NullHandler())   # what main() used to add first
    path = log_to_daemon_log()
    logging.getLogger("azqemu.daemon.server").info("serving /v1 on unix:/x")
    text = Path(path).read_text()
    assert "INFO serving /v1 on unix:/x" in text and "logging to" in text


def test_the_cli_logging_is_not_silenced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         root_logging: None) -> None:
    from azqemu.cli import _setup_logging

    monkeypatch.setenv("AZQ_DEBUG_LOG", str(tmp_path / "debug.log"))
    logging.getLogger().addHandler(logging.NullHandler())
    _setup_logging(verbose=False)
    logging.getLogger("azqemu.x").info("hello")
    assert "INFO hello" in (tmp_path / "debug.log").read_text()
