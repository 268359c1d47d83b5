"""libvirt lifecycle events: a sandbox destroyed with virsh is noticed at once (real libvirtd)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from azqemu.client import Client
from azqemu.errors import AzqemuError, SandboxNotFound
from azqemu.host.doctor import restore_mode

pytestmark = [pytest.mark.vm, pytest.mark.root]


def _wait_gone(c: Client, name: str, timeout_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if name not in {s.name for s in c.list_sandboxes()}:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{name} still listed {timeout_s:g} s after virsh destroy")


def test_virsh_destroy_is_noticed_at_once(template: str, azq) -> None:
    c = Client()
    lazy = restore_mode()[0] == "lazy"
    (rec,) = c.clone(template=template, count=1, name_prefix="ev-", ram_mode="lazy" if lazy else None)
    name = rec.name
    since = time.time() - 1
    try:
        if lazy:  # compressed: its pages in the store go too
            assert c.compress(name).stored_bytes > 0
        subprocess.run(["virsh", "-c", "qemu:///system", "destroy", name], check=True, capture_output=True)
        took = _wait_gone(c, name)
        assert took < 5
        events = [(e.sandbox, e.event, e.detail) for e in c.events(since=since)]
        assert (name, "stopped", "destroyed") in events
        assert (name, "released", "stopped-destroyed") in events
        r = azq("events", "--json", "--since", str(since))
        assert r.returncode == 0, r.stderr
        shown = [json.loads(line) for line in r.stdout.splitlines()]
        assert any((e["sandbox"], e["event"], e["detail"]) == (name, "stopped", "destroyed") for e in shown)
        with pytest.raises(SandboxNotFound) as err:
            c.dominfo(name=name)
        assert err.value.name == name
        # The name is free again at once (it used to be taken until a daemon restart).
        (again,) = c.clone(template=template, names=[name])
        assert again.name == name
        c.destroy(name=name)  # azqemu's own destroy: not a loss
        time.sleep(0.5)
        released = [e for e in c.events(since=since) if e.event == "released"]
        assert len(released) == 1
    finally:
        try:
            c.destroy(name=name)
        except AzqemuError:
            pass
