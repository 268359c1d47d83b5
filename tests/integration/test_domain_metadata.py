"""State visible to libvirt tools: ``virsh dumpxml`` of a sandbox shows what azqemu knows."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from lxml import etree

from azqemu.client import Client
from azqemu.errors import AzqemuError
from azqemu.host.doctor import restore_mode
from azqemu.virt.host import AZQ_NS

pytestmark = [pytest.mark.vm, pytest.mark.root]


def _sandbox_meta(name: str) -> etree._Element:
    xml = subprocess.run(["virsh", "-c", "qemu:///system", "dumpxml", name], check=True,
                         capture_output=True, text=True).stdout
    elem = etree.fromstring(xml.encode()).find(f"metadata/{{{AZQ_NS}}}sandbox")
    assert elem is not None, xml
    return elem


def _wait_meta(name: str, timeout_s: float = 10.0, **want: str) -> etree._Element:
    """The metadata once it says ``want`` (it is written by a background thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        elem = _sandbox_meta(name)
        if all(elem.get(k.replace("_", "-")) == v for k, v in want.items()) or time.monotonic() > deadline:
            return elem
        time.sleep(0.1)


def test_virsh_dumpxml_shows_state_policy_stored_bytes_labels(template: str, azq) -> None:
    if restore_mode()[0] != "lazy":
        pytest.skip(f"compression needs lazy restore: {restore_mode()[1]}")
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix="meta-", ram_mode="lazy",
                     labels={"task": "42"})
    name = rec.name
    try:
        elem = _wait_meta(name, state="running")
        assert elem.get("state") == "running" and elem.get("compressed") == "no"
        assert elem.get("role") == "sandbox" and elem.get("template") == template   # kept
        assert elem.get("policy") == "manual"
        assert [(e.get("key"), e.get("value")) for e in elem.findall(f"{{{AZQ_NS}}}label")] == [("task", "42")]

        c.compress(name)
        elem = _wait_meta(name, state="compressed", compressed="yes")
        assert elem.get("state") == "compressed" and elem.get("compressed") == "yes"
        assert int(elem.get("stored-bytes") or 0) > 0
        r = azq("domstats", name, "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert (st["state"], st["compressed"], st["compress_count"]) == ("compressed", True, 1)
        assert st["stored_bytes"] > 0 and st["domain_state"] == "paused"

        c.resume(name)
        elem = _wait_meta(name, state="running")
        assert elem.get("state") == "running" and elem.get("compressed") == "no"
        assert elem.get("role") == "sandbox"
        st = json.loads(azq("domstats", name, "--json", check=True).stdout)
        assert (st["state"], st["restore_count"], st["domain_state"]) == ("running", 1, "running")
        text = azq("domstats", name, check=True).stdout
        assert text.startswith(f"Domain: '{name}'") and "  state=running" in text
    finally:
        try:
            c.destroy(name=name)
        except AzqemuError:
            pass
