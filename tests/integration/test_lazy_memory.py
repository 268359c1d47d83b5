"""Guest memory correctness across compress/resume, with real guests and the real export.

A program in the guest keeps a buffer of known content, keeps changing parts of it and
verifies all of it in a loop (guest_checker.py); a file in the guest's tmpfs is checked by
md5. Every cycle compresses the sandbox (its pages leave QEMU) and resumes it (hot pages
prefetched, the rest served on first touch).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from azqemu.daemon import proc as daemonproc
from azqemu.daemon.client import Client
from tests.support.guest import needs_lazy_restore, sh, start_checker, wait_rounds

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]


@pytest.fixture(autouse=True)
def _needs_lazy() -> None:
    needs_lazy_restore()


@pytest.mark.parametrize("ram_mode", ["lazy", "cow"])
def test_twenty_compress_resume_cycles_keep_guest_memory_exact(template: str, ram_mode: str) -> None:
    c = Client()
    (rec,) = c.call("clone", template=template, count=1, name_prefix=f"cyc{ram_mode}-", ram_mode=ram_mode)
    name = rec["name"]
    try:
        code, _ = sh(name, "head -c 20000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
        assert code == 0
        start_checker(name, 24, "a")
        rounds = wait_rounds(name, "a", 0)
        for cycle in range(20):
            st = c.call("compress", name=name)
            assert st["stored_pages"] > 0 and not st["cancelled"]
            assert c.call("dominfo", name=name)["state"] == "paused"
            if cycle % 2:
                c.call("resume", name=name, prefetch=cycle % 4 == 1)
            # Even cycles: exec resumes the compressed sandbox transparently.
            code, out = sh(name, "md5sum -c /tmp/blob.md5")
            assert code == 0, f"cycle {cycle}: {out}"
            rounds = wait_rounds(name, "a", rounds)
    finally:
        c.call("destroy", name=name)


def test_trim_in_a_tool_call_and_unchanged_pages_keep_guest_memory_exact(template: str) -> None:
    """A copy-on-write sandbox resumed with its hot set is trimmed while a guest program keeps
    changing and verifying its buffer: copies equal to their stored entries are dropped and
    served again on their next touch, changed ones stay; the next compression encodes only
    what changed. The guest never sees a wrong byte."""
    c = Client()
    (rec,) = c.call("clone", template=template, count=1, name_prefix="trim-", ram_mode="cow")
    name = rec["name"]
    try:
        code, _ = sh(name, "head -c 16000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
        assert code == 0
        start_checker(name, 16, "t")
        rounds = wait_rounds(name, "t", 0)
        dropped, unchanged = 0, 0
        for cycle in range(6):
            st = c.call("compress", name=name)
            unchanged += st["unchanged_pages"]
            c.call("resume", name=name, prefetch=True)
            rounds = wait_rounds(name, "t", rounds)
            for _ in range(2):
                t = c.call("trim", name=name)
                assert t is not None and t["dropped_pages"] <= t["resident_pages"]
                dropped += t["dropped_pages"]
                rounds = wait_rounds(name, "t", rounds)
                code, out = sh(name, "md5sum -c /tmp/blob.md5")
                assert code == 0, f"cycle {cycle}: {out}"
        assert dropped > 1000, dropped          # the blob's pages at least, after each resume
        assert unchanged > 1000, unchanged      # re-compressions skipped the pages left as stored
        assert c.call("dominfo", name=name)["state"] == "running"
    finally:
        c.call("destroy", name=name)


@pytest.mark.parametrize("ram_mode", ["lazy", "cow"])
def test_clone_rewrites_template_pages(template: str, ram_mode: str) -> None:
    """A clone reads template pages on first touch (lazy: copied in; copy-on-write: mapped
    from the template's page cache); its own writes win over them after a compression."""
    c = Client()
    rows = c.call("clone", template=template, count=2, name_prefix=f"rw{ram_mode}-", ram_mode=ram_mode)
    try:
        for r in rows:
            n = r["name"]
            # Rewrite memory the template had filled (page cache of the workspace, python).
            code, out = sh(n, f"cd /workspace/* && sed -i 's/def /def  /' *.py */*.py 2>/dev/null; "
                              f"python3 -m unittest -q 2>&1 | tail -1; echo {n} > /tmp/who")
            assert code == 0
        for r in rows:
            c.call("compress", name=r["name"])
        for r in rows:
            n = r["name"]
            assert sh(n, "cat /tmp/who") == (0, n)
            code, out = sh(n, "cd /workspace/* && python3 -m unittest -q 2>&1 | tail -1")
            assert out == "OK", out
    finally:
        for r in rows:
            c.call("destroy", name=r["name"])


@pytest.fixture(scope="module")
def template_2vcpu(daemon: object) -> str:
    Client().call("template_create", name="itest2", mem_mib=384, vcpus=2)
    return "itest2"


def test_two_vcpus_fault_at_once(template_2vcpu: str) -> None:
    c = Client()
    (rec,) = c.call("clone", template=template_2vcpu, count=1, name_prefix="smp-", ram_mode="lazy")
    name = rec["name"]
    try:
        assert sh(name, "nproc") == (0, "2")
        start_checker(name, 16, "x")
        start_checker(name, 16, "y")
        rx, ry = wait_rounds(name, "x", 0), wait_rounds(name, "y", 0)
        for _ in range(5):
            c.call("compress", name=name)
            c.call("resume", name=name, prefetch=False)  # every page faults, from both vCPUs
            rx, ry = wait_rounds(name, "x", rx), wait_rounds(name, "y", ry)
    finally:
        c.call("destroy", name=name)


def test_manager_killed_while_compressed_guest_waits_then_finishes(template: str, daemon: dict) -> None:
    c = Client()
    (rec,) = c.call("clone", template=template, count=1, name_prefix="kill-", ram_mode="lazy")
    name = rec["name"]
    try:
        start_checker(name, 24, "k")
        rounds = wait_rounds(name, "k", 0)
        c.call("compress", name=name)
        c.call("resume", name=name, prefetch=False)
        os.kill(daemon["proc"].pid, signal.SIGKILL)
        daemon["proc"].wait()
        # Nobody serves faults now: the guest must stall, not run on with zero pages.
        pid = int(Path(f"/run/libvirt/qemu/{name}.pid").read_text())
        cpu0 = _cpu_ticks(pid)
        time.sleep(3)
        cpu1 = _cpu_ticks(pid)
        assert cpu1 - cpu0 < 100, "the guest kept running with nobody serving its faults"
        daemon["proc"] = daemonproc.start()
        after = wait_rounds(name, "k", rounds, timeout_s=120)
        assert after > rounds
        assert sh(name, "echo alive") == (0, "alive")
    finally:
        c.call("destroy", name=name)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_checker_detects_corruption_itself() -> None:
    """The checker is only worth something if it fails on wrong data: flip a byte."""
    seed = b"s"
    block = hashlib.sha256(seed + b"0:0").digest()
    assert hashlib.md5(block * 2048).digest() != hashlib.md5(bytes([block[0] ^ 1]) + block[1:] + block * 2047).digest()
