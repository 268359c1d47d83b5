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

from azqemu.client import Client
from azqemu.daemon import coldrule
from azqemu.daemon import proc as daemonproc
from azqemu.restore import native
from tests.support.guest import needs_lazy_restore, sh, start_checker, wait_rounds

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]


@pytest.fixture(autouse=True)
def _needs_lazy() -> None:
    needs_lazy_restore()


@pytest.mark.parametrize("ram_mode", ["lazy", "cow"])
def test_twenty_compress_resume_cycles_keep_guest_memory_exact(template: str, ram_mode: str) -> None:
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix=f"cyc{ram_mode}-", ram_mode=ram_mode)
    name = rec.name
    try:
        code, _ = sh(name, "head -c 20000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
        assert code == 0
        start_checker(name, 24, "a")
        rounds = wait_rounds(name, "a", 0)
        for cycle in range(20):
            st = c.compress(name=name)
            assert st.stored_pages > 0 and not st.cancelled
            info = c.dominfo(name)
            assert (info.state, info.domain_state) == ("compressed", "paused")   # lifecycle, libvirt
            if cycle % 2:
                c.resume(name=name, prefetch=cycle % 4 == 1)
            # Even cycles: exec resumes the compressed sandbox transparently.
            code, out = sh(name, "md5sum -c /tmp/blob.md5")
            assert code == 0, f"cycle {cycle}: {out}"
            rounds = wait_rounds(name, "a", rounds)
    finally:
        c.destroy(name=name)


@pytest.mark.parametrize("ram_mode", ["lazy", "cow"])
def test_incompressible_pages_are_not_tried_again_until_written(template: str, ram_mode: str) -> None:
    """Random bytes come out RAW and stay resident; the next compression leaves those the guest
    did not write untried, tries the rewritten ones again, and the guest's bytes stay exact."""
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix=f"raw{ram_mode}-", ram_mode=ram_mode)
    name = rec.name
    try:
        code, _ = sh(name, "head -c 8000000 /dev/urandom > /tmp/rand; md5sum /tmp/rand > /tmp/rand.md5")
        assert code == 0
        first = c.compress(name=name)                     # 8 MB of random bytes: 1,954 pages
        assert first.raw_pages >= 1900 and first.raw_untried_pages == 0, first
        c.resume(name=name, prefetch=True)
        second = c.compress(name=name)
        assert 1900 <= second.raw_untried_pages <= second.raw_pages, second
        c.resume(name=name, prefetch=True)
        code, _ = sh(name, "dd if=/dev/urandom of=/tmp/rand bs=1M count=4 conv=notrunc status=none && "
                           "md5sum /tmp/rand > /tmp/rand.md5")
        assert code == 0
        third = c.compress(name=name)                     # 4 MiB rewritten: 1,024 pages tried again
        assert third.raw_untried_pages <= second.raw_untried_pages - 900, (second, third)
        assert third.raw_pages >= 1900, third
        code, out = sh(name, "md5sum -c /tmp/rand.md5")   # every page, tried or not, exact
        assert code == 0, out
    finally:
        c.destroy(name=name)


def test_trim_in_a_tool_call_and_unchanged_pages_keep_guest_memory_exact(template: str) -> None:
    """A copy-on-write sandbox resumed with its hot set is trimmed while a guest program keeps
    changing and verifying its buffer: copies equal to their stored entries are dropped and
    served again on their next touch, pages written in the tool call and unchanged since the
    last trim are encoded and dropped, changed ones stay; the next compression encodes only
    what changed. The guest never sees a wrong byte."""
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix="trim-", ram_mode="cow")
    name = rec.name
    try:
        code, _ = sh(name, "head -c 16000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
        assert code == 0
        # A small buffer: the checker reads all of it every round, and dropped pages that
        # come back that often would (rightly) make the trim's rule wait longer.
        start_checker(name, 2, "t")
        rounds = wait_rounds(name, "t", 0)
        dropped, unchanged, encoded, stored, from_store = 0, 0, 0, 0, 0
        files = "/tmp/blob.md5 /tmp/cold*.md5"
        for cycle in range(6):
            st = c.compress(name=name)
            unchanged += st.unchanged_pages
            c.resume(name=name, prefetch=True)
            rounds = wait_rounds(name, "t", rounds)
            # Written in the tool call and left alone: encoded and dropped by the second trim
            # while the rule's age is the least (hex text: compressible, ~1,100 pages).
            code, _ = sh(name, f"head -c 1500000 /dev/urandom | od -An -tx1 > /tmp/cold{cycle}; "
                               f"md5sum /tmp/cold{cycle} > /tmp/cold{cycle}.md5")
            assert code == 0
            for _ in range(2):
                time.sleep(coldrule.AFTER_MIN_S + 0.5)   # left alone long enough to be cold
                t = c.trim(name=name)
                assert t is not None and t.dropped_pages <= t.resident_pages
                assert t.stored_pages <= t.encoded_pages and t.stored_pages <= t.dropped_pages
                dropped += t.dropped_pages
                encoded += t.encoded_pages
                stored += t.stored_pages
                rounds = wait_rounds(name, "t", rounds)
            r = c.exec(name=name, argv=["/bin/sh", "-c", f"md5sum -c {files}"])   # every dropped page back, exact
            assert r.exit_code == 0, f"cycle {cycle}: {r.stdout.decode()}"
            assert 0 <= r.faults_from_store <= r.faults, r
            from_store += r.faults_from_store
        assert dropped > 1000, dropped          # the blob's pages at least, after each resume
        assert unchanged > 1000, unchanged      # re-compressions skipped the pages left as stored
        # The first cold file at least (later ones wait for the rule's longer age, or for the
        # next compression); the blob's incompressible pages are not tried again (rawrecord.py).
        assert encoded >= stored > 900, (encoded, stored)
        # The dropped files read back came from the store (the C thread counts where from).
        assert from_store > 0 or not native.available(), from_store
        # Pages a trim dropped that the tool call reads again make the rule wait longer.
        c.compress(name=name)
        c.resume(name=name, prefetch=True)
        time.sleep(t.cold_after_s + 0.5)   # the rule as the last trim left it
        first = c.trim(name=name)
        assert first is not None and first.dropped_pages >= coldrule.JUDGE_PAGES, first
        code, out = sh(name, f"md5sum -c {files}")
        assert code == 0, out
        time.sleep(coldrule.AFTER_MIN_S + 0.5)
        second = c.trim(name=name)
        assert second is not None and second.cold_after_s > first.cold_after_s, (first, second)
        assert c.dominfo(name).state == "running"
    finally:
        c.destroy(name=name)


@pytest.mark.parametrize("ram_mode", ["lazy", "cow"])
def test_clone_rewrites_template_pages(template: str, ram_mode: str) -> None:
    """A clone reads template pages on first touch (lazy: copied in; copy-on-write: mapped
    from the template's page cache); its own writes win over them after a compression."""
    c = Client()
    rows = c.clone(template=template, count=2, name_prefix=f"rw{ram_mode}-", ram_mode=ram_mode)
    try:
        for r in rows:
            n = r.name
            # Rewrite memory the template had filled (page cache of the workspace, python).
            code, out = sh(n, f"cd /workspace/* && sed -i 's/def /def  /' *.py */*.py 2>/dev/null; "
                              f"python3 -m unittest -q 2>&1 | tail -1; echo {n} > /tmp/who")
            assert code == 0
        for r in rows:
            c.compress(name=r.name)
        for r in rows:
            n = r.name
            assert sh(n, "cat /tmp/who") == (0, n)
            code, out = sh(n, "cd /workspace/* && python3 -m unittest -q 2>&1 | tail -1")
            assert out == "OK", out
    finally:
        for r in rows:
            c.destroy(name=r.name)


@pytest.fixture(scope="module")
def template_2vcpu(daemon: object) -> str:
    Client().template_create(name="itest2", mem_mib=384, vcpus=2)
    return "itest2"


def test_two_vcpus_fault_at_once(template_2vcpu: str) -> None:
    c = Client()
    (rec,) = c.clone(template=template_2vcpu, count=1, name_prefix="smp-", ram_mode="lazy")
    name = rec.name
    try:
        assert sh(name, "nproc") == (0, "2")
        start_checker(name, 16, "x")
        start_checker(name, 16, "y")
        rx, ry = wait_rounds(name, "x", 0), wait_rounds(name, "y", 0)
        for _ in range(5):
            c.compress(name=name)
            c.resume(name=name, prefetch=False)  # every page faults, from both vCPUs
            rx, ry = wait_rounds(name, "x", rx), wait_rounds(name, "y", ry)
    finally:
        c.destroy(name=name)


def test_manager_killed_while_compressed_guest_waits_then_finishes(template: str, daemon: dict) -> None:
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix="kill-", ram_mode="lazy")
    name = rec.name
    try:
        start_checker(name, 24, "k")
        rounds = wait_rounds(name, "k", 0)
        c.compress(name=name)
        c.resume(name=name, prefetch=False)
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
        c.destroy(name=name)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_checker_detects_corruption_itself() -> None:
    """The checker is only worth something if it fails on wrong data: flip a byte."""
    seed = b"s"
    block = hashlib.sha256(seed + b"0:0").digest()
    assert hashlib.md5(block * 2048).digest() != hashlib.md5(bytes([block[0] ^ 1]) + block[1:] + block * 2047).digest()
