"""The manager's memory across compressions of a simulated sandbox: what a compression
allocates (the scan's chunks, the encoder's work buffers, the batch codec's output) is
released when it returns, so the manager's own memory does not grow with each compression.

No VM: the sandbox is a memfd (what a lazy or eager clone's RAM is), read through ``RamScan``
chunk by chunk into ``PageStore.encode`` as ``SandboxMemory.compress`` does, then punched.
tracemalloc counts numpy's buffers too (numpy reports them to it)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from azqemu.daemon import ramscan
from azqemu.daemon.ramscan import RamScan
from azqemu.host import selfmem
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
from azqemu.pages import PAGE_SIZE

N_PAGES = 4096          # a 16 MiB guest
MIB = 1 << 20
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_FALLOC_PUNCH = 0x02 | 0x01   # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)


def _text(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(97, 105, PAGE_SIZE, dtype=np.uint8)   # compressible, not a template page


@pytest.fixture
def template() -> Iterator[TemplateImage]:
    pages = np.stack([_text(p) for p in range(N_PAGES // 2)])
    img = TemplateImage(page_idx=np.arange(N_PAGES // 2, dtype=np.int64), pages=pages,
                        size_bytes=N_PAGES * PAGE_SIZE)
    yield img
    img.close()


def _fill(fd: int, template: TemplateImage, round_no: int) -> None:
    """A guest that wrote 3,000 pages since the last compression: template pages, edits of
    them, zero pages, new text, incompressible pages."""
    for p in range(0, 3000):
        k = (p + round_no) % 5
        if k == 0:
            page = np.array(template.pages[p % (N_PAGES // 2)])
        elif k == 1:
            page = np.array(template.pages[p % (N_PAGES // 2)])
            page[p % 4000:p % 4000 + 32] = round_no
        elif k == 2:
            page = np.zeros(PAGE_SIZE, np.uint8)
        elif k == 3:
            page = _text(100_000 + 7 * p + round_no)
        else:
            page = np.random.default_rng((p, round_no)).integers(0, 256, PAGE_SIZE, dtype=np.uint8)
        os.pwrite(fd, page.tobytes(), p * PAGE_SIZE)


def _compress(store: PageStore, scan: RamScan, template: TemplateImage, fd: int, sandbox: str = "s0") -> int:
    """What SandboxMemory.compress does for a memfd clone: chunks -> encode, flush, punch."""
    stored = []
    for part, pages in scan.chunks(scan.index()):
        stored.append(store.encode(sandbox, "d", part, pages, template).stored_idx)
    store.flush()
    idx = np.concatenate(stored) if stored else np.empty(0, np.int64)
    for p in idx.tolist():
        assert _libc.fallocate(fd, _FALLOC_PUNCH, ctypes.c_long(p * PAGE_SIZE), ctypes.c_long(PAGE_SIZE)) == 0
    return len(idx)


def test_scan_chunks_are_bounded(template: TemplateImage) -> None:
    fd = os.memfd_create("azq-test-ram")
    try:
        os.ftruncate(fd, N_PAGES * PAGE_SIZE)
        _fill(fd, template, 0)
        scan = RamScan(0, 0, N_PAGES, fd, False)
        sizes = [pages.nbytes for _, pages in scan.chunks(scan.index())]
        assert sum(sizes) == 3000 * PAGE_SIZE
        assert max(sizes) <= ramscan.CHUNK_PAGES * PAGE_SIZE <= 8 * MIB
    finally:
        os.close(fd)


@contextlib.contextmanager
def _compressed_once(template: TemplateImage, root: Path) -> Iterator[tuple[int, PageStore, RamScan]]:
    """A simulated sandbox (memfd) and a store that compressed it once ("s0"): imports,
    codec contexts and the store's tables exist before a test measures."""
    fd = os.memfd_create("azq-test-ram")
    store = PageStore(root)
    try:
        os.ftruncate(fd, N_PAGES * PAGE_SIZE)
        scan = RamScan(0, 0, N_PAGES, fd, False)
        _fill(fd, template, 0)
        _compress(store, scan, template, fd)
        yield fd, store, scan
    finally:
        store.close()
        os.close(fd)


def test_compressions_release_their_buffers(template: TemplateImage, tmp_path: Path) -> None:
    with _compressed_once(template, tmp_path / "store") as (fd, store, scan):
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            held = []
            for r in range(1, 5):
                _fill(fd, template, r)
                tracemalloc.reset_peak()
                assert _compress(store, scan, template, fd) > 0
                now, peak = tracemalloc.get_traced_memory()
                held.append(now - base)
                # While it ran: one chunk of pages and the encoder's buffers of its unique
                # pages, a few MiB, whatever the sandbox holds (12 MiB written here).
                assert peak - base < ramscan.CHUNK_PAGES * PAGE_SIZE + 6 * MIB, f"round {r}: peak {peak - base} bytes above the start"
        finally:
            tracemalloc.stop()
        # After it: what the store keeps of the new entries (its index), not the buffers;
        # and no growth from one compression to the next beyond that index.
        assert max(held) < 1 * MIB, held
        assert held[-1] - held[0] < 256 << 10, held
        assert selfmem.trim_heap() in (True, False)
        heap = selfmem.heap_stats()
        if heap:        # glibc: its books are readable, and the freed buffers are not in use
            assert heap["heap_in_use_bytes"] > 0 and heap["heap_free_bytes"] >= 0


def test_the_store_gives_its_tables_back_when_the_last_sandbox_goes(template: TemplateImage, tmp_path: Path) -> None:
    """A fleet of sandboxes grows the blob table and the domain's indices; once the last one
    is freed the manager holds what it held before them (not the fleet's high-water mark),
    and the store goes on exact: reopened, and with a new sandbox whose ids start again."""
    with _compressed_once(template, tmp_path / "store") as (fd, store, scan):
        store.free_sandbox("s0")
        store.flush()
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            for r in range(1, 4):
                for sb in ("s1", "s2", "s3", "s4"):
                    _fill(fd, template, 10 * r + int(sb[1]))
                    _compress(store, scan, template, fd, sb)
            grown = tracemalloc.get_traced_memory()[0] - base
            for sb in ("s1", "s2", "s3", "s4"):
                store.free_sandbox(sb)
            store.flush()
            left = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert grown > 512 << 10 and left < 128 << 10, (grown, left)
        _fill(fd, template, 99)
        idx = scan.index()
        want = np.stack([np.frombuffer(os.pread(fd, PAGE_SIZE, p * PAGE_SIZE), np.uint8) for p in idx.tolist()])
        stored = store.encode("s5", "d", idx, want, template).stored_idx
        store.flush()
        rows = np.searchsorted(idx, stored)
        assert (store.decode("s5", stored) == want[rows]).all()
    with PageStore(tmp_path / "store", templates=(template,)) as again:
        again.check_consistency()
        assert (again.decode("s5", stored) == want[rows]).all()


def test_a_detached_sandbox_memory_goes_without_a_garbage_collection(
        template: TemplateImage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its per-sandbox state (source map, the fault handler's maps and ring) is freed when the
    manager drops it: no reference cycle waits for the cyclic collector, which a daemon with
    a large heap runs rarely (a destroyed sandbox's state was seen held after a whole run)."""
    import gc
    import weakref

    from azqemu.daemon import sandboxmem
    from azqemu.restore.export import RamMapping, UffdHandle

    ram_fd = os.memfd_create("azq-test-ram")
    os.ftruncate(ram_fd, N_PAGES * PAGE_SIZE)
    block = RamMapping(hva=0x7F0000000000, size_bytes=N_PAGES * PAGE_SIZE, offset=0, page_size=PAGE_SIZE,
                       name="/memfd:pc.ram (deleted)")
    handle = UffdHandle(uffd=os.eventfd(0), ram_fds=[ram_fd], blocks=[block], pid=os.getpid())
    monkeypatch.setattr(sandboxmem.UffdExport, "connect", staticmethod(lambda path, timeout_s: handle))
    image = tmp_path / "tpl.ram"
    image.write_bytes(b"")
    store = PageStore(tmp_path / "store")
    gc.disable()
    try:
        mem = sandboxmem.SandboxMemory("s0", "d", uffd_socket=tmp_path / "x.sock", store=store,
                                       template=template, template_ram=image, lazy_clone=False)
        # A byte per page for the source map and the handler's two maps, the ring, buffers.
        assert 3 * N_PAGES <= mem.state_bytes() < 3 * N_PAGES + (1 << 20)
        ref = weakref.ref(mem)
        mem.detach()
        del mem
        assert ref() is None
    finally:
        gc.enable()
        store.close()
