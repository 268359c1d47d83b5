"""The page store's on-disk generation: writing the live state out, loading it back, checking it.

A generation is what one ``PageStore.flush`` leaves under the root directory: the store file
(its number, ids, domains, templates, the blob table, the similarity indices, and the name of
each sandbox's index file), the index files it names, and the arena files whose bytes those
name. ``load_generation`` reads it back into a blob table, an arena set and sandbox records,
and ``validate_generation`` recomputes every bound and reference count of a loaded (or live)
state and refuses any mismatch as ``StoreCorrupt``. The byte formats of the store and index
files are persist.py's; arena files are arena.py's.

A generation is written in three steps so that the slow I/O (writes, fsyncs) happens outside
the store's state lock, which every fault's lookup needs (PageStore.flush drives them, holding
its flush lock throughout, so one generation is written at a time and in number order):
    ``snapshot_generation`` (under the state lock): what the generation must contain, copied or
        referenced (the blob table rows copied; sandbox indices and RAW lists are replaced on
        every change, never changed in place, so references stay valid), the arena fds to sync
        dup(2)ed, and the arena marks handed to ``ArenaSet.begin_flush``;
    ``write_snapshot`` (no lock), ordered like a write-ahead log; a crash (SIGKILL) at any
        point leaves either the old generation or the new one, whole:
        1. arena payloads synced (fdatasync; tmpfs: nothing to do);
        2. each changed sandbox's index under a NEW name (``sbx-<h>-g<gen>.azqidx``: write to a
           temporary name, fsync, rename); the old generation's files are not touched;
        3. the store file naming those files (temporary name, fsync, rename over ``store.azq``),
           then fsync of the directory: the commit point;
    publishing (PageStore.flush, under the state lock again): the generation number, each
        written sandbox's file, then ``ArenaSet.finish_flush`` reclaims what only older
        generations named (dead blobs punched; space that died after the snapshot waits for
        the next generation, which may be the first not to name it), and without the lock
        ``remove_unnamed`` unlinks the index files and arenas no durable generation names.
Loading takes the generation ``store.azq`` names and sweeps every other store file (index
files and arenas of a newer generation that never committed, of an older one whose unlink a
crash interrupted, temporary files). A sandbox whose index file is unreadable or inconsistent
is quarantined (``LoadedGeneration.quarantined``: its file moved to ``quarantine/``, its
references released) and the others load.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from azqemu.errors import StoreCorrupt, StoreError
from azqemu.memory.arena import ARENA_HEADER_BYTES, ArenaSet
from azqemu.memory.blobtable import BLOB_DTYPE, BlobTable, DomainState
from azqemu.memory.crashpoint import crash_point, fail_point
from azqemu.memory.kinds import PAGE_SIZE, Method, RefType
from azqemu.memory.persist import (
    STORE_FILE,
    TMP_SUFFIX,
    StoreFull,
    index_file_name,
    is_index_file_name,
    read_index,
    read_store,
    sync_dir,
    write_index,
    write_store,
)
from azqemu.memory.sbxindex import SandboxIndex
from azqemu.memory.simindex import SimilarityIndex
from azqemu.pages import not_in_ids, unique_idx

_REFTYPE_BLOB = int(RefType.BLOB)
QUARANTINE_DIR = "quarantine"
log = logging.getLogger(__name__)


@dataclass
class StoredSandbox:
    """One sandbox of the store: its entry in the store file and what its index file holds."""

    name: str
    domain: DomainState
    template_id: str
    index: SandboxIndex
    raw: np.ndarray                  # sorted u4 page indices left resident (RAW)
    owner: str | None = None         # the domain UUID the entries belong to (None: not bound)
    file: str | None = None          # its index file in the last durable generation


@dataclass
class LoadedGeneration:
    """The state ``load_generation`` read back, for PageStore to adopt."""

    uuid: bytes
    table: BlobTable
    arenas: ArenaSet
    sandboxes: dict[str, StoredSandbox]
    generation: int = 0
    # Sandboxes the store named but could not load: name -> reason (their pages are lost).
    quarantined: dict[str, str] = field(default_factory=dict)
    swept: list[str] = field(default_factory=list)
    tombstones: dict[str, str | None] = field(default_factory=dict)


@dataclass
class GenerationSnapshot:
    """What one generation holds, taken under the state lock (``snapshot_generation``)."""

    generation: int
    meta: dict[str, Any]
    rows: bytes | memoryview                          # the blob table's rows (a copy)
    # Per domain (in did order): its similarity index and the parts not merged into it yet;
    # merged, and purged of ``dead``, outside the lock (``_binary``).
    sims: list[tuple[SimilarityIndex, list[SimilarityIndex]]]
    dead: np.ndarray                                  # ids freed but still in a similarity index
    free: np.ndarray                                  # sorted outside the lock into the binary part
    # (record, file name, index, RAW pages) of each sandbox whose index file is written anew.
    indices: list[tuple[StoredSandbox, str, SandboxIndex, np.ndarray]]
    named: set[str]                                   # every index file the generation names
    sync_fds: list[tuple[int, int]]                   # (arena id, dup fd) to fdatasync, then close
    dirty: set[str]                                   # the dirty set it took (given back on failure)
    synced: set[int] = field(default_factory=set)     # arena ids already synced (a retry skips them)
    binary: list[bytes | memoryview] | None = None    # the store file's binary part, once built


def rows_buffer(n_blobs: int) -> np.ndarray:
    """Room for a copy of ``n_blobs`` blob-table rows and some more, its pages touched: made
    before the state lock is taken, so that the copy under it is one memcpy (a fresh buffer
    of tens of MiB costs more in page faults than in copying)."""
    buf = np.empty((n_blobs + n_blobs // 8 + 1024) * BLOB_DTYPE.itemsize, dtype=np.uint8)
    buf.fill(0)
    return buf


def snapshot_generation(uuid: bytes, generation: int, table: BlobTable, arenas: ArenaSet,
                        sandboxes: dict[str, StoredSandbox], template_paths: dict[str, dict[str, Any]],
                        dirty: set[str], tombstones: dict[str, str | None],
                        rows_buf: np.ndarray | None = None) -> GenerationSnapshot:
    """Everything generation number ``generation`` must contain (module docstring), taken
    under the store's state lock: copies and references only, the rows copied into
    ``rows_buf`` (``rows_buffer``) when it is large enough. Empties ``dirty`` (what changes
    from now on is marked again and goes into the next generation) and starts the flush of
    ``arenas``; the caller gives both back with ``abort_snapshot`` if the generation is not
    committed, and closes the snapshot's fds (``close_snapshot``) in any case."""
    files: dict[str, str] = {}
    indices = []
    for s in sandboxes.values():
        if s.name in dirty:
            f = index_file_name(s.name, generation)
            indices.append((s, f, s.index, s.raw))
        elif s.file is None:
            raise AssertionError(f"sandbox {s.name!r} changed but was not marked dirty")
        else:
            f = s.file
        files[s.name] = f
    domains = sorted(table.domains.values(), key=lambda d: d.did)
    meta = {
        "store_uuid": uuid.hex(),
        "generation": generation,
        "tombstones": dict(tombstones),
        "n_blobs": table.n,
        "templates": {k: dict(v) for k, v in template_paths.items()},
        "domains": [{"name": d.name, "did": d.did, "template_id": d.template_id} for d in domains],
        "sandboxes": [{"name": s.name, "domain": s.domain.name, "template_id": s.template_id,
                       "file": files[s.name], "owner": s.owner} for s in sandboxes.values()],
        "arenas": [{"id": a.arena_id, "used": a.used, "live": a.live} for a in arenas.arenas.values()],
        "current_arena": None if arenas.current is None else arenas.current.arena_id,
        "arena_bytes": arenas.arena_bytes,
    }
    # The rows change in place: copied. Similarity indices are replaced, never changed in place.
    size = table.n * BLOB_DTYPE.itemsize
    rows: bytes | memoryview
    if rows_buf is not None and len(rows_buf) >= size:
        np.copyto(rows_buf[:size], table.rows[:table.n].view(np.uint8))
        rows = rows_buf[:size].data
    else:
        rows = table.rows[:table.n].tobytes()
    sims = [(d.sim, ([d.sim_young] if len(d.sim_young) else []) + list(d.sim_pending)) for d in domains]
    fds = arenas.begin_flush()          # the last step that can fail
    taken = set(dirty)
    dirty.clear()
    return GenerationSnapshot(generation, meta, rows, sims, table.quarantine.copy(), table.free.copy(), indices,
                              set(files.values()), fds, taken)


def _binary(snap: GenerationSnapshot) -> list[bytes | memoryview]:
    """The store file's binary part, built without the lock: the rows, then each domain's
    similarity index merged (BlobTable.sim_index's order) and purged of the ids freed since
    the last reclaim (BlobTable.reclaim), which the saved free list holds."""
    binary: list[bytes | memoryview] = [snap.rows]
    dead = snap.dead.astype(np.int64)
    for dm, (sim, pending) in zip(snap.meta["domains"], snap.sims):
        if pending:
            sim = SimilarityIndex.merged([sim] + pending)
        keys, src = sim.keys, sim.sources.astype(np.uint32)
        if len(dead) and len(src):
            keep = not_in_ids(src, dead)
            keys, src = keys[keep], src[keep]
        dm["sim_entries"] = len(keys)
        binary.append(np.ascontiguousarray(keys, dtype="<u8").data)
        binary.append(np.ascontiguousarray(src, dtype="<u4").data)
    free = np.sort(np.concatenate([snap.free, snap.dead]).astype("<u4"))
    snap.meta["free_count"] = len(free)
    binary.append(free.data)
    return binary


def write_snapshot(root: Path, uuid: bytes, snap: GenerationSnapshot) -> None:
    """Write the snapshot's generation and commit it (steps 1-3 of the module docstring),
    without the state lock. On a failure (``StoreFull``, any OSError) before the commit point
    the previous generation stays the durable one and the new files are removed; it may be
    called again with the same snapshot (the retry on the reserve)."""
    ArenaSet.sync_fds(root, [(aid, fd) for aid, fd in snap.sync_fds if aid not in snap.synced])
    snap.synced.update(aid for aid, _fd in snap.sync_fds)
    if snap.binary is None:
        snap.binary = _binary(snap)
    written: list[str] = []
    try:
        for sb, fname, index, raw in snap.indices:
            write_index(root / fname, uuid, sb.name, index.to_records(), raw, index.zt)
            written.append(fname)
            crash_point("between-generation-files")
        fail_point("commit", lambda: StoreFull(str(root / STORE_FILE), "injected (AZQ_FAIL_AT)"))
        write_store(root / STORE_FILE, snap.meta, snap.binary)
    except BaseException:
        for fname in written:
            try:
                os.unlink(root / fname)
            except OSError:
                pass
        raise
    # The rename is done: from here on the new files are named and must stay, and this
    # generation's number is used (PageStore counts it even if the directory sync fails).
    try:
        sync_dir(root)
    except OSError as err:
        log.error("%s: directory sync after the commit of generation %d failed: %s", root, snap.generation, err)


def close_snapshot(snap: GenerationSnapshot) -> None:
    for _aid, fd in snap.sync_fds:
        os.close(fd)
    snap.sync_fds = []


def publish_snapshot(snap: GenerationSnapshot, arenas: ArenaSet) -> list[Path]:
    """The snapshot's generation is durable (under the state lock): each written sandbox's
    record names its new file, and what only older generations named is reclaimed. Returns
    the arena files to unlink (``remove_unnamed``)."""
    for sb, fname, _index, _raw in snap.indices:
        sb.file = fname         # also on a record freed meanwhile: harmless, it is gone
    return arenas.finish_flush()


def abort_snapshot(snap: GenerationSnapshot, arenas: ArenaSet, sandboxes: dict[str, StoredSandbox],
                   dirty: set[str]) -> None:
    """The snapshot's generation was not committed (under the state lock): the sandboxes it
    would have written are dirty again (those still stored) and the arenas' reclaim waits."""
    dirty.update(n for n in snap.dirty if n in sandboxes)
    arenas.abort_flush(snap.sync_fds)


def remove_unnamed(root: Path, snap: GenerationSnapshot, arena_files: list[Path]) -> None:
    """After a commit, without the state lock (the caller still holds the flush lock, so no
    other generation is being written): unlink the index files the durable generation does
    not name, temporary files, and the arena files it dropped."""
    try:
        for p in root.iterdir():
            if (is_index_file_name(p.name) and p.name not in snap.named) or p.name.endswith(TMP_SUFFIX):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
        for path in arena_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    except OSError as err:      # left for the sweep at the next open
        log.error("%s: removing the files of older generations failed: %s", root, err)


def load_generation(root: Path, arena_bytes: int, template_paths: dict[str, dict[str, Any]]) -> LoadedGeneration:
    """Read the generation under ``root`` back and validate it.

    Called by PageStore's constructor, before the store is shared: no lock is taken.

    ``template_paths`` gains the templates the store file names that the caller did not pass.
    Refuses a foreign file with ``StoreForeign`` and a damaged or inconsistent one with
    ``StoreCorrupt``.
    """
    path = root / STORE_FILE
    try:
        return _load_checked(root, path, arena_bytes, template_paths)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        # The file passed its checksum, so this is a writer's bug or a crafted file.
        raise StoreCorrupt(str(path), f"malformed metadata: {type(err).__name__}: {err}") from err


def _load_checked(root: Path, path: Path, arena_bytes: int,
                  template_paths: dict[str, dict[str, Any]]) -> LoadedGeneration:
    meta, body = read_store(path)
    bad = StoreCorrupt
    try:
        uuid = bytes.fromhex(meta["store_uuid"])
        n_blobs = int(meta["n_blobs"])
        domains = meta["domains"]
        sandboxes = meta["sandboxes"]
        arenas = meta["arenas"]
        templates = meta["templates"]
        current = meta["current_arena"]
        a_bytes = int(meta.get("arena_bytes", arena_bytes))
    except (KeyError, TypeError, ValueError) as err:
        raise bad(str(path), f"metadata field missing or malformed: {err}") from err
    if len(uuid) != 16:
        raise bad(str(path), "bad store uuid")
    if not 0 <= n_blobs <= len(body) // BLOB_DTYPE.itemsize:
        raise bad(str(path), "blob count exceeds the file")
    off = n_blobs * BLOB_DTYPE.itemsize
    rows = np.zeros(max(1024, n_blobs), dtype=BLOB_DTYPE)
    rows[:n_blobs] = np.frombuffer(body, dtype=BLOB_DTYPE, count=n_blobs)
    table = BlobTable(rows, n_blobs)
    for t_id, info in templates.items():
        if t_id not in template_paths:
            template_paths[t_id] = info
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
    if "free_count" in meta:               # version 3; version 2 had them as a JSON list
        k = int(meta["free_count"])
        if k < 0 or off + 4 * k > len(body):
            raise bad(str(path), "free list exceeds the file")
        free = np.frombuffer(body, dtype="<u4", count=k, offset=off).astype(np.int64)
        off += 4 * k
    else:
        free = np.array(meta.get("free", []), dtype=np.int64)
    if off != len(body):
        raise bad(str(path), "trailing bytes after the indices")
    generation = int(meta.get("generation", 0))
    arena_set = ArenaSet(root, uuid, a_bytes)
    try:
        for a in arenas:
            arena_set.open_existing(int(a["id"]), int(a["used"]), int(a["live"]))
        if current is not None:
            if current not in arena_set.arenas:
                raise bad(str(path), "current arena missing")
            arena_set.current = arena_set.arenas[current]
        table.free = free[(free >= 0) & (free < n_blobs)].astype(np.uint32)
        records, quarantined = _load_sandboxes(root, uuid, table, sandboxes)
        orphans = _release_orphans(table, records) if quarantined else np.zeros(0, np.int64)
        validate_generation(path, table, arena_set, records)
    except BaseException:
        arena_set.close()
        raise
    # This generation is the durable one; everything else of the store's files goes.
    arena_set.commit()
    if len(orphans):
        # Blobs only a quarantined sandbox held: named by the generation on disk, so their
        # space waits for the next commit like any other dead blob's.
        rows = table.rows
        b = orphans
        for aid in unique_idx(rows["arena"][b]).tolist():
            sel = b[rows["arena"][b] == aid]
            arena_set.pending_release.append((int(aid), rows["offset"][sel].astype(np.int64),
                                              rows["length"][sel].astype(np.int64)))
        table.retire(orphans)
    named = {sb.file for sb in records.values()}
    for s in sandboxes:
        if s["name"] in quarantined:
            _move_aside(root, str(s["file"]))
    swept = arena_set.sweep()
    for p in sorted(root.iterdir()):
        if (is_index_file_name(p.name) and p.name not in named) or p.name.endswith(TMP_SUFFIX):
            p.unlink()
            swept.append(p.name)
    if swept:
        log.info("%s: removed %d file(s) no durable generation names: %s", root, len(swept), ", ".join(swept[:8]))
    tombstones = {str(k): (None if v is None else str(v)) for k, v in dict(meta.get("tombstones", {})).items()}
    return LoadedGeneration(uuid, table, arena_set, records, generation, quarantined, swept, tombstones)


def sweep_uncommitted(root: Path) -> None:
    """Remove the files of a store that never committed (no ``store.azq``: a crash before the
    first flush). Nothing was ever dropped on the strength of them: they are garbage."""
    leftovers = [p for p in root.iterdir()
                 if (p.name.startswith("arena-") and p.name.endswith(".azq"))
                 or is_index_file_name(p.name) or p.name.endswith(TMP_SUFFIX)]
    for p in leftovers:
        p.unlink()
    if leftovers:
        log.info("%s: removed %d file(s) of a store that never committed", root, len(leftovers))


def _load_sandboxes(root: Path, uuid: bytes, table: BlobTable,
                    sandboxes: list[dict[str, Any]]) -> tuple[dict[str, StoredSandbox], dict[str, str]]:
    """Each sandbox the store file names, from its index file; one that cannot be read or
    does not match the store is quarantined (name -> reason), not loaded."""
    records: dict[str, StoredSandbox] = {}
    quarantined: dict[str, str] = {}
    for s in sandboxes:
        sname, fname = str(s["name"]), str(s["file"])
        if not is_index_file_name(fname):
            raise StoreCorrupt(str(root / STORE_FILE), f"bad index file name {fname[:80]!r}")
        if s["domain"] not in table.domains:
            raise StoreCorrupt(str(root / STORE_FILE), f"sandbox {sname!r} of an unknown domain")
        try:
            name, rec, raw, zt = read_index(root / fname, uuid)
            if name != sname:
                raise StoreCorrupt(str(root / fname), "index does not match the store")
            idx = SandboxIndex.from_parts(zt, rec)
        except (StoreError, ValueError) as err:
            quarantined[sname] = str(err)
            continue
        d = table.domains[s["domain"]]
        owner = s.get("owner")
        sb = StoredSandbox(name, d, str(s["template_id"]), idx, raw,
                           owner=None if owner is None else str(owner), file=fname)
        problem = _sandbox_problem(sb, table)
        if problem:
            quarantined[sname] = f"index of {sname!r}: {problem}"
            continue
        records[name] = sb
        d.sandboxes.add(name)
    for name, reason in quarantined.items():
        log.error("page store %s: sandbox %s quarantined, its stored pages are lost: %s", root, name, reason)
    return records, quarantined


def _sandbox_problem(sb: StoredSandbox, table: BlobTable) -> str | None:
    """What is wrong with one sandbox's index against the blob table (None: nothing)."""
    n = table.n
    rows = table.rows[:n]
    problem = sb.index.check()
    if problem:
        return problem
    refs = sb.index.blob_refs().astype(np.int64)
    if len(refs) and (refs >= n).any():
        return "names a missing blob"
    if len(refs) and (rows["refcount"][refs] == 0).any():
        return "names a freed blob"
    if len(refs) and (rows["domain"][refs] != sb.domain.did).any():
        return "names a blob of another domain"
    return None


def _release_orphans(table: BlobTable, records: dict[str, StoredSandbox]) -> np.ndarray:
    """Reference counts recomputed without the quarantined sandboxes: returns the blobs now
    held by nobody (their SDELTA bases released in turn); counts of the others are set."""
    n = table.n
    rows = table.rows[:n]
    held = np.zeros(n, dtype=np.int64)
    for sb in records.values():
        held += np.bincount(sb.index.blob_refs().astype(np.int64), minlength=n)[:n]
    live = rows["refcount"] > 0
    while True:
        based = rows["ref"][live & (rows["reftype"] == _REFTYPE_BLOB)].astype(np.int64)
        count = held + np.bincount(based[based < n], minlength=n)[:n]
        now = live & (count > 0)
        if np.array_equal(now, live):
            break
        live = now
    orphans = np.flatnonzero((rows["refcount"] > 0) & ~live)
    rows["refcount"][:] = np.where(live, count, 0).astype(np.uint32)
    return orphans


def _move_aside(root: Path, fname: str) -> None:
    """Keep a quarantined index file for inspection, out of the store's way."""
    src = root / fname
    if not src.exists():
        return
    qdir = root / QUARANTINE_DIR
    qdir.mkdir(exist_ok=True)
    os.replace(src, qdir / fname)


def validate_generation(path: Path, table: BlobTable, arenas: ArenaSet,
                        sandboxes: dict[str, StoredSandbox]) -> None:
    """Bounds and reference counts of everything loaded; StoreCorrupt on any mismatch.

    Also run on the live state (PageStore.check_consistency, whose caller holds the store's
    state lock); ``path`` only names the store in the error.
    """
    n = table.n
    rows = table.rows[:n]
    live = rows["refcount"] > 0
    lv = rows[live]
    if len(lv):
        if (lv["method"] > int(Method.PATCH)).any() or (lv["reftype"] > 2).any():
            raise StoreCorrupt(str(path), "unknown blob method or reference type")
        if (lv["length"] == 0).any() or (lv["length"] > PAGE_SIZE + 128).any():
            raise StoreCorrupt(str(path), "blob length out of bounds")
        for a_id in unique_idx(lv["arena"]):
            a = arenas.arenas.get(int(a_id))
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
    for sb in sandboxes.values():
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
    for a in arenas.arenas.values():
        a.live = int(lv["length"][lv["arena"] == a.arena_id].sum()) if len(lv) else 0
