"""A compression cancelled in the middle of its encoding (as a resume that arrives during it
cancels it) drops nothing and keeps the entries it made (SandboxMemory._keep_entries): the
next trim drops the copies still equal to them without encoding them again, after committing
them, and the guest's bytes stay exact across that drop, a manager restart and a full
compress/resume cycle. Before, the store forgot them and the CPU spent on them was lost.
A manager killed inside a trim's pause leaves a sandbox its successor continues."""

from __future__ import annotations

import signal

import pytest

from azqemu.client import Client
from azqemu.daemon import proc as daemonproc
from azqemu.errors import AzqemuError
from tests.support.daemonctl import restart as _restart
from tests.support.daemonctl import start as _start
from tests.support.guest import blob_and_checker, md5_ok, needs_lazy_restore, wait_rounds

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]

# The compression is cancelled before its second chunk of pages (ramscan.CHUNK_PAGES each):
# the first chunk's entries are made by then.
CANCEL_AT = "encode-chunk@2"


def test_a_cancelled_compression_keeps_its_entries_and_the_guest_its_bytes(template: str, daemon: dict) -> None:
    needs_lazy_restore()
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix="cancelkeep-", ram_mode="cow")
    name = rec.name
    try:
        rounds = blob_and_checker(name, 24, "k")
        _restart(daemon, fail_at=CANCEL_AT)
        with pytest.raises(AzqemuError, match="cancelled"):
            c.compress(name=name)
        assert c.dominfo(name=name).state == "running"
        md5_ok(name)
        rounds = wait_rounds(name, "k", rounds)

        # The first trim has no history of the copies: it drops only those equal to entries,
        # i.e. what the cancelled compression encoded and the guest has not written since
        # (and the zero copies, which every trim encodes as ZERO, free, and drops; one the guest
        # writes meanwhile stays: changed_pages).
        t = c.trim(name=name)
        assert t is not None and t.dropped_pages > t.zero_pages and t.stored_pages == 0, t
        assert t.zero_pages <= t.encoded_pages <= t.zero_pages + t.changed_pages, t
        # Committed before that drop: a manager killed now (nothing flushed after the drop)
        # serves those pages from the store, never from the template they no longer equal.
        daemon["proc"].send_signal(signal.SIGKILL)
        assert daemon["proc"].wait(60) == -signal.SIGKILL
        daemon["proc"] = _start()
        md5_ok(name)
        rounds = wait_rounds(name, "k", rounds, timeout_s=180)
        # Killed inside a trim's pause, after its drop: the vCPUs stay paused until a manager
        # continues them. The record tells that pause from its user's (azq pause): the
        # restarted manager continues the sandbox.
        _restart(daemon, crash_at="after-discard-batch", fail_at=CANCEL_AT)
        with pytest.raises(AzqemuError, match="cancelled"):
            c.compress(name=name)
        md5_ok(name)
        rounds = wait_rounds(name, "k", rounds)
        with pytest.raises(AzqemuError):
            c.trim(name=name)
        assert daemon["proc"].wait(60) == -signal.SIGKILL
        daemon["proc"] = _start()
        assert c.dominfo(name=name).state == "running"
        md5_ok(name)
        rounds = wait_rounds(name, "k", rounds, timeout_s=180)

        st = c.compress(name=name)
        assert not st.cancelled and st.stored_pages > 0, st
        c.resume(name=name)
        md5_ok(name)
        wait_rounds(name, "k", rounds, timeout_s=180)
    finally:
        if not daemonproc.running():
            daemon["proc"] = _start()
        c.destroy(name=name)
        _restart(daemon)
