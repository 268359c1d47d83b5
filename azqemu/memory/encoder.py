"""The encoder: choose one representation per page, cheap kinds vectorised, the rest per page.

Order of decisions, cheapest first:
1. ZERO and TEMPLATE over all pages at once (one C loop comparing the template pages in place
   where _pagecodec.so is built; else numpy, pages compared as uint64 words, in chunks so the
   template pages gathered for comparison stay small);
2. one XXH3-128 per remaining page, then DUP against the template at any address, against
   the blobs already stored in the sharing domain, and within the batch; every DUP found by
   hash is confirmed byte for byte (a guest could craft XXH3 collisions);
3. the pages left go through the per-page codecs: plain zstd always; XOR+zstd against the
   same-address template page when enough 64-bit words are unchanged; zstd with the template
   page as raw prefix (effort >= 2); SDELTA against the best candidate of the similarity
   index (template pages elsewhere, or the domain's blobs). The smallest payload whose decode
   cost fits the budget wins; a delta must beat plain zstd by ``DELTA_MIN_GAIN_BYTES`` since it
   pins its reference; above ``RAW_THRESHOLD_BYTES`` the page stays RAW.
   Hot pages (``hot``: the caller's prediction of what the next resume puts back first) that
   reach this step are held to ``HOT_DECODE_BUDGET_US`` instead: LZ4 (high-compression mode)
   of the page, or of its XOR with the same-address template page or the SDELTA reference.

The encoder only plans; the store commits the plan (arena writes, blob table, references).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from azqemu.memory import lz4page, pagepatch
from azqemu.memory.attempts import AttemptOdds
from azqemu.memory.kinds import (
    DECODE_COST_US,
    DEFAULT_DECODE_BUDGET_US,
    HOT_DECODE_BUDGET_US,
    PAGE_SIZE,
    RAW_THRESHOLD_BYTES,
    Kind,
    Method,
    RefType,
)
from azqemu.memory.pagehash import page_hashes_rows
from azqemu.memory.simindex import N_SAMPLES, LayeredIndex, SimilarityIndex, sample_fingerprints
from azqemu.memory.template import TemplateImage
from azqemu.memory.zstdlib import (
    ATTEMPT_SLOTS,
    BOUND_BYTES,
    C_LZ4,
    C_LZ4_XOR_T,
    C_PATCH_T,
    C_PREFIX_T,
    C_RAW,
    C_ZSTD,
    F_HAS_S,
    F_LZ4,
    F_PATCH,
    F_PREFIX_S,
    F_PREFIX_T,
    F_XOR_S,
    F_XOR_T,
    NATIVE_LZ4,
    PageZstd,
    classify_native,
    rows_equal,
)
from azqemu.pages import Scratch, scratch_rows, take_rows

# Pages per vectorised classification step: 1 MiB of pages plus as much template data, so
# the gathered template pages are still in cache when they are compared.
CLASSIFY_CHUNK_PAGES = 256
# Try XOR against a reference only when at least this many of the 512 words are unchanged:
# below that the XOR stream is about as random as the page and zstd of it only costs time.
XOR_MIN_SAME_WORDS = 32
# A delta must save this many bytes over plain zstd, because it keeps its reference alive
# (an SDELTA base blob cannot be freed while the delta exists).
DELTA_MIN_GAIN_BYTES = 16
# Encoder effort: 1 = zstd, XOR deltas, SDELTA, and the template page as zstd prefix only for
# pages related to it (a sampled block in common, or some unchanged words); 2 = the prefix
# attempt for every page with a non-zero same-address template page. On the synthetic corpus
# effort 2 saved 0.1% of the bytes for 10-15% more encode time (tests/perf/test_codec_perf.py).
DEFAULT_EFFORT = 1
# "Some unchanged words" for effort 1: 8 of 512 aligned words equal is unlikely by chance.
PREFIX_MIN_SAME_WORDS = 8
# A delta this small is not going to be beaten by plain zstd by DELTA_MIN_GAIN_BYTES: skip
# the plain attempt (~0.5% of a page).
TINY_DELTA_BYTES = 128

# Unique pages are encoded in chunks through scratch buffers kept for the whole plan (5 x
# 512 KiB, and the batch codec's 528 KiB output): fresh large allocations page-fault on every
# batch, which costs more than the copy itself here. 128 pages rather than 512: the buffers
# are what a compression holds above the manager's idle memory, 3 MiB instead of 12, and
# the vectorised steps per chunk cost ~0.1 ms against ~2 ms of zstd for 128 pages.
UNIQUE_CHUNK_PAGES = 128
# Below this many bytes a payload is not worth a further (costlier) attempt.
SMALL_ENOUGH_BYTES = 128

_K_ZSTD, _K_TDELTA, _K_SDELTA, _K_RAW = int(Kind.ZSTD), int(Kind.TDELTA), int(Kind.SDELTA), int(Kind.RAW)
_K_LZ4 = int(Kind.LZ4)
_M_ZSTD, _M_XOR, _M_PREFIX, _M_LZ4 = int(Method.ZSTD), int(Method.XOR), int(Method.PREFIX), int(Method.LZ4)
_M_LZ4_XOR, _M_PATCH = int(Method.LZ4_XOR), int(Method.PATCH)
_R_NONE, _R_TEMPLATE, _R_BLOB = int(RefType.NONE), int(RefType.TEMPLATE), int(RefType.BLOB)

# Plan target kinds (what ``Plan.target`` holds for a page).
T_NONE, T_BLOB, T_NEW, T_TEMPLATE = 0, 1, 2, 3


class DomainView(Protocol):
    """What the encoder needs to know about the sharing domain (implemented by the store)."""

    def find_dups(self, key: np.ndarray) -> np.ndarray: ...           # blob id or -1
    # Verified contents (page rows) and whether each blob still lives (False: freed since found).
    def blob_pages(self, blob_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def blob_decode_cost_us(self, blob_id: int) -> float: ...
    def blob_shared(self, blob_id: int) -> bool: ...                   # referenced more than once
    def bases_among(self, blob_ids: np.ndarray) -> np.ndarray: ...    # per blob: may serve as SDELTA base
    def decode_costs_us(self, blob_ids: np.ndarray) -> np.ndarray: ...  # blob_decode_cost_us of many
    def sim_index(self) -> SimilarityIndex | LayeredIndex: ...         # sources are blob ids


@dataclass
class NewBlobs:
    """The blobs a plan creates, as parallel arrays, their payloads back to back."""

    prow: np.ndarray       # int64 row of the page in the plan's arrays
    method: np.ndarray     # u8 Method
    reftype: np.ndarray   # u8 RefType
    ref: np.ndarray        # int64 template page index or base blob id
    key: np.ndarray        # u64
    check: np.ndarray      # u64
    length: np.ndarray     # u32 payload bytes
    fps: np.ndarray        # (n, N_SAMPLES) u64 sample fingerprints
    has_fp: np.ndarray     # bool: enters the similarity index (may serve as an SDELTA base)
    payload: bytes

    def __len__(self) -> int:
        return len(self.prow)

    @classmethod
    def concat(cls, parts: list[NewBlobs]) -> NewBlobs:
        if not parts:
            z = np.zeros(0, np.int64)
            return cls(z, z.astype(np.uint8), z.astype(np.uint8), z, z.astype(np.uint64), z.astype(np.uint64),
                       z.astype(np.uint32), np.zeros((0, N_SAMPLES), np.uint64), z.astype(bool), b"")
        if len(parts) == 1:
            return parts[0]
        cat = np.concatenate
        return cls(cat([p.prow for p in parts]), cat([p.method for p in parts]), cat([p.reftype for p in parts]),
                   cat([p.ref for p in parts]), cat([p.key for p in parts]), cat([p.check for p in parts]),
                   cat([p.length for p in parts]), cat([p.fps for p in parts]), cat([p.has_fp for p in parts]),
                   b"".join(p.payload for p in parts))


@dataclass
class Plan:
    page_idx: np.ndarray              # int64, the caller's order
    kind: np.ndarray                  # uint8 Kind per page
    target: np.ndarray                # uint8 T_* per page
    ref: np.ndarray                   # int64: blob id, new-blob number or template page index
    blobs: NewBlobs = field(default_factory=lambda: NewBlobs.concat([]))
    tries: dict[str, int] = field(default_factory=dict)
    parts: list[NewBlobs] = field(default_factory=list)
    n_blobs: int = 0

    def add_blobs(self, part: NewBlobs) -> np.ndarray:
        """Number the blobs of ``part`` (0, 1, ... across the plan) and point their pages at them."""
        nums = np.arange(self.n_blobs, self.n_blobs + len(part), dtype=np.int64)
        self.n_blobs += len(part)
        self.parts.append(part)
        self.target[part.prow] = T_NEW
        self.ref[part.prow] = nums
        return nums


@dataclass
class EncoderOptions:
    effort: int = DEFAULT_EFFORT
    decode_budget_us: float = DEFAULT_DECODE_BUDGET_US
    use_siblings: bool = True
    raw_threshold_bytes: int = RAW_THRESHOLD_BYTES
    hot_decode_budget_us: float = HOT_DECODE_BUDGET_US
    patch: bool = True          # PATCH payloads for small deltas (off: the ablation of benchmarks)


def classify_cheap(page_idx: np.ndarray, pages: np.ndarray, template: TemplateImage,
                   scratch: np.ndarray | None = None) -> np.ndarray:
    """Vectorised first pass: Kind.ZERO, Kind.TEMPLATE, or Kind.RAW meaning 'undecided'.

    In C where _pagecodec.so is built (the template pages compared in place, a zero page
    given up at its first non-zero block), else in numpy; both give the same kinds."""
    n = len(page_idx)
    kind = np.full(n, int(Kind.RAW), dtype=np.uint8)
    if n == 0:
        return kind
    rows = template.rows(page_idx)
    # One reference to the mapping for the whole call (a concurrent close() swaps the
    # attribute; this view keeps the pages mapped). A closed image has no zero row: numpy
    # then raises as it always did.
    tpages = template.pages_z
    if len(tpages) > template.zero_row and classify_native(pages, rows, tpages, kind, int(Kind.ZERO),
                                                           int(Kind.TEMPLATE)):
        return kind
    words = pages.reshape(n, PAGE_SIZE).view(np.uint64)
    rows_all = np.where(rows >= 0, rows, template.zero_row)      # template.rows_z
    if scratch is None or len(scratch) < CLASSIFY_CHUNK_PAGES:
        scratch = np.empty((CLASSIFY_CHUNK_PAGES, PAGE_SIZE), dtype=np.uint8)
    tw_all = scratch.view(np.uint64)
    for s in range(0, n, CLASSIFY_CHUNK_PAGES):
        e = min(n, s + CLASSIFY_CHUNK_PAGES)
        w = words[s:e]
        tw = tw_all[:e - s]
        # Gather the same-address template pages (holes read the zero row) into warm scratch:
        # a chunk fits in L2/L3, so gather and compare run at cache speed.
        take_rows(tpages, rows_all[s:e], scratch[:e - s])
        zero = ~w.any(axis=1)
        same = (w == tw).all(axis=1)
        k = kind[s:e]
        k[same] = int(Kind.TEMPLATE)
        k[zero] = int(Kind.ZERO)          # a zero page at a template hole is ZERO, not TEMPLATE
    return kind


class Encoder:
    def __init__(self, zstd: PageZstd, options: EncoderOptions | None = None,
                 scratch: Scratch | None = None, odds: AttemptOdds | None = None) -> None:
        """``scratch``: buffers by name that outlive this encoder (the caller's for a whole
        compression: one ``plan`` per chunk then reuses them instead of faulting in new ones).
        ``odds``: the sharing domain's record of which follow-up attempts pay (attempts.py);
        None: every attempt on every page."""
        self.zstd = zstd
        self.opt = options or EncoderOptions()
        self._bufs: Scratch = {} if scratch is None else scratch
        self.odds = odds

    def plan(self, page_idx: np.ndarray, pages: np.ndarray, template: TemplateImage,
             domain: DomainView | None, hot: np.ndarray | None = None) -> Plan:
        """Plan every page; ``hot`` (bool per page, optional) marks the pages held to the hot
        decode budget."""
        page_idx = np.asarray(page_idx, dtype=np.int64)
        pages = np.ascontiguousarray(pages, dtype=np.uint8).reshape(len(page_idx), PAGE_SIZE)
        n = len(page_idx)
        kind = classify_cheap(page_idx, pages, template, self._scratch("classify", CLASSIFY_CHUNK_PAGES))
        target = np.zeros(n, dtype=np.uint8)
        ref = np.zeros(n, dtype=np.int64)
        plan = Plan(page_idx, kind, target, ref, tries={"zstd": 0, "xor": 0, "prefix": 0, "sdelta": 0, "lz4": 0,
                                                                   "patch": 0})
        rest = np.flatnonzero(kind == int(Kind.RAW))
        if len(rest) == 0:
            return plan
        key, check = page_hashes_rows(pages, rest)
        undecided = np.ones(len(rest), dtype=bool)

        # -- DUP of a template page anywhere (confirmed bytewise, vectorised) --------------
        trow = template.find_dups(key)
        hit = np.flatnonzero(trow >= 0)
        if len(hit):
            ok = rows_equal(pages, rest[hit], template.pages, trow[hit])
            h = hit[ok]
            kind[rest[h]] = int(Kind.DUP)
            target[rest[h]] = T_TEMPLATE
            ref[rest[h]] = trow[h]           # a template row is its page index
            undecided[h] = False

        # -- DUP of a blob of the domain (confirmed by decoding it) ---------------------------
        hot_rows = None if hot is None else np.asarray(hot, dtype=bool)[rest]
        hot_budget = self.opt.hot_decode_budget_us
        if domain is not None and self.opt.use_siblings:
            cand = np.flatnonzero(undecided)
            bid = domain.find_dups(key[cand])
            js: list[int] = []
            for j in np.flatnonzero(bid >= 0).tolist():
                b = int(bid[j])
                if (hot_rows is not None and hot_rows[int(cand[j])] and domain.blob_decode_cost_us(b) > hot_budget
                        and not domain.blob_shared(b)):
                    # A hot page whose only copy is a slow-to-decode blob (typically its own
                    # entry from an earlier wait, encoded while it was cold, which this encode
                    # replaces and frees): re-encode it for the hot budget. A blob that other
                    # pages share is kept: its memory saving beats the decode time.
                    continue
                js.append(j)
            if js:
                j_arr = np.asarray(js, dtype=np.int64)
                found, live = domain.blob_pages(bid[j_arr])   # not live: freed meanwhile (a sibling's discard)
                i_arr = cand[j_arr]
                same = live & rows_equal(pages, rest[i_arr], found, np.arange(len(j_arr)))
                hit_rows = rest[i_arr[same]]
                kind[hit_rows] = int(Kind.DUP)
                target[hit_rows] = T_BLOB
                ref[hit_rows] = bid[j_arr[same]]
                undecided[i_arr[same]] = False

        # -- DUP within the batch: first occurrence is encoded, later ones point at it -------
        cand = np.flatnonzero(undecided)
        first_of = np.full(len(rest), -1, dtype=np.int64)
        if len(cand) > 1:
            _, first, inverse = np.unique(key[cand], return_index=True, return_inverse=True)
            rep = cand[first[inverse]]
            dup = np.flatnonzero(rep != cand)
            if len(dup):
                same = rows_equal(pages, rest[cand[dup]], pages, rest[rep[dup]])
                first_of[cand[dup[same]]] = rep[dup[same]]
                undecided[cand[dup[same]]] = False

        # -- per-page codecs for the unique pages --------------------------------------------
        uniq = np.flatnonzero(undecided)
        self._encode_unique(plan, pages, rest, key, check, uniq, template, domain, hot)
        plan.blobs = NewBlobs.concat(plan.parts)
        plan.parts = []
        # Later batch duplicates follow their representative (which may have become RAW).
        dups = np.flatnonzero(first_of >= 0)
        if len(dups):
            rep_rows = rest[first_of[dups]]
            stored = target[rep_rows] == T_NEW
            kind[rest[dups[~stored]]] = int(Kind.RAW)
            d = rest[dups[stored]]
            kind[d] = int(Kind.DUP)
            target[d] = T_NEW
            ref[d] = ref[rep_rows[stored]]
        return plan

    def _scratch(self, name: str, rows: int) -> np.ndarray:
        return scratch_rows(self._bufs, f"enc-{name}", rows)

    def _encode_unique(self, plan: Plan, pages: np.ndarray, rest: np.ndarray, key: np.ndarray,
                       check: np.ndarray, uniq: np.ndarray, template: TemplateImage,
                       domain: DomainView | None, hot: np.ndarray | None = None) -> None:
        """Encode the unique pages ``pages[rest[uniq]]`` into ``plan``."""
        lz4_ok = DECODE_COST_US[Method.LZ4] <= self.opt.hot_decode_budget_us
        hot_u = (np.asarray(hot, dtype=bool)[rest[uniq]] if hot is not None and lz4_ok
                 else np.zeros(len(uniq), dtype=bool))
        sim_b = domain.sim_index() if (domain is not None and self.opt.use_siblings) else None
        sim_t = template.simindex()
        assert isinstance(sim_t, SimilarityIndex)
        for s in range(0, len(uniq), UNIQUE_CHUNK_PAGES):
            self._encode_chunk(plan, pages, rest, key, check, uniq[s:s + UNIQUE_CHUNK_PAGES], template,
                               domain, sim_t, sim_b, hot_u[s:s + UNIQUE_CHUNK_PAGES])

    def _encode_chunk(self, plan: Plan, pages: np.ndarray, rest: np.ndarray, key: np.ndarray,
                      check: np.ndarray, uniq: np.ndarray, template: TemplateImage, domain: DomainView | None,
                      sim_t: SimilarityIndex, sim_b: SimilarityIndex | LayeredIndex | None,
                      hot: np.ndarray) -> None:
        opt = self.opt
        z = self.zstd
        budget = opt.decode_budget_us
        m = len(uniq)
        prow_all = rest[uniq]
        up = self._scratch("up", m)
        take_rows(pages, prow_all, up)
        pidx = plan.page_idx[prow_all]
        uw = up.view(np.uint64)
        # Same-address template page (holes and zero template pages give no TDELTA).
        trows = template.rows(pidx)
        has_t: np.ndarray = np.asarray(trows >= 0)     # rows are data pages: never all zero
        tpages = self._scratch("t", m)
        take_rows(template.pages_z, np.where(trows >= 0, trows, template.zero_row), tpages)
        same_t = (uw == tpages.view(np.uint64)).sum(axis=1)
        do_xor_t = has_t & (same_t >= XOR_MIN_SAME_WORDS)
        # Similarity candidates: template pages elsewhere, then the domain's blobs.
        fps = sample_fingerprints(up)
        cand_t, votes_t = sim_t.query(fps, exclude=pidx)
        related_t = has_t & (sim_t.excluded_hit | (same_t >= PREFIX_MIN_SAME_WORDS))
        if sim_b is not None:
            cand_b, votes_b = sim_b.query(fps)
        else:
            cand_b, votes_b = np.full(m, -1, np.int64), np.zeros(m, np.int64)
        use_b = (votes_b > votes_t) & (cand_b >= 0)
        s_kind = np.where(cand_t >= 0, 1, 0).astype(np.uint8)
        s_ref = cand_t.copy()
        s_cost = np.zeros(m)
        sref = self._scratch("s", m)
        take_rows(template.pages_z, template.rows_z(np.maximum(cand_t, 0)), sref)
        if domain is not None:
            named = np.flatnonzero(use_b)
            bases = named[domain.bases_among(cand_b[named])]
            if len(bases):
                base_pages, live = domain.blob_pages(cand_b[bases])   # not live: freed since the index named it
                i_arr = bases[live]
                sref[i_arr] = base_pages[live]
                s_kind[i_arr], s_ref[i_arr] = 2, cand_b[i_arr]
                s_cost[i_arr] = domain.decode_costs_us(cand_b[i_arr])
        has_s = s_kind > 0
        same_s = (uw == sref.view(np.uint64)).sum(axis=1)
        do_xor_s = has_s & (same_s >= XOR_MIN_SAME_WORDS)

        try_prefix_t = has_t if opt.effort >= 2 else related_t
        c_x, c_p = DECODE_COST_US[Method.XOR], DECODE_COST_US[Method.PREFIX]
        # Hot pages: LZ4 attempts only, deltas when the reference decodes within the hot budget.
        hot_xor_t = hot & do_xor_t
        hot_xor_s = hot & do_xor_s & (DECODE_COST_US[Method.LZ4_XOR] + s_cost <= opt.hot_decode_budget_us)
        if z.native is not None and (NATIVE_LZ4 or not hot.any()):
            flags = ((do_xor_t & (c_x <= budget)) * F_XOR_T
                     | (try_prefix_t & (c_p <= budget)) * F_PREFIX_T
                     | has_s * F_HAS_S
                     | (do_xor_s & (c_x + s_cost <= budget)) * F_XOR_S
                     | (has_s & (c_p + s_cost <= budget)) * F_PREFIX_S
                     | opt.patch * F_PATCH).astype(np.uint8)
            flags[hot] = (F_LZ4 | hot_xor_t * F_XOR_T | hot_xor_s * F_XOR_S | opt.patch * F_PATCH)[hot]
            odds = self.odds
            astats = None if odds is None else np.zeros(2 * ATTEMPT_SLOTS, dtype=np.uint64)
            # The XORs are made in C, page by page, where the flags use them.
            res = z.encode_batch(m, up, tpages, None, sref, None, flags, TINY_DELTA_BYTES, DELTA_MIN_GAIN_BYTES,
                                 SMALL_ENOUGH_BYTES, opt.raw_threshold_bytes, lz4page.HOT_LZ4_LEVEL,
                                 out=self._scratch("out", -(-m * BOUND_BYTES // PAGE_SIZE)).reshape(-1),
                                 odds=None if odds is None else odds.table(), astats=astats,
                                 seed=0 if odds is None else odds.seed())
            if res is not None:
                if odds is not None and astats is not None:
                    odds.note(astats)
                self._take_native(plan, res, uniq, prow_all, pidx, key, check, fps, s_kind, s_ref)
                return
        xpages = np.bitwise_xor(up, tpages, out=self._scratch("x", m))
        spx = np.bitwise_xor(up, sref, out=self._scratch("sx", m))
        self._python_loop(plan, up, tpages, xpages, sref, spx, do_xor_t, try_prefix_t, has_s, do_xor_s,
                          s_kind, s_ref, s_cost, pidx, uniq, prow_all, key, check, fps, hot, hot_xor_t, hot_xor_s)

    def _take_native(self, plan: Plan, res: tuple[np.ndarray, ...], uniq: np.ndarray, prow_all: np.ndarray,
                     pidx: np.ndarray, key: np.ndarray, check: np.ndarray, fps: np.ndarray, s_kind: np.ndarray,
                     s_ref: np.ndarray) -> None:
        out, off, length, choice, tries = res
        for name, v in zip(("zstd", "xor", "prefix", "sdelta", "lz4", "patch"), tries.tolist()):
            plan.tries[name] += int(v)
        raw = choice == C_RAW
        plan.kind[prow_all[raw]] = _K_RAW
        keep = np.flatnonzero(~raw)
        if len(keep) == 0:
            return
        ch = choice[keep].astype(np.int64)
        # choice -> (kind, method, reftype, ref), vectorised
        k_of = np.array([_K_ZSTD, _K_TDELTA, _K_TDELTA, _K_SDELTA, _K_SDELTA, _K_LZ4, _K_TDELTA, _K_SDELTA,
                         _K_TDELTA, _K_SDELTA], dtype=np.uint8)
        m_of = np.array([_M_ZSTD, _M_XOR, _M_PREFIX, _M_XOR, _M_PREFIX, _M_LZ4, _M_LZ4_XOR, _M_LZ4_XOR,
                         _M_PATCH, _M_PATCH], dtype=np.uint8)
        s_rt = np.where(s_kind[keep] == 1, _R_TEMPLATE, _R_BLOB)
        no_ref = (ch == C_ZSTD) | (ch == C_LZ4)
        same_t = (ch <= C_PREFIX_T) | (ch == C_LZ4_XOR_T) | (ch == C_PATCH_T)
        reftype = np.select([no_ref, same_t], [_R_NONE, _R_TEMPLATE], s_rt).astype(np.uint8)
        ref = np.select([no_ref, same_t], [0, pidx[keep]], s_ref[keep]).astype(np.int64)
        rows = uniq[keep]
        lens = length[keep].astype(np.uint32)
        # RAW pages take no room in ``out``: the kept payloads are already back to back.
        payload = out[:int(lens.sum())].tobytes()
        prows = prow_all[keep]
        plan.kind[prows] = k_of[ch]
        plan.add_blobs(NewBlobs(prows, m_of[ch], reftype, ref, key[rows], check[rows], lens, fps[keep],
                                reftype != _R_BLOB, payload))

    def _python_loop(self, plan: Plan, up: np.ndarray, tpages: np.ndarray, xpages: np.ndarray, sref: np.ndarray,
                     spx: np.ndarray, do_xor_t: np.ndarray, try_prefix_t: np.ndarray, has_s: np.ndarray,
                     do_xor_s: np.ndarray, s_kind: np.ndarray, s_ref: np.ndarray, s_cost: np.ndarray,
                     pidx: np.ndarray, uniq: np.ndarray, prow_all: np.ndarray, key: np.ndarray, check: np.ndarray,
                     fps: np.ndarray, hot: np.ndarray, hot_xor_t: np.ndarray, hot_xor_s: np.ndarray) -> None:
        """The per-page attempts in Python (the fallback of _pagecodec.c's azq_encode_batch)."""
        opt = self.opt
        z = self.zstd
        fast = z.backend == "libzstd"
        budget = opt.decode_budget_us
        m = len(uniq)
        base_up, base_t, base_x = up.ctypes.data, tpages.ctypes.data, xpages.ctypes.data
        base_s, base_sx = sref.ctypes.data, spx.ctypes.data
        try_prefix_t_l = try_prefix_t.tolist()
        do_xor_t_l, has_s_l, do_xor_s_l = do_xor_t.tolist(), has_s.tolist(), do_xor_s.tolist()
        s_kind_l, s_ref_l, s_cost_l = s_kind.tolist(), s_ref.tolist(), s_cost.tolist()
        pidx_l, prow_l = pidx.tolist(), prow_all.tolist()
        hot_l, hot_xor_t_l, hot_xor_s_l = hot.tolist(), hot_xor_t.tolist(), hot_xor_s.tolist()
        lz4 = lz4page.compress_addr
        level = lz4page.HOT_LZ4_LEVEL
        tries = plan.tries
        kind = plan.kind
        c_x, c_p = DECODE_COST_US[Method.XOR], DECODE_COST_US[Method.PREFIX]
        raw_limit = opt.raw_threshold_bytes
        xor_ok, prefix_ok = c_x <= budget, c_p <= budget
        new_rows: list[int] = []
        meta: list[tuple[int, int, int]] = []
        payloads: list[bytes] = []
        make_patch, patch_max = pagepatch.make_patch, pagepatch.PATCH_MAX_BYTES
        for i in range(m):
            off = i * PAGE_SIZE
            # PATCH against the same-address template page, then the SDELTA reference (kept
            # only if strictly smaller): small enough, it is taken and no codec runs.
            xor_t = hot_xor_t_l[i] if hot_l[i] else (do_xor_t_l[i] and xor_ok)
            xor_s = hot_xor_s_l[i] if hot_l[i] else (do_xor_s_l[i] and c_x + s_cost_l[i] <= budget)
            patch, patch_meta = None, (0, 0, 0, 0)
            if xor_t and opt.patch:
                patch = make_patch(up[i], xpages[i], patch_max)
                patch_meta = (_K_TDELTA, _M_PATCH, _R_TEMPLATE, pidx_l[i])
                tries["patch"] += 1
            if xor_s and opt.patch:
                pay_s = make_patch(up[i], spx[i], len(patch) - 1 if patch is not None else patch_max)
                tries["patch"] += 1
                if pay_s is not None:
                    patch = pay_s
                    patch_meta = (_K_SDELTA, _M_PATCH, _R_TEMPLATE if s_kind_l[i] == 1 else _R_BLOB, s_ref_l[i])
            if patch is not None and len(patch) <= SMALL_ENOUGH_BYTES:
                best = patch
                b_kind, b_method, b_reftype, b_ref = patch_meta
            elif hot_l[i]:
                # Hot: LZ4 of the page, or of an XOR delta that beats it by the gain (as in C).
                best = lz4(base_up + off, level)
                tries["lz4"] += 1
                b_kind, b_method, b_reftype, b_ref = _K_LZ4, _M_LZ4, _R_NONE, 0
                limit = len(best) - DELTA_MIN_GAIN_BYTES
                if hot_xor_t_l[i] and limit > SMALL_ENOUGH_BYTES:
                    pay = lz4(base_x + off, level)
                    tries["lz4"] += 1
                    if len(pay) < limit:
                        best, limit = pay, len(pay)
                        b_kind, b_method, b_reftype, b_ref = _K_TDELTA, _M_LZ4_XOR, _R_TEMPLATE, pidx_l[i]
                if hot_xor_s_l[i] and limit > SMALL_ENOUGH_BYTES:
                    pay = lz4(base_sx + off, level)
                    tries["lz4"] += 1
                    if len(pay) < limit:
                        best, limit = pay, len(pay)
                        rt = _R_TEMPLATE if s_kind_l[i] == 1 else _R_BLOB
                        b_kind, b_method, b_reftype, b_ref = _K_SDELTA, _M_LZ4_XOR, rt, s_ref_l[i]
            else:
                # XOR first when it is promising: a tiny XOR delta makes every other attempt moot.
                best = b""
                if do_xor_t_l[i] and xor_ok:
                    best = z.compress_addr(base_x + off) if fast else z.compress(xpages[i])
                    tries["xor"] += 1
                    b_kind, b_method, b_reftype, b_ref = _K_TDELTA, _M_XOR, _R_TEMPLATE, pidx_l[i]
                    limit = len(best)
                if not best or len(best) > TINY_DELTA_BYTES:
                    pay = z.compress_addr(base_up + off) if fast else z.compress(up[i])
                    tries["zstd"] += 1
                    if not best or len(pay) - DELTA_MIN_GAIN_BYTES <= len(best):
                        best = pay
                        b_kind, b_method, b_reftype, b_ref = _K_ZSTD, _M_ZSTD, _R_NONE, 0
                        limit = len(best) - DELTA_MIN_GAIN_BYTES
                if try_prefix_t_l[i] and prefix_ok and limit > SMALL_ENOUGH_BYTES:
                    pay = z.compress_addr(base_up + off, base_t + off) if fast else z.compress(up[i], tpages[i])
                    tries["prefix"] += 1
                    if len(pay) < limit:
                        best, limit = pay, len(pay)
                        b_kind, b_method, b_reftype, b_ref = _K_TDELTA, _M_PREFIX, _R_TEMPLATE, pidx_l[i]
                if has_s_l[i] and limit > SMALL_ENOUGH_BYTES:
                    rt = _R_TEMPLATE if s_kind_l[i] == 1 else _R_BLOB
                    extra = s_cost_l[i]
                    tries["sdelta"] += 1
                    if do_xor_s_l[i] and c_x + extra <= budget:
                        pay = z.compress_addr(base_sx + off) if fast else z.compress(spx[i])
                        if len(pay) < limit:
                            best, limit = pay, len(pay)
                            b_kind, b_method, b_reftype, b_ref = _K_SDELTA, _M_XOR, rt, s_ref_l[i]
                    if c_p + extra <= budget and limit > SMALL_ENOUGH_BYTES:
                        pay = z.compress_addr(base_up + off, base_s + off) if fast else z.compress(up[i], sref[i])
                        if len(pay) < limit:
                            best, limit = pay, len(pay)
                            b_kind, b_method, b_reftype, b_ref = _K_SDELTA, _M_PREFIX, rt, s_ref_l[i]
            if patch is not None and len(patch) > SMALL_ENOUGH_BYTES:
                # Kept if it beats the codecs (a payload without reference by the gain).
                no_ref = b_method in (_M_ZSTD, _M_LZ4)
                if len(patch) < len(best) - (DELTA_MIN_GAIN_BYTES if no_ref else 0):
                    best = patch
                    b_kind, b_method, b_reftype, b_ref = patch_meta
            prow = prow_l[i]
            if len(best) > raw_limit:
                kind[prow] = _K_RAW
                continue
            kind[prow] = b_kind
            new_rows.append(i)
            meta.append((b_method, b_reftype, b_ref))
            payloads.append(best)
        if not new_rows:
            return
        sel = np.array(new_rows, dtype=np.int64)
        rows = uniq[sel]
        mt = np.array(meta, dtype=np.int64).reshape(-1, 3)
        reftype = mt[:, 1].astype(np.uint8)
        plan.add_blobs(NewBlobs(prow_all[sel], mt[:, 0].astype(np.uint8), reftype, mt[:, 2], key[rows], check[rows],
                                np.array([len(p) for p in payloads], dtype=np.uint32), fps[sel],
                                reftype != _R_BLOB, b"".join(payloads)))
