"""Similarity index of sampled block hashes (Difference Engine style) for SDELTA bases.

Difference Engine (Gupta et al., OSDI'08) finds candidate reference pages by hashing a few
64-byte blocks at fixed offsets of every page: two pages that share one of those blocks at the
same offset are likely to be versions of each other. We do the same, vectorised: the
fingerprint of a block is a multiply-xorshift mix of its eight 64-bit words computed with
numpy over all pages at once, the index is a sorted array of fingerprints searched with
``np.searchsorted``, and a query page takes the candidate that matches the most samples.

Blocks whose eight words are all equal (zero runs, fill patterns) match too many unrelated
pages to say anything and are not sampled (fingerprint 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from azqemu.memory.kinds import PAGE_SIZE, WORDS_PER_PAGE

# Sample blocks: 8 words (64 bytes) at word offsets spread over the page. The offsets are
# arbitrary but fixed (they are part of nothing on disk; changing them only changes which
# candidates are found). Four samples instead of Difference Engine's two: each is cheap here
# and recall on partly rewritten pages improves markedly (measured on the synthetic corpus).
SAMPLE_WORD_OFFSETS = (27, 141, 290, 433)
SAMPLE_WORDS = 8
N_SAMPLES = len(SAMPLE_WORD_OFFSETS)
assert all(o + SAMPLE_WORDS <= WORDS_PER_PAGE for o in SAMPLE_WORD_OFFSETS)

_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                 0x27D4EB2F165667C5, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0xD6E8FEB86659FD93],
                dtype=np.uint64)
_SLOT = np.array([0x0, 0x5851F42D4C957F2D, 0x14057B7EF767814F, 0x2545F4914F6CDD1D], dtype=np.uint64)
_OFFSETS = np.array(SAMPLE_WORD_OFFSETS, dtype=np.int64)      # the C loop's view of them
assert len(_MIX) == SAMPLE_WORDS == 8 and len(_SLOT) == N_SAMPLES   # azq_sample_fingerprints mixes 8 words
# The source dtypes the C loops read, as azq_sim_hits names them.
_SOURCE_BYTES = {np.dtype(np.uint32): 4, np.dtype(np.int32): -4, np.dtype(np.int64): 8}


def _native() -> Any | None:
    """_pagecodec.so's loops (one call a batch; the numpy below is the fallback, kept to the
    same results by tests/unit/memory/test_simindex_native.py)."""
    from azqemu.memory.zstdlib import _NATIVE

    return _NATIVE


def sample_fingerprints(pages: np.ndarray) -> np.ndarray:
    """(n, N_SAMPLES) uint64 fingerprints of the sample blocks; 0 where a block is constant."""
    n = len(pages)
    out = np.zeros((n, N_SAMPLES), dtype=np.uint64)
    if n == 0:
        return out
    pages = np.ascontiguousarray(pages)
    lib = _native()
    if lib is not None and pages.dtype == np.uint8 and pages.size == n * PAGE_SIZE:
        lib.azq_sample_fingerprints(n, pages.ctypes.data, N_SAMPLES, _OFFSETS.ctypes.data, _MIX.ctypes.data,
                                    _SLOT.ctypes.data, out.ctypes.data)
        return out
    return _numpy_fingerprints(pages, out)


def _numpy_fingerprints(pages: np.ndarray, out: np.ndarray) -> np.ndarray:
    words = pages.view(np.uint64).reshape(len(pages), WORDS_PER_PAGE)
    with np.errstate(over="ignore"):
        for k, off in enumerate(SAMPLE_WORD_OFFSETS):
            blk = words[:, off:off + SAMPLE_WORDS]
            h = (blk * _MIX).sum(axis=1, dtype=np.uint64)      # wraps mod 2^64 on purpose
            h ^= h >> np.uint64(31)
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(29)
            h ^= _SLOT[k]                                       # a match must be at the same offset
            h |= np.uint64(1)                                   # 0 is reserved for "not sampled"
            const = (blk == blk[:, :1]).all(axis=1)
            h[const] = 0
            out[:, k] = h
    return out


@dataclass
class SimilarityIndex:
    """Sorted sample fingerprints -> source ids (template page index or blob id)."""

    keys: np.ndarray     # uint64, sorted
    sources: np.ndarray  # int64 or uint32, aligned with keys
    excluded_hit: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), repr=False)

    @classmethod
    def build(cls, fps: np.ndarray, sources: np.ndarray) -> SimilarityIndex:
        if len(sources) == 0:
            return cls(np.zeros(0, np.uint64), np.zeros(0, np.asarray(sources).dtype))
        fps = np.asarray(fps, dtype=np.uint64).reshape(len(sources), -1)
        flat = fps.reshape(-1)
        src = np.repeat(np.asarray(sources), fps.shape[1])      # keeps the caller's dtype
        keep = flat != 0
        flat, src = flat[keep], src[keep]
        order = np.argsort(flat, kind="stable")
        return cls(flat[order], src[order])

    @classmethod
    def merged(cls, parts: list[SimilarityIndex]) -> SimilarityIndex:
        """One index of ``parts`` in order, u32 sources: a stable sort keeps, for equal
        fingerprints, the entries of earlier parts first (sorted runs: timsort merges them in
        linear time)."""
        keys = np.concatenate([p.keys for p in parts])
        src = np.concatenate([p.sources.astype(np.uint32) for p in parts])
        order = np.argsort(keys, kind="stable")
        return cls(keys[order], src[order])

    @classmethod
    def empty(cls) -> SimilarityIndex:
        return cls(np.zeros(0, np.uint64), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.sources.nbytes)

    def query(self, fps: np.ndarray, exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Best candidate per query row and its number of matching samples (-1, 0 if none).

        ``exclude`` (one source id per row, or None) removes a candidate such as the page's own
        same-address template page, which TDELTA covers already; ``self.excluded_hit`` then
        tells which rows matched their excluded source (a sign the two pages are related).
        """
        n = len(fps)
        self.excluded_hit = np.zeros(n, dtype=bool)
        if n == 0 or len(self.keys) == 0:
            return np.full(n, -1, np.int64), np.zeros(n, np.int64)
        lib = _native()
        if lib is not None and self._native_ok(fps):
            cand = np.empty(fps.shape, np.int64)
            ex = None if exclude is None else np.ascontiguousarray(exclude, dtype=np.int64)
            if ex is not None and ex.shape != (n,):
                raise ValueError(f"exclude holds {ex.shape} sources for {n} rows")
            self._hits(lib, fps, cand, ex, only_missing=False)
            return _native_best(lib, cand)
        cand, hit, pos_c = self.first_hits(fps)
        if exclude is not None:
            # A duplicated fingerprint may hide a second candidate behind the excluded one:
            # look one slot further for those rows.
            ex = cand == np.asarray(exclude, dtype=np.int64)[:, None]
            self.excluded_hit = ex.any(axis=1)
            if ex.any():
                nxt = np.minimum(pos_c + 1, len(self.keys) - 1)
                alt_hit = hit & (self.keys[nxt] == fps) & (self.sources[nxt] != cand)
                cand = np.where(ex, np.where(alt_hit, self.sources[nxt].astype(np.int64), -1), cand)
        return best_candidates(cand)

    def _native_ok(self, fps: np.ndarray) -> bool:
        """Whether the C loops take these arrays as they are (the usual case)."""
        return (fps.dtype == np.uint64 and fps.ndim == 2 and fps.shape[1] == N_SAMPLES and fps.flags.c_contiguous
                and self.keys.dtype == np.uint64 and self.keys.flags.c_contiguous
                and self.sources.dtype in _SOURCE_BYTES and self.sources.flags.c_contiguous)

    def _hits(self, lib: Any, fps: np.ndarray, cand: np.ndarray, exclude: np.ndarray | None, *,
              only_missing: bool) -> None:
        """First hits into ``cand`` in C (``azq_sim_hits``); with ``exclude``, sets
        ``excluded_hit``."""
        ex_hit = np.zeros(len(fps), np.uint8) if exclude is not None else None
        lib.azq_sim_hits(fps.size, N_SAMPLES, fps.ctypes.data, len(self.keys), self.keys.ctypes.data,
                         self.sources.ctypes.data, _SOURCE_BYTES[self.sources.dtype],
                         None if exclude is None else exclude.ctypes.data, int(only_missing), cand.ctypes.data,
                         None if ex_hit is None else ex_hit.ctypes.data)
        if ex_hit is not None:
            self.excluded_hit = ex_hit.view(bool)

    def first_hits(self, fps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per fingerprint, the source of its first entry (-1: none), whether it hit, and where."""
        if len(self.keys) == 0:
            return np.full(fps.shape, -1, np.int64), np.zeros(fps.shape, bool), np.zeros(fps.shape, np.int64)
        pos_c = np.minimum(np.searchsorted(self.keys, fps), len(self.keys) - 1)
        hit = (self.keys[pos_c] == fps) & (fps != 0)
        # int64 first: blob indices hold u32 sources, where -1 would wrap to a valid-looking id.
        return np.where(hit, self.sources[pos_c].astype(np.int64), -1), hit, pos_c


def _native_best(lib: Any, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``best_candidates`` in C, for a C-contiguous (n, N_SAMPLES) int64 ``cand``."""
    best, votes = np.empty(len(cand), np.int64), np.empty(len(cand), np.int64)
    lib.azq_best_candidates(len(cand), N_SAMPLES, cand.ctypes.data, best.ctypes.data, votes.ctypes.data)
    return best, votes


def best_candidates(cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of per-sample candidates: the one most samples name, and how many do."""
    valid = cand >= 0
    votes = np.zeros(cand.shape, dtype=np.int64)
    for k in range(cand.shape[1]):
        votes[:, k] = ((cand == cand[:, k:k + 1]) & valid).sum(axis=1) * valid[:, k]
    best = votes.argmax(axis=1)
    rows = np.arange(len(cand))
    return cand[rows, best], votes[rows, best]


@dataclass
class LayeredIndex:
    """A large sorted index and a younger, smaller one: a query answers what the two merged
    would (for equal fingerprints the older entry first, as a stable merge orders them)
    without re-sorting the large one at every commit (BlobTable._merge_sim)."""

    old: SimilarityIndex
    young: SimilarityIndex

    def __len__(self) -> int:
        return len(self.old) + len(self.young)

    def query(self, fps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(fps)
        if n == 0 or len(self) == 0:
            return np.full(n, -1, np.int64), np.zeros(n, np.int64)
        lib = _native()
        if lib is not None and self.old._native_ok(fps) and self.young._native_ok(fps):
            cand = np.empty(fps.shape, np.int64)
            self.old._hits(lib, fps, cand, None, only_missing=False)
            self.young._hits(lib, fps, cand, None, only_missing=True)
            return _native_best(lib, cand)
        cand = self.old.first_hits(fps)[0]
        miss = cand < 0
        if miss.any():
            cand[miss] = self.young.first_hits(fps[miss])[0]
        return best_candidates(cand)
