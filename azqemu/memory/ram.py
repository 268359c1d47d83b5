"""Reading guest RAM from its backing without allocating its holes.

A sandbox's RAM is a tmpfs file or a QEMU memfd (reachable as /proc/PID/fd/N). Reading it
through mmap would allocate every hole it touches (a shmem read fault on a hole of a shared
mapping instantiates a page), so this module walks the data extents with
``lseek(SEEK_DATA/SEEK_HOLE)`` (Linux >= 3.1, supported by tmpfs/shmem) and reads them with
``preadv`` straight into numpy page arrays.

``page_idx`` everywhere in azqemu.memory counts 4 KiB pages from offset 0 of the RAM backing
(``offset = page_idx * 4096``). ``RamLayout`` maps offsets to guest physical addresses
(``gpa``) through the RAM blocks of the machine; the two address spaces are never mixed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from azqemu.errors import ConfigError, HostError
from azqemu.pages import PAGE_SHIFT, PAGE_SIZE, data_extents, page_runs

GIB = 1 << 30
# QEMU q35 (hw/i386/pc_q35.c): with ram_size >= 0xb0000000 only 2 GiB stay below the
# 4 GiB PCI hole and the rest is mapped from 4 GiB up; otherwise all RAM sits below.
Q35_LOWMEM_SPLIT_BYTES = 0xB0000000
Q35_LOWMEM_BYTES = 0x80000000
ABOVE_4G_GPA = 4 * GIB

# One preadv covers at most this much, and at most IOV_BATCH iovecs (IOV_MAX is 1024).
READ_CHUNK_BYTES = 64 << 20
IOV_BATCH = 1024
# Holes up to this size between two extents are read through (into a scratch buffer) rather
# than costing a syscall each; guest RAM is often a fine mix of pages and small holes.
MAX_GAP_BYTES = 256 << 10


@dataclass(frozen=True)
class GuestRamRange:
    """One contiguous piece of guest RAM: file range [offset, offset+size) at gpa [gpa, gpa+size)."""

    name: str
    offset: int
    size_bytes: int
    gpa: int

    def __post_init__(self) -> None:
        if self.offset % PAGE_SIZE or self.size_bytes % PAGE_SIZE or self.gpa % PAGE_SIZE:
            raise ConfigError(f"RAM block {self.name!r} is not page aligned")
        if self.size_bytes <= 0 or self.offset < 0 or self.gpa < 0:
            raise ConfigError(f"RAM block {self.name!r} has a bad range")


@dataclass(frozen=True)
class RamLayout:
    """The RAM blocks of a machine, sorted by file offset, non-overlapping."""

    blocks: tuple[GuestRamRange, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        blocks = tuple(sorted(self.blocks, key=lambda b: b.offset))
        for a, b in zip(blocks, blocks[1:]):
            if a.offset + a.size_bytes > b.offset:
                raise ConfigError(f"RAM blocks {a.name!r} and {b.name!r} overlap in the file")
        object.__setattr__(self, "blocks", blocks)

    @classmethod
    def flat(cls, ram_bytes: int, name: str = "pc.ram") -> RamLayout:
        """One block with offset == gpa."""
        return cls((GuestRamRange(name, 0, ram_bytes, 0),))

    @classmethod
    def q35(cls, ram_bytes: int) -> RamLayout:
        """QEMU q35's split of pc.ram around the 4 GiB hole."""
        if ram_bytes % PAGE_SIZE or ram_bytes <= 0:
            raise ConfigError(f"RAM size {ram_bytes} is not a positive multiple of 4 KiB")
        lowmem = Q35_LOWMEM_BYTES if ram_bytes >= Q35_LOWMEM_SPLIT_BYTES else ram_bytes
        blocks = [GuestRamRange("pc.ram/below-4g", 0, lowmem, 0)]
        if ram_bytes > lowmem:
            blocks.append(GuestRamRange("pc.ram/above-4g", lowmem, ram_bytes - lowmem, ABOVE_4G_GPA))
        return cls(tuple(blocks))

    @property
    def size_bytes(self) -> int:
        return sum(b.size_bytes for b in self.blocks)

    def _tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        offs = np.array([b.offset for b in self.blocks], dtype=np.int64)
        ends = offs + np.array([b.size_bytes for b in self.blocks], dtype=np.int64)
        gpas = np.array([b.gpa for b in self.blocks], dtype=np.int64)
        return offs, ends, gpas

    def offset_to_gpa(self, offset: np.ndarray | int) -> np.ndarray:
        """File offsets -> guest physical addresses (vectorised); ConfigError outside every block."""
        off = np.asarray(offset, dtype=np.int64)
        offs, ends, gpas = self._tables()
        i = np.searchsorted(offs, off, side="right") - 1
        if np.any(i < 0) or np.any(off >= ends[np.maximum(i, 0)]):
            raise ConfigError("file offset outside every RAM block")
        return gpas[i] + (off - offs[i])

    def gpa_to_offset(self, gpa: np.ndarray | int) -> np.ndarray:
        """Guest physical addresses -> file offsets (vectorised); ConfigError for gpa outside RAM."""
        g = np.asarray(gpa, dtype=np.int64)
        offs, ends, gpas = self._tables()
        order = np.argsort(gpas)
        gs, os_, sz = gpas[order], offs[order], (ends - offs)[order]
        i = np.searchsorted(gs, g, side="right") - 1
        if np.any(i < 0) or np.any(g >= gs[np.maximum(i, 0)] + sz[np.maximum(i, 0)]):
            raise ConfigError("guest physical address outside RAM")
        return os_[i] + (g - gs[i])

    def page_gpa(self, page_idx: np.ndarray) -> np.ndarray:
        return self.offset_to_gpa(np.asarray(page_idx, dtype=np.int64) << PAGE_SHIFT)

    def clip(self, extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Intersect (offset, length) extents with the blocks."""
        out: list[tuple[int, int]] = []
        for off, length in extents:
            end = off + length
            for b in self.blocks:
                lo, hi = max(off, b.offset), min(end, b.offset + b.size_bytes)
                if lo < hi:
                    out.append((lo, hi - lo))
        return out


def _open(fd_or_path: int | str | os.PathLike[str]) -> tuple[int, bool]:
    if isinstance(fd_or_path, int):
        return fd_or_path, False
    try:
        return os.open(os.fspath(fd_or_path), os.O_RDONLY | os.O_CLOEXEC), True
    except OSError as err:
        raise HostError(f"cannot open RAM backing {fd_or_path}: {err.strerror}") from err


def _read_extents_into(fd: int, extents: list[tuple[int, int]], dest: np.ndarray) -> None:
    """preadv(2) the extents into consecutive rows of ``dest``, several extents per call.

    Extents separated by a gap of at most ``MAX_GAP_BYTES`` are read in one preadv whose
    iovecs alternate between ``dest`` rows and a scratch buffer that swallows the gap: pread
    of a hole returns zeros without allocating it (shmem_file_read_iter maps holes to the zero
    page; regular filesystems never allocate on read), so this only saves syscalls.
    """
    if not extents:
        return
    flat = dest.data.cast("B")
    gap_buf = memoryview(bytearray(MAX_GAP_BYTES))
    pos = 0            # bytes of dest filled
    i = 0
    n = len(extents)
    while i < n:
        start, length = extents[i]
        iov = [flat[pos:pos + length]]
        want = length
        end = start + length
        pos += length
        i += 1
        while i < n and len(iov) < IOV_BATCH - 1 and want < READ_CHUNK_BYTES:
            nstart, nlen = extents[i]
            gap = nstart - end
            if gap > MAX_GAP_BYTES:
                break
            if gap:
                iov.append(gap_buf[:gap])
            iov.append(flat[pos:pos + nlen])
            want += gap + nlen
            end = nstart + nlen
            pos += nlen
            i += 1
        got = os.preadv(fd, iov, start)
        if got < want:
            # Short read (file shrank, or a huge request): finish extent by extent.
            raise HostError(f"short read of the RAM backing at offset {start}: {got} of {want} bytes")


def _extent_pages(extents: list[tuple[int, int]]) -> np.ndarray:
    if not extents:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(off >> PAGE_SHIFT, (off + ln) >> PAGE_SHIFT, dtype=np.int64)
                           for off, ln in extents])


def _page_extents(fd: int, layout: RamLayout | None) -> list[tuple[int, int]]:
    extents = data_extents(fd)
    if layout is not None:
        extents = layout.clip(extents)
    # A tail shorter than a page is rounded up by data_extents; reading past EOF gives zeros
    # only if we ask for it, so clip the request to the file and let the row stay zero.
    size = os.fstat(fd).st_size
    out = []
    for off, ln in extents:
        ln = min(ln, ((size + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)) - off)
        if ln > 0:
            out.append((off, ln))
    return out


def _clip_to_file(fd: int, extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The last page of a file whose size is not page aligned: read only what exists (the rest
    of the row is zeroed here)."""
    size = os.fstat(fd).st_size
    if not extents or extents[-1][0] + extents[-1][1] <= size:
        return extents
    off, ln = extents[-1]
    return extents[:-1] + [(off, size - off)]


def read_resident_pages(fd_or_path: int | str | os.PathLike[str],
                        layout: RamLayout | None = None) -> tuple[np.ndarray, np.ndarray]:
    """All resident pages of a RAM backing: (page_idx int64 sorted, pages (n, 4096) uint8).

    Holes are skipped without being allocated. With a layout, only pages inside its blocks are
    returned. A tail shorter than a page is zero-padded.
    """
    idx, buf = read_resident_buffer(fd_or_path, layout)
    return idx, buf


def resident_page_index(fd_or_path: int | str | os.PathLike[str]) -> np.ndarray:
    """The indices of a RAM backing's resident pages (sorted), without reading them: a caller
    that reads them in bounded chunks (``read_file_pages``) never holds them all at once."""
    fd, owned = _open(fd_or_path)
    try:
        return _extent_pages(_page_extents(fd, None))
    finally:
        if owned:
            os.close(fd)


def read_file_pages(fd: int, page_idx: np.ndarray) -> np.ndarray:
    """Pages ``page_idx`` (sorted) of a RAM backing: (n, 4096) uint8, holes read as zeros."""
    idx = np.asarray(page_idx, dtype=np.int64)
    pages = np.empty((len(idx), PAGE_SIZE), dtype=np.uint8)
    if len(idx):
        starts, lengths = page_runs(idx)
        extents = [(s << PAGE_SHIFT, n << PAGE_SHIFT)
                   for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
        clipped = _clip_to_file(fd, extents)
        if clipped != extents:
            pages[-1] = 0
        _read_extents_into(fd, clipped, pages)
    return pages


def read_resident_buffer(fd_or_path: int | str | os.PathLike[str], layout: RamLayout | None = None,
                         spare_rows: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Like read_resident_pages, into an array with ``spare_rows`` extra zero rows at the end
    (the template keeps a zero row there, and this saves it a second copy of every page)."""
    fd, owned = _open(fd_or_path)
    try:
        extents = _page_extents(fd, layout)
        idx = _extent_pages(extents)
        n = len(idx)
        pages = np.empty((n + spare_rows, PAGE_SIZE), dtype=np.uint8)
        pages[n:] = 0
        clipped = _clip_to_file(fd, extents)
        if clipped != extents:
            pages[n - 1] = 0
        _read_extents_into(fd, clipped, pages)
        return idx, pages
    finally:
        if owned:
            os.close(fd)


def resident_bytes(fd_or_path: int | str | os.PathLike[str], layout: RamLayout | None = None) -> int:
    fd, owned = _open(fd_or_path)
    try:
        ext = data_extents(fd)
        if layout is not None:
            ext = layout.clip(ext)
        return sum(length for _, length in ext)
    finally:
        if owned:
            os.close(fd)


def write_sparse_image(path: str | Path, page_idx: np.ndarray, pages: np.ndarray, size_bytes: int) -> None:
    """Write pages at their indices into a sparse file of ``size_bytes`` (tests, synthetic images)."""
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size_bytes)
        idx = np.asarray(page_idx, dtype=np.int64)
        if len(idx) == 0:
            return
        order = np.argsort(idx, kind="stable")
        idx = idx[order]
        # Write runs of consecutive pages with one pwritev each.
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [len(idx)]])
        for s, e in zip(starts, ends):
            run = np.ascontiguousarray(pages[order[s:e]])
            os.pwritev(fd, [run.data.cast("B")], int(idx[s]) << PAGE_SHIFT)
    finally:
        os.close(fd)
