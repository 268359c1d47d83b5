"""The native fault thread serving a real PageStore's pages (restore/_faultloop.c with the
store's C lookup, memory/_storeview.c), against a real uffd of this process.

The C thread must answer store pages alone (no Python in the path), give the bytes the store
holds after every commit, and hand a page it cannot verify to the Python thread, which leaves
the fault waiting and reports it: never a wrong page.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from azqemu.errors import ChecksumMismatch, StoreCorrupt
from azqemu.memory import nativestore
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
from azqemu.restore import native as cfaults
from azqemu.restore.handler import FaultHandler
from azqemu.restore.source import CompositeSource, StoreSource, TemplateSource

from .test_restore_handler import PAGES, PS, Ram, pattern

pytestmark = [pytest.mark.uffd,
              pytest.mark.skipif(not (cfaults.available() and nativestore.available()),
                                 reason="_faultloop.so / _storeview.so not built (make lib)")]


def _content(i: int, gen: int) -> bytes:
    """Page i at version gen: template-equal, zero, a template delta or a page of its own."""
    k = i % 4
    if k == 0:
        return pattern(i)
    if k == 1:
        return bytes(PS)
    page = bytearray(pattern(i) if k == 2 else pattern(i + 1000, gen))
    page[100:108] = gen.to_bytes(8, "little")
    return bytes(page)


@pytest.fixture
def world() -> Iterator[tuple[Ram, PageStore, TemplateImage]]:
    ram = Ram()
    tpl = TemplateImage(page_idx=np.arange(PAGES), pages=np.stack([np.frombuffer(pattern(i), np.uint8)
                                                                  for i in range(PAGES)]),
                        size_bytes=PAGES * PS)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="azq-test-", dir=base) as d:
        store = PageStore(d, templates=(tpl,))
        try:
            yield ram, store, tpl
        finally:
            store.close()
            ram.close()


def _store_and_punch(ram: Ram, store: PageStore, tpl: TemplateImage, pages: list[int], gen: int) -> None:
    idx = np.array(pages, dtype=np.int64)
    for i in pages:
        ram.map[i * PS:(i + 1) * PS] = _content(i, gen)
    data = np.stack([np.frombuffer(_content(i, gen), np.uint8) for i in pages])
    store.encode("sb", "d", idx, data, tpl)
    for i in pages:
        ram.handle.punch(ram.block, i * PS, PS)


def _read_all(ram: Ram, pages: list[int], timeout_s: float = 10) -> dict[int, bytes]:
    got: dict[int, bytes] = {}
    t = ram.reader(pages, got)
    t.join(timeout_s)
    assert not t.is_alive(), "a read stayed blocked"
    return got


def _comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:                 # the thread ended meanwhile
        return ""


def _thread_names() -> set[str]:
    return {_comm(t) for t in os.listdir("/proc/self/task")}


def _wait_for(cond, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_store_pages_are_served_by_the_c_thread_alone(world) -> None:
    ram, store, tpl = world
    ram.handle.register(ram.addr, ram.size)
    _store_and_punch(ram, store, tpl, list(range(PAGES)), gen=1)
    comp = CompositeSource.for_sandbox(PAGES, PS, stored=np.arange(PAGES), store=StoreSource(store, "sb"))
    with FaultHandler(ram.handle, comp, name="azq-faults-sb") as h:
        assert h.native
        # The C thread, the Python one (top -H); the Python one names itself once it runs.
        want = {"azq-fault", "azq-faults-sb"}
        _wait_for(lambda: want <= _thread_names())
        assert want <= _thread_names(), _thread_names()
        got1: dict[int, bytes] = {}
        got2: dict[int, bytes] = {}
        t1, t2 = ram.reader(list(range(PAGES)), got1), ram.reader(list(reversed(range(PAGES))), got2)
        t1.join(10)
        t2.join(10)
        assert not t1.is_alive() and not t2.is_alive()
        for i in range(PAGES):
            assert got1[i] == _content(i, 1) and got2[i] == _content(i, 1), i
        _wait_for(lambda: h.stats().served + h.stats().already_present >= h.stats().faults)
        c = h.native_counters()
        s = h.stats()
    assert c["forwarded"] == 0, c
    assert c["from_store"] == c["native"] and c["from_template"] == c["from_zero"] == 0, c
    assert s.native_served == s.faults and s.served == PAGES and s.errors == 0, s
    assert s.service_samples == s.faults


def test_the_thread_follows_new_commits(world) -> None:
    ram, store, tpl = world
    ram.handle.register(ram.addr, ram.size)
    pages = list(range(0, PAGES, 3))
    _store_and_punch(ram, store, tpl, pages, gen=1)
    comp = CompositeSource.for_sandbox(PAGES, PS, stored=np.array(pages), store=StoreSource(store, "sb"))
    with FaultHandler(ram.handle, comp) as h:
        assert _read_all(ram, pages) == {i: _content(i, 1) for i in pages}
        for gen in (2, 3):                  # re-encoded with new versions while it runs
            _store_and_punch(ram, store, tpl, pages, gen=gen)
            assert _read_all(ram, pages) == {i: _content(i, gen) for i in pages}
        assert h.native_counters()["forwarded"] == 0


def test_a_page_that_fails_its_check_waits_and_is_reported(world) -> None:
    ram, store, tpl = world
    ram.handle.register(ram.addr, ram.size)
    _store_and_punch(ram, store, tpl, [6], gen=1)      # a page of its own: a blob
    with store._lock:
        sb = store._sandboxes["sb"]
        blob = int(sb.index.ref[0])
        row = store._table.rows[blob]
        arena = store._arenas.arenas[int(row["arena"])]
        at = int(row["offset"]) + int(row["length"]) // 2
        arena.mm[at] ^= 0xFF
    errors: list[BaseException] = []
    comp = CompositeSource.for_sandbox(PAGES, PS, stored=[6], store=StoreSource(store, "sb"))
    with FaultHandler(ram.handle, comp, on_error=lambda e, hva: errors.append(e)) as h:
        got: dict[int, bytes] = {}
        t = ram.reader([6], got)
        _wait_for(lambda: bool(errors))
        assert errors and isinstance(errors[0], (ChecksumMismatch, StoreCorrupt)), errors
        assert t.is_alive() and not got, "a page that failed its check reached the reader"
        assert h.native_counters()["forwarded"] >= 1
        with store._lock:
            arena.mm[at] ^= 0xFF            # repaired: the retry serves the stored bytes
        h.retry_failed()
        t.join(5)
        assert not t.is_alive() and got[6] == _content(6, 1)


def test_a_stop_and_start_keeps_serving(world) -> None:
    ram, store, tpl = world
    ram.handle.register(ram.addr, ram.size)
    _store_and_punch(ram, store, tpl, list(range(32)), gen=1)
    comp = CompositeSource.for_sandbox(PAGES, PS, stored=np.arange(32), store=StoreSource(store, "sb"))
    h = FaultHandler(ram.handle, comp)
    try:
        h.start()
        assert _read_all(ram, list(range(16))) == {i: _content(i, 1) for i in range(16)}
        h.stop()
        stopped = threading.Event()
        got: dict[int, bytes] = {}

        def late_reader() -> None:
            got.update({i: ram.read(i) for i in range(16, 32)})
            stopped.set()
        threading.Thread(target=late_reader, daemon=True).start()
        time.sleep(0.1)
        assert not stopped.is_set()          # nobody serves while stopped
        h.start()                            # wakes the waiting thread, which faults again
        assert stopped.wait(10)
        assert got == {i: _content(i, 1) for i in range(16, 32)}
    finally:
        h.close()


def test_a_lazy_clones_template_pages_are_read_by_the_c_thread(world, tmp_path) -> None:
    ram, store, tpl = world
    image = tmp_path / "template.ram"
    image.write_bytes(b"".join(pattern(i, gen=3) for i in range(PAGES - 8)))    # shorter: the rest reads as zero
    ram.handle.register(ram.addr, ram.size)
    for i in range(PAGES):
        ram.handle.punch(ram.block, i * PS, PS)
    with TemplateSource(image) as src:
        comp = CompositeSource(PAGES, PS, default=src)
        h = FaultHandler(ram.handle, comp)
        h.start()
        try:
            got = _read_all(ram, list(range(PAGES)))
            # The C thread counts a fault after its copy woke the reader: wait for the count.
            _wait_for(lambda: h.native_counters()["native"] >= PAGES)
            c = h.native_counters()
        finally:
            h.close()
    assert got == {i: pattern(i, gen=3) if i < PAGES - 8 else bytes(PS) for i in range(PAGES)}
    assert c["forwarded"] == 0 and c["native"] >= PAGES, c
    assert c["from_template"] == c["native"] and c["from_store"] == c["from_zero"] == 0, c


def _spin_run(ram: Ram, store: PageStore, tpl: TemplateImage, pages: list[int],
              gap_s: float) -> tuple[dict[int, bytes], dict[str, int]]:
    """Every page stored and punched, then ``pages`` read one at a time ``gap_s`` apart: the
    bytes read and the C thread's counters."""
    ram.handle.register(ram.addr, ram.size)
    _store_and_punch(ram, store, tpl, list(range(PAGES)), gen=1)
    comp = CompositeSource.for_sandbox(PAGES, PS, stored=np.arange(PAGES), store=StoreSource(store, "sb"))
    got: dict[int, bytes] = {}
    with FaultHandler(ram.handle, comp) as h:
        for i in pages:
            got.update(_read_all(ram, [i]))
            time.sleep(gap_s)
        _wait_for(lambda: h.stats().served >= len(pages))
        c = h.native_counters()
    return got, c


@pytest.mark.parametrize("spin_us", ["0", "1000"])
def test_a_spinning_thread_serves_the_same_bytes(world, monkeypatch, spin_us) -> None:
    """After a fault the C thread reads its uffd without sleeping (AZQ_FAULT_SPIN_US): the
    faults it catches that way get the stored bytes like any other; with 0 it never spins."""
    monkeypatch.setenv("AZQ_FAULT_SPIN_US", spin_us)
    ram, store, tpl = world
    got, c = _spin_run(ram, store, tpl, list(range(PAGES)), gap_s=0.0)
    assert got == {i: _content(i, 1) for i in range(PAGES)}
    assert c["forwarded"] == 0, c
    if spin_us == "0":
        assert c["spin_caught"] == c["spin_ns"] == 0, c
    else:
        # One reader faulting page after page: its next fault comes within the spin.
        assert c["spin_caught"] > 0 and c["spin_ns"] > 0, c


def test_the_spin_stops_on_isolated_faults(world, monkeypatch) -> None:
    """Faults further apart than the longest spin halve it at each one, down to none: a sandbox
    whose faults are isolated costs at most ~2x the longest spin in all."""
    monkeypatch.setenv("AZQ_FAULT_SPIN_US", "1000")
    ram, store, tpl = world
    got, c = _spin_run(ram, store, tpl, list(range(12)), gap_s=0.03)
    assert got == {i: _content(i, 1) for i in range(12)}
    assert c["spin_caught"] == 0, c
    # 1 + 1/2 + 1/4 + ... ms of spins that caught nothing, then none.
    assert c["spin_ns"] <= 2_000_000, c


def test_a_spinning_thread_stops_at_once(world, monkeypatch) -> None:
    monkeypatch.setenv("AZQ_FAULT_SPIN_US", "1000")
    ram, store, tpl = world
    ram.handle.register(ram.addr, ram.size)
    _store_and_punch(ram, store, tpl, [0, 1], gen=1)
    comp = CompositeSource.for_sandbox(PAGES, PS, stored=np.arange(2), store=StoreSource(store, "sb"))
    h = FaultHandler(ram.handle, comp)
    try:
        h.start()
        assert _read_all(ram, [0, 1]) == {0: _content(0, 1), 1: _content(1, 1)}
        t0 = time.monotonic()
        h.stop()                    # within the spin that followed the faults; joins the thread
        assert time.monotonic() - t0 < 1.0
    finally:
        h.close()
