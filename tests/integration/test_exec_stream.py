"""Streamed exec against a real guest agent: output arrives while the command runs, exit codes
and stderr are kept, output past the cap is one typed error, a client that leaves stops the
command, and the guest keeps no output files. Then labels and TTLs across daemon restarts
(and the move from an older daemon's api-tags.json), and azq bench api against the daemon."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from azqemu import agent as agent_mod
from azqemu import config as config_mod
from azqemu.client import Client
from azqemu.daemon import proc as daemonproc
from azqemu.errors import ExecError, PayloadTooLarge, SandboxNotFound
from tests.support import daemonctl

pytestmark = [pytest.mark.vm, pytest.mark.root]

# What the guest's /run and /tmp hold of streamed execs (none, once each has ended).
LEFTOVERS = ["/bin/sh", "-c", "ls -a /run /tmp | grep -c '^azq-exec\\.' || true"]


@pytest.fixture()
def sandbox(template: str) -> Iterator[str]:
    c = Client()
    (rec,) = c.clone(template, names=["xstream-0"])
    try:
        yield rec.name
    finally:
        try:
            c.destroy(rec.name)
        except SandboxNotFound:
            pass


def timed_events(c: Client, name: str, argv: list[str], **kw: Any) -> list[tuple[float, dict[str, Any]]]:
    out = []
    for ev in c.exec_stream(name, argv, **kw):
        out.append((time.monotonic(), ev))
    return out


def leftovers(c: Client, name: str) -> int:
    return int(c.exec(name, LEFTOVERS).stdout.decode().strip() or 0)


def test_output_arrives_while_the_command_runs(sandbox: str) -> None:
    c = Client()
    t0 = time.monotonic()
    events = timed_events(c, sandbox, ["/bin/sh", "-c", "echo first; sleep 3; echo second; echo oops >&2; exit 5"])
    kinds = [e["event"] for _, e in events]
    assert kinds[0] == "started" and kinds[-1] == "exit", kinds
    t_first = next(t for t, e in events if e["event"] == "stdout")
    t_exit = events[-1][0]
    print(f"\nfirst line after {t_first - t0:.2f} s, exit after {t_exit - t0:.2f} s")
    # The first line came while the command slept: at least 2 of its 3 seconds before its end.
    assert t_exit - t_first >= 2.0, (t_first - t0, t_exit - t0)
    assert b"".join(e["data"] for _, e in events if e["event"] == "stdout") == b"first\nsecond\n"
    assert b"".join(e["data"] for _, e in events if e["event"] == "stderr") == b"oops\n"
    assert events[-1][1]["exit_code"] == 5 and events[-1][1]["duration_s"] >= 3
    # stdin still goes in; a command that cannot start is ExecError, as without streaming.
    ev = list(c.exec_stream(sandbox, ["wc", "-c"], stdin=b"12345"))
    assert b"".join(e["data"] for e in ev if e["event"] == "stdout").strip() == b"5" and ev[-1]["exit_code"] == 0
    with pytest.raises(ExecError, match="No such file or directory"):
        list(c.exec_stream(sandbox, ["/no/such/cmd"]))
    assert leftovers(c, sandbox) == 0


def test_azq_exec_streams_by_default_and_keeps_its_exit_codes(sandbox: str, azq: Any) -> None:
    r = azq("exec", sandbox, "--", "/bin/sh", "-c", "echo out; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    r = azq("exec", "--no-stream", sandbox, "--", "/bin/sh", "-c", "echo out; exit 4")
    assert (r.returncode, r.stdout) == (4, "out\n")
    assert azq("exec", "--timeout", "1", sandbox, "--", "sleep", "30").returncode == 124
    r = azq("exec", sandbox, "--", "/no/such/cmd")
    assert r.returncode == 127 and r.stderr.startswith("azq: cannot run '/no/such/cmd'")
    assert azq("exec", sandbox, "--", "/etc/passwd").returncode == 126
    r = azq("exec", "-i", sandbox, "--", "wc", "-c", input_="abc")
    assert (r.returncode, r.stdout.strip()) == (0, "3")
    r = azq("exec", "nope", "--", "true")
    assert r.returncode == 125 and r.stderr.strip() == "azq: unknown sandbox 'nope'"
    assert leftovers(Client(), sandbox) == 0


def test_output_past_the_cap_is_one_typed_error_and_the_command_is_killed(sandbox: str, azq: Any) -> None:
    c = Client()
    cap = agent_mod.MAX_STREAM_OUTPUT_BYTES
    got = 0
    t0 = time.monotonic()
    with pytest.raises(PayloadTooLarge) as exc:
        for ev in c.exec_stream(sandbox, ["/bin/sh", "-c", f"head -c {cap + (1 << 20)} /dev/zero; sleep 60"]):
            got += len(ev.get("data", b""))
    print(f"\n{got} bytes streamed in {time.monotonic() - t0:.1f} s before the cap")
    assert exc.value.limit_bytes == cap and got == cap
    assert "larger than its limit" in str(exc.value)
    r = azq("exec", sandbox, "--", "head", "-c", str(cap + 1), "/dev/zero")
    assert r.returncode == 125 and "larger than its limit" in r.stderr
    assert c.exec(sandbox, ["/bin/sh", "-c", "pgrep -x head || pgrep -x sleep || true"]).stdout == b""
    assert leftovers(c, sandbox) == 0


def test_a_client_that_leaves_stops_the_command(sandbox: str) -> None:
    c = Client()
    events = c.exec_stream(sandbox, ["yes"])
    for ev in events:
        if ev["event"] == "stdout":
            break
    events.close()   # type: ignore[attr-defined]
    c.close()
    c = Client()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and c.exec(sandbox, ["/bin/sh", "-c", "pgrep -x yes || true"]).stdout:
        time.sleep(0.5)
    assert c.exec(sandbox, ["/bin/sh", "-c", "pgrep -x yes || true"]).stdout == b""
    assert leftovers(c, sandbox) == 0


def test_labels_and_ttl_survive_restarts_and_api_tags_json_moves_into_the_records(
        daemon: dict, template: str, azq: Any) -> None:
    c = Client()
    (rec,) = c.clone(template, names=["xlabels-0"])
    cfg = config_mod.load()
    legacy = cfg.state_dir / "api-tags.json"
    try:
        # An older daemon's file: moved into the record at the next start, then gone.
        daemonproc.stop(daemon["proc"])
        legacy.write_text(json.dumps({rec.name: {"labels": {"task": "41"}, "expires_at": None},
                                      "gone-0": {"labels": {"x": "1"}, "expires_at": None}}))
        daemon["proc"] = daemonctl.start()
        assert not legacy.exists()
        assert Client().dominfo(rec.name).labels == {"task": "41"}
        # Labels and a TTL set now survive a restart: in the record, dominfo, list --label.
        expires = Client().update(rec.name, labels={"task": "42", "team": "a"}, ttl_s=3600).expires_at
        daemonctl.restart(daemon)
        c = Client()
        info = c.dominfo(rec.name)
        assert info.labels == {"task": "42", "team": "a"} and info.expires_at == pytest.approx(expires)
        assert json.loads((cfg.sandboxes_dir / f"{rec.name}.json").read_text())["labels"] == info.labels
        r = json.loads(azq("dominfo", rec.name, "--json", check=True).stdout)
        assert r["labels"] == {"task": "42", "team": "a"}
        assert [s["name"] for s in json.loads(azq("list", "--label", "task=42", "--json", check=True).stdout)] \
            == [rec.name]
        # The reaper still works from the records: a short TTL destroys it.
        c.update(rec.name, ttl_s=1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and rec.name in {s.name for s in c.list_sandboxes()}:
            time.sleep(0.5)
        assert rec.name not in {s.name for s in c.list_sandboxes()}
    finally:
        legacy.unlink(missing_ok=True)
        try:
            Client().destroy(rec.name)
        except SandboxNotFound:
            pass


def test_bench_api_against_the_daemon(sandbox: str, azq: Any) -> None:
    from azqemu.bench import api_bench

    res = api_bench.run(clients=4, duration_s=1.0, warmup_s=0.2)
    assert set(res) == {"benchmark", "version", "where", "daemon_pid", "clients", "duration_s", "warmup_s",
                        "sandbox", "requests", "ok", "errors", "error_types", "requests_per_s", "latency_ms",
                        "endpoints"}
    assert res["sandbox"] is not None and res["requests"] > 0 and res["errors"] == 0
    assert set(res["latency_ms"]) == {"median", "p95", "p99", "max", "mean"}
    assert set(res["endpoints"]) == {"GET /v1/ping", "GET /v1/sandboxes", "GET /v1/templates",
                                     "GET /v1/sandboxes/{name}", "GET /v1/sandboxes/{name}/domstats"}
    for row in res["endpoints"].values():
        assert set(row) == {"requests", "ok", "errors", "error_types", "requests_per_s", "latency_ms"}
        assert row["ok"] > 0 and 0 < row["latency_ms"]["median"] <= row["latency_ms"]["p99"]
    print("\n" + api_bench.table(res))
    r = azq("bench", "api", "--json", "-c", "2", "-d", "0.5", "--sandbox", sandbox)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sandbox"] == sandbox
    r = azq("bench", "api", "-c", "0")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    r = azq("bench", "api", "--sandbox", "nope", "-d", "0.5")
    assert r.returncode == 1 and r.stderr.strip() == "azq: unknown sandbox 'nope'"
