"""Operations: the daemon's one log file and the daemon line of ``azq doctor`` (real daemon)."""

from __future__ import annotations

import json

import pytest

from azqemu import config as config_mod
from azqemu.client import Client

pytestmark = pytest.mark.root


def test_doctor_names_the_daemon_that_answers(daemon: dict, azq) -> None:
    r = azq("doctor", "--json")
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    pid = Client().ping().pid
    assert checks["daemon"]["verdict"] == "ok", checks["daemon"]
    assert f"(pid {pid})" in checks["daemon"]["detail"]
    assert str(config_mod.load().daemon_socket) in checks["daemon"]["detail"]


def test_the_daemon_logs_info_lines_to_its_one_log(daemon: dict) -> None:
    cfg = config_mod.load()
    text = cfg.daemon_log.read_text()
    pid = Client().ping().pid
    assert f"INFO azqemu daemon {pid} serving /v1 on unix:{cfg.daemon_socket}" in text
    assert "INFO restore mode:" in text
    assert not (cfg.run_dir / "daemon.log").exists()   # the old second place
