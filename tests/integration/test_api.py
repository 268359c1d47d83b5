"""The /v1 API of a real daemon: curl on the unix socket, the typed client, azq's exit codes,
template jobs, the event stream, and the opt-in TCP listener with a bearer token and TLS."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from azqemu import config as config_mod
from azqemu.client import Client
from azqemu.daemon import proc as daemonproc
from azqemu.errors import SandboxNotFound, TemplateExists, Unauthorized
from tests.support import services

pytestmark = [pytest.mark.vm, pytest.mark.root]


def curl(path: str, *args: str, url: str | None = None, sock: bool = True) -> tuple[int, Any]:
    """curl against the daemon: (HTTP status, JSON body or None)."""
    cmd = ["curl", "-sS", "-w", "\n%{http_code}"] + ([] if "-o" in args else ["-o", "-"])
    if url is None and sock:
        cmd += ["--unix-socket", str(config_mod.load().daemon_socket)]
    cmd += [*args, (url or "http://azq") + path]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    body, _, status = r.stdout.rpartition("\n")
    return int(status), (json.loads(body) if body.strip() else None)


def post(path: str, body: Any, *args: str, **kw: Any) -> tuple[int, Any]:
    return curl(path, "-X", "POST", "-H", "content-type: application/json", "-d", json.dumps(body), *args, **kw)


def test_curl_clone_exec_errors_and_destroy(template: str, azq: Any, tmp_path: Path) -> None:
    status, ping = curl("/v1/ping")
    assert status == 200 and ping["pid"] > 0 and ping["api"] == "v1"
    status, rows = post("/v1/sandboxes", {"template": template, "names": ["api-0"], "ram_mode": "cow"})
    assert status == 201 and [r["name"] for r in rows] == ["api-0"]
    try:
        status, listed = curl("/v1/sandboxes?template=" + template)
        assert status == 200 and "api-0" in {r["name"] for r in listed}
        assert all(r["state"] for r in listed)
        status, res = post("/v1/sandboxes/api-0/exec", {"argv": ["/bin/sh", "-c", "cat; echo err >&2; exit 3"],
                                                        "stdin_b64": base64.b64encode(b"hi\n").decode()})
        assert status == 200 and res["exit_code"] == 3
        assert base64.b64decode(res["stdout_b64"]) == b"hi\n" and base64.b64decode(res["stderr_b64"]) == b"err\n"
        # One typed error each: unknown sandbox, bad name, malformed body, wrong shape, oversized body.
        status, err = curl("/v1/sandboxes/nope")
        assert status == 404 and err["error"]["type"] == "SandboxNotFound" and err["error"]["fields"] == {"name": "nope"}
        status, err = post("/v1/sandboxes", {"template": "../etc"})
        assert status == 400 and err["error"]["type"] == "ConfigError" and err["error"]["exit_code"] == 2
        status, err = curl("/v1/sandboxes/api-0/exec", "-X", "POST", "-H", "content-type: application/json",
                           "-d", "{not json")
        assert status == 400 and err["error"]["type"] == "MalformedRequest"
        status, err = post("/v1/sandboxes/api-0/exec", {"argv": "true"})
        assert status == 422 and err["error"]["type"] == "RequestInvalid"
        big = tmp_path / "big.json"
        big.write_bytes(b"[" + b" " * (9 << 20) + b"]")
        status, err = curl("/v1/sandboxes", "-X", "POST", "-H", "content-type: application/json",
                           "--data-binary", f"@{big}")
        assert status == 413 and err["error"]["type"] == "PayloadTooLarge"
        # azq exec: the command's code, or its own 124-127 (README.md).
        assert azq("exec", "api-0", "--", "/bin/sh", "-c", "exit 3").returncode == 3
        assert azq("exec", "api-0", "--timeout", "1", "--", "sleep", "30").returncode == 124
        assert azq("exec", "api-0", "--", "/no/such/cmd").returncode in (126, 127)
        r = azq("exec", "nope", "--", "true")
        assert r.returncode == 125 and r.stderr.strip() == "azq: unknown sandbox 'nope'"
        r = azq("exec", "--json", "nope", "--", "true")
        assert r.returncode == 125 and json.loads(r.stdout)["error"]["type"] == "SandboxNotFound"
        r = azq("exec", "-i", "api-0", "--", "wc", "-c", input_="12345")
        assert r.returncode == 0 and r.stdout.strip() == "5"
    finally:
        status, _ = curl("/v1/sandboxes/api-0", "-X", "DELETE")
    assert status == 204
    with pytest.raises(SandboxNotFound):
        Client().dominfo("api-0")


def test_template_create_is_a_job(template: str, azq: Any) -> None:
    status, job = post("/v1/templates", {"name": template})
    assert status == 202 and job["kind"] == "template_create"
    assert job["state"] in ("running", "failed")   # TemplateExists comes at once
    status, done = curl(f"/v1/jobs/{job['id']}?wait=60")
    assert status == 200 and done["state"] == "failed"
    assert done["error"]["type"] == "TemplateExists" and done["error"]["fields"] == {"name": template}
    with pytest.raises(TemplateExists):
        Client().template_create(template)
    r = azq("template", "create", template, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["type"] == "TemplateExists"


def test_events_follow_streams_pause_and_resume(template: str) -> None:
    c = Client()
    since = time.time()
    (rec,) = c.clone(template, names=["ev-follow-0"])
    follower = subprocess.Popen([sys.executable, "-m", "azqemu", "events", "--follow", "--json",
                                 "--since", str(since)], stdout=subprocess.PIPE, text=True)
    try:
        c.pause(rec.name)
        c.resume(rec.name)
        seen: list[tuple[str, str]] = []
        deadline = time.monotonic() + 30
        assert follower.stdout is not None
        while time.monotonic() < deadline and ("ev-follow-0", "resumed") not in seen:
            line = follower.stdout.readline()
            if line.strip():
                e = json.loads(line)
                seen.append((e["sandbox"], e["event"]))
        assert ("ev-follow-0", "suspended") in seen and ("ev-follow-0", "resumed") in seen, seen
    finally:
        daemonproc.stop(follower)  # type: ignore[arg-type]
        c.destroy(rec.name)


def test_files_labels_and_ttl(template: str, azq: Any, tmp_path: Path) -> None:
    c = Client()
    r = azq("clone", template, "--name-prefix", "lbl-", "-n", "1", "--label", "task=42", "--label", "team=a",
            "--json", check=True)
    (row,) = json.loads(r.stdout)
    assert row["name"] == "lbl-0" and row["labels"] == {"task": "42", "team": "a"}
    try:
        payload = os.urandom(1 << 20)
        local = tmp_path / "in.bin"
        local.write_bytes(payload)
        t0 = time.monotonic()
        azq("cp", str(local), "lbl-0:/tmp/in.bin", check=True)
        print(f"\nazq cp of 1 MiB into the guest: {time.monotonic() - t0:.1f} s")
        assert c.get_file("lbl-0", "/tmp/in.bin") == payload
        status, _ = curl("/v1/sandboxes/lbl-0/files?path=/tmp/in.bin", "-o", str(tmp_path / "out.bin"))
        assert status == 200 and (tmp_path / "out.bin").read_bytes() == payload
        assert c.exec("lbl-0", ["md5sum", "/tmp/in.bin"]).stdout.split()[0].decode() == \
            __import__("hashlib").md5(payload).hexdigest()
        azq("cp", "lbl-0:/tmp/in.bin", str(tmp_path / "back.bin"), check=True)
        assert (tmp_path / "back.bin").read_bytes() == payload
        status, err = curl("/v1/sandboxes/lbl-0/files?path=/no/such/file")
        assert status == 404 and err["error"]["type"] == "GuestFileNotFound"
        assert c.exec("lbl-0", ["/bin/sh", "-c", "head -c 17000000 /dev/zero > /tmp/big"]).exit_code == 0
        status, err = curl("/v1/sandboxes/lbl-0/files?path=/tmp/big")
        assert status == 413 and err["error"]["type"] == "PayloadTooLarge"
        big = tmp_path / "big.bin"
        big.write_bytes(b"\0" * (17 << 20))
        status, err = curl("/v1/sandboxes/lbl-0/files?path=/tmp/x", "-X", "PUT", "--data-binary", f"@{big}")
        assert status == 413 and err["error"]["type"] == "PayloadTooLarge"
        # Labels: filters in the CLI and the API.
        listed = json.loads(azq("list", "--label", "task=42", "--json", check=True).stdout)
        assert [s["name"] for s in listed] == ["lbl-0"]
        assert json.loads(azq("list", "--label", "task=41", "--json", check=True).stdout) == []
        # A time to live: the reaper destroys the sandbox through the normal path.
        azq("tag", "lbl-0", "--ttl", "2", check=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "lbl-0" in {s.name for s in c.list_sandboxes()}:
            time.sleep(0.5)
        assert "lbl-0" not in {s.name for s in c.list_sandboxes()}
        assert not (config_mod.load().sandboxes_dir / "lbl-0.json").exists()
    finally:
        try:
            c.destroy("lbl-0")
        except SandboxNotFound:
            pass


def test_exec_stream(template: str) -> None:
    c = Client()
    (rec,) = c.clone(template, names=["xs-0"])
    try:
        events = list(c.exec_stream("xs-0", ["/bin/sh", "-c", "cat; sleep 6; echo err >&2; exit 4"], stdin=b"in\n"))
        kinds = [e["event"] for e in events]
        assert kinds[0] == "started" and "running" in kinds and kinds[-1] == "exit", kinds
        assert b"".join(e["data"] for e in events if e["event"] == "stdout") == b"in\n"
        assert b"".join(e["data"] for e in events if e["event"] == "stderr") == b"err\n"
        assert events[-1]["exit_code"] == 4 and events[-1]["duration_s"] >= 6
        status, err = post("/v1/sandboxes/nope/exec/stream", {"argv": ["true"]})
        assert status == 404 and err["error"]["type"] == "SandboxNotFound"
    finally:
        c.destroy(rec.name)


@pytest.fixture()
def tcp_daemon(daemon: dict, tmp_path: Path) -> Iterator[dict[str, Any]]:
    port = services.free_port()
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True, timeout=60)
    env = {"AZQ_API_ADDR": f"127.0.0.1:{port}", "AZQ_API_TOKEN_FILE": str(tmp_path / "token")}
    info = {"port": port, "token_file": tmp_path / "token", "cert": cert, "key": key}

    def restart(extra: dict[str, str]) -> None:
        daemonproc.stop(daemon["proc"])
        os.environ.update(extra)
        try:
            daemon["proc"] = daemonproc.start()
        finally:
            for k in extra:
                del os.environ[k]

    info["restart"] = lambda tls: restart(dict(env, AZQ_API_CERT=str(cert), AZQ_API_KEY=str(key)) if tls else env)
    try:
        yield info
    finally:
        daemonproc.stop(daemon["proc"])
        daemon["proc"] = daemonproc.start()


def test_tcp_listener_needs_the_token_and_speaks_tls(tcp_daemon: dict[str, Any]) -> None:
    tcp_daemon["restart"](False)
    token_file: Path = tcp_daemon["token_file"]
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    url = f"http://127.0.0.1:{tcp_daemon['port']}"
    status, err = curl("/v1/ping", url=url)
    assert status == 401 and err["error"]["type"] == "Unauthorized"
    status, err = curl("/v1/ping", "-H", "Authorization: Bearer not-the-token", url=url)
    assert status == 401 and err["error"]["type"] == "Unauthorized"
    status, ping = curl("/v1/ping", "-H", f"Authorization: Bearer {token}", url=url)
    assert status == 200 and ping["api"] == "v1"
    with Client(url=url, token=token) as c:
        assert c.list_sandboxes() is not None
    with pytest.raises(Unauthorized), Client(url=url, token="wrong-token-wrong-token") as c:
        c.ping()
    # The unix socket needs no token.
    assert curl("/v1/ping")[0] == 200

    tcp_daemon["restart"](True)
    https = f"https://127.0.0.1:{tcp_daemon['port']}"
    cacert = str(tcp_daemon["cert"])
    status, ping = curl("/v1/ping", "--cacert", cacert, "-H", f"Authorization: Bearer {token}", url=https)
    assert status == 200
    status, err = curl("/v1/ping", "--cacert", cacert, "-H", "Authorization: Bearer nope", url=https)
    assert status == 401 and err["error"]["type"] == "Unauthorized"
    with Client(url=https, token=token, verify=cacert) as c:   # closed: uvicorn waits for open TLS peers
        assert c.ping().pid > 0
