"""Events of sandboxes (real libvirtd, real QEMU): a sandbox destroyed with virsh is noticed
at once (libvirt's lifecycle events), and azqemu's own events (created, phase, compress,
resume, destroyed) come out in order with their figures, through the client, ``azq events
--json`` and ``azq events --follow``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from azqemu.api.models import Event
from azqemu.client import Client
from azqemu.daemon import proc as daemonproc
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


OWN = ["created", "compress", "resume", "destroyed"]


def test_azqemu_publishes_its_own_events(template: str, azq) -> None:
    if restore_mode()[0] != "lazy":
        pytest.skip(f"compression needs userfaultfd and the export library: {restore_mode()[1]}")
    c = Client()
    name = "ev-own-0"
    since = time.time()
    follower = subprocess.Popen([sys.executable, "-m", "azqemu", "events", "--follow", "--json",
                                 "--since", str(since), "--sandbox", name, *(f"--event={k}" for k in OWN)],
                                stdout=subprocess.PIPE, text=True)
    followed: list[dict] = []

    def read() -> None:
        assert follower.stdout is not None
        for line in follower.stdout:
            if line.strip():
                followed.append(json.loads(line))
                if followed[-1]["event"] == "destroyed":
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        c.clone(template=template, names=[name], ram_mode="lazy")
        c.phase(name, "wait")
        comp = c.compress(name)
        assert not comp.cancelled and comp.stored_bytes > 0
        res = c.resume(name)
        c.destroy(name)

        got = c.events(since=since, sandbox=name)
        assert {e.sandbox for e in got} == {name}
        own = [e for e in got if e.source == "azqemu" and e.event in OWN]
        assert [(e.event, e.detail) for e in own] == [
            ("created", "lazy clone of itest"), ("compress", "done"), ("resume", "done"),
            ("destroyed", "by azqemu (was running)")], got
        created, compressed, resumed, destroyed = own
        assert created.template == template and created.ram_mode == "lazy" and 0 < (created.duration_s or 0) < 120
        assert compressed.stored_bytes == comp.stored_bytes and compressed.stored_pages == comp.stored_pages
        assert compressed.resident_pages == comp.resident_pages
        assert compressed.duration_s == pytest.approx(comp.total_s, abs=1e-3)
        assert resumed.prefetched_pages == res.prefetched_pages
        assert resumed.prefetched_bytes == res.prefetched_pages * 4096
        assert 0 <= (resumed.duration_s or 0) <= res.resume_s
        assert destroyed.state == "running" and destroyed.reason is None
        # The hint is a phase event, after the clone and before the compression it allowed.
        hinted = [e for e in got if e.event == "phase" and e.signal == "hint"]
        assert [(e.phase, e.detail) for e in hinted] == [("wait", "wait (hint)")]
        assert created.seq < hinted[0].seq < compressed.seq   # type: ignore[operator]
        # libvirt's own events are there too, told apart: the vCPUs continue after the hot set.
        libvirt = [e for e in got if e.source == "libvirt"]
        assert {"suspended", "resumed"} <= {e.event for e in libvirt}, libvirt
        vcpus_back = [e for e in libvirt if e.event == "resumed"]
        assert vcpus_back and vcpus_back[-1].seq > resumed.seq   # type: ignore[operator]
        # Filters are the daemon's: kinds.
        assert [e.event for e in c.events(since=since, sandbox=name, event=["compress", "resume"])] == [
            "compress", "resume"]

        # azq events --json: the same events, one object per line, absent fields left out.
        r = azq("events", "--json", "--since", str(since), "--sandbox", name)
        assert r.returncode == 0, r.stderr
        shown = [json.loads(line) for line in r.stdout.splitlines()]
        assert [e["seq"] for e in shown] == [e.seq for e in got]
        assert [Event.model_validate(e) for e in shown] == got
        assert "reason" not in next(e for e in shown if e["event"] == "compress")
        print(next(line for line in r.stdout.splitlines() if '"compress"' in line))
        # The readable form, with the figures.
        r = azq("events", "--since", str(since), "--sandbox", name)
        assert r.returncode == 0, r.stderr
        print(r.stdout)
        lines = r.stdout.splitlines()
        assert any(" azqemu " in ln and " compress " in ln and "stored " in ln for ln in lines), lines
        assert any(" libvirt " in ln and " suspended " in ln for ln in lines), lines

        # --follow saw the same four, filtered by the daemon.
        reader.join(30)
        assert [e["event"] for e in followed] == OWN, followed
        assert [e["seq"] for e in followed] == [e.seq for e in own]
    finally:
        daemonproc.stop(follower)  # type: ignore[arg-type]
        try:
            c.destroy(name=name)
        except AzqemuError:
            pass
