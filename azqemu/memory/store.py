"""The shared page store: encoded pages of many sandboxes, with sharing inside a domain.

``PageStore`` keeps encoded pages in arenas (arena.py), their locations and reference counts in
the blob table (blobtable.py), one compact index per sandbox (sbxindex.py) and persists all of
it under one root directory (generation.py, in persist.py's formats); the encoder sees a
sharing domain through domainview.py and pagedecode.py turns entries back into pages. It is the
API the restore path and the scheduler build on: ``encode`` a sandbox's resident pages while it
waits for its LLM, ``decode`` in bulk for prefetch and ``decode_page_into`` on the userfaultfd
fault path, ``discard`` pages that are resident again, ``free_sandbox`` when it is destroyed.

Concurrency: one re-entrant state lock guards the tables and the arena mappings and is held
only for lookups and in-memory steps (decoders copy the payload bytes out under it and
decompress outside it); a second lock serialises encoders. Flushes and compactions (their
base class, storewrite.py) write their files and copy their bytes outside the state lock, so
a fault's lookup never waits for an fsync or a compaction's copy. Known race, handled: a blob
an encode plans to reference may be freed by a concurrent discard/free before the commit; the
commit checks that every referenced blob is still live and re-plans otherwise (freed ids are
quarantined until the next encode, so such an id never points at another page meanwhile).

Crash consistency (docs/memory.md): ``flush`` writes and commits a whole generation
(generation.py); space that the last durable generation names is reclaimed only after the next
commit (arena.py), so a process killed at any point reopens into the last durable generation,
whole. A caller must flush before it drops the pages it encoded (SandboxMemory.compress).
Entries are bound to an owner (the domain UUID of the sandbox, ``encode(owner=)``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from azqemu.errors import StoreCorrupt, StoreError
from azqemu.memory import nativestore
from azqemu.memory.accounting import OwnedBytes
from azqemu.memory.arena import DEFAULT_ARENA_BYTES, ArenaSet
from azqemu.memory.blobtable import BLOB_DTYPE, BlobTable, DomainState, in_domain_indices
from azqemu.memory.crashpoint import crash_point
from azqemu.memory.domainview import StoreDomainView
from azqemu.memory.encoder import T_BLOB, T_NEW, T_TEMPLATE, Encoder, EncoderOptions, Plan
from azqemu.memory.generation import StoredSandbox, load_generation, sweep_uncommitted, validate_generation
from azqemu.memory.kinds import (
    DEFAULT_DECODE_BUDGET_US,
    ENTRY_DTYPE,
    FLAG_REF_TEMPLATE,
    PAGE_SIZE,
    Kind,
    RefType,
)
from azqemu.memory.nativestore import NativeView
from azqemu.memory.pagedecode import locate_page, locate_rows, write_page, write_rows
from azqemu.memory.persist import STORE_FILE, ensure_reserve
from azqemu.memory.sbxindex import SandboxIndex
from azqemu.memory.storebooks import StoreBooks
from azqemu.memory.storewrite import StoreWriter
from azqemu.memory.template import TemplateImage
from azqemu.memory.zstdlib import DEFAULT_LEVEL, PageZstd
from azqemu.pages import in_sorted, union_idx, unique_idx

_KIND_ZERO, _KIND_TEMPLATE = int(Kind.ZERO), int(Kind.TEMPLATE)
_REFTYPE_BLOB = int(RefType.BLOB)
_NAME_OK = re.compile(r"^[^\x00]{1,1024}$")
log = logging.getLogger(__name__)


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


class PageStore(StoreWriter, StoreBooks):
    """Encoded guest pages of many sandboxes under ``root_dir`` (see the module docstring)."""

    def __init__(self, root_dir: str | os.PathLike[str], *, templates: tuple[TemplateImage, ...] = (),
                 zstd_level: int = DEFAULT_LEVEL, effort: int | None = None,
                 decode_budget_us: float = DEFAULT_DECODE_BUDGET_US, arena_bytes: int = DEFAULT_ARENA_BYTES,
                 zstd_backend: str | None = None) -> None:
        self.root = Path(root_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        # The state lock. With the native lookup built it is the C mutex the fault threads take
        # too, and the arrays they read are published to them on every change (nativestore.py).
        self._native = nativestore.tables_or_none()
        self._lock: Any = self._native.lock if self._native is not None else threading.RLock()
        self._encode_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._compact_lock = threading.Lock()
        self._tls = threading.local()
        self.zstd = PageZstd(zstd_level, backend=zstd_backend)
        opts = EncoderOptions(decode_budget_us=decode_budget_us)
        if effort is not None:
            opts.effort = effort
        self._options = opts
        self._templates: dict[str, TemplateImage] = {t.template_id: t for t in templates}
        self._template_paths: dict[str, dict[str, Any]] = {
            t.template_id: {"path": t.path, "n_pages": t.n_pages} for t in templates}
        self._sandboxes: dict[str, StoredSandbox] = {}
        self._dirty: set[str] = set()
        self._changed = False           # anything to write since the last generation's snapshot
        self._generation = 0            # number of the last durable generation (0: none)
        self._table = BlobTable()
        # Sandboxes the store named but could not load (name -> reason): their pages are lost.
        self.quarantined: dict[str, str] = {}
        # Sandboxes a destroy freed (name -> owner), durable until the name is used again.
        self._tombstones: dict[str, str | None] = {}
        self._reserved = ensure_reserve(self.root)    # room for a commit when full (persist.py)
        store_file = self.root / STORE_FILE
        if store_file.exists():
            loaded = load_generation(self.root, arena_bytes, self._template_paths)
            self.uuid, self._table, self._arenas = loaded.uuid, loaded.table, loaded.arenas
            self._sandboxes.update(loaded.sandboxes)
            self._generation = loaded.generation
            self._tombstones = dict(loaded.tombstones)
            self.quarantined = dict(loaded.quarantined)
            if self.quarantined:
                # Commit the store without them, so what only they held is reclaimed.
                self._changed = True
                try:
                    self.flush()
                except StoreError as exc:
                    log.error("%s: cannot commit the quarantine yet: %s", self.root, exc)
        else:
            sweep_uncommitted(self.root)
            self.uuid = os.urandom(16)
            self._arenas = ArenaSet(self.root, self.uuid, arena_bytes)
        if self._native is not None:
            self._table.on_change = self._native.publish_table
            self._arenas.on_change = self._native.publish_arenas
            self._native.publish_table(self._table)
            self._native.publish_arenas(self._arenas)

    # ------------------------------------------------------------------ templates / names
    def add_template(self, template: TemplateImage) -> None:
        with self._lock:
            known = self._template_paths.get(template.template_id)
            self._templates[template.template_id] = template
            if known is None or known.get("path") is None:
                self._template_paths[template.template_id] = {"path": template.path, "n_pages": template.n_pages}
                self._changed = True

    def drop_template(self, template_id: str) -> None:
        """Let go of a template's image when no stored sandbox uses it (its template was
        deleted or replaced): the manager's mapping of it goes. Reopened from its path if
        pages of it are decoded again."""
        with self._lock:
            if all(sb.template_id != template_id for sb in self._sandboxes.values()):
                self._templates.pop(template_id, None)
        self._tidy()        # its record goes with the last domain that names it

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

    def _sandbox(self, name: str) -> StoredSandbox:
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

    def owner_of(self, sandbox: str) -> str | None:
        """The owner (domain UUID) the sandbox's entries are bound to; None for entries
        written without one (stores of earlier builds, tests)."""
        with self._lock:
            return self._sandbox(sandbox).owner

    def tombstones(self) -> dict[str, str | None]:
        """Sandboxes freed with ``tombstone=True`` since: name -> the owner their entries had."""
        with self._lock:
            return dict(self._tombstones)

    def clear_tombstone(self, sandbox: str) -> None:
        """The domain of a tombstoned sandbox is gone (reconcile): forget it at the next flush."""
        with self._lock:
            if self._tombstones.pop(sandbox, 0) != 0:
                self._changed = True

    # ------------------------------------------------------------------ encode
    def encode(self, sandbox: str, domain: str, page_idx: np.ndarray, pages: np.ndarray,
               template: TemplateImage, *, use_siblings: bool = True, hot: np.ndarray | None = None,
               owner: str | None = None, scratch: dict[str, np.ndarray] | None = None) -> EncodeResult:
        """Encode resident pages of ``sandbox`` (a member of sharing ``domain``).

        Pages already stored for this sandbox are replaced. Returns the counts and the page
        indices that are now stored (punch them, after ``flush``) or left RAW (keep them resident).
        ``hot`` (optional, bool per page) marks pages the next resume will want first: those
        that need a codec get the cheap-to-decode one (Kind.LZ4, see kinds.HOT_DECODE_BUDGET_US).
        ``owner`` (the domain UUID) binds the sandbox's entries: encoding for another owner
        than the one they are bound to is refused (a reused name must be freed first).
        Raises ``StoreFull`` (nothing stored) when the arenas' file system has no room.
        ``scratch``: the encoder's work buffers, kept by the caller across calls (encoder.Encoder)."""
        if not _NAME_OK.match(sandbox) or not _NAME_OK.match(domain):
            raise StoreError("sandbox and domain names must be 1-1024 characters without NUL")
        page_idx = np.asarray(page_idx, dtype=np.int64)
        pages = np.asarray(pages, dtype=np.uint8).reshape(len(page_idx), PAGE_SIZE)
        if len(page_idx) and (page_idx.min() < 0 or page_idx.max() >= (1 << 32) - 1):
            raise StoreError("page index out of range")
        # A sort and one pass (np.unique hashes here: 3% of an encode's samples).
        ordered = np.sort(page_idx)
        if (ordered[1:] == ordered[:-1]).any():
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
                if sb is not None and owner is not None and sb.owner not in (None, owner):
                    raise StoreError(f"the stored pages of {sandbox!r} belong to domain UUID {sb.owner}, "
                                     f"not {owner}: free them first")
                d = self._table.domain(domain, template.template_id)
                if d.template_id != template.template_id:
                    raise StoreError(f"domain {domain!r} is bound to another template")
                self._table.reclaim()
            opts = dataclasses.replace(self._options, use_siblings=use_siblings)
            encoder = Encoder(self.zstd, opts, scratch, odds=d.attempts)
            for _attempt in range(3):
                with self._lock:
                    old = self._sandboxes.get(sandbox)
                    own = old.index.blob_refs().copy() if old is not None and hot is not None else None
                view = StoreDomainView(self._lock, self._table, self._arenas, self.zstd, d, template, own)
                plan = encoder.plan(page_idx, pages, template, view, hot)
                with self._lock:
                    if self._plan_still_valid(plan):
                        result = self._commit(sandbox, d, template, plan, owner)
                        break
            else:
                raise StoreError("encode kept racing with concurrent frees")
        self._maybe_compact()           # old entries replaced: their blobs may have died
        result.encode_s = time.perf_counter() - t0
        result.cpu_s = time.thread_time() - c0
        return result

    def _plan_still_valid(self, plan: Plan) -> bool:
        rc = self._table.rows["refcount"]
        refs = [plan.ref[plan.target == T_BLOB]]
        refs.append(plan.blobs.ref[plan.blobs.reftype == _REFTYPE_BLOB])
        ids = np.concatenate(refs).astype(np.int64)
        return bool(len(ids) == 0 or (rc[ids] > 0).all())

    def _commit(self, sandbox: str, d: DomainState, template: TemplateImage, plan: Plan,
                owner: str | None) -> EncodeResult:
        table = self._table
        nb = plan.blobs
        n_new = len(nb)
        # Payloads first: a StoreFull here leaves the table and the indices untouched.
        if n_new:
            arena_ids, offsets = self._arenas.append_concat(nb.payload, nb.length)
        new_ids = table.alloc(n_new)
        rows = table.rows
        self._changed = True
        if n_new:
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
            indexed = in_domain_indices(nb.method, nb.reftype)
            sim = nb.has_fp & indexed
            if sim.any():
                table.add_sim(d, nb.fps[sim], new_ids[sim])
            table.add_dups(d, nb.key[indexed], new_ids[indexed])
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
            sb = StoredSandbox(sandbox, d, template.template_id, SandboxIndex.empty(), np.zeros(0, np.uint32),
                               owner=owner)
            self._sandboxes[sandbox] = sb
            d.sandboxes.add(sandbox)
            self._tombstones.pop(sandbox, None)
        elif sb.owner is None and owner is not None:
            sb.owner = owner
        new_sorted = np.sort(new_pages)
        sb.index, replaced = sb.index.replaced(new_sorted, new_pages[stored], kind[stored], flags[stored],
                                               entry_ref[stored])
        if len(replaced[0]):
            self._release_refs(*replaced)
        self._publish(sandbox)
        raw_now = new_pages[~stored]
        old_raw = sb.raw[~in_sorted(sb.raw, new_sorted)]
        sb.raw = union_idx(old_raw, raw_now).astype(np.uint32)
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
        # Space the last durable generation names is only reclaimed at the next commit (arena.py).
        self._changed = True
        m = ~np.isin(kind, (_KIND_ZERO, _KIND_TEMPLATE)) & ((flags & FLAG_REF_TEMPLATE) == 0)
        freed = self._table.decref(ref[m].astype(np.int64))
        if len(freed):
            rows = self._table.rows
            self._arenas.release_many(rows["arena"][freed], rows["offset"][freed], rows["length"][freed])
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

    def entries_match(self, sandbox: str, page_idx: np.ndarray, key: np.ndarray, check: np.ndarray) -> np.ndarray:
        """For each page, whether its stored entry decodes to content with this XXH3-128
        (``key``, ``check``: pagehash.page_hashes of the page now): a page still equal to its
        entry needs no new encoding, and its resident copy can be dropped again, the entry
        serving it. Only entries that name a blob compare (their blob records the page's hash);
        any other entry, and a page without one, is "does not match": the safe answer."""
        p = np.asarray(page_idx, dtype=np.int64)
        with self._lock:
            sb = self._sandboxes.get(sandbox)
            if sb is None or len(p) == 0:
                return np.zeros(len(p), dtype=bool)
            found, kind, flags, ref = sb.index.lookup(p)
            blob_kinds = np.isin(kind, [int(Kind.DUP), int(Kind.TDELTA), int(Kind.SDELTA), int(Kind.ZSTD),
                                        int(Kind.LZ4)])
            named = found & blob_kinds & ((flags & FLAG_REF_TEMPLATE) == 0)
            out = np.zeros(len(p), dtype=bool)
            if named.any():
                rows = self._table.rows[ref[named].astype(np.int64)]
                out[named] = ((rows["key"] == np.asarray(key, dtype=np.uint64)[named])
                              & (rows["check"] == np.asarray(check, dtype=np.uint64)[named])
                              & (rows["refcount"] > 0))
            return out

    # ------------------------------------------------------------------ native lookups
    def native_view(self, sandbox: str) -> NativeView | None:
        """The sandbox's pages as the native fault thread looks them up (None without the
        library); kept current from now on. Give it back with ``release_native_view``."""
        if self._native is None:
            return None
        with self._lock:
            sb = self._sandboxes.get(sandbox)
            try:
                template = self._template(sb.template_id) if sb is not None else None
            except StoreError:
                template = None     # its pages are left to the Python path, which says why
            return self._native.view(sandbox, sb.index if sb is not None else None, template)

    def release_native_view(self, view: NativeView) -> None:
        if self._native is not None:
            self._native.release(view)

    def _publish(self, sandbox: str) -> None:
        """Under the lock, after the sandbox's index changed: tell its native view."""
        if self._native is not None:
            sb = self._sandboxes.get(sandbox)
            template = self._templates.get(sb.template_id) if sb is not None else None
            self._native.publish_sandbox(sandbox, sb.index if sb is not None else None, template)

    # ------------------------------------------------------------------ decode
    # Entries are looked up and their payloads copied out under the state lock; pages are
    # produced and verified outside it (pagedecode.py).
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
            located = locate_page(self._table, self._arenas, template, page_idx, k, flags, ref)
        write_page(self.zstd, self._tls, template, page_idx, located, out)

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
            rows = locate_rows(self._table, self._arenas, kind, flags, ref32)
        write_rows(self.zstd, template, page_idx, rows, out)
        return out

    def decode_pages_into(self, sandbox: str, page_idx: np.ndarray, out: Any) -> None:
        """Bulk decode into a writable buffer of len(page_idx) * 4096 bytes (page j at j*4096):
        the prefetcher's form of ``decode``, same verification and errors."""
        n = len(page_idx)
        arr = np.frombuffer(out, dtype=np.uint8, count=n * PAGE_SIZE).reshape(n, PAGE_SIZE)
        # A sandbox with a native view (its fault thread runs): decoded in C, page by page,
        # without the GIL; anything it cannot produce is decoded (or refused) again below.
        if self._native is not None and self._native.decode_many(sandbox, page_idx, arr):
            return
        self.decode(sandbox, page_idx, out=arr)

    # ------------------------------------------------------------------ release
    def discard(self, sandbox: str, page_idx: np.ndarray) -> None:
        """Forget pages that are resident again (restored): release their entries and references."""
        page_idx = np.asarray(page_idx, dtype=np.int64)
        with self._lock:
            sb = self._sandbox(sandbox)
            page_idx = unique_idx(page_idx)
            none = np.empty(0, dtype=np.int64)
            index, gone = sb.index.replaced(page_idx, none, none, none, none)
            if len(gone[0]):
                self._release_refs(*gone)
                sb.index = index
                self._publish(sandbox)
            sb.raw = sb.raw[~in_sorted(sb.raw, page_idx)]
            self._dirty.add(sandbox)
            self._changed = True
        self._maybe_compact()

    def free_sandbox(self, sandbox: str, *, tombstone: bool = False) -> None:
        """Release every entry and reference of ``sandbox`` (destroy, a reused name). Its
        index file and the space only it held go after the next ``flush``. ``tombstone``
        (destroy) remembers the name and owner durably (``tombstones``)."""
        with self._lock:
            sb = self._sandbox(sandbox)
            if tombstone:
                self._tombstones[sandbox] = sb.owner
            self._release_refs(sb.index.kind, sb.index.flags, sb.index.ref.astype(np.int64))
            del self._sandboxes[sandbox]
            self._publish(sandbox)
            sb.domain.sandboxes.discard(sandbox)
            if not sb.domain.sandboxes:
                self._table.forget_domain(sb.domain)
            self._dirty.discard(sandbox)
            self._changed = True
        self._maybe_compact()
        crash_point("after-free-compact")

    # ------------------------------------------------------------------ accounting
    # owned_bytes_many, domain_bytes, total_bytes, books: StoreBooks (storebooks.py).
    def owned_bytes(self, sandbox: str) -> OwnedBytes:
        got = self.owned_bytes_many([sandbox]).get(sandbox)
        if got is None:
            raise NotStored(sandbox)
        return got

    def attempt_summary(self, domain: str) -> dict[str, list[float | None]]:
        """Bytes a try of each follow-up attempt saved lately on ``domain`` (attempts.py)."""
        with self._lock:
            d = self._table.domains.get(domain)
        return {} if d is None else d.attempts.summary()

    def fault_lock_waits(self) -> dict[str, float | int]:
        """The C fault side's waits for the state lock (NativeLock.fault_waits); empty
        without the native lookup (faults then take the Python lock, not counted)."""
        return self._native.lock.fault_waits() if self._native is not None else {}

    # ------------------------------------------------------------------ persistence
    # flush, generation and compact_arena: StoreWriter (storewrite.py).
    def close(self) -> None:
        """Close the arenas, once a flush or compaction under way has finished."""
        with self._flush_lock, self._compact_lock, self._lock:
            self._arenas.close()

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ introspection
    def check_consistency(self) -> None:
        """Re-run the load-time validation on the live state (tests, debugging). Waits for a
        running compaction (the validation recounts the arenas' live bytes, which a
        compaction's reserved room is part of)."""
        with self._compact_lock, self._lock:
            validate_generation(self.root / STORE_FILE, self._table, self._arenas, self._sandboxes)

    @property
    def entry_bytes(self) -> int:
        return ENTRY_DTYPE.itemsize
