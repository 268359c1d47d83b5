"""Page representations and the constants shared by the codec, the store and the analyzer.

Every resident 4 KiB guest page is encoded as exactly one ``Kind``. Delta kinds (TDELTA,
SDELTA) additionally carry a ``Method``: XOR against the reference page followed by zstd, or
zstd with the reference page as a raw-content prefix (zstd's "raw content dictionary").
The numbers are part of the on-disk format: append, never renumber.
"""

from __future__ import annotations

import enum

import numpy as np

from azqemu.pages import PAGE_SHIFT, PAGE_SIZE

__all__ = ["PAGE_SHIFT", "PAGE_SIZE"]  # re-exported: the codec's modules import them from here
WORDS_PER_PAGE = PAGE_SIZE // 8

# An encoded page larger than this is not worth storing: it stays resident (RAW). zram keeps
# pages that compress worse than ~3/4 of a page uncompressed for the same reason (its
# "huge page" class), so both models use one threshold.
RAW_THRESHOLD_BYTES = 3000


class Kind(enum.IntEnum):
    ZERO = 0        # all-zero page: nothing stored
    TEMPLATE = 1    # identical to the template page at the same page index: nothing stored
    DUP = 2         # identical to a stored blob of the same domain, or to a template page elsewhere
    TDELTA = 3      # delta against the template page at the same page index
    SDELTA = 4      # delta against a similar page (template elsewhere, or a sibling's blob)
    ZSTD = 5        # zstd of the page alone
    RAW = 6         # nothing profitable: stays resident, not stored
    LZ4 = 7         # LZ4 of the page alone: a hot page, cheap to decode (see HOT_DECODE_BUDGET_US)


class Method(enum.IntEnum):
    """How a blob's payload turns back into a page."""

    ZSTD = 0          # zstd frame of the page
    XOR = 1           # zstd frame of (page XOR reference)
    PREFIX = 2        # zstd frame compressed with the reference page as raw-content prefix
    LZ4 = 3           # LZ4 block of the page (no reference)
    LZ4_XOR = 4       # LZ4 block of (page XOR reference)
    PATCH = 5         # the byte runs where the page differs from the reference (pagepatch.py)


class RefType(enum.IntEnum):
    """What a blob's reference names."""

    NONE = 0
    TEMPLATE = 1      # ``ref`` is a template page index
    BLOB = 2          # ``ref`` is a blob id of the same domain (an SDELTA base)


# Sandbox index entries (pages that are neither ZERO nor TEMPLATE; those live in a 2-bit map):
# ``ref`` is a blob id, or a template page index for a DUP of a template page, marked by
# ``flags & FLAG_REF_TEMPLATE``.
FLAG_REF_TEMPLATE = 1

ENTRY_DTYPE = np.dtype([("page_idx", "<u4"), ("kind", "u1"), ("flags", "u1"), ("ref", "<u4")])   # 10 bytes

# Decode cost model in microseconds per page, measured on the development machine
# (EPYC under a hypervisor, tests/perf/test_codec_perf.py). The encoder refuses a
# representation whose estimated decode cost exceeds the budget.
DECODE_COST_US = {Method.ZSTD: 6.0, Method.XOR: 7.0, Method.PREFIX: 7.5, Method.LZ4: 1.3, Method.LZ4_XOR: 1.6,
                  Method.PATCH: 0.5}
DEFAULT_DECODE_BUDGET_US = 20.0
# Hot pages (touched since the last resume: the next resume prefetches them before the vCPUs
# continue, and the rest of them fault first) get this budget instead: only LZ4 fits among the
# codecs (zstd of any level and method costs 4-8 us per page here; LZ4 ~1.2 us), of the page or
# of its XOR with a template page (TDELTA/SDELTA with Method.LZ4_XOR). ZERO, TEMPLATE and DUP
# pages are unaffected. Measured on real guest text pages: bulk decode
# ~4x faster for ~35% more bytes on those pages (LZ4 HC 2 2.44x vs zstd-1 3.32x; lz4page.py).
HOT_DECODE_BUDGET_US = 2.0
