"""Guest RAM files: copy a template image into a clone's RAM, save a template's out.

Guest RAM is a memfd inside QEMU; root reaches it as /proc/PID/fd/N (opening that path
gives a new file description of the same memfd). Reading a tmpfs/memfd file through mmap
would allocate its holes, so everything here walks data extents with SEEK_DATA/SEEK_HOLE
(lseek(2)) and moves bytes with pread/pwrite or sendfile(2).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from azqemu.errors import VirtError
from azqemu.pages import PAGE_SIZE, data_extents, page_runs
from azqemu.restore.uffd import punch_hole

COPY_CHUNK_BYTES = 8 << 20


def copy_into(src_path: Path, dst_path: Path) -> int:
    """Copy the data extents of ``src_path`` to the same offsets of ``dst_path``; returns bytes."""
    copied = 0
    src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(dst_path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            for off, length in data_extents(src):
                os.lseek(dst, off, os.SEEK_SET)
                done = 0
                while done < length:
                    n = os.sendfile(dst, src, off + done, min(COPY_CHUNK_BYTES, length - done))
                    if n == 0:
                        raise VirtError(f"short copy from {src_path}")
                    done += n
                copied += length
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return copied


def _data_chunks(fd: int, path: Path) -> Iterator[tuple[int, memoryview, np.ndarray]]:
    """The data extents of ``fd`` read with pread (never a mapping) in chunks of up to
    COPY_CHUNK_BYTES: (file offset, the bytes, the same bytes as one row of u64 per page).
    One buffer serves every chunk: each is valid until the next."""
    buf = np.empty(COPY_CHUNK_BYTES, dtype=np.uint8)
    for off, length in data_extents(fd):
        pos = off
        while pos < off + length:
            n = min(COPY_CHUNK_BYTES, off + length - pos)
            view = memoryview(buf.data)[:n]  # type: ignore[arg-type]
            if os.preadv(fd, [view], pos) != n:
                raise VirtError(f"short read from {path}")
            yield pos, view, buf[:n].view(np.uint64).reshape(-1, PAGE_SIZE // 8)
            pos += n


def save_sparse(src_path: Path, dst_path: Path, size_bytes: int) -> int:
    """Write the non-zero pages of ``src_path`` to a new sparse file; returns bytes of data.

    Zero pages become holes: a template image then costs page cache only for real data, and
    a hole reads back as the zero page it was.
    """
    written = 0
    src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        try:
            os.ftruncate(dst, size_bytes)
            for pos, view, pages in _data_chunks(src, src_path):
                starts, lengths = page_runs(np.flatnonzero(pages.any(axis=1)))
                for run_start, run_len in zip(starts.tolist(), lengths.tolist(), strict=True):
                    a, b = run_start * PAGE_SIZE, (run_start + run_len) * PAGE_SIZE
                    os.pwritev(dst, [view[a:b]], pos + a)
                    written += b - a
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return written


def punch_zero_pages(path: Path) -> int:
    """Give back the zero pages a template's working copy has come to hold: punch every
    all-zero page of its data extents back to a hole; returns the bytes given back.

    A copy-on-write clone maps the image privately, and on tmpfs its first write to a hole
    (and any read of one through the mapping) allocates a zero page in the file before the
    copy is made: the image grows by every hole its clones touch and keeps those pages after
    they are gone (73 MiB on a 91 MiB long-tools template after two linux runs at 8 sandboxes,
    docs/figures.md session 31). A hole reads back as the zero page it replaces, so this
    changes no byte a clone or the manager reads, whether or not clones still map the file
    (a mapped page is unmapped and faulted in again). Read with pread, never mmap: a mapping's
    read of a hole would allocate it."""
    freed = 0
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        for pos, _view, pages in _data_chunks(fd, path):
            starts, lengths = page_runs(np.flatnonzero(~pages.any(axis=1)))
            for run_start, run_len in zip(starts.tolist(), lengths.tolist(), strict=True):
                punch_hole(fd, pos + run_start * PAGE_SIZE, run_len * PAGE_SIZE)
                freed += run_len * PAGE_SIZE
    finally:
        os.close(fd)
    return freed
