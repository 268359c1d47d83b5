"""Fault handler and prefetcher against a real uffd of this very process.

No QEMU and no root needed: the uffd is made from /dev/userfaultfd when the test runs as
root, else with userfaultfd(UFFD_USER_MODE_ONLY), which is enough because every access
here is a user-mode read through ctypes.memmove (which also releases the GIL: a Python
thread touching a missing page while holding the GIL would block the handler thread).
The cross-process path (the preload library, an unprivileged "QEMU", a killed manager)
is in tests/integration/test_uffd_export.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import time

import numpy as np
import pytest

from azqemu.restore import native as cfaults
from azqemu.restore import uffd
from azqemu.restore import uffd_abi as abi
from azqemu.restore.errors import PageUnavailable, UffdIoctlError
from azqemu.restore.export import RamMapping, UffdHandle
from azqemu.restore.handler import FaultHandler
from azqemu.restore.mapback import map_from_file
from azqemu.restore.prefetch import Prefetcher, prefetch
from azqemu.restore.source import CompositeSource, MappedSource, StoreSource, ZeroSource

# Every test here makes a real uffd (skipped where the kernel refuses one).
pytestmark = pytest.mark.uffd

PS = 4096
PAGES = 256
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_DONTNEED = 4


def make_uffd(features: int = abi.UFFD_FEATURE_MISSING_SHMEM | abi.UFFD_FEATURE_EVENT_REMOVE,
              *, need_dev: bool = False) -> int:
    """A uffd of this process; without root (``need_dev`` False) a user-mode-only one."""
    try:
        dev = uffd.open_dev()
        try:
            fd = uffd.new_from_dev(dev)
        finally:
            os.close(dev)
    except (PermissionError, UffdIoctlError) as err:
        if need_dev:
            pytest.skip(f"needs /dev/userfaultfd (root): {err}")
        try:
            fd = uffd.new_syscall(user_mode_only=True)
        except UffdIoctlError as err2:
            pytest.skip(f"no userfaultfd here: {err2}")
    try:
        uffd.api(fd, features)
    except UffdIoctlError as err:
        os.close(fd)
        pytest.skip(f"kernel lacks a feature of {features:#x}: {err}")
    return fd


def pattern(page_idx: int, gen: int = 0) -> bytes:
    return np.full(PS // 8, (page_idx << 16) | (gen << 8) | 0xA5, dtype=np.uint64).tobytes()


class Store:
    def __init__(self) -> None:
        self.pages: dict[int, bytes] = {}

    def decode_page_into(self, sandbox: str, page_idx: int, out: memoryview) -> None:
        out[:] = self.pages[page_idx]


class Ram:
    """A memfd mapped MAP_SHARED here, filled with pattern(i), plus a uffd for it."""

    def __init__(self, pages: int = PAGES) -> None:
        self.size = pages * PS
        self.memfd = os.memfd_create("azq-unit-ram", os.MFD_CLOEXEC)
        os.ftruncate(self.memfd, self.size)
        self.map = mmap.mmap(self.memfd, self.size, mmap.MAP_SHARED)
        self._pin = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(self._pin)
        for i in range(pages):
            self.map[i * PS:(i + 1) * PS] = pattern(i)
        self.block = RamMapping(self.addr, self.size, 0, PS, "azq-unit-ram", 0)
        self.handle = UffdHandle(uffd=make_uffd(), ram_fds=[os.dup(self.memfd)], blocks=[self.block])
        self.store = Store()

    def save_and_punch(self, pages: list[int] | range) -> None:
        """What the compressor does: register, save, punch (DESIGN: register first)."""
        self.handle.register(self.addr, self.size)
        for i in pages:
            self.store.pages[i] = os.pread(self.memfd, PS, i * PS)
            self.handle.punch(self.block, i * PS, PS)

    def read(self, page_idx: int) -> bytes:
        """A user-mode read of the page that does not hold the GIL while it faults."""
        out = ctypes.create_string_buffer(PS)
        ctypes.memmove(out, self.addr + page_idx * PS, PS)
        return out.raw

    def reader(self, pages: list[int], results: dict[int, bytes]) -> threading.Thread:
        def run() -> None:
            for i in pages:
                results[i] = self.read(i)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        try:
            self.handle.unregister(self.addr, self.size)
        except UffdIoctlError:
            pass
        self.handle.close()
        del self._pin
        self.map.close()
        os.close(self.memfd)


@pytest.fixture(autouse=True, params=["python", "native"])
def fault_path(request, monkeypatch) -> str:
    """Every test twice: faults read by the Python thread, and by the C thread (restore/native.py)
    with this module's thread serving what it forwards."""
    if request.param == "native":
        if not cfaults.available():
            pytest.skip("_faultloop.so not built (make lib)")
    else:
        monkeypatch.setattr(cfaults, "LIB", None)
    return str(request.param)


@pytest.fixture
def ram():
    r = Ram()
    yield r
    r.close()


def test_two_threads_fault_at_once(ram: Ram) -> None:
    ram.save_and_punch(range(PAGES))
    h = FaultHandler(ram.handle, StoreSource(ram.store, "sb"))
    h.start()
    got1: dict[int, bytes] = {}
    got2: dict[int, bytes] = {}
    t1 = ram.reader(list(range(PAGES)), got1)
    t2 = ram.reader(list(reversed(range(PAGES))), got2)
    t1.join(10)
    t2.join(10)
    h.close()
    assert not t1.is_alive() and not t2.is_alive()
    for i in range(PAGES):
        assert got1[i] == pattern(i) and got2[i] == pattern(i), i
    s = h.stats()
    assert s.served == PAGES
    assert s.faults == s.served + s.already_present  # duplicates answered by EEXIST + wake
    assert s.errors == 0 and s.service_samples == s.faults
    assert list(h.hot_pages()) == list(range(PAGES))
    h.reset_hot()
    assert len(h.hot_pages()) == 0


def test_phases_of_hot_marks_keep_the_handler_memory_flat(ram: Ram) -> None:
    """reset_hot at every phase (each resume) must not leave a map behind: a fresh map per
    phase, kept alive for the C thread, had grown the manager by a map per sandbox per phase."""
    import tracemalloc
    h = FaultHandler(ram.handle, StoreSource(ram.store, "sb"))
    h.start()
    tracemalloc.start()
    try:
        for phase in range(40):
            pages = [phase % PAGES, (phase * 7 + 3) % PAGES]
            ram.save_and_punch(pages)
            got: dict[int, bytes] = {}
            ram.reader(pages, got).join(10)
            assert all(got[i] == pattern(i) for i in pages)
            deadline = time.monotonic() + 5     # the mark follows the copy that woke the reader
            while sorted(h.hot_pages()) != sorted(set(pages)) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert sorted(h.hot_pages()) == sorted(set(pages)), phase
            h.reset_hot()
            assert len(h.hot_pages()) == 0
            if phase == 4:
                base = tracemalloc.take_snapshot()
        # What the fault path allocated (this test's own store keeps every page it saved).
        only = [tracemalloc.Filter(True, "*/azqemu/restore/*")]
        grown = sum(st.size_diff for st in tracemalloc.take_snapshot().filter_traces(only)
                    .compare_to(base.filter_traces(only), "filename"))
    finally:
        tracemalloc.stop()
        h.close()
    assert grown < 4 * PAGES, grown      # a map (and its export) leaked per phase: ~7 KiB here


def test_never_saved_page_is_served_zero_by_copy(ram: Ram) -> None:
    ram.save_and_punch([1])
    ram.handle.punch(ram.block, 2 * PS, PS)  # punched without being saved: zero by definition
    comp = CompositeSource.for_sandbox(PAGES, PS, stored=[1], store=StoreSource(ram.store, "sb"))
    with FaultHandler(ram.handle, comp) as h:
        got: dict[int, bytes] = {}
        ram.reader([1, 2], got).join(5)
    assert got == {1: pattern(1), 2: bytes(PS)}
    assert h.stats().served == 2  # both through UFFDIO_COPY, no bare wake


def test_source_error_leaves_the_thread_waiting(ram: Ram) -> None:
    ram.save_and_punch([5])
    errors: list[tuple[BaseException, int]] = []
    empty = StoreSource(Store(), "sb")  # lost the page: must never become a zero page
    h = FaultHandler(ram.handle, empty, on_error=lambda exc, hva: errors.append((exc, hva)))
    h.start()
    got: dict[int, bytes] = {}
    t = ram.reader([5], got)
    t.join(0.5)
    assert t.is_alive() and got == {}
    assert h.stats().errors == 1
    assert isinstance(h.last_error, PageUnavailable)
    assert errors[0][1] == ram.addr + 5 * PS
    h.set_source(0, StoreSource(ram.store, "sb"))
    assert h.retry_failed() == 1
    t.join(5)
    h.close()
    assert got == {5: pattern(5)}


def test_retry_answer_is_asked_again(ram: Ram) -> None:
    ram.save_and_punch([7])
    inner = StoreSource(ram.store, "sb")

    class Busy:
        calls = 0

        def fill(self, offset: int, out: memoryview) -> bool:
            Busy.calls += 1
            return Busy.calls > 2 and inner.fill(offset, out)

    with FaultHandler(ram.handle, Busy()) as h:
        got: dict[int, bytes] = {}
        ram.reader([7], got).join(5)
    assert got == {7: pattern(7)}
    assert h.stats().retries == 2 and h.stats().served == 1


def test_wake_after_a_lost_fault_message(ram: Ram) -> None:
    """A manager that read a fault message and died: the next one must wake the range."""
    ram.save_and_punch([9])
    got: dict[int, bytes] = {}
    t = ram.reader([9], got)
    deadline = time.monotonic() + 5
    while True:  # play the dying manager: read the message, never answer
        try:
            msg = os.read(ram.handle.uffd, abi.UFFD_MSG_SIZE)
            break
        except BlockingIOError:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    assert msg[0] == abi.UFFD_EVENT_PAGEFAULT
    h = FaultHandler(ram.handle, StoreSource(ram.store, "sb"))
    h.start(wake=False)
    t.join(0.3)
    assert t.is_alive()  # nobody will ever resend that message
    ram.handle.wake_all()  # what start(wake=True) does
    t.join(5)
    h.close()
    assert got == {9: pattern(9)}


def test_remove_event_is_read_and_recorded(ram: Ram) -> None:
    removed: list[tuple[int, int, int]] = []
    ram.save_and_punch([])
    with FaultHandler(ram.handle, ZeroSource(), on_remove=lambda *a: removed.append(a)) as h:
        # QEMU's discard of guest-freed pages: punch, then MADV_DONTNEED, which blocks
        # until the handler has read UFFD_EVENT_REMOVE.
        ram.handle.punch(ram.block, 16 * PS, 4 * PS)
        done = threading.Event()

        def discard() -> None:
            assert libc.madvise(ram.addr + 16 * PS, 4 * PS, MADV_DONTNEED) == 0
            done.set()
        threading.Thread(target=discard, daemon=True).start()
        assert done.wait(5)
        deadline = time.monotonic() + 5
        while h.stats().removes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert h.stats().removes == 1
    assert list(h.discarded_pages()) == [16, 17, 18, 19]
    assert removed == [(0, 16, 4)]


def test_prefetch_skips_present_pages(ram: Ram) -> None:
    ram.save_and_punch(range(64))
    src = StoreSource(ram.store, "sb")
    with FaultHandler(ram.handle, src) as h:
        got: dict[int, bytes] = {}
        ram.reader([10, 11, 40], got).join(5)
        res = prefetch(ram.handle.uffd, ram.block, np.arange(64), src)
        assert (res.pages_requested, res.pages_copied, res.pages_present) == (64, 61, 3)
        assert res.runs == 1
        faults = h.stats().faults
        for i in range(64):
            assert ram.read(i) == pattern(i), i
        assert h.stats().faults == faults  # everything was back: no more faults


def test_prefetch_runs_and_partial_copies(ram: Ram) -> None:
    ram.save_and_punch(range(PAGES))
    src = StoreSource(ram.store, "sb")
    # Make pages 3 and 100 present behind the prefetcher's back (as a fault would).
    for i in (3, 100):
        page = ctypes.create_string_buffer(pattern(i), PS)
        assert uffd.copy(ram.handle.uffd, ram.addr + i * PS, ctypes.addressof(page), PS) == PS
    with Prefetcher(ram.handle.uffd, chunk_bytes=8 * PS) as p:  # tiny chunks: many pieces
        res = p.prefetch(ram.block, [0, 1, 2, 3, 4, 5, 100, 101, 255, 2, 1], src)
        assert (res.pages_requested, res.pages_copied, res.pages_present, res.runs) == (9, 7, 2, 3)
        assert list(res.present_idx) == [3, 100]       # which ones: a guest touched them first
        assert res.bytes_copied == 7 * PS
        res2 = p.prefetch(ram.block, range(PAGES), src)
        assert res2.pages_copied == PAGES - 9 and res2.pages_present == 9
        assert sorted(res2.present_idx) == [0, 1, 2, 3, 4, 5, 100, 101, 255]
    for i in range(PAGES):
        assert ram.read(i) == pattern(i), i


class _FailingSource:
    """Bulk source that fails (raises, or asks to retry) on its ``fail_at``-th chunk."""

    def __init__(self, inner: StoreSource, fail_at: int, how: str) -> None:
        self.inner, self.fail_at, self.how = inner, fail_at, how
        self.calls = 0
        self.threads: set[str] = set()

    def fill(self, offset: int, out: memoryview) -> bool:
        return self.inner.fill(offset, out)

    def fill_pages(self, offsets: np.ndarray, out: memoryview) -> bool:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.calls == self.fail_at:
            if self.how == "raise":
                raise PageUnavailable(int(offsets[0]), "damaged")
            return False
        return self.inner.fill_pages(offsets, out)


@pytest.mark.parametrize("how", ["raise", "retry"])
def test_pipelined_prefetch_stops_at_a_failing_chunk(ram: Ram, how: str) -> None:
    """Chunk k+1 decodes in a helper thread while chunk k is copied; a failure there surfaces
    from prefetch() after the earlier chunks were placed, and nothing of the failed chunk is."""
    ram.save_and_punch(range(PAGES))
    src = _FailingSource(StoreSource(ram.store, "sb"), fail_at=3, how=how)
    with FaultHandler(ram.handle, StoreSource(ram.store, "sb")) as h:
        with Prefetcher(ram.handle.uffd, chunk_bytes=16 * PS) as p, pytest.raises(PageUnavailable):
            p.prefetch(ram.block, range(PAGES), src)
        assert src.calls == 3 and any(t.startswith("azq-prefetch") for t in src.threads)
        faults = h.stats().faults
        for i in range(32):                      # chunks 1 and 2 were placed
            assert ram.read(i) == pattern(i), i
        assert h.stats().faults == faults
        assert ram.read(40) == pattern(40)       # chunk 3 was not: it faults and is served
        assert h.stats().faults == faults + 1


def test_pipelined_prefetch_places_everything(ram: Ram) -> None:
    ram.save_and_punch(range(PAGES))
    src = StoreSource(ram.store, "sb")
    with Prefetcher(ram.handle.uffd, chunk_bytes=16 * PS) as p:
        res = p.prefetch(ram.block, np.arange(PAGES)[::-1], src)
    assert (res.pages_requested, res.pages_copied, res.pages_present) == (PAGES, PAGES, 0)
    assert res.decode_s > 0 and res.copy_s > 0
    for i in range(PAGES):
        assert ram.read(i) == pattern(i), i


def test_prefetch_rejects_bad_indices(ram: Ram) -> None:
    with Prefetcher(ram.handle.uffd, chunk_bytes=PS) as p, pytest.raises(PageUnavailable):
        p.prefetch(ram.block, [PAGES], ZeroSource())


def test_prefetch_into_an_unregistered_range_fails(ram: Ram) -> None:
    ram.handle.punch(ram.block, 0, PS)
    with pytest.raises(UffdIoctlError) as exc:
        prefetch(ram.handle.uffd, ram.block, [0], ZeroSource())
    assert exc.value.op == "UFFDIO_COPY" and exc.value.errno == 2  # ENOENT: not registered


def test_register_outside_any_mapping_fails(ram: Ram) -> None:
    with pytest.raises(UffdIoctlError) as exc:
        ram.handle.register(0x1000, PS)  # page 1 is never mapped
    assert (exc.value.op, exc.value.errno, exc.value.start) == ("UFFDIO_REGISTER", 22, 0x1000)


def test_handler_checks_its_sources(ram: Ram) -> None:
    with pytest.raises(ValueError, match="2 sources for 1 RAM blocks"):
        FaultHandler(ram.handle, [ZeroSource(), ZeroSource()])
    with pytest.raises(ValueError, match="power of two"):
        FaultHandler(ram.handle, ZeroSource(), ring_size=1000)


def test_handler_restarts_after_stop(ram: Ram) -> None:
    ram.save_and_punch([1, 2])
    h = FaultHandler(ram.handle, StoreSource(ram.store, "sb"))
    h.start()
    got: dict[int, bytes] = {}
    ram.reader([1], got).join(5)
    h.stop()
    assert not h.running
    t = ram.reader([2], got)
    t.join(0.3)
    assert t.is_alive()  # stopped: the fault stays queued for the next start
    h.start()
    t.join(5)
    h.close()
    assert got == {1: pattern(1), 2: pattern(2)}
    with pytest.raises(RuntimeError, match="already started"):
        h2 = FaultHandler(ram.handle, ZeroSource())
        h2.start()
        try:
            h2.start()
        finally:
            h2.close()


class CowRam:
    """A tmpfs "template" file mapped MAP_PRIVATE (as QEMU maps it for a copy-on-write
    clone), with a hole in its last page, and a uffd asking for MINOR_SHMEM."""

    def __init__(self, pages: int = 64) -> None:
        self.pages = pages
        self.size = pages * PS
        base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        self.path = os.path.join(base, f"azq-unit-cow-{os.getpid()}")
        with open(self.path, "wb") as f:
            for i in range(pages - 1):
                f.write(pattern(i))
            f.truncate(self.size)          # the last page: a hole of the file
        self.fd = os.open(self.path, os.O_RDONLY)
        self.map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._pin = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(self._pin)
        self.block = RamMapping(self.addr, self.size, 0, PS, self.path, -1, private=True)
        fd = make_uffd(abi.UFFD_FEATURE_MISSING_SHMEM | abi.UFFD_FEATURE_MINOR_SHMEM, need_dev=True)
        self.handle = UffdHandle(uffd=fd, ram_fds=[], blocks=[self.block],
                                 features=abi.UFFD_FEATURE_MISSING_SHMEM | abi.UFFD_FEATURE_MINOR_SHMEM)
        self.store = Store()

    def compressed(self, stored: tuple[int, ...], zero: tuple[int, ...]) -> FaultHandler:
        """As a compression leaves it: ``stored`` pages (gen 7) in the store, ``zero`` pages
        known zero, the rest the file's; the range registered, every page dropped, a handler
        started (the caller closes it)."""
        self.store.pages = {i: pattern(i, gen=7) for i in stored}
        zero_src = ZeroSource()
        comp = CompositeSource(self.pages, PS, default=MappedSource())
        comp.register(zero_src)
        comp.assign(list(stored), StoreSource(self.store, "sb"))
        comp.assign(list(zero), zero_src)
        self.handle.register(self.addr, self.size, minor=True)
        assert libc.madvise(self.addr, self.size, MADV_DONTNEED) == 0
        h = FaultHandler(self.handle, comp)
        h.start()
        return h

    def read(self, page_idx: int) -> bytes:
        out = ctypes.create_string_buffer(PS)
        ctypes.memmove(out, self.addr + page_idx * PS, PS)
        return out.raw

    def close(self) -> None:
        with contextlib.suppress(UffdIoctlError):
            self.handle.unregister(self.addr, self.size)
        self.handle.close()
        del self._pin
        self.map.close()
        os.close(self.fd)
        os.unlink(self.path)


@pytest.mark.root  # MINOR_SHMEM needs a uffd from /dev/userfaultfd
def test_copy_on_write_pages_come_back_by_copy_continue_and_zeropage() -> None:
    """After a DISCARD (MADV_DONTNEED of the private mapping, range registered MISSING+MINOR)
    a stored page comes back by UFFDIO_COPY with the guest's bytes, a template page by
    UFFDIO_CONTINUE (the file's page cache), a zero page by UFFDIO_ZEROPAGE and the file's
    hole by ZEROPAGE too; the prefetcher's mapping does the same in bulk."""
    ram = CowRam()
    try:
        for i in (1, 2, 5):                 # the guest writes three pages
            ram.map[i * PS:(i + 1) * PS] = pattern(i, gen=7)
        ram.map[9 * PS:10 * PS] = bytes(PS)  # and zeroes one
        h = ram.compressed((1, 2, 5), zero=(9,))
        try:
            got: dict[int, bytes] = {}

            def run() -> None:
                for i in range(ram.pages):
                    got[i] = ram.read(i)
            t = threading.Thread(target=run, daemon=True)
            t.start()
            t.join(10)
            assert not t.is_alive()
            for i in range(ram.pages):
                want = (pattern(i, gen=7) if i in (1, 2, 5) else bytes(PS) if i in (9, ram.pages - 1)
                        else pattern(i))
                assert got[i] == want, i
            # The handler counts a fault after its ioctl has woken the reader: the last
            # count may land just after the reader's join.
            deadline = time.monotonic() + 5
            while h.stats().served < ram.pages and time.monotonic() < deadline:
                time.sleep(0.01)
            # The C thread maps a first touch's span along (map_around): those pages never fault.
            around = h.native_counters().get("around", 0)
            assert h.stats().served + around == ram.pages and h.stats().errors == 0
            # Again, through the bulk path: discard, then map before touching.
            assert libc.madvise(ram.addr, ram.size, MADV_DONTNEED) == 0
            tpl = np.array([0, 3, 4, ram.pages - 1])
            assert map_from_file(ram.handle.uffd, ram.block, tpl) == 4
            assert map_from_file(ram.handle.uffd, ram.block, np.array([9]), zero=True) == 1
            assert map_from_file(ram.handle.uffd, ram.block, tpl) == 0   # mapped already
            # Past the registered range: the kernel's error is raised, not skipped.
            with pytest.raises(UffdIoctlError) as err:
                map_from_file(ram.handle.uffd, ram.block, np.array([ram.pages + 64]))
            assert err.value.errno not in (0, errno.EEXIST, errno.EFAULT)
            faults = h.stats().faults
            assert [ram.read(i) for i in (0, 3, 9)] == [pattern(0), pattern(3), bytes(PS)]
            assert h.stats().faults == faults
        finally:
            h.close()
        # A write to a mapped template page copies it: the file keeps its bytes.
        ram.map[0:PS] = pattern(0, gen=9)
        assert ram.read(0) == pattern(0, gen=9)
        with open(ram.path, "rb") as f:
            assert f.read(PS) == pattern(0)
    finally:
        ram.close()


@pytest.mark.root
def test_a_first_touch_maps_the_template_and_zero_pages_of_its_span(fault_path: str) -> None:
    """The C thread answers a first touch of a template page and then maps the other pages of
    its 2 MiB span that come from the template or are zero (map_around), never a stored page
    (its bytes are the guest's, not the template's) nor a hole of the file mapped as template:
    those fault as before, and every page reads exactly."""
    if fault_path != "native":
        pytest.skip("map_around is the C thread's")
    ram = CowRam()
    try:
        stored = (1, 2, 5)
        for i in stored:
            ram.map[i * PS:(i + 1) * PS] = pattern(i, gen=7)
        h = ram.compressed(stored, zero=(9,))
        try:
            span = 2 << 20
            same_span = [i for i in range(ram.pages) if (ram.addr + i * PS) // span == ram.addr // span]
            hole = ram.pages - 1
            want_around = [i for i in same_span if i not in (0, *stored, hole)]
            assert ram.read(0) == pattern(0)
            deadline = time.monotonic() + 5
            while h.native_counters().get("around", 0) < len(want_around) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert h.native_counters()["around"] == len(want_around)
            faults = h.stats().faults
            for i in want_around:
                assert ram.read(i) == (bytes(PS) if i == 9 else pattern(i)), i
            assert h.stats().faults == faults            # mapped already: no fault
            for i in range(ram.pages):                    # the rest fault and read exactly
                want = pattern(i, gen=7) if i in stored else bytes(PS) if i in (9, hole) else pattern(i)
                assert ram.read(i) == want, i
            assert h.stats().faults >= faults + len(stored)
        finally:
            h.close()
    finally:
        ram.close()
