"""The hot set per kind of tool call (daemon/callkinds.py), on a real copy-on-write guest: a
resume for a call brings back what the last call of its kind used, not what the last phase
used; a call that finds its sandbox running gets back what trims dropped of its kind; a kind
whose calls run long gets nothing placed; every byte the guest reads stays exact."""

from __future__ import annotations

import time

import pytest

from azqemu.client import Client
from azqemu.daemon import callkinds, coldrule
from tests.support.guest import needs_lazy_restore, sh

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]

FILE_PAGES = 3290   # 3 MB of random bytes as od's decimal text: 13.5 MB of tmpfs pages that zstd stores
READ_ALPHA = "cd /tmp && md5sum -c alpha.md5"
READ_BRAVO = "cd /tmp && sha256sum --check bravo.sha256 && wc -c bravo"


@pytest.fixture(autouse=True)
def _needs_lazy() -> None:
    needs_lazy_restore()


def _phase(c: Client, name: str, command: str) -> None:
    """One phase that uses only what ``command`` reads: resumed by it, trimmed (every copy
    the resume put back is dropped: no fault touched them since), then the command again,
    which faults its own pages back; compressed at the end."""
    r = c.exec(name=name, argv=["/bin/sh", "-c", command])
    assert r.exit_code == 0, r.stdout.decode()
    time.sleep(coldrule.AFTER_MIN_S + 0.5)
    t = c.trim(name=name)
    assert t is not None and t.dropped_pages > 0, t
    r = c.exec(name=name, argv=["/bin/sh", "-c", command])
    assert r.exit_code == 0, r.stdout.decode()
    assert not c.compress(name=name).cancelled


def test_a_resume_brings_back_what_the_last_call_of_its_kind_used(template: str) -> None:
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix="kinds-", ram_mode="cow")
    name = rec.name
    try:
        code, out = sh(name, "cd /tmp && head -c 3000000 /dev/urandom | od -A d -t u1 > alpha && md5sum alpha > alpha.md5"
                             " && head -c 3000000 /dev/urandom | od -A d -t u1 > bravo && sha256sum bravo > bravo.sha256")
        assert code == 0, out
        assert not c.compress(name=name).cancelled
        _phase(c, name, READ_ALPHA)
        _phase(c, name, READ_BRAVO)
        # The last phase used bravo; this call is of alpha's kind: alpha comes back with the
        # resume (one phase set for every call would have brought bravo and faulted alpha).
        r = c.exec(name=name, argv=["/bin/sh", "-c", READ_ALPHA])
        assert r.exit_code == 0, r.stdout.decode()
        assert 0.9 * FILE_PAGES <= r.prefetched_pages < 1.5 * FILE_PAGES, r     # not bravo
        assert r.faults < 0.2 * FILE_PAGES, r
        # Bravo was left in the store by the compression (not by a trim): its read, in the
        # same phase, faults it in, exact.
        r = c.exec(name=name, argv=["/bin/sh", "-c", READ_BRAVO])
        assert r.exit_code == 0, r.stdout.decode()
        assert r.prefetched_pages == 0 and r.faults >= 0.8 * FILE_PAGES, r
        # A named kind is its own, whatever the command: nothing of it is known yet, so its
        # resume brings back the last phase's set.
        assert not c.compress(name=name).cancelled
        r = c.exec(name=name, argv=["/bin/sh", "-c", READ_ALPHA], kind="verify_alpha")
        assert r.exit_code == 0, r.stdout.decode()
        assert r.prefetched_pages >= 1.8 * FILE_PAGES, r
        # A trim drops both files (put back, not touched since); the next call comes before
        # any compression: the pages of its kind come back before it starts, not by faults.
        time.sleep(coldrule.AFTER_MIN_S + 0.5)
        t = c.trim(name=name)
        assert t is not None and t.dropped_pages >= 1.8 * FILE_PAGES, t
        r = c.exec(name=name, argv=["/bin/sh", "-c", READ_ALPHA])
        assert r.exit_code == 0, r.stdout.decode()
        assert r.prefetched_pages >= 0.9 * FILE_PAGES, r
        assert r.faults < 0.2 * FILE_PAGES, r
        assert c.dominfo(name).state == "running"
        # A kind whose last call ran long: its pages are left to first touch (the faults they
        # would save are a small share of such a call), and still read back exact. Long enough
        # that even every stored page (a bound on any prediction) would save under 10% of it,
        # at the stall a fault costs by the last call's measure (an idle host's and the vCPU's
        # wait for a CPU after it: a few tens of us on an idle host) twice over.
        assert not c.compress(name=name).cancelled
        stats = c.memstats(name).as_json()
        stored = int(stats["store"]["stored_pages"])
        stall_s = float(stats["fault_stall_s"])
        assert callkinds.FAULT_STALL_S <= stall_s < 0.05, stats
        long_s = max(callkinds.PREFETCH_SKIP_MIN_S,
                     3 * stored * max(stall_s, 1.5 * callkinds.FAULT_STALL_S) / callkinds.PREFETCH_SKIP_SHARE)
        long_alpha = f"{READ_ALPHA} && sleep {long_s:.1f}"
        r = c.exec(name=name, argv=["/bin/sh", "-c", long_alpha], kind="long_alpha", timeout_s=120)
        assert r.exit_code == 0 and r.prefetched_pages > 0, r      # its length was not known yet
        assert not c.compress(name=name).cancelled
        r = c.exec(name=name, argv=["/bin/sh", "-c", long_alpha], kind="long_alpha", timeout_s=120)
        assert r.exit_code == 0, r.stdout.decode()
        assert r.prefetched_pages == 0 and r.faults >= 0.8 * FILE_PAGES, r
    finally:
        c.destroy(name=name)
