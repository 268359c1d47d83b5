"""Tenants never see each other's pages through a reused name, and a template made again under
the same name never decodes a clone against the old image (issue 11), with real guests.

What a guest could read is read the way QEMU reads it: ``pmemsave`` over QMP dumps guest
physical memory through QEMU's own mapping, so every page not resident comes through the
manager's fault handler exactly as a vCPU would get it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from azqemu import config as config_mod
from azqemu.client import Client
from azqemu.errors import SandboxNotFound, TemplateInUse
from azqemu.memory.persist import STORE_FILE, read_store
from tests.support.daemonctl import restart
from tests.support.guest import needs_lazy_restore, sh, start_checker, wait_rounds

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]

# Guest memory read per pmemsave (a file on /dev/shm that QEMU writes, scanned and replaced).
DUMP_CHUNK_BYTES = 64 << 20
TOTALS = {"bytes_scanned": 0, "marker_hits_in_other_tenant": 0}


@pytest.fixture(autouse=True)
def _needs_lazy() -> None:
    needs_lazy_restore()


def _qmp(name: str, command: dict) -> dict:
    import libvirt
    import libvirt_qemu

    conn = libvirt.open("qemu:///system")
    try:
        out = libvirt_qemu.qemuMonitorCommand(conn.lookupByName(name), json.dumps(command), 0)
    finally:
        conn.close()
    return json.loads(out)


def _guest_memory_holds(name: str, marker: bytes, mem_bytes: int) -> bool:
    """Whether ``marker`` occurs anywhere in the guest's physical memory as QEMU reads it."""
    work = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="azq-pmem-"))
    os.chmod(work, 0o777)            # QEMU (libvirt-qemu) writes the dump
    dump = work / "ram"
    try:
        for gpa in range(0, mem_bytes, DUMP_CHUNK_BYTES):
            reply = _qmp(name, {"execute": "pmemsave",
                                "arguments": {"val": gpa, "size": DUMP_CHUNK_BYTES, "filename": str(dump)}})
            assert "error" not in reply, reply
            data = dump.read_bytes()
            TOTALS["bytes_scanned"] += len(data)
            if marker in data:
                return True
        return False
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _store_names() -> tuple[set[str], set[str], dict[str, dict], set[str]]:
    """(sandboxes, tombstones, rows by name, sharing domains) of the store's durable generation."""
    path = config_mod.load().shm_dir / "store" / STORE_FILE
    if not path.exists():
        return set(), set(), {}, set()
    meta, _ = read_store(path)
    rows = {str(s["name"]): s for s in meta.get("sandboxes", [])}
    return set(rows), set(meta.get("tombstones", {})), rows, {str(d["name"]) for d in meta.get("domains", [])}


def _wait_gone(c: Client, name: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            c.dominfo(name)
        except SandboxNotFound:
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} did not go away after its guest powered off")


def test_a_reused_name_in_another_tenant_never_reads_the_old_pages(template: str, daemon: dict) -> None:
    c = Client()
    name = "x-0"
    marker = f"AZQ-TENANT-A-{secrets.token_hex(12)}-".encode()
    # Tenant A: a marker in guest memory (tmpfs), compressed into the store, resumed without
    # prefetch (its pages stay in the store), then the guest powers itself off.
    (a,) = c.clone(template=template, names=[name], sharing_domain="tenantA", ram_mode="lazy")
    mem_bytes = int(c.dominfo(name).mem_mib) << 20
    try:
        code, _ = sh(name, f"python3 -c \"import sys; sys.stdout.write('{marker.decode()}' * 131072)\" "
                           f"> /tmp/marker; sync")
        assert code == 0
        assert _guest_memory_holds(name, marker, mem_bytes)        # the check can see it
        st = c.compress(name=name)
        assert st.stored_pages > 0
        names, _, rows, _ = _store_names()
        assert name in names and rows[name]["domain"].startswith("tenantA@") and rows[name]["owner"] == a.uuid
        c.resume(name=name, prefetch=False)
        code, _ = sh(name, "(sleep 1; echo o > /proc/sysrq-trigger) >/dev/null 2>&1 &")
        assert code == 0
        _wait_gone(c, name)
    except BaseException:
        with contextlib.suppress(Exception):
            c.destroy(name=name)
        raise
    restart(daemon)
    names, tombstones, _, _ = _store_names()
    assert name not in names and name not in tombstones          # nothing of A's x-0 is left

    # Tenant B: the same name, a new domain; compressed and read back in full.
    (b,) = c.clone(template=template, names=[name], sharing_domain="tenantB", ram_mode="lazy")
    try:
        assert b.uuid != a.uuid
        assert sh(name, "test -e /tmp/marker; echo $?") == (0, "1")
        st = c.compress(name=name)
        assert st.stored_pages > 0 and not st.cancelled
        names, _, rows, _ = _store_names()
        assert rows[name]["domain"].startswith("tenantB@") and rows[name]["owner"] == b.uuid
        hit = _guest_memory_holds(name, marker, mem_bytes)       # served from B's entries only
        TOTALS["marker_hits_in_other_tenant"] += hit
        assert not hit, "tenant B read tenant A's marker"
        c.resume(name=name, prefetch=False)
        assert sh(name, "test -e /tmp/marker; echo $?") == (0, "1")
        assert sh(name, "cd /workspace/* && python3 -m unittest -q 2>&1 | tail -1")[1] == "OK"
        print(f"\nname reuse across tenants: {TOTALS}")
    finally:
        c.destroy(name=name)
    names, tombstones, _, domains = _store_names()
    assert name not in names
    # The domain is gone: its tombstone too, and tenant B's sharing domain with its last sandbox
    # (a daemon that runs for weeks keeps no record of either).
    assert name not in tombstones
    assert not any(d.startswith("tenantB@") for d in domains)


def test_template_made_again_under_its_name_never_mixes_images(daemon: dict) -> None:
    """A copy-on-write clone of template ``itre`` (first image) is compressed, which loads the
    image into the manager's template cache; the clone goes, the template is deleted (refused
    while the clone existed) and made again with other content under the same name; a new
    copy-on-write clone under the old clone's name compresses and resumes with every byte
    exact: the manager never classifies against, or maps back from, the old image."""
    c = Client()
    tname, cname = "itre", "re-0"
    warm = "head -c 24000000 /dev/urandom > /tmp/warm; md5sum /tmp/warm > /tmp/warm.md5"
    c.template_create(tname, mem_mib=384, vcpus=1, warmup=[warm])
    try:
        c.clone(template=tname, names=[cname], ram_mode="cow")
        try:
            code, v1 = sh(cname, "cat /tmp/warm.md5")
            assert code == 0
            c.compress(name=cname)
            c.resume(name=cname, prefetch=True)
            assert sh(cname, "md5sum -c /tmp/warm.md5")[0] == 0
            with pytest.raises(TemplateInUse):
                c.template_delete(tname)
        finally:
            c.destroy(name=cname)
        c.template_delete(tname)
        c.template_create(tname, mem_mib=384, vcpus=1, warmup=[warm])
        (rec,) = c.clone(template=tname, names=[cname], ram_mode="cow")
        code, v2 = sh(cname, "cat /tmp/warm.md5")
        assert code == 0 and v2 != v1                 # another image under the same name
        code, _ = sh(cname, "head -c 16000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
        assert code == 0
        start_checker(cname, 16, "t")
        rounds = wait_rounds(cname, "t", 0)
        for cycle in range(4):
            st = c.compress(name=cname)
            assert st.stored_pages > 0 and not st.cancelled
            c.resume(name=cname, prefetch=cycle % 2 == 0)
            code, out = sh(cname, "md5sum -c /tmp/warm.md5 /tmp/blob.md5")
            assert code == 0, f"cycle {cycle}: {out}"
            rounds = wait_rounds(cname, "t", rounds)
        assert sh(cname, "cd /workspace/* 2>/dev/null && ls >/dev/null; echo ok")[1] == "ok"
    finally:
        with contextlib.suppress(SandboxNotFound):
            c.destroy(name=cname)
        with contextlib.suppress(Exception):
            c.template_delete(tname)
