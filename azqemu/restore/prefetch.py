"""Prefetch: put a list of pages back in bulk before the guest resumes.

The hot set of the phase that just ended predicts the next one. The prefetcher sorts
the page indices, decodes a chunk of them with one bulk call into consecutive slots of
a staging buffer (``fill_pages``: a store decodes a whole chunk at once where it can),
cuts the chunk into runs of consecutive pages and places each run with a single
UFFDIO_COPY. Decoding and copying overlap: while chunk k is copied from one half of the
staging buffer, a helper thread decodes chunk k+1 into the other half (both sides run
outside the GIL: the store's C loop, and the ioctl). Like the fault handler it never writes the
backing file directly: UFFDIO_COPY refuses pages that are already present, so pages the
guest (or the handler) brought back meanwhile are never overwritten.

A copy that meets a present page stops there and reports the bytes it placed (the
kernel returns EAGAIN with ``copy`` = bytes copied); the next call starting on the
present page fails with EEXIST and ``copy`` = -EEXIST, and that page is skipped.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from azqemu.host.threads import name_os_thread, run_at_nice, thread_nice
from azqemu.pages import unique_idx
from azqemu.restore import uffd_abi as abi
from azqemu.restore.errors import PageUnavailable, UffdIoctlError
from azqemu.restore.export import RamMapping
from azqemu.restore.source import PageSource, fill_pages

# One chunk (half of the staging buffer): large enough that per-chunk overhead (~0.1 ms of
# thread hand-off and Python) vanishes, small enough that the pipeline fills quickly (the
# first chunk's decode and the last chunk's copy do not overlap anything) and that the
# buffer stays in a shared host's budget (anonymous memory of the manager).
CHUNK_BYTES = 4 << 20
# A run longer than this is copied in pieces: 2 MiB keeps one ioctl's kernel work short
# (~1 ms), so a stop or an error surfaces quickly; longer pieces gain nothing measurable.
MAX_COPY_BYTES = 2 << 20
# EAGAIN from UFFDIO_COPY (mm changing: an event the handler thread has not read yet):
# back off this long between attempts, at most EAGAIN_LIMIT times per run.
EAGAIN_SLEEP_S = 0.0002
EAGAIN_LIMIT = 20000


@dataclass(frozen=True)
class PrefetchResult:
    pages_requested: int
    pages_copied: int
    pages_present: int     # EEXIST: already back, left alone
    runs: int
    ioctls: int
    decode_s: float
    copy_s: float
    elapsed_s: float
    page_size: int = 4096
    # The pages found present (indices from the block start): beside a running guest, those it
    # touched before the prefetch got to them (each was a fault): callkinds.CallKinds.early.
    present_idx: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @property
    def bytes_copied(self) -> int:
        return self.pages_copied * self.page_size

    @property
    def mib_s(self) -> float:
        """Throughput over everything requested (copied or found present)."""
        mib = self.pages_requested * self.page_size / 2**20
        return mib / self.elapsed_s if self.elapsed_s > 0 else 0.0


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
# Staging buffers kept for the next Prefetcher: the first touch of a fresh 8 MiB buffer costs
# ~5 ms here (2048 page faults and zeroing), a sizeable share of a resume that prefetches
# ~26 MB in 20-30 ms. One is kept (resumes are mostly one at a time), MADV_FREE'd while idle
# so that the kernel may take its pages back under memory pressure (the next write simply
# faults them in again); others are unmapped as before.
POOLED_BUFFERS = 1
_SPARE: list[mmap.mmap] = []


def _decode_pool() -> ThreadPoolExecutor:
    """Helper threads that decode the next chunk (two: two sandboxes may resume at once)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="azq-prefetch",
                                       initializer=name_os_thread)
        return _POOL


def _timed_fill(source: PageSource, offsets: np.ndarray, out: memoryview, ps: int) -> tuple[bool, float]:
    """fill_pages and the time it took (in a helper: under blobdecode.run_at_nice, at the
    priority of the thread that prefetches)."""
    t0 = time.perf_counter()
    ok = fill_pages(source, offsets, out, ps)
    return ok, time.perf_counter() - t0


class Prefetcher:
    """Bulk restore into one uffd. Reuse one instance: it owns the staging buffer (two
    chunks of ``chunk_bytes``; the second is touched only by prefetches of more than one)."""

    def __init__(self, uffd: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._uffd = uffd
        self._buf = self._take_buffer(2 * chunk_bytes)
        self._closed = False
        self._mv = memoryview(self._buf)
        self._buf_obj = ctypes.c_char.from_buffer(self._buf)  # pins the buffer
        self._addr = ctypes.addressof(self._buf_obj)
        self._arg = bytearray(ctypes.sizeof(abi.uffdio_copy))
        self._q = memoryview(self._arg).cast("Q")
        self._copied_field = memoryview(self._arg).cast("q")  # ``copy`` is signed
        self.chunk_bytes = chunk_bytes

    @staticmethod
    def _take_buffer(size: int) -> mmap.mmap:
        with _POOL_LOCK:
            for i, buf in enumerate(_SPARE):
                if len(buf) == size:
                    return _SPARE.pop(i)
        return mmap.mmap(-1, size)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self._buf_obj
        self._mv.release()
        self._q.release()
        self._copied_field.release()
        with _POOL_LOCK:
            if len(_SPARE) < POOLED_BUFFERS:
                try:
                    self._buf.madvise(mmap.MADV_FREE)     # Linux 4.5+: contents may vanish
                except (AttributeError, OSError):
                    pass
                _SPARE.append(self._buf)
                return
        try:
            self._buf.close()
        except BufferError:
            pass  # a view is still alive (an exception's traceback): freed with it

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prefetch(self, block: RamMapping, page_idxs: object, source: PageSource) -> PrefetchResult:
        """Place pages ``page_idxs`` (indices from the block start) of ``block``."""
        t_start = time.perf_counter()
        idx = unique_idx(np.asarray(page_idxs, dtype=np.int64))
        if len(idx) and (idx[0] < 0 or idx[-1] >= block.page_count):
            raise PageUnavailable(block.offset, f"page index outside 0..{block.page_count - 1}")
        ps = block.page_size
        chunk_pages = self.chunk_bytes // ps
        if chunk_pages == 0:
            raise ValueError(f"page size {ps} exceeds the staging buffer")
        max_copy = max(ps, MAX_COPY_BYTES // ps * ps)
        q, arg, uffd, addr, ioctl = self._q, self._arg, self._uffd, self._addr, fcntl.ioctl
        field = self._copied_field
        copy_req = abi.UFFDIO_COPY
        decode_s = copy_s = 0.0
        copied = present = calls = runs = 0
        present_at: list[int] = []                 # host addresses of the pages found present
        chunks = [idx[c0:c0 + chunk_pages] for c0 in range(0, len(idx), chunk_pages)]
        slot_bytes = chunk_pages * ps

        def views(k: int) -> tuple[np.ndarray, memoryview, int]:
            base = (k % 2) * slot_bytes
            return chunks[k] * ps + block.offset, self._mv[base:base + len(chunks[k]) * ps], base

        # Decode of chunk k+1 (helper thread) overlaps the copy of chunk k (this thread).
        pending: Future[tuple[bool, float]] | None = None
        nice = thread_nice()
        for k, chunk in enumerate(chunks):
            n = len(chunk)
            offsets, out, base = views(k)
            if pending is None:
                ok, spent = _timed_fill(source, offsets, out, ps)
            else:
                ok, spent = pending.result()      # re-raises the helper's error
                pending = None
            decode_s += spent
            if not ok:
                raise PageUnavailable(int(offsets[0]), "source asked to retry during prefetch")
            if k + 1 < len(chunks):
                n_off, n_out, _ = views(k + 1)
                pending = _decode_pool().submit(run_at_nice, nice, _timed_fill, source, n_off, n_out, ps)
            t1 = time.perf_counter()
            try:
                # One UFFDIO_COPY per run of consecutive pages (slots are consecutive too).
                cuts = np.flatnonzero(np.diff(chunk) != 1) + 1
                firsts = [0, *cuts.tolist()]
                ends = [*cuts.tolist(), n]
                dsts = (chunk[firsts] * ps + block.hva).tolist()
                runs += len(firsts)
                for a, b, dst in zip(firsts, ends, dsts):
                    length = (b - a) * ps
                    src = addr + base + a * ps
                    if length <= max_copy:  # the common case: one ioctl, no exception
                        q[0] = dst
                        q[1] = src
                        q[2] = length
                        q[3] = 0
                        q[4] = 0
                        calls += 1
                        try:
                            ioctl(uffd, copy_req, arg, True)
                            copied += b - a
                            continue
                        except OSError:
                            # Stopped early: take what the kernel placed, the rest is _copy's.
                            got = max(0, field[4])
                            copied += got // ps
                            dst += got
                            src += got
                            length -= got
                    c, p, kk = self._copy(dst, src, length, ps, max_copy, present_at)
                    copied += c
                    present += p
                    calls += kk
            except BaseException:
                if pending is not None:
                    # The helper writes into the other half: let it finish before anyone
                    # can reuse or free the buffer.
                    pending.exception()
                raise
            copy_s += time.perf_counter() - t1
        present_idx = (np.asarray(present_at, dtype=np.int64) - block.hva) // ps
        return PrefetchResult(len(idx), copied, present, runs, calls, decode_s, copy_s,
                              time.perf_counter() - t_start, ps, present_idx)

    def _copy(self, dst: int, src: int, length: int, ps: int, max_copy: int,
              present_at: list[int]) -> tuple[int, int, int]:
        """UFFDIO_COPY [dst, dst+length) from src in pieces of at most max_copy bytes,
        skipping present pages (their addresses appended to ``present_at``); returns (pages
        copied, pages present, ioctls)."""
        q, field, arg, uffd = self._q, self._copied_field, self._arg, self._uffd
        done = copied = present = calls = eagain = 0
        while done < length:
            piece = min(length - done, max_copy)
            q[0] = dst + done
            q[1] = src + done
            q[2] = piece
            q[3] = 0
            q[4] = 0
            calls += 1
            try:
                fcntl.ioctl(uffd, abi.UFFDIO_COPY, arg, True)
            except OSError as err:
                got = field[4]
                if got > 0:  # partial: stopped on a present page (or an mm change)
                    copied += got // ps
                    done += got
                    continue
                if err.errno == errno.EEXIST:
                    # Present already (faulted back, or never punched): leave it alone.
                    # Its waiters, if any, were woken by whoever placed it.
                    present += 1
                    present_at.append(dst + done)
                    done += ps
                    continue
                if err.errno == errno.EAGAIN and eagain < EAGAIN_LIMIT:
                    eagain += 1
                    time.sleep(EAGAIN_SLEEP_S)
                    continue
                raise UffdIoctlError("UFFDIO_COPY", err.errno or 0, dst + done, piece) from err
            copied += piece // ps
            done += piece
        return copied, present, calls


def prefetch(uffd: int, block: RamMapping, page_idxs: object, source: PageSource) -> PrefetchResult:
    """One-shot form of :meth:`Prefetcher.prefetch` (allocates a staging buffer)."""
    with Prefetcher(uffd, chunk_bytes=min(CHUNK_BYTES, max(block.page_size,
                                                            len(np.atleast_1d(np.asarray(page_idxs)))
                                                            * block.page_size))) as p:
        return p.prefetch(block, page_idxs, source)
