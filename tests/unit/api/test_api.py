"""The /v1 API over HTTP on a unix socket, through the typed client and raw requests: typed
results, one typed error for each kind of bad input, jobs, the event stream, the OpenAPI
document, and the listener's own refusals (not root, busy, oversized)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from openapi_spec_validator import validate

from azqemu.api import models
from azqemu.api.app import make_app
from azqemu.api.guard import MAX_BODY_BYTES, MAX_EXEC_BODY_BYTES, Guard, Limiter
from azqemu.client import Client
from azqemu.daemon.manager import Manager
from azqemu.errors import (
    ConfigError,
    DaemonBusy,
    DaemonUnavailable,
    NotRoot,
    SandboxNotFound,
    TemplateExists,
    TemplateInUse,
)
from tests.unit.api.conftest import Served, serve_in_thread


def raw(served: Served, method: str, path: str, **kw: Any) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(served.socket_path)), base_url="http://azq") as h:
        return h.request(method, path, **kw)


def one_error(r: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"}
    err = models.ErrorInfo.model_validate(body["error"])
    assert err.type == type_, body
    assert "\n" not in err.message
    return body["error"]


def test_typed_results_through_the_client(served: Served) -> None:
    c = served.client
    p = c.ping()
    assert p.pid == os.getpid() and p.sandboxes == 1 and p.api == "v1"
    (row,) = c.list_sandboxes()
    assert isinstance(row, models.SandboxInfo) and (row.name, row.state, row.template) == ("a-0", "running", "base")
    assert c.list_sandboxes(state="paused") == [] and c.list_sandboxes(template="base")[0].name == "a-0"
    info = c.dominfo("a-0")
    assert info.name == "a-0" and info.compressed is False
    stats = c.domstats("a-0")
    assert isinstance(stats, models.DomStats) and (stats.name, stats.state) == ("a-0", "running")
    (t,) = c.template_list()
    assert (t.name, t.clones) == ("base", 1)
    owned = c.owned()
    assert set(owned.sandboxes) == {"a-0"} and owned.manager_rss_bytes > 0
    assert c.owned([]).sandboxes == {}
    assert c.phase("a-0", "wait").phase == "wait"
    c.pause("a-0")
    c.set_policy(["a-0"], "manual")


def test_extra_fields_the_daemon_adds_reach_the_client(served: Served) -> None:
    from azqemu.daemon.accounting import Accounting

    describe = Accounting.describe

    def more(self: Accounting, rec: Any) -> dict[str, Any]:
        return dict(describe(self, rec), failed_reason="a new field")

    served.manager.accounting.describe = more.__get__(served.manager.accounting)  # type: ignore[method-assign]
    (row,) = served.client.list_sandboxes()
    assert row.as_json()["failed_reason"] == "a new field"


def test_unknown_sandbox_is_a_404_and_the_same_error_on_the_client(served: Served) -> None:
    err = one_error(raw(served, "GET", "/v1/sandboxes/nope"), 404, "SandboxNotFound")
    assert err["fields"] == {"name": "nope"} and err["exit_code"] == 1
    with pytest.raises(SandboxNotFound) as exc:
        served.client.compress("nope")
    assert exc.value.name == "nope" and str(exc.value) == "unknown sandbox 'nope'"


def test_conflicts_are_409_with_fields(served: Served) -> None:
    err = one_error(raw(served, "DELETE", "/v1/templates/base"), 409, "TemplateInUse")
    assert err["fields"] == {"name": "base", "clones": ["a-0"]}
    with pytest.raises(TemplateInUse) as exc:
        served.client.template_delete("base")
    assert exc.value.clones == ["a-0"]


@pytest.mark.parametrize("name", ["x" * 65, "-x", ".hidden", "a b", "é"])
def test_bad_names_are_config_errors_on_both_sides(served: Served, name: str) -> None:
    with pytest.raises(ConfigError, match="invalid sandbox name"):
        served.client.destroy(name)
    one_error(raw(served, "POST", f"/v1/sandboxes/{name}/pause"), 400, "ConfigError")
    one_error(raw(served, "POST", "/v1/sandboxes", json={"template": name}), 400, "ConfigError")
    assert served.client.ping().sandboxes == 1


def test_malformed_and_misshapen_bodies(served: Served) -> None:
    js = {"content-type": "application/json"}
    one_error(raw(served, "POST", "/v1/sandboxes", content=b"{not json", headers=js), 400, "MalformedRequest")
    one_error(raw(served, "POST", "/v1/sandboxes", content=b"[" * 100000, headers=js), 400, "MalformedRequest")
    err = one_error(raw(served, "POST", "/v1/sandboxes", json={"template": "base", "count": "3"}), 422,
                    "RequestInvalid")
    assert err["fields"]["errors"][0]["loc"] == "body.count" and err["exit_code"] == 2
    one_error(raw(served, "POST", "/v1/sandboxes", json={"template": "base", "bogus": 1}), 422, "RequestInvalid")
    one_error(raw(served, "POST", "/v1/sandboxes", json=["base"]), 422, "RequestInvalid")
    one_error(raw(served, "POST", "/v1/sandboxes/a-0/exec", headers=js,
                  content=b'{"argv": ["true"], "timeout_s": NaN}'), 422, "RequestInvalid")
    one_error(raw(served, "POST", "/v1/sandboxes/a-0/exec", json={"argv": ["true"], "timeout_s": 1e12}), 400,
              "ConfigError")
    one_error(raw(served, "POST", "/v1/sandboxes", json={"template": "base", "count": 10**9}), 400, "ConfigError")
    one_error(raw(served, "GET", "/v1/nowhere"), 404, "ApiNotFound")
    one_error(raw(served, "PUT", "/v1/sandboxes/a-0"), 404, "ApiNotFound")


def test_oversized_bodies_are_413_before_and_while_reading(served: Served) -> None:
    js = {"content-type": "application/json"}
    err = one_error(raw(served, "POST", "/v1/sandboxes", content=b" " * (MAX_BODY_BYTES + 1), headers=js), 413,
                    "PayloadTooLarge")
    assert err["fields"] == {"limit_bytes": MAX_BODY_BYTES}

    def chunks() -> Any:
        for _ in range(MAX_EXEC_BODY_BYTES // (1 << 20) + 2):
            yield b" " * (1 << 20)

    one_error(raw(served, "POST", "/v1/sandboxes/a-0/exec", content=chunks(), headers=js), 413, "PayloadTooLarge")
    assert served.client.ping().pid == os.getpid()


def test_template_create_is_a_job(served: Served) -> None:
    r = raw(served, "POST", "/v1/templates", json={"name": "base"})
    assert r.status_code == 202
    job = models.Job.model_validate(r.json())
    assert job.kind == "template_create"
    done = models.Job.model_validate(raw(served, "GET", f"/v1/jobs/{job.id}", params={"wait": 10}).json())
    assert done.state == "failed" and done.error is not None and done.error.type == "TemplateExists"
    assert served.client.job(job.id).state == "failed"
    assert job.id in {j["id"] for j in raw(served, "GET", "/v1/jobs").json()}
    with pytest.raises(TemplateExists):
        served.client.template_create("base")
    one_error(raw(served, "GET", "/v1/jobs/nope"), 404, "ApiNotFound")
    one_error(raw(served, "POST", "/v1/templates", json={"name": "../x"}), 400, "ConfigError")


def test_events_stream_as_json_lines(served: Served) -> None:
    got: list[models.Event] = []

    def follow() -> None:
        for e in Client(served.socket_path).follow_events(since=0):
            got.append(e)
            if len(got) == 2:
                return

    served.manager.events.publish("a-0", "suspended", "paused", source="libvirt")
    t = threading.Thread(target=follow, daemon=True)
    t.start()
    time.sleep(0.5)
    served.manager.events.publish("a-0", "compress", "done", stored_bytes=8192, duration_s=0.5)
    t.join(10)
    assert [(e.sandbox, e.event, e.source) for e in got] == [("a-0", "suspended", "libvirt"),
                                                            ("a-0", "compress", "azqemu")]
    assert got[1].stored_bytes == 8192 and got[1].duration_s == 0.5 and got[1].reason is None
    assert [e.event for e in served.client.events(since=0)] == ["suspended", "compress"]
    # Absent fields are left out, not null (the route and the stream alike).
    body = raw(served, "GET", "/v1/events").json()
    assert body[0] == {"time": body[0]["time"], "seq": 1, "sandbox": "a-0", "event": "suspended",
                       "detail": "paused", "source": "libvirt"}


def test_events_filtered_by_sandbox_and_kind(served: Served) -> None:
    log = served.manager.events
    log.publish("a-0", "created", "eager clone of base")
    log.publish("b-0", "created", "eager clone of base")
    log.publish("a-0", "phase", "wait (hint)", phase="wait", signal="hint")
    log.publish("a-0", "destroyed", "by azqemu (was running)")
    c = served.client
    assert [e.event for e in c.events(sandbox="a-0")] == ["created", "phase", "destroyed"]
    assert [(e.sandbox, e.event) for e in c.events(event=["created", "destroyed"])] == [
        ("a-0", "created"), ("b-0", "created"), ("a-0", "destroyed")]
    assert [e.signal for e in c.events(sandbox="a-0", event=["phase"])] == ["hint"]
    got: list[models.Event] = []

    def follow() -> None:
        for e in Client(served.socket_path).follow_events(sandbox="b-0", event=["destroyed"]):
            got.append(e)
            return

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    time.sleep(0.3)
    log.publish("a-0", "destroyed", "by azqemu (was running)")     # another sandbox's: not sent
    log.publish("b-0", "compress", "done")                        # another kind: not sent
    log.publish("b-0", "destroyed", "by azqemu (was compressed)")
    t.join(10)
    assert [(e.sandbox, e.event, e.detail) for e in got] == [("b-0", "destroyed", "by azqemu (was compressed)")]
    deadline = time.monotonic() + 5      # the follower left: its stream stops waiting on the log
    while log._async_waiters and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not log._async_waiters
    one_error(raw(served, "GET", "/v1/events", params={"sandbox": "../x"}), 400, "ConfigError")
    one_error(raw(served, "GET", "/v1/events", params={"event": ["x" * 65]}), 400, "ConfigError")


def test_openapi_document_validates_and_covers_every_operation(served: Served) -> None:
    doc = raw(served, "GET", "/v1/openapi.json").json()
    validate(doc)
    paths = set(doc["paths"])
    assert all(p.startswith("/v1/") for p in paths)
    # Every manager operation has its route (events/owned/... by name; the rest under sandboxes).
    ops = {n[3:] for n in dir(Manager) if n.startswith("op_")}
    route_of = {"ping": "/v1/ping", "template_create": "/v1/templates", "template_list": "/v1/templates",
                "template_delete": "/v1/templates/{name}", "clone": "/v1/sandboxes", "list": "/v1/sandboxes",
                "dominfo": "/v1/sandboxes/{name}", "destroy": "/v1/sandboxes/{name}", "events": "/v1/events",
                "owned": "/v1/owned", "set_policy": "/v1/policy"}
    for op in ops:
        assert route_of.get(op, f"/v1/sandboxes/{{name}}/{op}") in paths, op
    err = doc["paths"]["/v1/sandboxes/{name}"]["get"]["responses"]["404"]
    assert err["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


def test_no_daemon_is_daemon_unavailable(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="No such file or directory"):
        Client(tmp_path / "none.sock").ping()
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(tmp_path / "dead.sock"))   # a file nobody listens on
    with pytest.raises(DaemonUnavailable, match="Connection refused"):
        Client(tmp_path / "dead.sock").ping()
    dead.close()


def test_busy_daemon_answers_503_daemon_busy(served: Served, tmp_path: Path) -> None:
    path = tmp_path / "busy.sock"
    with serve_in_thread(Guard(make_app(served.manager), limiter=Limiter(0)), path):
        with pytest.raises(DaemonBusy) as exc:
            Client(path).ping()
        assert exc.value.limit == 0 and exc.value.exit_code == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_a_peer_that_is_not_root_is_refused_by_its_credentials(served: Served) -> None:
    os.chmod(served.socket_path, 0o666)   # past the file mode: the credentials check must hold
    for d in (served.socket_path.parent, *served.socket_path.parents):
        if str(d) == "/":
            break
        os.chmod(d, os.stat(d).st_mode | 0o011)
    code = ("import httpx,sys; r=httpx.Client(transport=httpx.HTTPTransport(uds=sys.argv[1]))"
            ".get('http://x/v1/ping'); print(r.status_code, r.text)")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-c", code, str(served.socket_path)],
                         capture_output=True, text=True, timeout=60)
    status, _, body = out.stdout.strip().partition(" ")
    assert status == "403", out
    err = json.loads(body)["error"]
    assert err["type"] == NotRoot.__name__


def test_labels_filters_and_a_ttl_that_destroys_through_the_manager(served: Served) -> None:
    from azqemu.daemon.tags import TtlReaper

    c = served.client
    info = c.update("a-0", labels={"task": "42", "tenant": "acme"})
    assert info.labels == {"task": "42", "tenant": "acme"} and info.expires_at is None
    assert [r.name for r in c.list_sandboxes(label=["task=42"])] == ["a-0"]
    assert [r.name for r in c.list_sandboxes(label=["tenant"])] == ["a-0"]
    assert c.list_sandboxes(label=["task=41"]) == [] and c.list_sandboxes(label=["task=42", "x"]) == []
    assert c.update("a-0", labels={"tenant": ""}).labels == {"task": "42"}   # an empty value removes
    assert c.update("a-0", labels={"b": "1"}, replace_labels=True).labels == {"b": "1"}
    one_error(raw(served, "PATCH", "/v1/sandboxes/a-0", json={"labels": {"bad key": "x"}}), 400, "ConfigError")
    one_error(raw(served, "PATCH", "/v1/sandboxes/a-0", json={"ttl_s": -1}), 400, "ConfigError")
    one_error(raw(served, "GET", "/v1/sandboxes", params={"label": "=x"}), 400, "ConfigError")
    with pytest.raises(SandboxNotFound):
        c.update("nope", labels={"a": "b"})
    # Labels survive a new daemon: they are in the sandbox's record (and dominfo).
    from azqemu.daemon.tags import SandboxTags
    from azqemu.virt.clones import SandboxRepo

    assert SandboxRepo(served.manager.cfg).get("a-0").labels == {"b": "1"}
    assert SandboxTags(served.manager.registry).get("a-0")["labels"] == {"b": "1"}
    assert c.dominfo("a-0").labels == {"b": "1"} and c.list_sandboxes()[0].labels == {"b": "1"}
    info = c.update("a-0", ttl_s=0.2)
    assert info.expires_at is not None and info.expires_at > time.time()
    reaper = TtlReaper(served.tags, served.manager)
    assert reaper.reap() == []
    time.sleep(0.3)
    assert reaper.reap() == ["a-0"]
    assert c.list_sandboxes() == []
    with pytest.raises(SandboxNotFound):
        c.dominfo("a-0")


def test_file_paths_and_sizes_are_checked_before_the_guest(served: Served) -> None:
    from azqemu.daemon.files import MAX_FILE_BYTES

    one_error(raw(served, "GET", "/v1/sandboxes/a-0/files", params={"path": "relative"}), 400, "ConfigError")
    one_error(raw(served, "GET", "/v1/sandboxes/a-0/files"), 422, "RequestInvalid")
    one_error(raw(served, "PUT", "/v1/sandboxes/a-0/files", params={"path": "/tmp/x"},
                  content=b"x" * (MAX_FILE_BYTES + 1)), 413, "PayloadTooLarge")
    with pytest.raises(SandboxNotFound):
        served.client.put_file("nope", "/tmp/x", b"data")
