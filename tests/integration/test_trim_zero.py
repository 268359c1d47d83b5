"""Zero copies go at the next trim, cold or not (trimsort.py): a tool call that frees memory
(its guest kernel zeroes what it frees, init_on_free) gives it back within one trim. The drop
maps the zero page in their place, so the guest reads zeros without a fault and writes them
through the kernel's copy-on-write; a manager killed between the drop and that mapping serves
them as zero from the store (the ZERO entries were committed first), never as the template's
page. Checked by the guest itself: fresh anonymous memory (handed out from freed pages,
which init_on_free lets the kernel skip zeroing) must read zero, then keep what it is written."""

from __future__ import annotations

import signal

import pytest

from azqemu.client import Client
from azqemu.daemon import coldrule
from azqemu.daemon import proc as daemonproc
from azqemu.errors import AzqemuError
from tests.support.daemonctl import restart as _restart
from tests.support.daemonctl import start as _start
from tests.support.guest import blob_and_checker, md5_ok, needs_lazy_restore, sh, wait_rounds

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]

HEAP_MIB = 96
# In the guest: take fresh anonymous memory, check it reads zero, fill it with random bytes,
# check them, exit (the kernel zeroes the pages it gets back).
HEAP = f"""python3 - <<'PY'
import hashlib, mmap, os
MIB = 1 << 20
m = mmap.mmap(-1, {HEAP_MIB} * MIB, flags=mmap.MAP_PRIVATE)
bad = [i for i in range({HEAP_MIB}) if m[i * MIB:(i + 1) * MIB].count(0) != MIB]
sums = []
for i in range({HEAP_MIB}):
    chunk = os.urandom(MIB)
    m[i * MIB:(i + 1) * MIB] = chunk
    sums.append(hashlib.md5(chunk).digest())
bad += [i for i in range({HEAP_MIB}) if hashlib.md5(m[i * MIB:(i + 1) * MIB]).digest() != sums[i]]
print("BAD", bad[:8]) if bad else print("OK")
PY"""


def _heap_ok(name: str) -> None:
    code, out = sh(name, HEAP, timeout_s=300)
    assert (code, out) == (0, "OK"), out


def test_freed_memory_goes_at_the_next_trim_and_comes_back_zero(template: str, daemon: dict) -> None:
    needs_lazy_restore()
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix="trimzero-", ram_mode="cow")
    name = rec.name
    try:
        rounds = blob_and_checker(name, 16, "z")
        c.compress(name=name)            # trims run between compressions
        c.resume(name=name, prefetch=True)
        _heap_ok(name)
        # The heap's pages were written a moment ago: younger than any cold age, dropped
        # because they are zero again.
        t = c.trim(name=name)
        assert t is not None and t.cold_after_s >= coldrule.AFTER_MIN_S, t
        assert t.zero_pages >= HEAP_MIB * 256 // 2 and t.dropped_pages >= t.zero_pages, t
        md5_ok(name)
        rounds = wait_rounds(name, "z", rounds)
        _heap_ok(name)                   # zero, then written through the zero page's copy-on-write

        # Killed after the drop, before the zero page is mapped in: the successor serves them
        # from the committed ZERO entries.
        _restart(daemon, crash_at="after-discard-batch")
        _heap_ok(name)
        with pytest.raises(AzqemuError):
            c.trim(name=name)
        assert daemon["proc"].wait(60) == -signal.SIGKILL
        daemon["proc"] = _start()
        assert c.dominfo(name=name).state == "running"
        _heap_ok(name)
        md5_ok(name)
        rounds = wait_rounds(name, "z", rounds, timeout_s=180)
        c.compress(name=name)
        c.resume(name=name)
        _heap_ok(name)
        md5_ok(name)
        wait_rounds(name, "z", rounds, timeout_s=180)
    finally:
        if not daemonproc.running():
            daemon["proc"] = _start()
        c.destroy(name=name)
        _restart(daemon)
