"""A trim scans, hashes and encodes beside the running guest and pauses it only to drop:
a page the guest writes after the trim read it must stay, exact (SandboxMemory._trim)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from azqemu.client import Client
from azqemu.daemon import coldrule
from tests.support.guest import needs_lazy_restore, sh

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]

SWEEPER = (Path(__file__).parent / "guest_sweeper.py").read_text()
PAGES = 8192            # a 32 MiB file in the guest's tmpfs
PACE_S = 0.003          # one page rewritten every few ms: tens of pages in a trim's scan


def _sweep_status(name: str) -> str:
    code, out = sh(name, "cat /tmp/st-sweep 2>/dev/null || echo NONE")
    assert code == 0 and not out.startswith("BAD"), f"{name}: guest saw wrong data: {out}"
    return out


def test_pages_written_while_a_trim_reads_stay_exact(template: str) -> None:
    needs_lazy_restore()
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix="trimrun-", ram_mode="cow")
    name = rec.name
    try:
        c.exec(name=name, argv=["/bin/sh", "-c", "cat > /tmp/sweeper.py"], stdin=SWEEPER.encode())
        code, out = sh(name, f"python3 /tmp/sweeper.py init /tmp/sweep {PAGES}")
        assert code == 0, out
        # Stored, then put back by the resume: every page of the file is a copy equal to its
        # entry, which a trim drops once it is older than the cold age.
        c.compress(name=name)
        c.resume(name=name, prefetch=True)
        code, out = sh(name, f"nohup python3 /tmp/sweeper.py run /tmp/sweep {PAGES} {PACE_S} /tmp/st-sweep "
                             f">/dev/null 2>&1 & sleep 0.5; echo started")
        assert code == 0, out
        changed = dropped = 0
        cold_s = coldrule.AFTER_MIN_S
        for _ in range(6):
            time.sleep(cold_s + 0.5)
            t = c.trim(name=name)
            assert t is not None and t.dropped_pages + t.changed_pages <= t.resident_pages, t
            assert 0 <= t.paused_s <= t.total_s, t
            changed += t.changed_pages
            dropped += t.dropped_pages
            cold_s = t.cold_after_s
            _sweep_status(name)
            if changed and dropped:
                break
            # Store what the sweeper wrote and put it back: candidates again for the next trim.
            c.compress(name=name)
            c.resume(name=name, prefetch=True)
        # The sweeper wrote pages between the trim's read and its pause: they were kept.
        assert changed > 0 and dropped > 0, (changed, dropped)
        deadline = time.monotonic() + 300
        while not (out := _sweep_status(name)).startswith("DONE"):
            assert time.monotonic() < deadline, out
            time.sleep(2)
        c.compress(name=name)          # and the file stays exact across one more cycle
        c.resume(name=name, prefetch=False)
        code, out = sh(name, "python3 - <<'PY'\n"
                             "import hashlib\n"
                             f"f = open('/tmp/sweep', 'rb'); bad = [i for i in range({PAGES}) "
                             "if f.read(4096) != hashlib.sha256(b'%d:1' % i).digest() * 128]\n"
                             "print(len(bad))\nPY")
        assert (code, out) == (0, "0"), out
        assert c.dominfo(name).state == "running"
    finally:
        c.destroy(name=name)
