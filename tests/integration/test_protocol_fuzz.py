"""Bad API requests against a live daemon while compress, resume and exec act on the same sandbox.

Every bad request gets exactly one typed JSON error (ConfigError, MalformedRequest,
RequestInvalid, PayloadTooLarge, ApiNotFound, SandboxNotFound) with a 4xx status, never an
internal error; the daemon stays alive; nothing outside its state directory is touched; the
sandbox keeps working and its guest-visible bytes stay exact across the compress/resume cycles
that ran meanwhile.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from azqemu import config as config_mod
from azqemu.api.guard import MAX_BODY_BYTES
from azqemu.client import Client
from azqemu.daemon.memstats import CompressCancelled
from azqemu.errors import AzqemuError

pytestmark = [pytest.mark.vm, pytest.mark.root]

BAD_NAMES = ["/", "..", ".", "base/", "../../../tmp/azq-fuzz-sentinel", "a/b", "-x", "x" * 200,
             "é" * 100, "fz-0/../fz-0", "fz-0\n", ""]
# (method, path template, body keys the route takes)
ROUTES = [("DELETE", "/v1/sandboxes/{}", []), ("POST", "/v1/sandboxes/{}/exec", ["argv", "timeout_s", "stdin_b64"]),
          ("POST", "/v1/sandboxes/{}/compress", []), ("POST", "/v1/sandboxes/{}/resume", ["prefetch"]),
          ("POST", "/v1/sandboxes/{}/pause", []), ("GET", "/v1/sandboxes/{}", []),
          ("DELETE", "/v1/templates/{}", []), ("POST", "/v1/sandboxes/{}/phase", ["phase"]),
          ("GET", "/v1/sandboxes/{}/memstats", []), ("POST", "/v1/sandboxes", []), ("POST", "/v1/policy", []),
          ("POST", "/v1/templates", [])]
TYPED = {"ConfigError", "MalformedRequest", "RequestInvalid", "PayloadTooLarge", "ApiNotFound", "SandboxNotFound",
         "TemplateNotFound", "DomainStateError"}
REPLY_TIMEOUT_S = 120.0


def _seg(name: str) -> str:
    """A path segment with every byte percent-encoded: httpx would resolve '.' and '..' itself."""
    return "".join(f"%{b:02X}" for b in name.encode())


def _http() -> httpx.Client:
    path = str(config_mod.load().daemon_socket)
    return httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://azq", timeout=REPLY_TIMEOUT_S)


def _one_error(h: httpx.Client, method: str, path: str, **kw: Any) -> dict[str, Any]:
    r = h.request(method, path, **kw)
    assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert err["type"] in TYPED, (method, path, body)
    assert "\n" not in err["message"]
    return err


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40) | st.sampled_from(BAD_NAMES),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def sandbox(template: str) -> Any:
    c = Client()
    c.clone(template, names=["fz-0"], ram_mode="cow")
    c.exec("fz-0", ["/bin/sh", "-c", "head -c 8000000 /dev/urandom > /tmp/mark && md5sum /tmp/mark"])
    yield "fz-0"
    c.destroy("fz-0")


def test_bad_requests_while_the_sandbox_is_compressed_and_resumed(sandbox: str, tmp_path: Path) -> None:
    sentinel = Path("/tmp/azq-fuzz-sentinel")
    sentinel.write_text("untouched")
    want = Client().exec(sandbox, ["md5sum", "/tmp/mark"]).stdout
    stop = threading.Event()
    cycles, failures = [0], []

    def churn() -> None:
        c = Client()
        while not stop.is_set():
            try:
                c.compress(sandbox)
                c.resume(sandbox)
                r = c.exec(sandbox, ["md5sum", "/tmp/mark"])
                if r.stdout != want:
                    failures.append(r)
                cycles[0] += 1
            except CompressCancelled:
                continue                 # a fuzzed exec or resume of this sandbox came first
            except AzqemuError as exc:   # compress refused where lazy restore is unavailable
                failures.append(str(exc))
                return

    worker = threading.Thread(target=churn, daemon=True)
    worker.start()
    sent = 0
    js = {"content-type": "application/json"}
    h = _http()
    try:
        # Fixed cases first: the list.
        for body in [b"{not json", b"[" * 100000, b"\"just a string\"", b"{}", b'{"argv": 7}', b"[]",
                     b'{"argv": ["true"], "timeout_s": NaN}', b'{"argv": ["true"], "bogus": 1}',
                     b"\xff\xfe not utf-8"]:
            _one_error(h, "POST", f"/v1/sandboxes/{sandbox}/exec", content=body, headers=js)
            sent += 1
        _one_error(h, "POST", "/v1/sandboxes", json={"template": "itest", "count": 1e9})
        _one_error(h, "POST", "/v1/sandboxes", json={"template": "itest", "count": 10**9})
        _one_error(h, "GET", "/v1/__init__")
        _one_error(h, "POST", "/v1/sandboxes/nope/compress")
        sent += 4
        for method, path, _keys in ROUTES:
            if "{}" not in path:
                continue
            for bad in BAD_NAMES:
                _one_error(h, method, path.format(_seg(bad)), json={"argv": ["true"]}
                           if path.endswith("exec") else None)
                sent += 1
        # An over-long body is refused, once, without the daemon dying.
        err = _one_error(h, "POST", "/v1/sandboxes", content=b"[" + b" " * MAX_BODY_BYTES + b"]", headers=js)
        assert err["type"] == "PayloadTooLarge"
        sent += 1

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(route=st.sampled_from(ROUTES), name=st.sampled_from(BAD_NAMES + ["nope", sandbox]),
               body=st.dictionaries(st.sampled_from(["name", "names", "template", "count", "timeout_s", "argv",
                                                     "prefetch", "sharing_domain", "name_prefix", "grace_s",
                                                     "phase", "policy", "mem_mib"]), json_values, max_size=4))
        def fuzz(route: tuple[str, str, list[str]], name: str, body: dict[str, Any]) -> None:
            nonlocal sent
            method, path, _keys = route
            if name == sandbox and method == "DELETE" or name == sandbox and path.endswith("pause"):
                return   # valid requests that would end or stop the test's own sandbox
            if path in ("/v1/sandboxes", "/v1/templates"):
                body.pop("template", None)   # a valid clone or template request would make things
                body.pop("name", None)
            if path == "/v1/policy" and isinstance(body.get("names"), list) and sandbox in body["names"]:
                return
            try:
                content = json.dumps(body, allow_nan=True).encode()
            except ValueError:
                return
            r = h.request(method, path.format(_seg(name)), content=content, headers=js)
            sent += 1
            if r.status_code >= 400:
                err = r.json()["error"]
                assert "\n" not in err["message"]
                # A valid exec of a random command may fail in the guest (ExecError 502, AgentTimeout
                # 504): azqemu's own errors, typed; never an internal one.
                assert err["type"] != "InternalError" and r.status_code != 500, (method, path, name, body, err)

        fuzz()
    finally:
        stop.set()
        worker.join(300)
        h.close()
    assert not failures, failures[:3]
    assert cycles[0] >= 1
    assert Client().ping().pid > 0
    assert sentinel.read_text() == "untouched"
    sentinel.unlink()
    assert Client().exec(sandbox, ["md5sum", "/tmp/mark"]).stdout == want
    names = [s.name for s in Client().list_sandboxes()]
    assert sandbox in names and all(n == sandbox or not n.startswith("fz") for n in names)
    print(f"\nAPI fuzz: {sent} bad requests, {cycles[0]} compress/resume cycles, md5 of 8 MB intact")
