"""Decoding a sandbox's stored pages: one page for the fault path, many for prefetch.

PageStore (store.py) looks a sandbox's entries up under its state lock and, still under it,
has them located here: ``locate_page`` and ``locate_rows`` split the entries by source and copy
the blob payloads they need out of the arenas (blobdecode.py's recipes and batches), so that a
concurrent free or compaction cannot pull the bytes away. ``write_page`` and ``write_rows`` then
run without the lock and produce the pages: ZERO pages are produced, not read; TEMPLATE pages
and DUPs of template pages are copied from the template and re-hashed against its load-time
hashes; blob pages are decoded and checked against their checksums. A ChecksumMismatch raised
here names the requested page that failed (``page_idx``), not the blob.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from azqemu.errors import ChecksumMismatch
from azqemu.memory.arena import ArenaSet
from azqemu.memory.blobdecode import Batch, Recipe, decode_batch, decode_recipe, read_batch, read_recipe
from azqemu.memory.blobtable import BlobTable
from azqemu.memory.kinds import FLAG_REF_TEMPLATE, PAGE_SIZE, Kind
from azqemu.memory.pagehash import ZERO_CHECK, page_hashes_rows
from azqemu.memory.template import TemplateImage
from azqemu.memory.zstdlib import PageZstd
from azqemu.pages import take_rows

_ZERO_ARRAY = np.zeros(PAGE_SIZE, dtype=np.uint8)
_ZERO_ARRAY.flags.writeable = False
_DIGEST = xxhash.xxh3_128_digest
_KIND_ZERO, _KIND_TEMPLATE = int(Kind.ZERO), int(Kind.TEMPLATE)

# One located page: its kind, the template (or zero) page it is copied from and the check that
# page must hash to, or the recipe of its blob (None for ZERO and template pages).
Located = tuple[int, np.ndarray, int, Recipe | None]


# ---------------------------------------------------------------------- one page (fault path)
def locate_page(table: BlobTable, arenas: ArenaSet, template: TemplateImage, page_idx: int,
                kind: int, flags: int, ref: int) -> Located:
    """Where one entry (``kind``, ``flags``, ``ref`` of ``page_idx``) decodes from.

    The caller (PageStore.decode_page_into) holds the store's state lock: a blob's payload is
    copied out here.
    """
    recipe = None
    src: np.ndarray = _ZERO_ARRAY
    expect = ZERO_CHECK
    if kind == _KIND_ZERO:
        pass
    elif kind == _KIND_TEMPLATE or (flags & FLAG_REF_TEMPLATE):
        tpage = page_idx if kind == _KIND_TEMPLATE else ref
        tp = template.page(tpage)
        if tp is not None:
            src = tp
            expect = template.check_of(tpage)
    else:
        recipe = read_recipe(table, arenas, ref)
    return kind, src, expect, recipe


def _page_buf(tls: threading.local) -> tuple[np.ndarray, int]:
    pair = getattr(tls, "page", None)
    if pair is None:
        buf = np.empty(PAGE_SIZE, dtype=np.uint8)
        pair = tls.page = (buf, buf.ctypes.data)
    return pair


def write_page(zstd: PageZstd, tls: threading.local, template: TemplateImage, page_idx: int,
               located: Located, out: Any) -> None:
    """Write the located page into ``out`` (a writable 4096-byte buffer), verified first.

    Runs without the store's lock. ``out`` is only written once the page matched its checksum:
    a blob is decoded into the calling thread's scratch page (kept in ``tls``, the store's
    thread-local state) and copied from there.
    """
    kind, src, expect, recipe = located
    if kind == _KIND_ZERO:
        out[:PAGE_SIZE] = _ZERO_ARRAY
        return
    if recipe is None:
        if int.from_bytes(_DIGEST(src.data)[8:], "little") != expect:
            raise ChecksumMismatch(page_idx, "template page")
        out[:PAGE_SIZE] = src
        return
    buf, buf_addr = _page_buf(tls)
    try:
        decode_recipe(zstd, recipe, buf, template, buf_addr)
    except ChecksumMismatch as err:
        raise ChecksumMismatch(page_idx, str(err)) from err
    out[:PAGE_SIZE] = buf


# ---------------------------------------------------------------------- many pages (prefetch)
@dataclass
class LocatedRows:
    """The entries of one bulk decode split by source, with the blob payloads copied out."""

    kind: np.ndarray         # u1 Kind per row
    ref: np.ndarray          # int64 blob id or template page index per row
    m_tpl: np.ndarray        # rows that are TEMPLATE pages
    m_dupt: np.ndarray       # rows that are DUPs of a template page
    m_blob: np.ndarray       # rows decoded from a blob
    first: np.ndarray        # per distinct blob: its first row among the blob rows
    inverse: np.ndarray      # per blob row: its distinct blob
    batch: Batch             # the distinct blobs' fields and payloads


def locate_rows(table: BlobTable, arenas: ArenaSet, kind: np.ndarray, flags: np.ndarray,
                ref32: np.ndarray) -> LocatedRows:
    """Split found entries by source and copy their blobs out, each distinct blob once.

    The caller (PageStore.decode) holds the store's state lock.
    """
    ref = ref32.astype(np.int64)
    m_tpl = kind == _KIND_TEMPLATE
    m_dupt = (flags & FLAG_REF_TEMPLATE) != 0
    m_blob = ~m_tpl & ~m_dupt & (kind != _KIND_ZERO)
    blobs, first, inverse = np.unique(ref[m_blob], return_index=True, return_inverse=True)
    batch = read_batch(table, arenas, blobs)
    return LocatedRows(kind, ref, m_tpl, m_dupt, m_blob, first, inverse, batch)


def write_rows(zstd: PageZstd, template: TemplateImage, page_idx: np.ndarray, rows: LocatedRows,
               out: np.ndarray) -> None:
    """Write the located pages into ``out`` (row j: ``page_idx[j]``), every page verified.

    Runs without the store's lock. On ChecksumMismatch (its ``page_idx`` names a page that
    failed) the contents of ``out`` are undefined and must not reach a guest.
    """
    n = len(page_idx)
    kind, ref, m_tpl, m_dupt, m_blob = rows.kind, rows.ref, rows.m_tpl, rows.m_dupt, rows.m_blob
    first, inverse, batch = rows.first, rows.inverse, rows.batch
    # Template rows are gathered from the template, ZERO rows zero-filled; blob rows are
    # written by the decoder below (a hot set is mostly blobs: no gather for them).
    t_any = m_tpl | m_dupt
    src = np.full(n, template.zero_row, dtype=np.int64)
    if t_any.all():
        src = template.rows_z(np.where(m_tpl, page_idx, ref))
        take_rows(template.pages_z, src, out)
    elif t_any.any():
        tr = np.flatnonzero(t_any)
        src[tr] = template.rows_z(np.where(m_tpl[tr], page_idx[tr], ref[tr]))
        out[tr] = template.pages_z[src[tr]]
    out[kind == _KIND_ZERO] = 0
    # Template-derived rows are verified by hashing: the template is trusted only as far as
    # its load-time hashes.
    trows = np.flatnonzero(t_any & (src != template.zero_row))
    if len(trows):
        bad = page_hashes_rows(out, trows)[1] != template.checks_of(src[trows])
        if bad.any():
            raise ChecksumMismatch(int(page_idx[trows[np.flatnonzero(bad)[0]]]), "template page")
    if len(batch.blobs):
        brows = np.flatnonzero(m_blob)
        # Decode each blob once, into the first row that needs it, then copy to the others.
        try:
            decode_batch(zstd, batch, template, out, brows[first])
        except ChecksumMismatch as err:
            # Name the first requested page that depends on the failing blob.
            bad_blob = getattr(err, "blob_id", -1)
            hit = np.flatnonzero(ref[brows] == bad_blob)
            if len(hit) == 0 and batch.base is not None:
                users = batch.blobs[batch.base_pos >= 0][batch.base.blobs[batch.base_pos[batch.base_pos >= 0]]
                                                         == bad_blob]
                hit = np.flatnonzero(np.isin(ref[brows], users))
            page = int(page_idx[brows[hit[0]]]) if len(hit) else -1
            raise ChecksumMismatch(page, str(err)) from err
        others = np.ones(len(brows), dtype=bool)
        others[first] = False
        if others.any():
            out[brows[others]] = out[brows[first][inverse[others]]]
