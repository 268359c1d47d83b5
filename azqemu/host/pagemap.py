"""The pages a copy-on-write clone wrote, read from outside QEMU.

A copy-on-write clone maps its template's RAM image MAP_PRIVATE: a page the guest wrote is
an anonymous copy in QEMU's address space; every other page is the template's page cache
(mapped or not). /proc/PID/pagemap tells them apart without touching them: an entry that is
present (or swapped) and not "file page or shared anonymous" (bit 61) is an anonymous copy.
Those are read with process_vm_readv(2), which takes the pages as they are and never faults
one in: a fault on a range the manager registered would reach its own fault handler (a
deadlock for a read done under the sandbox's lock, and a page wrongly counted as used).

Layout of a pagemap entry: Documentation/admin-guide/mm/pagemap.rst. Where the kernel has the
PAGEMAP_SCAN ioctl (6.7 on), the pages are found with it instead: the kernel walks the page
tables and returns runs of matching pages, skipping empty tables, so a 512 MiB guest with a few
thousand copies costs a few hundred runs instead of a 1 MiB read classified in numpy (0.27 ms
against 2.1 ms here; docs/figures.md, session 12).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os

import numpy as np

from azqemu.errors import HostError
from azqemu.memory.kinds import PAGE_SHIFT, PAGE_SIZE

PM_PRESENT = 1 << 63
PM_SWAP = 1 << 62
PM_FILE_OR_SHARED_ANON = 1 << 61
PM_PFN_MASK = (1 << 55) - 1
# process_vm_readv takes at most IOV_MAX (1024) iovecs per side.
IOV_BATCH = 1024

# PAGEMAP_SCAN (include/uapi/linux/fs.h): _IOWR('f', 16, struct pm_scan_arg) and the page
# categories its filter and its regions speak of.
PAGEMAP_SCAN = 0xC0606610
PAGE_IS_FILE = 1 << 2
PAGE_IS_PRESENT = 1 << 3
PAGE_IS_SWAPPED = 1 << 4
PAGE_IS_PFNZERO = 1 << 5
# Regions per ioctl: a guest's copies come in runs; a larger map is walked in several calls.
SCAN_REGIONS = 4096


class _pm_scan_arg(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


# struct iovec {void *iov_base; size_t iov_len;} as rows of two u64 (x86-64, aarch64): built
# with numpy for all runs at once (a ctypes array type made per call cost more than the read).
_IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])

_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                   ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int
# Set when the kernel refuses PAGEMAP_SCAN (older than 6.7): the pagemap read is used from then on.
_scan_unsupported = False


def read_pagemap(pid: int, hva: int, page_count: int) -> np.ndarray:
    """The pagemap entries (uint64) of ``page_count`` pages from address ``hva``."""
    want = page_count * 8
    try:
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"cannot open /proc/{pid}/pagemap: {exc.strerror}") from exc
    try:
        buf = bytearray(want)
        view = memoryview(buf)
        got = 0
        while got < want:
            n = os.preadv(fd, [view[got:]], (hva >> PAGE_SHIFT) * 8 + got)
            if n <= 0:
                raise HostError(f"short read of /proc/{pid}/pagemap at {hva:#x}")
            got += n
    finally:
        os.close(fd)
    return np.frombuffer(buf, dtype=np.uint64)


@functools.cache
def zero_pfn() -> int:
    """The PFN of the kernel's shared zero page (0 if pagemap hides PFNs from us: then
    zero-page mappings count as copies, which costs a needless read, never a wrong page).

    Found by mapping one anonymous page, reading it (a read fault maps the zero page) and
    looking it up in our own pagemap."""
    m = mmap.mmap(-1, PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(buf)
        _ = buf.value  # the read fault
        entry = int(read_pagemap(os.getpid(), addr, 1)[0])
        del buf
    finally:
        m.close()
    return entry & PM_PFN_MASK if entry & PM_PRESENT else 0


def scan_regions(pid: int, hva: int, page_count: int, *, without: int, anyof: int,
                 report: int) -> np.ndarray | None:
    """PAGEMAP_SCAN over ``page_count`` pages from ``hva``: the runs of pages that have none of
    the categories ``without`` and at least one of ``anyof``, as rows (first page, end page,
    categories & ``report``) in page indices from ``hva``; None where the kernel has no
    PAGEMAP_SCAN (the caller reads the pagemap instead)."""
    global _scan_unsupported
    if _scan_unsupported:
        return None
    if page_count <= 0:      # the kernel's EINVAL for an empty range would read as "no ioctl"
        return np.empty((0, 3), dtype=np.int64)
    try:
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"cannot open /proc/{pid}/pagemap: {exc.strerror}") from exc
    try:
        vec = np.empty((SCAN_REGIONS, 3), dtype=np.uint64)     # struct page_region rows
        arg = _pm_scan_arg(size=ctypes.sizeof(_pm_scan_arg), start=hva, end=hva + page_count * PAGE_SIZE,
                           vec=vec.ctypes.data, vec_len=SCAN_REGIONS, category_inverted=without,
                           category_mask=without, category_anyof_mask=anyof, return_mask=report)
        parts = []
        while True:
            n = _libc.ioctl(fd, PAGEMAP_SCAN, ctypes.byref(arg))
            if n < 0:
                err = ctypes.get_errno()
                if err in (errno.ENOTTY, errno.EINVAL):
                    _scan_unsupported = True
                    return None
                raise HostError(f"PAGEMAP_SCAN of pid {pid}: {os.strerror(err)}")
            if n:
                parts.append(vec[:n].copy())
            if arg.walk_end >= arg.end or n < SCAN_REGIONS:
                break
            arg.start = arg.walk_end
    finally:
        os.close(fd)
    rows = np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)
    out = rows.astype(np.int64)
    out[:, :2] = (out[:, :2] - hva) >> PAGE_SHIFT
    return out


def _indices(regions: np.ndarray) -> np.ndarray:
    """The page indices the (first, end, ...) rows cover, sorted."""
    lengths = regions[:, 1] - regions[:, 0]
    if not len(lengths):
        return np.empty(0, dtype=np.int64)
    # Each index is its run's first page plus its place in the run.
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(regions[:, 0], lengths) + offsets


def _anon_regions(pid: int, hva: int, page_count: int) -> np.ndarray | None:
    """Runs of anonymous copies (present or swapped, not the zero page), present and swapped
    told apart in the categories."""
    return scan_regions(pid, hva, page_count, without=PAGE_IS_FILE | PAGE_IS_PFNZERO,
                        anyof=PAGE_IS_PRESENT | PAGE_IS_SWAPPED, report=PAGE_IS_PRESENT | PAGE_IS_SWAPPED)


def anon_page_counts(pid: int, hva: int, page_count: int) -> tuple[int, int]:
    """(present, swapped) anonymous copies in the range: smaps' Anonymous and Swap of the
    range, in pages, without printing every mapping of the process as smaps does."""
    regions = _anon_regions(pid, hva, page_count)
    if regions is None:
        pm = read_pagemap(pid, hva, page_count)
        copies = _anon_mask(pm)
        present = int(np.count_nonzero(copies & ((pm & np.uint64(PM_PRESENT)) != 0)))
        return present, int(np.count_nonzero(copies)) - present
    lengths = regions[:, 1] - regions[:, 0]
    present = (regions[:, 2] & PAGE_IS_PRESENT) != 0
    return int(lengths[present].sum()), int(lengths[~present].sum())


def _anon_mask(pm: np.ndarray) -> np.ndarray:
    """Of pagemap entries, the anonymous copies: present or swapped out, not a file page, not
    the shared zero page."""
    held = (pm & np.uint64(PM_PRESENT | PM_SWAP)) != 0
    anon = (pm & np.uint64(PM_FILE_OR_SHARED_ANON)) == 0
    zpfn = zero_pfn()
    if zpfn:
        present = (pm & np.uint64(PM_PRESENT)) != 0
        anon &= ~(present & ((pm & np.uint64(PM_PFN_MASK)) == np.uint64(zpfn)))
    return held & anon


def private_pages(pid: int, hva: int, page_count: int) -> np.ndarray:
    """Indices (from ``hva``) of the pages that are anonymous copies, sorted (pages mapped
    to the shared zero page are not copies and are left out)."""
    regions = _anon_regions(pid, hva, page_count)
    if regions is not None:
        return _indices(regions)
    return private_pages_read(pid, hva, page_count)


def private_pages_read(pid: int, hva: int, page_count: int) -> np.ndarray:
    """``private_pages`` from a read of the pagemap (kernels without PAGEMAP_SCAN)."""
    pm = read_pagemap(pid, hva, page_count)
    return np.flatnonzero(_anon_mask(pm)).astype(np.int64)


def unmapped_pages(pid: int, hva: int, page_count: int) -> np.ndarray:
    """Indices (from ``hva``) of the pages neither present nor swapped."""
    pm = read_pagemap(pid, hva, page_count)
    return np.flatnonzero((pm & np.uint64(PM_PRESENT | PM_SWAP)) == 0).astype(np.int64)


def read_pages(pid: int, hva: int, page_idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The content of pages ``page_idx`` (from ``hva``) of process ``pid``: (n, 4096) uint8,
    in ``out`` (C-contiguous rows, at least n) when given, else in a new array.

    Contiguous pages go in one iovec, up to IOV_BATCH runs per call."""
    idx = np.asarray(page_idx, dtype=np.int64)
    pages = np.empty((len(idx), PAGE_SIZE), dtype=np.uint8) if out is None else out[:len(idx)]
    if not pages.flags.c_contiguous or pages.shape != (len(idx), PAGE_SIZE) or pages.dtype != np.uint8:
        raise ValueError("read_pages: out must be C-contiguous uint8 rows of a page, one per index")
    if not len(idx):
        return pages
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(idx)])))
    local = np.empty(len(starts), dtype=_IOVEC)
    local["base"] = pages.ctypes.data + starts * PAGE_SIZE
    local["len"] = lengths * PAGE_SIZE
    remote = np.empty(len(starts), dtype=_IOVEC)
    remote["base"] = hva + idx[starts] * PAGE_SIZE
    remote["len"] = local["len"]
    for b in range(0, len(starts), IOV_BATCH):
        k = min(IOV_BATCH, len(starts) - b)
        want = int(local["len"][b:b + k].sum())
        got = _libc.process_vm_readv(pid, local[b:].ctypes.data, k, remote[b:].ctypes.data, k, 0)
        if got != want:
            err = ctypes.get_errno()
            raise HostError(f"process_vm_readv of pid {pid}: {got} of {want} bytes"
                            + (f" ({os.strerror(err)})" if got < 0 else ""))
    return pages


def read_private_pages(pid: int, hva: int, page_count: int) -> tuple[np.ndarray, np.ndarray]:
    """(page_idx int64 sorted, pages (n, 4096) uint8) of every anonymous copy in the range."""
    idx = private_pages(pid, hva, page_count)
    return idx, read_pages(pid, hva, idx)
