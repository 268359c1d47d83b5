"""Page sources: where the fault handler and the prefetcher get a page's content.

The interface follows cloud-hypervisor's ``UffdMemorySource.resolve()`` (Served or
Retry), with a third outcome made explicit because a guest must never see a zero page
by mistake:

``fill(offset, out) -> bool``
    ``offset`` is the page's offset in the RAM backing file (never a gpa or hva), and
    ``out`` is exactly one page long.

    - ``True``: **served**. ``out`` now holds the page's content (a zero page is content
      too: :class:`ZeroSource` serves it on purpose).
    - ``False``: **retry**. The source cannot answer yet (the data is being written, a
      lock is held); the caller asks again later and leaves the faulting thread waiting.
    - raises :class:`~azqemu.restore.errors.PageUnavailable` (or the store's own error,
      e.g. ``ChecksumMismatch``): **no content exists**. The caller must not substitute a
      zero page; the handler leaves the faulting thread waiting and reports the error.

Which pages come from where is decided once, by :class:`CompositeSource`: pages the
compressor stored come from the store, pages a lazy clone never copied come from the
template image, and pages nobody holds (never populated, or punched without being
saved) are zero by definition, which only ZeroSource may claim.

``fill_pages(offsets, out) -> bool`` is the optional bulk form used by the prefetcher:
``offsets`` is an int64 array of page offsets (any order, not necessarily contiguous)
and page ``j`` goes to ``out[j * page_size:(j + 1) * page_size]``; same three outcomes
for the whole batch. :func:`fill_pages` falls back to page-by-page ``fill``.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np

from azqemu.pages import PAGE_SIZE, unique_idx
from azqemu.restore.errors import PageUnavailable


@runtime_checkable
class PageSource(Protocol):
    def fill(self, offset: int, out: memoryview) -> bool: ...


def fill_pages(source: PageSource, offsets: np.ndarray, out: memoryview, page_size: int) -> bool:
    """Fill ``len(offsets)`` pages, page ``j`` from file offset ``offsets[j]``, into ``out``."""
    bulk = getattr(source, "fill_pages", None)
    if bulk is not None:
        return bool(bulk(offsets, out))
    fill = source.fill
    pos = 0
    for offset in offsets.tolist():
        if not fill(offset, out[pos:pos + page_size]):
            return False
        pos += page_size
    return True


class ZeroSource:
    """Serves zero pages: the content of a page no one saved (a tmpfs hole reads as zero)."""

    def __init__(self, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size
        self._zero = bytes(page_size)

    def fill(self, offset: int, out: memoryview) -> bool:
        out[:] = self._zero
        return True

    def fill_pages(self, offsets: np.ndarray, out: memoryview) -> bool:
        np.frombuffer(out, dtype=np.uint8)[:] = 0
        return True

    def __repr__(self) -> str:
        return "ZeroSource()"


class MappedSource:
    """Pages a copy-on-write mapping already holds: the template's own page cache.

    For a private (MAP_PRIVATE) RAM block a page the guest never wrote is the template
    image's page, shared by every clone. The fault handler answers such a page with
    UFFDIO_CONTINUE, which maps that page-cache page (read-only; a write copies it), or
    with the zero page over a hole of the template file: no copy and no memory of the
    sandbox's own. There is no content to fill from here."""

    def __init__(self, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size

    def fill(self, offset: int, out: memoryview) -> bool:
        raise PageUnavailable(offset, "a mapped page is answered by UFFDIO_CONTINUE, not filled")

    def __repr__(self) -> str:
        return "MappedSource()"


class TemplateSource:
    """Pages of the template's RAM image file (read-only, shared by every clone).

    The image has the RAM file's layout (offset ``o`` of the clone's backing is offset
    ``base_offset + o`` of the image). Holes read as zero through pread (a tmpfs hole is
    not allocated by reading it, unlike an mmap read); past the end of the image is zero.
    """

    def __init__(self, path: str | os.PathLike[str], base_offset: int = 0) -> None:
        self.path = os.fspath(path)
        self.base_offset = base_offset
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)

    @property
    def fd(self) -> int:
        """The image's descriptor (-1 once closed): the native fault thread reads a dup of it."""
        return self._fd

    def fill(self, offset: int, out: memoryview) -> bool:
        n = os.preadv(self._fd, [out], self.base_offset + offset)
        if n < len(out):
            out[n:] = bytes(len(out) - n)  # beyond the image's end: zero, like a hole
        return True

    def fill_pages(self, offsets: np.ndarray, out: memoryview) -> bool:
        # One pread per run of consecutive offsets (a hot set is mostly runs).
        if len(offsets) == 0:
            return True
        ps = len(out) // len(offsets)
        cuts = np.flatnonzero(np.diff(offsets) != ps) + 1
        firsts = np.concatenate(([0], cuts)).tolist()
        ends = [*cuts.tolist(), len(offsets)]
        for a, b in zip(firsts, ends):
            self.fill(int(offsets[a]), out[a * ps:b * ps])
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TemplateSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TemplateSource({self.path!r})"


class StoreSource:
    """Adapts a page store (``azqemu.memory.PageStore`` or anything with the same
    ``decode_page_into(sandbox, page_idx, out)``) to the PageSource interface.

    ``page_idx`` is ``offset // page_size`` (the store indexes the RAM file by page).
    ``decode_page_into`` writes the page into ``out`` and raises on a missing or damaged
    page; a ``False`` return is taken as "not held" and refused, never served as zero.
    If the store also offers ``decode_pages_into(sandbox, page_idxs, out)`` (an int64
    array of any pages; page ``j`` into ``out[j*page_size:]``) the prefetcher decodes a
    whole chunk of the hot set with one call.
    """

    def __init__(self, store: Any, sandbox: Any, page_size: int = PAGE_SIZE) -> None:
        self.store = store
        self.sandbox = sandbox
        self.page_size = page_size
        self._shift = page_size.bit_length() - 1
        self._decode = store.decode_page_into
        self._decode_many = getattr(store, "decode_pages_into", None)

    def fill(self, offset: int, out: memoryview) -> bool:
        page_idx = offset >> self._shift
        try:
            held = self._decode(self.sandbox, page_idx, out)
        except (KeyError, IndexError) as err:
            raise PageUnavailable(offset, f"store has no page {page_idx} of {self.sandbox!r}") from err
        if held is False:
            raise PageUnavailable(offset, f"store has no page {page_idx} of {self.sandbox!r}")
        return True

    def fill_pages(self, offsets: np.ndarray, out: memoryview) -> bool:
        idxs = offsets >> self._shift
        if self._decode_many is not None:
            try:
                held = self._decode_many(self.sandbox, idxs, out)
            except (KeyError, IndexError) as err:
                raise PageUnavailable(int(offsets[0]), f"store lacks a page among {len(idxs)} "
                                      f"of {self.sandbox!r}: {err}") from err
            if held is False:
                raise PageUnavailable(int(offsets[0]), f"store lacks a page among {len(idxs)} of {self.sandbox!r}")
            return True
        ps = self.page_size
        for j, offset in enumerate(offsets.tolist()):
            self.fill(offset, out[j * ps:(j + 1) * ps])
        return True

    def __repr__(self) -> str:
        return f"StoreSource({type(self.store).__name__}, {self.sandbox!r})"


# Sources a CompositeSource tells apart: a page's source index is a nibble.
MAX_SOURCES = 16


def kind_in(packed: bytearray, page: int) -> int:
    """The source index of ``page`` in a CompositeSource's ``kinds`` (two pages a byte)."""
    pair = packed[page >> 1]
    return pair >> 4 if page & 1 else pair & 15


class CompositeSource:
    """Maps each page of one RAM block to one source.

    Pages are indexed from the block's first file offset (``base_offset``). Every page
    starts on ``default`` (by convention :class:`ZeroSource`: nobody saved it) and
    ``assign`` moves pages to another source. Up to MAX_SOURCES sources: a page's source
    index is a nibble (two pages a byte, the even page in the low nibble), so the map of a
    512 MiB guest is 64 KiB of the manager's memory, not 128 (a sandbox's copy-on-write
    clone uses four sources: the template, the store, zero and unstored pages).
    """

    def __init__(self, page_count: int, page_size: int = PAGE_SIZE, default: PageSource | None = None,
                 base_offset: int = 0) -> None:
        self.page_count = page_count
        self.page_size = page_size
        self.base_offset = base_offset
        self._shift = page_size.bit_length() - 1
        if 1 << self._shift != page_size:
            raise ValueError(f"page size {page_size} is not a power of two")
        # bytearray, not numpy, for the per-fault lookup (kind_in): indexing it yields a
        # cached small int without allocating; numpy views of it serve the bulk operations.
        self._kind = bytearray((page_count + 1) // 2)
        self._sources: list[PageSource] = [default if default is not None else ZeroSource(page_size)]
        self._fills = [self._sources[0].fill]
        # assign reads and writes whole bytes: two assigns at once could each undo the other's
        # nibble of a byte they share (readers see a byte either before or after a write).
        self._assign_lock = threading.Lock()

    @classmethod
    def for_sandbox(cls, page_count: int, page_size: int, *, stored: Any, store: PageSource,
                    template: PageSource | None = None, base_offset: int = 0) -> CompositeSource:
        """Stored pages (indices or a bool mask) from ``store``; the others from
        ``template`` for a lazy clone, else zero."""
        comp = cls(page_count, page_size, default=template, base_offset=base_offset)
        comp.assign(stored, store)
        return comp

    def _index(self, source: PageSource) -> int:
        i = self.index_of(source)
        if i >= 0:
            return i
        if len(self._sources) == MAX_SOURCES:
            raise ValueError(f"CompositeSource holds at most {MAX_SOURCES} sources")
        self._sources.append(source)
        self._fills.append(source.fill)
        return len(self._sources) - 1

    def _page_indices(self, pages: Any) -> np.ndarray:
        """``pages`` (a range, a slice, an index array or a bool mask) as page indices."""
        if isinstance(pages, range):
            pages = slice(pages.start, pages.stop, pages.step)
        if isinstance(pages, slice):
            return np.arange(self.page_count, dtype=np.int64)[pages]
        pages = np.asarray(pages)
        if pages.dtype == bool:
            if pages.shape != (self.page_count,):
                raise IndexError(f"a mask of {pages.shape} for {self.page_count} pages")
            return np.flatnonzero(pages)
        idx = pages.astype(np.int64, copy=False).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.page_count):
            raise IndexError(f"page index out of 0..{self.page_count - 1}")
        return idx

    def assign(self, pages: Any, source: PageSource) -> None:
        """Serve ``pages`` (a range, a slice, an index array or a bool mask) from ``source``."""
        idx = self._page_indices(pages)
        with self._assign_lock:
            value = self._index(source)
            packed = np.frombuffer(self._kind, dtype=np.uint8)
            even, odd = idx[(idx & 1) == 0] >> 1, idx[(idx & 1) == 1] >> 1
            packed[even] = (packed[even] & 0xF0) | value
            packed[odd] = (packed[odd] & 0x0F) | (value << 4)

    def register(self, source: PageSource) -> int:
        """Make ``source`` known (no pages yet); returns its index in ``kinds``."""
        with self._assign_lock:
            return self._index(source)

    def index_of(self, source: PageSource) -> int:
        """Index of ``source`` in ``kinds``, -1 if it serves nothing."""
        for i, known in enumerate(self._sources):
            if known is source:
                return i
        return -1

    @property
    def sources(self) -> tuple[PageSource, ...]:
        return tuple(self._sources)

    @property
    def default(self) -> PageSource:
        return self._sources[0]

    @property
    def kinds(self) -> bytearray:
        """Per page, the index of its source (0: ``default``), a nibble a page (``kind_in``);
        read by the fault handler."""
        return self._kind

    def kind_of(self, page_idx: np.ndarray) -> np.ndarray:
        """The source indices of ``page_idx`` (valid page indices), as uint8."""
        idx = np.asarray(page_idx, dtype=np.int64)
        pair = np.frombuffer(self._kind, dtype=np.uint8)[idx >> 1]
        return np.where((idx & 1) == 1, pair >> 4, pair & 15).astype(np.uint8)

    def source_of(self, page_idx: int) -> PageSource:
        return self._sources[kind_in(self._kind, page_idx)]

    def pages_of(self, source: PageSource) -> np.ndarray:
        """Indices of the pages ``source`` serves."""
        i = self.index_of(source)
        if i < 0:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self.kind_of(np.arange(self.page_count)) == i)

    def fill(self, offset: int, out: memoryview) -> bool:
        idx = (offset - self.base_offset) >> self._shift
        if not 0 <= idx < self.page_count:
            raise PageUnavailable(offset, f"outside the {self.page_count} pages mapped")
        return self._fills[kind_in(self._kind, idx)](offset, out)

    def fill_pages(self, offsets: np.ndarray, out: memoryview) -> bool:
        idx = (offsets - self.base_offset) >> self._shift
        if len(idx) and (idx.min() < 0 or idx.max() >= self.page_count):
            raise PageUnavailable(int(offsets[0]), f"a page outside the {self.page_count} mapped")
        kinds = self.kind_of(idx)
        ps = self.page_size
        present = unique_idx(kinds)
        if len(present) == 1:
            return fill_pages(self._sources[present[0]], offsets, out, ps)
        pages_out = np.frombuffer(out, dtype=np.uint8).reshape(-1, ps)
        for kind in present.tolist():
            sel = np.flatnonzero(kinds == kind)
            scratch = bytearray(len(sel) * ps)
            if not fill_pages(self._sources[kind], offsets[sel], memoryview(scratch), ps):
                return False
            pages_out[sel] = np.frombuffer(scratch, dtype=np.uint8).reshape(-1, ps)
        return True

    def __repr__(self) -> str:
        return f"CompositeSource({self.page_count} pages, sources={self._sources!r})"
