"""A compressed copy-on-write clone's copies are counted once and that count is given back
while nothing that could change them moved (daemon/accounting.py, ``_still_copies``): it
equals what QEMU's page tables hold, read here from the test's side, and follows the guest
as soon as it runs, also when someone resumes the domain behind azqemu's back."""

from __future__ import annotations

import json
import time

import libvirt
import libvirt_qemu
import pytest

from azqemu.client import Client
from azqemu.daemon.accounting import Accounting
from tests.support.guest import needs_lazy_restore, sh

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]


def _owned_resident(c: Client, name: str) -> int:
    return int(c.owned([name]).sandboxes[name].resident_bytes)


def _guest_writes_behind_azqemu(dom: libvirt.virDomain, mib: int) -> None:
    """Run a writer in the guest through qemu-ga directly (not azq exec, which would resume
    through azqemu) and wait for it to end."""
    cmd = {"execute": "guest-exec", "arguments": {"path": "/bin/sh", "arg": [
        "-c", f"head -c {mib << 20} /dev/urandom > /tmp/behind && sync"]}}
    pid = json.loads(libvirt_qemu.qemuAgentCommand(dom, json.dumps(cmd), 30, 0))["return"]["pid"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = {"execute": "guest-exec-status", "arguments": {"pid": pid}}
        if json.loads(libvirt_qemu.qemuAgentCommand(dom, json.dumps(status), 30, 0))["return"]["exited"]:
            return
        time.sleep(0.2)
    raise AssertionError("the guest's writer did not end")


def test_a_compressed_clones_count_is_kept_while_paused_and_follows_the_guest(template: str, daemon: dict) -> None:
    needs_lazy_restore()
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix="ownedstill-", ram_mode="cow")
    name = rec.name
    conn = libvirt.open("qemu:///system")
    try:
        assert sh(name, "head -c 4000000 /dev/urandom > /tmp/kept")[0] == 0     # copies to keep (RAW)
        res = c.compress(name=name)
        pid = c.dominfo(name).qemu_pid
        assert pid
        # The compression's own figure (its incompressible copies, not scanned) is the scan's.
        assert res.raw_pages > 0 and res.resident_bytes == Accounting.ram_resident_bytes(pid, "cow")
        first = _owned_resident(c, name)
        assert first > 0
        for _ in range(3):
            assert _owned_resident(c, name) == first == Accounting.ram_resident_bytes(pid, "cow")
        # Resumed behind azqemu's back: the guest writes 16 MiB, and is paused again so that
        # both sides count the same page tables.
        dom = conn.lookupByName(name)
        dom.resume()
        _guest_writes_behind_azqemu(dom, 16)
        dom.suspend()
        after = _owned_resident(c, name)
        assert after == Accounting.ram_resident_bytes(pid, "cow")
        assert after >= first + (8 << 20)
    finally:
        c.destroy(name)
        conn.close()
