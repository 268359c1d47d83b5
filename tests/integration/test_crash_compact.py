"""The manager killed (SIGKILL) while the page store compacts an arena, or while it writes a
generation, or right after a sibling's free, with real guests: the next manager serves every
page, the guest's own verifier and md5 agree, and the next compression works.

A guest heap (guest_heap.py) whose pages compress to a quarter each is compressed, then gives
three of every four pages back (init_on_free zeroes them): the next compressions find them
ZERO, their blobs die scattered among live ones, the arena is left mostly dead, and the store
compacts it (storewrite.py, compaction.py). The daemon is restarted with ``AZQ_CRASH_AT``
set at that point (azqemu/memory/crashpoint.py) and dies there.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from azqemu.client import Client
from azqemu.daemon import proc as daemonproc
from azqemu.errors import AzqemuError
from tests.support.daemonctl import restart as _restart
from tests.support.daemonctl import start as _start
from tests.support.guest import md5_ok, needs_lazy_restore, sh

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]

HEAP = (Path(__file__).parent / "guest_heap.py").read_text()
HEAP_PAGES = 32768         # 128 MiB of heap, ~34 MiB stored: most of what the arenas hold


@pytest.fixture(autouse=True)
def _needs_lazy() -> None:
    needs_lazy_restore()


def _heap_rounds(name: str) -> tuple[int, int]:
    code, out = sh(name, "cat /tmp/heap-st 2>/dev/null || echo NONE")
    assert code == 0 and not out.startswith("BAD"), f"{name}: guest saw wrong data: {out}"
    if not out.startswith("OK"):
        return 0, 0
    _, rounds, kept = out.split()
    return int(rounds), int(kept)


def _wait_heap(name: str, above: int, kept: int | None = None, timeout_s: float = 180) -> int:
    """The guest's verifier passed a round after ``above`` (with ``kept`` pages, if given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rounds, now_kept = _heap_rounds(name)
        if rounds > above and (kept is None or now_kept == kept):
            return rounds
        time.sleep(0.5)
    raise AssertionError(f"{name}: the heap verifier made no progress past round {above}")


def _start_heap(name: str) -> int:
    Client().exec(name=name, argv=["/bin/sh", "-c", "cat > /tmp/heap.py"], stdin=HEAP.encode())
    code, _ = sh(name, f"nohup python3 /tmp/heap.py {HEAP_PAGES} /tmp/heap-st /tmp/heap-free "
                       ">/dev/null 2>&1 & sleep 0.5; echo started")
    assert code == 0
    return _wait_heap(name, 0, HEAP_PAGES)



def _killed(daemon: dict) -> None:
    assert daemon["proc"].wait(60) == -signal.SIGKILL, "the crash point was not reached"


# Copy-on-write clones (the agentzip policies' mode): their compressions skip unchanged copies,
# so the kept heap pages keep their old blobs and the freed ones' blobs die among them. Lazy
# and eager clones re-encode every resident page; in this scenario their dead blobs lay in
# whole pages that the commit punched, and no arena was compacted (their compaction points
# are tried on the simulated guest: tests/unit/memory/test_crash_points.py).
@pytest.mark.parametrize(("ram_mode", "point"), [
    ("cow", "after-compact-copy"), ("cow", "after-compact-switch"), ("cow", "after-flush-snapshot")])
def test_manager_killed_while_the_store_compacts_loses_no_page(template: str, daemon: dict, ram_mode: str,
                                                               point: str) -> None:
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix=f"compact{ram_mode}-", ram_mode=ram_mode)
    name = rec.name
    try:
        code, _ = sh(name, "head -c 8000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
        assert code == 0
        rounds = _start_heap(name)
        c.compress(name=name)                    # the heap's blobs, back to back in an arena
        rounds = _wait_heap(name, rounds)        # exec resumes it
        code, _ = sh(name, "touch /tmp/heap-free")
        assert code == 0
        rounds = _wait_heap(name, rounds, HEAP_PAGES // 4)

        # Three of four heap pages are ZERO now: this compression's encode kills their blobs,
        # its commit punches what it can (little: each arena page keeps a live blob), and the
        # arena, a quarter live, is compacted when the pages are dropped.
        _restart(daemon, point)
        with pytest.raises(AzqemuError):
            c.compress(name=name)
        _killed(daemon)

        daemon["proc"] = _start()
        info = c.dominfo(name)
        assert info.failed_reason is None, info
        c.resume(name=name, prefetch=False)      # every lost page comes by a fault
        rounds = _wait_heap(name, rounds, HEAP_PAGES // 4)
        md5_ok(name)
        st = c.compress(name=name)               # the next compression works
        assert st.stored_pages > 0 and not st.cancelled
        c.resume(name=name, prefetch=False)
        _wait_heap(name, rounds, HEAP_PAGES // 4)
        md5_ok(name)
    finally:
        if not daemonproc.running():
            daemon["proc"] = _start()
        c.destroy(name=name)


def test_manager_killed_after_a_siblings_free_loses_no_page(template: str, daemon: dict) -> None:
    """Two siblings of one sharing domain share blobs (DUP); one is destroyed and the
    manager dies right after its pages were freed in the store (compacting what the free
    left mostly dead), before the domain went: the survivor's pages are exact, and the
    destroyed one is either still whole or failed (its free was durable), never served
    another's pages."""
    c = Client()
    a, b = c.clone(template=template, count=2, name_prefix="sibfree-", ram_mode="cow", sharing_domain="sibfree")
    try:
        for rec in (a, b):
            # The same file in both (DUP across siblings), and each one's own heap.
            code, _ = sh(rec.name, "head -c 4000000 /dev/zero | tr '\\0' 'x' > /tmp/same; "
                                   "head -c 8000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
            assert code == 0
        rounds = _start_heap(a.name)
        _start_heap(b.name)
        c.compress(name=a.name)
        c.compress(name=b.name)
        rounds = _wait_heap(a.name, rounds)

        _restart(daemon, "after-free-compact")
        with pytest.raises(AzqemuError):
            c.destroy(name=b.name)
        _killed(daemon)

        daemon["proc"] = _start()
        c.resume(name=a.name, prefetch=False)
        _wait_heap(a.name, rounds, HEAP_PAGES)
        md5_ok(a.name)
        info = c.dominfo(b.name)
        if info.failed_reason is None:           # the free was not durable: b is whole
            c.resume(name=b.name, prefetch=False)
            _wait_heap(b.name, 0, HEAP_PAGES)
            md5_ok(b.name)
        st = c.compress(name=a.name)
        assert st.stored_pages > 0 and not st.cancelled
        c.resume(name=a.name, prefetch=False)
        md5_ok(a.name)
    finally:
        if not daemonproc.running():
            daemon["proc"] = _start()
        for rec in (a, b):
            try:
                c.destroy(name=rec.name)
            except AzqemuError:
                pass
