"""Bad requests against a live daemon while compress, resume and exec act on the same sandbox.

Every request gets exactly one reply line; bad ones a ProtocolError or ConfigError; the daemon
stays alive; nothing outside its state directory is touched; the sandbox keeps working and its
guest-visible bytes stay exact across the compress/resume cycles that ran meanwhile.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from azqemu import config as config_mod
from azqemu.daemon.client import Client
from azqemu.errors import AzqemuError

pytestmark = [pytest.mark.vm, pytest.mark.root]

BAD_NAMES = ["/", "..", ".", "base/", "../../../tmp/azq-fuzz-sentinel", "a/b", "-x", "x" * 200,
             "é" * 100, "fz-0/../fz-0", "fz-0\n", ""]
OPS = ["destroy", "exec", "compress", "resume", "pause", "dominfo", "template_delete", "phase", "clone",
       "memstats", "set_policy"]
REPLY_TIMEOUT_S = 120.0


def _raw(line: bytes) -> list[bytes]:
    """Send one raw request line; return every reply line the daemon sent before closing."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(REPLY_TIMEOUT_S)
    sock.connect(str(config_mod.load().daemon_socket))
    with sock:
        sock.sendall(line)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.splitlines()


def _one_error(line: bytes) -> dict:
    replies = _raw(line)
    assert len(replies) == 1, replies
    reply = json.loads(replies[0])
    assert reply["ok"] is False, reply
    assert reply["error"]["type"] in ("ProtocolError", "ConfigError"), reply
    assert "\n" not in reply["error"]["message"]
    return reply


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40) | st.sampled_from(BAD_NAMES),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def sandbox(template: str) -> str:
    Client().call("clone", template=template, names=["fz-0"], ram_mode="cow")
    Client().call("exec", name="fz-0", argv=["/bin/sh", "-c",
                                             "head -c 8000000 /dev/urandom > /tmp/mark && md5sum /tmp/mark"])
    yield "fz-0"
    Client().call("destroy", name="fz-0")


def test_bad_requests_while_the_sandbox_is_compressed_and_resumed(sandbox: str, tmp_path: Path) -> None:
    sentinel = Path("/tmp/azq-fuzz-sentinel")
    sentinel.write_text("untouched")
    want = Client().call("exec", name=sandbox, argv=["md5sum", "/tmp/mark"])["stdout_b64"]
    stop = threading.Event()
    cycles, failures = [0], []

    def churn() -> None:
        c = Client()
        while not stop.is_set():
            try:
                c.call("compress", name=sandbox)
                c.call("resume", name=sandbox)
                r = c.call("exec", name=sandbox, argv=["md5sum", "/tmp/mark"])
                if r["stdout_b64"] != want:
                    failures.append(r)
                cycles[0] += 1
            except AzqemuError as exc:   # compress refused where lazy restore is unavailable
                failures.append(str(exc))
                return

    worker = threading.Thread(target=churn, daemon=True)
    worker.start()
    sent = 0
    try:
        # Fixed cases first: the list.
        for line in [b"{not json\n", b"[" * 100000 + b"\n", b"\"just a string\"\n", b"{}\n",
                     b'{"op": 7}\n', b'{"op": "exec", "args": []}\n', b'{"op": "\\u00e9x\\u00e9c"}\n',
                     b'{"op": "exec", "args": {"name": "fz-0", "argv": ["true"], "timeout_s": NaN}}\n',
                     b'{"op": "clone", "args": {"template": "itest", "count": 1e9}}\n',
                     b'{"op": "__init__", "args": {}}\n', b'{"op": "exec", "args": {"bogus": 1}}\n']:
            _one_error(line)
            sent += 1
        for op in OPS:
            for bad in BAD_NAMES:
                _one_error(json.dumps({"op": op, "args": {"name": bad}}).encode() + b"\n")
                sent += 1
        # An over-long line (above the 64 MiB limit) is refused, once, without the daemon dying.
        replies = _raw(b'{"op": "list", "x": "' + b"a" * ((64 << 20) + 16) + b'"}\n')
        assert len(replies) == 1 and json.loads(replies[0])["error"]["type"] == "ProtocolError"
        sent += 1

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(op=st.sampled_from(OPS), args=st.dictionaries(
            st.sampled_from(["name", "names", "template", "count", "timeout_s", "argv", "prefetch",
                             "sharing_domain", "name_prefix", "grace_s", "phase"]), json_values, max_size=4))
        def fuzz(op: str, args: dict) -> None:
            nonlocal sent
            if op in ("destroy", "template_delete", "clone", "pause") and args.get("name") in (sandbox, "itest"):
                return   # valid requests that would end the test's own sandbox or template
            if op == "clone" and "template" in args:
                return   # a valid clone request would make sandboxes
            replies = _raw(json.dumps({"op": op, "args": args}).encode() + b"\n")
            sent += 1
            assert len(replies) == 1, replies
            reply = json.loads(replies[0])
            if not reply["ok"]:
                assert "\n" not in reply["error"]["message"]
                assert reply["error"]["type"] != "InternalError", reply

        fuzz()
    finally:
        stop.set()
        worker.join(300)
    assert not failures, failures[:3]
    assert cycles[0] >= 1
    assert Client().call("ping")["pid"] > 0
    assert sentinel.read_text() == "untouched"
    sentinel.unlink()
    assert Client().call("exec", name=sandbox, argv=["md5sum", "/tmp/mark"])["stdout_b64"] == want
    names = [s["name"] for s in Client().call("list")]
    assert sandbox in names and all(n == sandbox or not n.startswith("fz") for n in names)
    print(f"\nprotocol fuzz: {sent} bad requests, {cycles[0]} compress/resume cycles, md5 of 8 MB intact")
