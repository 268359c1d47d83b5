"""The page store's on-disk generation: writing the live state out, loading it back, checking it.

A generation is what one ``PageStore.flush`` leaves under the root directory: the store file
(ids, domains, templates, the blob table and the similarity indices), one index file per
sandbox, and the arena files whose bytes those name. ``write_generation`` writes it (arenas
first, then the sandboxes' indices, then the store file that names them, and only then drops
the index files of freed sandboxes), ``load_generation`` reads it back into a blob table, an
arena set and sandbox records, and ``validate_generation`` recomputes every bound and reference
count of a loaded (or live) state and refuses any mismatch as ``StoreCorrupt``. The byte
formats of the store and index files are persist.py's; arena files are arena.py's.

Known gap, not crash-consistent yet: index files are replaced one by one before the store file
that names them, and between flushes the store frees space at once (dead blobs punched, arenas
compacted and unlinked by PageStore.compact_arena), not after a generation that no longer names
it. A crash mid-flush, or after such a release, leaves files that load refuses (StoreCorrupt)
or blobs that fail their checksum. Reopen what was flushed, with nothing released since.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from azqemu.errors import StoreCorrupt
from azqemu.memory.arena import ARENA_HEADER_BYTES, ArenaSet
from azqemu.memory.blobtable import BLOB_DTYPE, BlobTable, DomainState
from azqemu.memory.kinds import PAGE_SIZE, Method, RefType
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

_REFTYPE_BLOB = int(RefType.BLOB)


@dataclass
class StoredSandbox:
    """One sandbox of the store: its entry in the store file and what its index file holds."""

    name: str
    domain: DomainState
    template_id: str
    index: SandboxIndex
    raw: np.ndarray                  # sorted u4 page indices left resident (RAW)


@dataclass
class LoadedGeneration:
    """The state ``load_generation`` read back, for PageStore to adopt."""

    uuid: bytes
    table: BlobTable
    arenas: ArenaSet
    sandboxes: dict[str, StoredSandbox]


def write_generation(root: Path, uuid: bytes, table: BlobTable, arenas: ArenaSet,
                     sandboxes: dict[str, StoredSandbox], template_paths: dict[str, dict[str, Any]],
                     dirty: set[str], freed_files: list[str]) -> None:
    """Write everything needed to reopen the store from ``root`` (PageStore.flush).

    The caller holds the store's state lock. Writes the index files of the ``dirty`` sandboxes
    and empties the set; unlinks the index files in ``freed_files`` (those of freed sandboxes)
    once the store file no longer names them, and empties the list.
    """
    arenas.flush()
    for name in sorted(dirty):
        sb = sandboxes[name]
        write_index(root / index_file_name(name), uuid, name, sb.index.to_records(), sb.raw, sb.index.zt)
    dirty.clear()
    # Purge freed ids from the similarity indices so the saved free list is clean.
    table.reclaim()
    for d in table.domains.values():
        table.sim_index(d)
    meta = {
        "store_uuid": uuid.hex(),
        "n_blobs": table.n,
        "free": sorted(table.free),
        "templates": template_paths,
        "domains": [{"name": d.name, "did": d.did, "template_id": d.template_id, "sim_entries": len(d.sim)}
                    for d in sorted(table.domains.values(), key=lambda d: d.did)],
        "sandboxes": [{"name": s.name, "domain": s.domain.name, "template_id": s.template_id,
                       "file": index_file_name(s.name)} for s in sandboxes.values()],
        "arenas": [{"id": a.arena_id, "used": a.used, "live": a.live} for a in arenas.arenas.values()],
        "current_arena": None if arenas.current is None else arenas.current.arena_id,
        "arena_bytes": arenas.arena_bytes,
    }
    binary: list[bytes | memoryview] = [table.rows[:table.n].tobytes()]
    for d in sorted(table.domains.values(), key=lambda d: d.did):
        binary.append(d.sim.keys.astype("<u8").tobytes())
        binary.append(d.sim.sources.astype("<u4").tobytes())
    write_store(root / STORE_FILE, meta, binary)
    for fname in freed_files:
        if fname not in {index_file_name(s) for s in sandboxes}:
            try:
                os.unlink(root / fname)
            except FileNotFoundError:
                pass
    freed_files.clear()


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
    if off != len(body):
        raise bad(str(path), "trailing bytes after the indices")
    arena_set = ArenaSet(root, uuid, a_bytes)
    for a in arenas:
        arena_set.open_existing(int(a["id"]), int(a["used"]), int(a["live"]))
    if current is not None:
        if current not in arena_set.arenas:
            raise bad(str(path), "current arena missing")
        arena_set.current = arena_set.arenas[current]
    table.free = [int(b) for b in meta.get("free", []) if 0 <= int(b) < n_blobs]
    records: dict[str, StoredSandbox] = {}
    for s in sandboxes:
        name, rec, raw, zt = read_index(root / str(s["file"]), uuid)
        if name != s["name"] or s["domain"] not in table.domains:
            raise bad(str(root / str(s["file"])), "index does not match the store")
        d = table.domains[s["domain"]]
        sb = StoredSandbox(name, d, str(s["template_id"]), SandboxIndex.from_parts(zt, rec), raw)
        records[name] = sb
        d.sandboxes.add(name)
    validate_generation(path, table, arena_set, records)
    return LoadedGeneration(uuid, table, arena_set, records)


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
        if (lv["method"] > int(Method.LZ4_XOR)).any() or (lv["reftype"] > 2).any():
            raise StoreCorrupt(str(path), "unknown blob method or reference type")
        if (lv["length"] == 0).any() or (lv["length"] > PAGE_SIZE + 128).any():
            raise StoreCorrupt(str(path), "blob length out of bounds")
        for a_id in np.unique(lv["arena"]):
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
