"""The shared page store: encoded pages of many sandboxes, with sharing inside a domain.

``PageStore`` keeps encoded pages in arenas (arena.py), their locations and reference counts in
the blob table (blobtable.py), one compact index per sandbox (sbxindex.py) and persists all of
it under one root directory (persist.py). It is the API the restore path and the scheduler
build on: ``encode`` a sandbox's resident pages while it waits for its LLM, ``decode`` in bulk
for prefetch and ``decode_page_into`` on the userfaultfd fault path, ``discard`` pages that are
resident again, ``free_sandbox`` when it is destroyed.

Concurrency: one re-entrant state lock guards the tables and the arena mappings and is held
only for lookups and commits (decoders copy the payload bytes out under it and decompress
outside it); a second lock serialises encoders. Known race, handled: a blob an encode plans to
reference may be freed by a concurrent discard/free before the commit; the commit checks that
every referenced blob is still live and re-plans otherwise (freed ids are quarantined until the
next encode, so such an id never points at another page meanwhile).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from azqemu.errors import ChecksumMismatch, StoreCorrupt, StoreError
from azqemu.memory.accounting import (
    DomainBytes,
    OwnedBytes,
    StoreBytes,
    blob_costs,
    raw_page_bytes,
    sandbox_shares,
)
from azqemu.memory.arena import ARENA_HEADER_BYTES, DEFAULT_ARENA_BYTES, ArenaSet
from azqemu.memory.blobdecode import decode_batch, decode_recipe, read_batch, read_recipe
from azqemu.memory.blobtable import BLOB_DTYPE, BlobTable, DomainState
from azqemu.memory.encoder import T_BLOB, T_NEW, T_TEMPLATE, Encoder, EncoderOptions, Plan
from azqemu.memory.kinds import (
    DECODE_COST_US,
    DEFAULT_DECODE_BUDGET_US,
    ENTRY_DTYPE,
    FLAG_REF_TEMPLATE,
    PAGE_SIZE,
    Kind,
    Method,
    RefType,
)
from azqemu.memory.pagehash import ZERO_CHECK, page_hashes_rows
from azqemu.memory.persist import (
    STORE_FILE,
    index_file_name,
    read_index,
    read_store,
    write_index,
    write_store,
)
from azqemu.memory.sbxindex import SandboxIndex
from azqemu.memory.simindex import SimilarityIndex
from azqemu.memory.template import TemplateImage
from azqemu.memory.zstdlib import DEFAULT_LEVEL, PageZstd

_ZERO_ARRAY = np.zeros(PAGE_SIZE, dtype=np.uint8)
_ZERO_ARRAY.flags.writeable = False
_DIGEST = xxhash.xxh3_128_digest
_KIND_ZERO, _KIND_TEMPLATE = int(Kind.ZERO), int(Kind.TEMPLATE)
_REFTYPE_BLOB, _REFTYPE_TEMPLATE = int(RefType.BLOB), int(RefType.TEMPLATE)
# Blobs decoded for the encoder (DUP confirmation, SDELTA bases) are cached per encode call.
ENCODER_BLOB_CACHE_PAGES = 4096
_NAME_OK = re.compile(r"^[^\x00]{1,1024}$")


class NotStored(StoreError, KeyError):
    """The store holds no such sandbox (``page_idx`` None) or no such page of it.

    Also a KeyError, so that lookups of a missing page read naturally to callers such as the
    restore path's StoreSource, which turns KeyError into PageUnavailable (never a zero page).
    """

    def __init__(self, sandbox: str, page_idx: int | None = None) -> None:
        self.sandbox, self.page_idx = sandbox, page_idx
        msg = (f"no sandbox {sandbox!r} in the page store" if page_idx is None
               else f"page {page_idx} of {sandbox!r} is not in the store")
        super().__init__(msg)

    def __str__(self) -> str:          # KeyError would quote the message
        return str(self.args[0])


@dataclass
class EncodeResult:
    sandbox: str
    domain: str
    pages: dict[str, int]            # pages per kind of this call (RAW included)
    bytes: dict[str, int]            # payload bytes added per kind (RAW: resident bytes)
    stored_idx: np.ndarray           # page indices now in the store (everything but RAW): punch these
    raw_idx: np.ndarray              # page indices left resident
    input_bytes: int
    encode_s: float                  # wall time
    tries: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0               # CPU time of the encoding thread (what one core spent)

    @property
    def encode_mib_s(self) -> float:
        """Per core: input bytes over the encoding thread's CPU time."""
        return self.input_bytes / (1 << 20) / self.cpu_s if self.cpu_s > 0 else float("inf")


@dataclass
class _Sandbox:
    name: str
    domain: DomainState
    template_id: str
    index: SandboxIndex
    raw: np.ndarray                  # sorted u4 page indices left resident (RAW)


class _DomainView:
    """The encoder's window on one domain (encoder.DomainView)."""

    def __init__(self, store: PageStore, d: DomainState, template: TemplateImage,
                 own_refs: np.ndarray | None = None) -> None:
        self.store, self.d, self.template = store, d, template
        self.cache: dict[int, np.ndarray] = {}
        # Blob ids the encoding sandbox references now (sorted): its old entries.
        self.own_refs = np.unique(own_refs) if own_refs is not None else np.zeros(0, np.uint32)

    def find_dups(self, key: np.ndarray) -> np.ndarray:
        with self.store._lock:
            return self.store._table.find_dups(self.d, key)

    def blob_page(self, blob_id: int) -> np.ndarray:
        page = self.cache.get(blob_id)
        if page is None:
            page = np.empty(PAGE_SIZE, dtype=np.uint8)
            with self.store._lock:
                recipe = read_recipe(self.store._table, self.store._arenas, blob_id)
            decode_recipe(self.store.zstd, recipe, page, self.template)
            if len(self.cache) >= ENCODER_BLOB_CACHE_PAGES:
                self.cache.clear()
            self.cache[blob_id] = page
        return page

    def blob_decode_cost_us(self, blob_id: int) -> float:
        return DECODE_COST_US[Method(int(self.store._table.rows["method"][blob_id]))]

    def blob_shared(self, blob_id: int) -> bool:
        """Whether anything but one old entry of the encoding sandbox holds the blob."""
        if int(self.store._table.rows["refcount"][blob_id]) > 1:
            return True
        i = int(np.searchsorted(self.own_refs, blob_id))
        return not (i < len(self.own_refs) and int(self.own_refs[i]) == blob_id)

    def blob_is_base(self, blob_id: int) -> bool:
        rows = self.store._table.rows
        return (blob_id < self.store._table.n and int(rows["refcount"][blob_id]) > 0
                and int(rows["domain"][blob_id]) == self.d.did and int(rows["reftype"][blob_id]) != _REFTYPE_BLOB)

    def sim_index(self) -> SimilarityIndex:
        with self.store._lock:
            return self.store._table.sim_index(self.d)


class PageStore:
    """Encoded guest pages of many sandboxes under ``root_dir`` (see the module docstring)."""

    def __init__(self, root_dir: str | os.PathLike[str], *, templates: tuple[TemplateImage, ...] = (),
                 zstd_level: int = DEFAULT_LEVEL, effort: int | None = None,
                 decode_budget_us: float = DEFAULT_DECODE_BUDGET_US, arena_bytes: int = DEFAULT_ARENA_BYTES,
                 zstd_backend: str | None = None) -> None:
        self.root = Path(root_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._encode_lock = threading.Lock()
        self._tls = threading.local()
        self.zstd = PageZstd(zstd_level, backend=zstd_backend)
        opts = EncoderOptions(decode_budget_us=decode_budget_us)
        if effort is not None:
            opts.effort = effort
        self._options = opts
        self._templates: dict[str, TemplateImage] = {t.template_id: t for t in templates}
        self._template_paths: dict[str, dict[str, Any]] = {
            t.template_id: {"path": t.path, "n_pages": t.n_pages} for t in templates}
        self._sandboxes: dict[str, _Sandbox] = {}
        self._freed_files: list[str] = []
        self._dirty: set[str] = set()
        self._table = BlobTable()
        store_file = self.root / STORE_FILE
        if store_file.exists():
            self._load(store_file, arena_bytes)
        else:
            leftovers = [p.name for p in self.root.iterdir() if p.name.startswith(("arena-", "sbx-"))]
            if leftovers:
                raise StoreCorrupt(str(self.root), f"store files without {STORE_FILE} ({leftovers[0]}, ...)")
            self.uuid = os.urandom(16)
            self._arenas = ArenaSet(self.root, self.uuid, arena_bytes)

    # ------------------------------------------------------------------ templates / names
    def add_template(self, template: TemplateImage) -> None:
        with self._lock:
            known = self._template_paths.get(template.template_id)
            self._templates[template.template_id] = template
            if known is None or known.get("path") is None:
                self._template_paths[template.template_id] = {"path": template.path, "n_pages": template.n_pages}

    def _template(self, template_id: str) -> TemplateImage:
        t = self._templates.get(template_id)
        if t is None:
            info = self._template_paths.get(template_id)
            if info is None or not info.get("path"):
                raise StoreError(f"template {template_id[:12]} of this store is not loaded")
            t = TemplateImage(info["path"])
            if t.template_id != template_id:
                raise StoreCorrupt(info["path"], "the template image changed since pages were stored")
            self._templates[template_id] = t
        return t

    def _sandbox(self, name: str) -> _Sandbox:
        sb = self._sandboxes.get(name)
        if sb is None:
            raise NotStored(name)
        return sb

    def sandboxes(self) -> list[str]:
        return sorted(self._sandboxes)

    def domains(self) -> list[str]:
        return sorted(self._table.domains)

    def domain_of(self, sandbox: str) -> str:
        return self._sandbox(sandbox).domain.name

    # ------------------------------------------------------------------ encode
    def encode(self, sandbox: str, domain: str, page_idx: np.ndarray, pages: np.ndarray,
               template: TemplateImage, *, use_siblings: bool = True,
               hot: np.ndarray | None = None) -> EncodeResult:
        """Encode resident pages of ``sandbox`` (a member of sharing ``domain``).

        Pages already stored for this sandbox are replaced. Returns the counts and the page
        indices that are now stored (punch them) or left RAW (keep them resident).
        ``hot`` (optional, bool per page) marks pages the next resume will want first: those
        that need a codec get the cheap-to-decode one (Kind.LZ4, see kinds.HOT_DECODE_BUDGET_US).
        """
        if not _NAME_OK.match(sandbox) or not _NAME_OK.match(domain):
            raise StoreError("sandbox and domain names must be 1-1024 characters without NUL")
        page_idx = np.asarray(page_idx, dtype=np.int64)
        pages = np.asarray(pages, dtype=np.uint8).reshape(len(page_idx), PAGE_SIZE)
        if len(page_idx) and (page_idx.min() < 0 or page_idx.max() >= (1 << 32) - 1):
            raise StoreError("page index out of range")
        if len(np.unique(page_idx)) != len(page_idx):
            raise StoreError("duplicate page indices in one encode")
        if hot is not None:
            hot = np.asarray(hot, dtype=bool)
            if hot.shape != page_idx.shape:
                raise StoreError("hot must hold one flag per page")
        t0 = time.perf_counter()
        c0 = time.thread_time()
        with self._encode_lock:
            with self._lock:
                self.add_template(template)
                sb = self._sandboxes.get(sandbox)
                if sb is not None and sb.domain.name != domain:
                    raise StoreError(f"sandbox {sandbox!r} belongs to domain {sb.domain.name!r}, not {domain!r}")
                d = self._table.domain(domain, template.template_id)
                if d.template_id != template.template_id:
                    raise StoreError(f"domain {domain!r} is bound to another template")
                self._table.reclaim()
            opts = EncoderOptions(self._options.effort, self._options.decode_budget_us, use_siblings,
                                  self._options.raw_threshold_bytes, self._options.hot_decode_budget_us)
            encoder = Encoder(self.zstd, opts)
            for _attempt in range(3):
                with self._lock:
                    old = self._sandboxes.get(sandbox)
                    own = old.index.blob_refs().copy() if old is not None and hot is not None else None
                view = _DomainView(self, d, template, own)
                plan = encoder.plan(page_idx, pages, template, view, hot)
                with self._lock:
                    if self._plan_still_valid(plan):
                        result = self._commit(sandbox, d, template, plan)
                        self._maybe_compact()
                        break
            else:
                raise StoreError("encode kept racing with concurrent frees")
        result.encode_s = time.perf_counter() - t0
        result.cpu_s = time.thread_time() - c0
        return result

    def _plan_still_valid(self, plan: Plan) -> bool:
        rc = self._table.rows["refcount"]
        refs = [plan.ref[plan.target == T_BLOB]]
        refs.append(plan.blobs.ref[plan.blobs.reftype == _REFTYPE_BLOB])
        ids = np.concatenate(refs).astype(np.int64)
        return bool(len(ids) == 0 or (rc[ids] > 0).all())

    def _commit(self, sandbox: str, d: DomainState, template: TemplateImage, plan: Plan) -> EncodeResult:
        table = self._table
        nb = plan.blobs
        n_new = len(nb)
        new_ids = table.alloc(n_new)
        rows = table.rows
        if n_new:
            arena_ids, offsets = self._arenas.append_concat(nb.payload, nb.length)
            blob_rows = np.zeros(n_new, dtype=BLOB_DTYPE)
            blob_rows["key"] = nb.key
            blob_rows["check"] = nb.check
            blob_rows["arena"] = arena_ids
            blob_rows["offset"] = offsets
            blob_rows["length"] = nb.length
            blob_rows["method"] = nb.method
            blob_rows["reftype"] = nb.reftype
            blob_rows["ref"] = nb.ref
            blob_rows["domain"] = d.did
            rows[new_ids] = blob_rows
            table.incref(nb.ref[nb.reftype == _REFTYPE_BLOB])
            if nb.has_fp.any():
                table.add_sim(d, nb.fps[nb.has_fp], new_ids[nb.has_fp])
            d.dup_dirty = True
        kind = plan.kind
        stored = kind != int(Kind.RAW)
        entry_ref = np.zeros(len(kind), dtype=np.int64)
        flags = np.zeros(len(kind), dtype=np.uint8)
        t = plan.target
        m_blob, m_new, m_tpl = t == T_BLOB, t == T_NEW, t == T_TEMPLATE
        entry_ref[m_blob] = plan.ref[m_blob]
        if n_new:
            entry_ref[m_new] = new_ids[plan.ref[m_new]]
        entry_ref[m_tpl] = plan.ref[m_tpl]
        flags[m_tpl] = FLAG_REF_TEMPLATE
        table.incref(entry_ref[m_blob | m_new])
        # Merge with what the sandbox already had: re-encoded pages replace their old entries.
        sb = self._sandboxes.get(sandbox)
        new_pages = plan.page_idx
        if sb is None:
            sb = _Sandbox(sandbox, d, template.template_id, SandboxIndex.empty(), np.zeros(0, np.uint32))
            self._sandboxes[sandbox] = sb
            d.sandboxes.add(sandbox)
        old_p, old_k, old_f, old_r = sb.index.expand()
        replaced = np.isin(old_p, new_pages)
        if replaced.any():
            self._release_refs(old_k[replaced], old_f[replaced], old_r[replaced])
        keep = ~replaced
        sb.index = SandboxIndex.from_pages(
            np.concatenate([old_p[keep], new_pages[stored]]), np.concatenate([old_k[keep], kind[stored]]),
            np.concatenate([old_f[keep], flags[stored]]), np.concatenate([old_r[keep], entry_ref[stored]]))
        raw_now = new_pages[~stored]
        old_raw = sb.raw[~np.isin(sb.raw, new_pages)]
        sb.raw = np.union1d(old_raw, raw_now).astype(np.uint32)
        self._dirty.add(sandbox)
        # Result figures.
        counts = np.bincount(kind, minlength=len(Kind))
        nbytes = {k.name: 0 for k in Kind}
        if n_new:
            per_kind = np.bincount(kind[nb.prow], weights=nb.length, minlength=len(Kind))
            for k in (Kind.TDELTA, Kind.SDELTA, Kind.ZSTD, Kind.LZ4):
                nbytes[k.name] = int(per_kind[int(k)])
        nbytes["RAW"] = int(counts[int(Kind.RAW)]) * PAGE_SIZE
        return EncodeResult(sandbox, d.name, {k.name: int(counts[int(k)]) for k in Kind}, nbytes,
                            new_pages[stored].copy(), raw_now.copy(), len(new_pages) * PAGE_SIZE, 0.0,
                            dict(plan.tries))

    def _release_refs(self, kind: np.ndarray, flags: np.ndarray, ref: np.ndarray) -> None:
        m = ~np.isin(kind, (_KIND_ZERO, _KIND_TEMPLATE)) & ((flags & FLAG_REF_TEMPLATE) == 0)
        freed = self._table.decref(ref[m].astype(np.int64))
        if freed:
            rows = self._table.rows
            b = np.asarray(freed, dtype=np.int64)
            self._arenas.release_many(rows["arena"][b], rows["offset"][b], rows["length"][b])
            self._table.retire(freed)

    # ------------------------------------------------------------------ queries
    def stored_pages(self, sandbox: str) -> np.ndarray:
        with self._lock:
            return self._sandbox(sandbox).index.expand()[0]

    def raw_pages(self, sandbox: str) -> np.ndarray:
        with self._lock:
            return self._sandbox(sandbox).raw.astype(np.int64)

    def page_kinds(self, sandbox: str, page_idx: np.ndarray) -> np.ndarray:
        """Kind of each stored page (RAW for pages the store does not hold)."""
        with self._lock:
            sb = self._sandbox(sandbox)
            found, kind, _, _ = sb.index.lookup(page_idx)
            return np.where(found, kind, int(Kind.RAW)).astype(np.uint8)

    # ------------------------------------------------------------------ decode
    def _page_buf(self) -> tuple[np.ndarray, int]:
        pair = getattr(self._tls, "page", None)
        if pair is None:
            buf = np.empty(PAGE_SIZE, dtype=np.uint8)
            pair = self._tls.page = (buf, buf.ctypes.data)
        return pair

    def decode_page_into(self, sandbox: str, page_idx: int, out: Any) -> None:
        """Decode one page into ``out`` (a writable 4096-byte buffer), verified first.

        The fault path: ``out`` is only written once the page matched its checksum, so a
        ChecksumMismatch leaves it untouched and the caller must not hand it to the guest.
        """
        with self._lock:
            sb = self._sandboxes.get(sandbox)
            if sb is None:
                raise NotStored(sandbox)
            idx = sb.index
            hit = idx.lookup_one(page_idx)
            if hit is None:
                raise NotStored(sandbox, page_idx)
            k, flags, ref = hit
            template = self._templates.get(sb.template_id) or self._template(sb.template_id)
            recipe = None
            src: np.ndarray = _ZERO_ARRAY
            expect = ZERO_CHECK
            if k == _KIND_ZERO:
                pass
            elif k == _KIND_TEMPLATE or (flags & FLAG_REF_TEMPLATE):
                tpage = page_idx if k == _KIND_TEMPLATE else ref
                tp = template.page(tpage)
                if tp is not None:
                    src = tp
                    expect = int(template.check[template.row_of[tpage]])
            else:
                recipe = read_recipe(self._table, self._arenas, ref)
        if k == _KIND_ZERO:
            out[:PAGE_SIZE] = _ZERO_ARRAY
            return
        if recipe is None:
            if int.from_bytes(_DIGEST(src.data)[8:], "little") != expect:
                raise ChecksumMismatch(page_idx, "template page")
            out[:PAGE_SIZE] = src
            return
        buf, buf_addr = self._page_buf()
        try:
            decode_recipe(self.zstd, recipe, buf, template, buf_addr)
        except ChecksumMismatch as err:
            raise ChecksumMismatch(page_idx, str(err)) from err
        out[:PAGE_SIZE] = buf

    def decode(self, sandbox: str, page_idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Decode many pages at once (prefetch): (n, 4096) uint8, every page verified.

        ``out`` may be a reusable (n, 4096) C-contiguous uint8 buffer; fresh large buffers
        page-fault on first touch, which costs as much as decoding on this class of host.
        On ChecksumMismatch (``page_idx`` names a page that failed) or StoreCorrupt, the
        contents of ``out`` are undefined and must not reach a guest.
        """
        page_idx = np.asarray(page_idx, dtype=np.int64)
        n = len(page_idx)
        if out is None:
            out = np.empty((n, PAGE_SIZE), dtype=np.uint8)
        elif out.shape != (n, PAGE_SIZE) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError("out must be a C-contiguous (n, 4096) uint8 array")
        with self._lock:
            sb = self._sandbox(sandbox)
            template = self._templates.get(sb.template_id) or self._template(sb.template_id)
            found, kind, flags, ref32 = sb.index.lookup(page_idx)
            if n and not found.all():
                missing = int(page_idx[np.flatnonzero(~found)[0]])
                raise NotStored(sandbox, missing)
            ref = ref32.astype(np.int64)
            m_tpl = kind == _KIND_TEMPLATE
            m_dupt = (flags & FLAG_REF_TEMPLATE) != 0
            m_blob = ~m_tpl & ~m_dupt & (kind != _KIND_ZERO)
            blobs, first, inverse = np.unique(ref[m_blob], return_index=True, return_inverse=True)
            batch = read_batch(self._table, self._arenas, blobs)
        # Template rows are gathered from the template, ZERO rows zero-filled; blob rows are
        # written by the decoder below (a hot set is mostly blobs: no gather for them).
        t_any = m_tpl | m_dupt
        src = np.full(n, template.zero_row, dtype=np.int64)
        if t_any.all():
            src = template.rows_z(np.where(m_tpl, page_idx, ref))
            np.take(template.pages_z, src, axis=0, out=out)
        elif t_any.any():
            tr = np.flatnonzero(t_any)
            src[tr] = template.rows_z(np.where(m_tpl[tr], page_idx[tr], ref[tr]))
            out[tr] = template.pages_z[src[tr]]
        out[kind == _KIND_ZERO] = 0
        # Template-derived rows are verified by hashing: the template is trusted only as far as
        # its load-time hashes.
        trows = np.flatnonzero(t_any & (src != template.zero_row))
        if len(trows):
            bad = page_hashes_rows(out, trows)[1] != template.check[src[trows]]
            if bad.any():
                raise ChecksumMismatch(int(page_idx[trows[np.flatnonzero(bad)[0]]]), "template page")
        if len(blobs):
            brows = np.flatnonzero(m_blob)
            # Decode each blob once, into the first row that needs it, then copy to the others.
            try:
                decode_batch(self.zstd, batch, template, out, brows[first])
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
        return out

    def decode_pages_into(self, sandbox: str, page_idx: np.ndarray, out: Any) -> None:
        """Bulk decode into a writable buffer of len(page_idx) * 4096 bytes (page j at j*4096):
        the prefetcher's form of ``decode``, same verification and errors."""
        n = len(page_idx)
        arr = np.frombuffer(out, dtype=np.uint8, count=n * PAGE_SIZE).reshape(n, PAGE_SIZE)
        self.decode(sandbox, page_idx, out=arr)

    # ------------------------------------------------------------------ release
    def discard(self, sandbox: str, page_idx: np.ndarray) -> None:
        """Forget pages that are resident again (restored): release their entries and references."""
        page_idx = np.asarray(page_idx, dtype=np.int64)
        with self._lock:
            sb = self._sandbox(sandbox)
            p, k, f, r = sb.index.expand()
            gone = np.isin(p, page_idx)
            if gone.any():
                self._release_refs(k[gone], f[gone], r[gone])
                keep = ~gone
                sb.index = SandboxIndex.from_pages(p[keep], k[keep], f[keep], r[keep])
            sb.raw = sb.raw[~np.isin(sb.raw, page_idx)]
            self._dirty.add(sandbox)
            self._maybe_compact()

    def free_sandbox(self, sandbox: str) -> None:
        with self._lock:
            sb = self._sandbox(sandbox)
            self._release_refs(sb.index.kind, sb.index.flags, sb.index.ref.astype(np.int64))
            del self._sandboxes[sandbox]
            sb.domain.sandboxes.discard(sandbox)
            self._dirty.discard(sandbox)
            self._freed_files.append(index_file_name(sandbox))
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        for arena_id in self._arenas.compaction_candidates():
            self.compact_arena(arena_id)

    def compact_arena(self, arena_id: int) -> None:
        """Move the live blobs of an arena to the current one and drop its file."""
        with self._lock:
            table = self._table
            rows = table.rows[:table.n]
            live = np.flatnonzero((rows["refcount"] > 0) & (rows["arena"] == arena_id))
            payloads = [self._arenas.read(arena_id, int(rows["offset"][b]), int(rows["length"][b])) for b in live]
            if self._arenas.current is not None and self._arenas.current.arena_id == arena_id:
                self._arenas.retire_current()
            locs = self._arenas.append(payloads)
            for b, (a, o) in zip(live, locs):
                table.rows["arena"][b] = a
                table.rows["offset"][b] = o
            self._arenas.drop(arena_id)

    # ------------------------------------------------------------------ accounting
    def owned_bytes(self, sandbox: str) -> OwnedBytes:
        with self._lock:
            sb = self._sandbox(sandbox)
            cost = blob_costs(self._table, sb.domain)
            private, shared = sandbox_shares(self._table, cost, sb.index.blob_refs())
            return OwnedBytes(private, shared, sb.index.nbytes + sb.raw.nbytes, raw_page_bytes(len(sb.raw)),
                              len(sb.raw), sb.index.n_pages)

    def domain_bytes(self, domain: str) -> DomainBytes:
        with self._lock:
            d = self._table.domains.get(domain)
            if d is None:
                raise StoreError(f"no sharing domain {domain!r} in the page store")
            cost = blob_costs(self._table, d)
            rows = self._table.rows[:self._table.n]
            mine = (rows["refcount"] > 0) & (rows["domain"] == d.did)
            sbs = [self._sandboxes[s] for s in sorted(d.sandboxes)]
            return DomainBytes(domain, len(sbs), int(round(cost.sum())), int(rows["length"][mine].sum()),
                               sum(s.index.nbytes + s.raw.nbytes for s in sbs),
                               sum(raw_page_bytes(len(s.raw)) for s in sbs))

    def total_bytes(self) -> StoreBytes:
        with self._lock:
            total = sum(self.domain_bytes(d).total_bytes for d in self._table.domains)
            return StoreBytes(len(self._table.domains), len(self._sandboxes), total,
                              self._arenas.used_bytes, self._arenas.live_bytes,
                              sum(t.data_bytes for t in self._templates.values()),
                              self._arenas.allocated_bytes)

    # ------------------------------------------------------------------ persistence
    def flush(self) -> None:
        """Write everything needed to reopen the store from ``root_dir``."""
        with self._lock:
            self._arenas.flush()
            for name in sorted(self._dirty):
                sb = self._sandboxes[name]
                write_index(self.root / index_file_name(name), self.uuid, name, sb.index.to_records(), sb.raw,
                            sb.index.zt)
            self._dirty.clear()
            table = self._table
            # Purge freed ids from the similarity indices so the saved free list is clean.
            table.reclaim()
            for d in table.domains.values():
                table.sim_index(d)
            meta = {
                "store_uuid": self.uuid.hex(),
                "n_blobs": table.n,
                "free": sorted(table.free),
                "templates": self._template_paths,
                "domains": [{"name": d.name, "did": d.did, "template_id": d.template_id, "sim_entries": len(d.sim)}
                            for d in sorted(table.domains.values(), key=lambda d: d.did)],
                "sandboxes": [{"name": s.name, "domain": s.domain.name, "template_id": s.template_id,
                               "file": index_file_name(s.name)} for s in self._sandboxes.values()],
                "arenas": [{"id": a.arena_id, "used": a.used, "live": a.live} for a in self._arenas.arenas.values()],
                "current_arena": None if self._arenas.current is None else self._arenas.current.arena_id,
                "arena_bytes": self._arenas.arena_bytes,
            }
            binary: list[bytes | memoryview] = [table.rows[:table.n].tobytes()]
            for d in sorted(table.domains.values(), key=lambda d: d.did):
                binary.append(d.sim.keys.astype("<u8").tobytes())
                binary.append(d.sim.sources.astype("<u4").tobytes())
            write_store(self.root / STORE_FILE, meta, binary)
            for fname in self._freed_files:
                if fname not in {index_file_name(s) for s in self._sandboxes}:
                    try:
                        os.unlink(self.root / fname)
                    except FileNotFoundError:
                        pass
            self._freed_files = []

    def close(self) -> None:
        with self._lock:
            self._arenas.close()

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _load(self, path: Path, arena_bytes: int) -> None:
        try:
            self._load_checked(path, arena_bytes)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            # The file passed its checksum, so this is a writer's bug or a crafted file.
            raise StoreCorrupt(str(path), f"malformed metadata: {type(err).__name__}: {err}") from err

    def _load_checked(self, path: Path, arena_bytes: int) -> None:
        meta, body = read_store(path)
        bad = StoreCorrupt
        try:
            self.uuid = bytes.fromhex(meta["store_uuid"])
            n_blobs = int(meta["n_blobs"])
            domains = meta["domains"]
            sandboxes = meta["sandboxes"]
            arenas = meta["arenas"]
            templates = meta["templates"]
            current = meta["current_arena"]
            a_bytes = int(meta.get("arena_bytes", arena_bytes))
        except (KeyError, TypeError, ValueError) as err:
            raise bad(str(path), f"metadata field missing or malformed: {err}") from err
        if len(self.uuid) != 16:
            raise bad(str(path), "bad store uuid")
        if not 0 <= n_blobs <= len(body) // BLOB_DTYPE.itemsize:
            raise bad(str(path), "blob count exceeds the file")
        off = n_blobs * BLOB_DTYPE.itemsize
        rows = np.zeros(max(1024, n_blobs), dtype=BLOB_DTYPE)
        rows[:n_blobs] = np.frombuffer(body, dtype=BLOB_DTYPE, count=n_blobs)
        table = BlobTable(rows, n_blobs)
        for t_id, info in templates.items():
            if t_id not in self._template_paths:
                self._template_paths[t_id] = info
        for dm in sorted(domains, key=lambda x: x["did"]):
            d = DomainState(str(dm["name"]), int(dm["did"]), str(dm["template_id"]))
            k = int(dm["sim_entries"])
            if k < 0 or off + 12 * k > len(body):
                raise bad(str(path), "similarity index exceeds the file")
            keys = np.frombuffer(body, dtype="<u8", count=k, offset=off).copy()
            srcs = np.frombuffer(body, dtype="<u4", count=k, offset=off + 8 * k).copy()
            off += 12 * k
            if k and (srcs.max() >= max(n_blobs, 1) or np.any(np.diff(keys.astype(np.uint64)) < 0)
                      if k > 1 else srcs.max() >= max(n_blobs, 1)):
                raise bad(str(path), "similarity index out of bounds")
            d.sim = SimilarityIndex(keys, srcs)
            table.domains[d.name] = d
            table.domain_by_id[d.did] = d
        if off != len(body):
            raise bad(str(path), "trailing bytes after the indices")
        self._table = table
        self._arenas = ArenaSet(self.root, self.uuid, a_bytes)
        for a in arenas:
            self._arenas.open_existing(int(a["id"]), int(a["used"]), int(a["live"]))
        if current is not None:
            if current not in self._arenas.arenas:
                raise bad(str(path), "current arena missing")
            self._arenas.current = self._arenas.arenas[current]
        table.free = [int(b) for b in meta.get("free", []) if 0 <= int(b) < n_blobs]
        for s in sandboxes:
            name, rec, raw, zt = read_index(self.root / str(s["file"]), self.uuid)
            if name != s["name"] or s["domain"] not in table.domains:
                raise bad(str(self.root / str(s["file"])), "index does not match the store")
            d = table.domains[s["domain"]]
            sb = _Sandbox(name, d, str(s["template_id"]), SandboxIndex.from_parts(zt, rec), raw)
            self._sandboxes[name] = sb
            d.sandboxes.add(name)
        self._validate(path)

    def _validate(self, path: Path) -> None:
        """Bounds and reference counts of everything loaded; StoreCorrupt on any mismatch."""
        table = self._table
        n = table.n
        rows = table.rows[:n]
        live = rows["refcount"] > 0
        lv = rows[live]
        if len(lv):
            if (lv["method"] > int(Method.LZ4_XOR)).any() or (lv["reftype"] > 2).any():
                raise StoreCorrupt(str(path), "unknown blob method or reference type")
            if (lv["length"] == 0).any() or (lv["length"] > PAGE_SIZE + 128).any():
                raise StoreCorrupt(str(path), "blob length out of bounds")
            for a_id in np.unique(lv["arena"]):
                a = self._arenas.arenas.get(int(a_id))
                sel = lv[lv["arena"] == a_id]
                if a is None:
                    raise StoreCorrupt(str(path), f"blob in missing arena {a_id}")
                ends = sel["offset"].astype(np.int64) + sel["length"]
                if (sel["offset"] < ARENA_HEADER_BYTES).any() or (ends > a.used).any():
                    raise StoreCorrupt(str(path), f"blob outside arena {a_id}")
            if not np.isin(lv["domain"], list(table.domain_by_id)).all():
                raise StoreCorrupt(str(path), "blob of an unknown domain")
            based = lv[lv["reftype"] == _REFTYPE_BLOB]
            if len(based):
                b = based["ref"].astype(np.int64)
                if (b >= n).any() or (rows["refcount"][np.minimum(b, n - 1)] == 0).any() \
                        or (rows["reftype"][np.minimum(b, n - 1)] == _REFTYPE_BLOB).any():
                    raise StoreCorrupt(str(path), "SDELTA base missing or chained")
        expected = np.zeros(n, dtype=np.int64)
        for sb in self._sandboxes.values():
            idx = sb.index
            problem = idx.check()
            if problem:
                raise StoreCorrupt(str(path), f"index of {sb.name!r}: {problem}")
            refs = idx.blob_refs().astype(np.int64)
            if len(refs) and (refs >= n).any():
                raise StoreCorrupt(str(path), f"index of {sb.name!r} names a missing blob")
            if len(refs) and (rows["domain"][refs] != sb.domain.did).any():
                raise StoreCorrupt(str(path), f"index of {sb.name!r} names a blob of another domain")
            expected += np.bincount(refs, minlength=n)[:n]
        based_ids = rows["ref"][live & (rows["reftype"] == _REFTYPE_BLOB)].astype(np.int64)
        expected += np.bincount(based_ids, minlength=n)[:n]
        if not np.array_equal(expected, rows["refcount"].astype(np.int64)):
            raise StoreCorrupt(str(path), "reference counts do not match the indices")
        for d in table.domains.values():
            d.dup_dirty = True
        # Arena live counters are recomputed, not trusted.
        for a in self._arenas.arenas.values():
            a.live = int(lv["length"][lv["arena"] == a.arena_id].sum()) if len(lv) else 0

    # ------------------------------------------------------------------ introspection
    def check_consistency(self) -> None:
        """Re-run the load-time validation on the live state (tests, debugging)."""
        with self._lock:
            self._validate(self.root / STORE_FILE)

    @property
    def entry_bytes(self) -> int:
        return ENTRY_DTYPE.itemsize
