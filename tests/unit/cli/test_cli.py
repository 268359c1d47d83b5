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


@pytest.mark.parametrize("args", [["template", "list"], ["exec", "nope", "--", "true"], ["destroy", "nope"]])
def test_no_daemon_is_one_clear_line(tmp_path, args: list[str]) -> None:
    import os

    env = dict(os.environ, AZQ_RUN_DIR=str(tmp_path))
    r = azq(*args, env=env)
    assert r.returncode == (125 if args[0] == "exec" else 1)   # exec keeps 1-123 for the command
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


def test_version() -> None:
    from azqemu import __version__

    r = azq("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"azq {__version__}"


@pytest.mark.parametrize("args", [["template", "list", "--json"], ["dominfo", "x", "--json"],
                                  ["daemon", "status", "--json"],
                                  ["exec", "--json", "x", "--", "true"]])
def test_errors_are_json_under_json(tmp_path, args: list[str]) -> None:
    import json
    import os

    r = azq(*args, env=dict(os.environ, AZQ_RUN_DIR=str(tmp_path)))
    assert r.returncode == (125 if args[0] == "exec" else 1)
    err = json.loads(r.stdout)["error"]
    assert err["type"] == "DaemonUnavailable" and err["exit_code"] == r.returncode
    assert err["fields"] == {"socket_path": f"{tmp_path}/azqemu.sock"}
    assert r.stderr == ""


def test_every_command_that_prints_has_json() -> None:
    """--json on every command that prints a result (the daemon and the demo run in the foreground)."""
    import click

    from azqemu.cli import COMMANDS, LazyGroup, cli

    ctx = click.Context(cli)
    missing = []

    def walk(cmd: click.Command, path: str) -> None:
        if isinstance(cmd, click.Group):
            for name in (cmd.list_commands(ctx) if not isinstance(cmd, LazyGroup) else sorted(COMMANDS)):
                sub = cmd.get_command(ctx, name)
                if sub is not None:
                    walk(sub, f"{path} {name}".strip())
            return
        if not any("--json" in p.opts for p in cmd.params if isinstance(p, click.Option)):
            missing.append(path)

    walk(cli, "")
    assert sorted(missing) == sorted(EXEMPT_FROM_JSON), missing


# Commands that stream or run in the foreground rather than print one result.
EXEMPT_FROM_JSON = ["daemon run", "demo"]


def test_list_without_a_daemon_reads_the_records(tmp_path) -> None:
    """Read-only from the records and libvirt (none here: an empty state dir); where libvirt does
    not answer either, the daemon's absence is the error."""
    import json
    import os

    env = dict(os.environ, AZQ_RUN_DIR=str(tmp_path / "run"), AZQ_STATE_DIR=str(tmp_path / "state"))
    r = azq("list", "--json", env=env)
    if r.returncode == 0:
        assert json.loads(r.stdout) == []
        assert r.stderr.strip().endswith("listing from the records and libvirt (no memory figures)")
    else:
        assert r.returncode == 1 and json.loads(r.stdout)["error"]["type"] == "DaemonUnavailable"


@pytest.mark.parametrize(("cmd", "item", "message"), [
    ("density", "linux", "azq: policy grace 'linux': expected POLICY=SECONDS (for example linux=1.0)"),
    ("capacity", "none=1", "azq: a grace is given for none, which this run does not run"),
])
def test_a_bad_policy_grace_is_refused_before_any_daemon_starts(tmp_path, cmd: str, item: str, message: str) -> None:
    import os

    env = dict(os.environ, AZQ_RUN_DIR=str(tmp_path))
    r = azq("bench", cmd, "--policy", "linux", "--policy", "agentzip", "--policy-grace", item, env=env)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [message]
    assert not (tmp_path / "azqemu.sock").exists()       # no daemon was started for it
