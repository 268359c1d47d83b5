"""The CLI's contract for bad input: one clear line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def azq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "azqemu", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_unknown_command_is_one_line_and_exit_2() -> None:
    r = azq("frobnicate")
    assert r.returncode == 2
    assert r.stderr.strip() == "azq: unknown command 'frobnicate' (see 'azq --help')"
    assert "Traceback" not in r.stderr


def test_help_lists_the_commands() -> None:
    r = azq("--help")
    assert r.returncode == 0
    for cmd in ("clone", "exec", "template", "doctor", "list", "destroy", "daemon"):
        assert cmd in r.stdout


@pytest.mark.parametrize("args", [["list"], ["exec", "nope", "--", "true"], ["destroy", "nope"]])
def test_no_daemon_is_one_clear_line(tmp_path, args: list[str]) -> None:
    import os

    env = dict(os.environ, AZQ_RUN_DIR=str(tmp_path))
    r = azq(*args, env=env)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines == [f"azq: no azqemu daemon at {tmp_path}/azqemu.sock (No such file or directory); "
                     "start it with 'azq daemon'"]


def test_bad_memory_size_is_a_usage_error(tmp_path) -> None:
    import os

    env = dict(os.environ, AZQ_RUN_DIR=str(tmp_path))
    r = azq("template", "create", "t", "--mem", "lots", env=env)
    assert r.returncode == 2
    assert "cannot read memory size 'lots'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
