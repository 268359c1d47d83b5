"""The page store's slow writes, flush and compaction, done outside the lock faults take.

Every fault's lookup takes PageStore's state lock (store.py). Writing a generation (fsyncs) and
compacting an arena (copying megabytes) used to hold it too, so a vCPU fault could wait for an
fsync. ``StoreWriter`` (PageStore's base) does each in steps: the state is read or changed under
the state lock in short, in-memory steps, and the I/O runs between them without it.

Flush (``flush``, one at a time under the flush lock, so generations are written in number
order and a later one is never overwritten by an earlier one):
    under the state lock: ``generation.snapshot_generation`` (what the generation holds;
        ``ArenaSet.begin_flush``: from now on, space it names is reclaimed only after a later
        generation);                                    crash point ``after-flush-snapshot``
    without it: ``generation.write_snapshot`` (arena fdatasync, index files,
        ``between-generation-files``, store file renamed in, directory fsync), retried once on
        the reserve when full; a failure gives the snapshot back (``abort_snapshot``: dirty
        again, nothing reclaimed);                     crash point ``after-commit``
    under the state lock: the generation number and the sandboxes' files are published and
        what only older generations named is punched (``publish_snapshot``); space freed since
        the snapshot waits for the next generation;
    without it: older index files and dropped arenas unlinked (``remove_unnamed``);
                                                        crash point ``after-reclaim``
Compaction (``compact_arena``, one at a time under the compaction lock; compaction.py): the
live blobs are planned and their room reserved under the state lock, copied without it
(``after-compact-copy``), and switched under it, each only if its row did not change meanwhile
(``after-compact-switch``); the old arena's file goes after a generation naming the new
locations is durable. Lookups meanwhile decode from the old locations, whole.

Lock order: flush lock, then state lock; compaction lock, then state lock; never the other way
(a thread holding the state lock never waits for the flush or compaction lock: compactions
that the store starts itself are skipped, not waited for, when one is running).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from azqemu.memory.arena import ArenaSet
from azqemu.memory.blobtable import BlobTable
from azqemu.memory.compaction import copy_payloads, plan_compaction, release_reserved, switch_compaction
from azqemu.memory.crashpoint import crash_point
from azqemu.memory.generation import (
    GenerationSnapshot,
    StoredSandbox,
    abort_snapshot,
    close_snapshot,
    publish_snapshot,
    remove_unnamed,
    rows_buffer,
    snapshot_generation,
    write_snapshot,
)
from azqemu.memory.persist import RESERVE_FILE, StoreFull, ensure_reserve, is_no_space, release_reserve

if TYPE_CHECKING:
    from azqemu.memory.template import TemplateImage

log = logging.getLogger(__name__)


class StoreWriter:
    """Flush and compaction of a PageStore (its base class; the state lives in store.py)."""

    root: Path
    uuid: bytes
    _lock: threading.RLock              # the state lock: tables, indices, arena mappings
    _flush_lock: threading.Lock         # one generation written at a time
    _compact_lock: threading.Lock       # one compaction at a time
    _encode_lock: threading.Lock        # one encode at a time (its plan holds blob ids)
    _table: BlobTable
    _arenas: ArenaSet
    _sandboxes: dict[str, StoredSandbox]
    _template_paths: dict[str, dict[str, Any]]
    _templates: dict[str, TemplateImage]   # the images loaded (add_template; drop_template lets go)
    _dirty: set[str]
    _tombstones: dict[str, str | None]
    _changed: bool                      # anything to write since the last snapshot
    _generation: int                    # number of the last durable generation (0: none)
    _reserved: bool

    # ------------------------------------------------------------------ flush
    def flush(self) -> None:
        """Write and commit a generation: everything needed to reopen the store from
        ``root_dir`` (generation.py), then reclaim what only older generations named. When it
        returns, every page encoded before the call survives a crash; a ``StoreFull`` (or any
        error) leaves the previous generation the durable one and nothing reclaimed. Lookups
        and decodes go on while the files are written and synced (module docstring)."""
        with self._flush_lock:
            # Unlocked reads, hints only: the buffer the rows are copied into under the lock.
            buf = rows_buffer(self._table.n) if self._changed or not self._generation else None
            with self._lock:
                if not self._changed and self._generation:
                    return
                snap = snapshot_generation(self.uuid, self._generation + 1, self._table, self._arenas,
                                           self._sandboxes, self._template_paths, self._dirty, self._tombstones,
                                           buf)
                self._changed = False
            try:
                try:
                    crash_point("after-flush-snapshot")
                    self._write_snapshot(snap)
                finally:
                    close_snapshot(snap)
            except BaseException:
                with self._lock:
                    self._changed = True
                    abort_snapshot(snap, self._arenas, self._sandboxes, self._dirty)
                raise
            crash_point("after-commit")
            with self._lock:
                self._generation = snap.generation
                dropped = publish_snapshot(snap, self._arenas)
            remove_unnamed(self.root, snap, dropped)
            crash_point("after-reclaim")
            if not self._reserved or not (self.root / RESERVE_FILE).exists():
                self._reserved = ensure_reserve(self.root)

    def _write_snapshot(self, snap: GenerationSnapshot) -> None:
        try:
            write_snapshot(self.root, self.uuid, snap)
        except StoreFull:
            # Full: spend the reserve on this commit (it may be the one that frees space).
            if not release_reserve(self.root):
                raise
            log.warning("%s: file system full, committing on the reserved space", self.root)
            write_snapshot(self.root, self.uuid, snap)

    @property
    def generation(self) -> int:
        """Number of the last durable generation (0: none yet)."""
        return self._generation

    # ------------------------------------------------------------------ compaction
    def _maybe_compact(self) -> None:
        """Compact the arenas that need it (ArenaSet.compaction_candidates). Called without the
        state lock; skipped if a compaction is running (the next free looks again)."""
        if not self._compact_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                candidates = self._arenas.compaction_candidates()
            for arena_id in candidates:
                try:
                    self._compact(arena_id)
                except StoreFull as exc:
                    # Compaction only gives memory back; with no room to copy, it waits.
                    log.warning("%s: arena %d not compacted: %s", self.root, arena_id, exc)
                    return
        finally:
            self._compact_lock.release()
        self._tidy()

    def _tidy(self) -> None:
        """Books that outlived what they describe go, so that a manager that served a fleet
        returns to its idle memory and a daemon that runs for weeks, through templates made and
        deleted, does not keep (and write into every generation) a record of each:
        - the last sandbox went: the blob table shrinks back (BlobTable.reset_if_empty);
        - a sharing domain whose last sandbox went (BlobTable.drop_empty_domains);
        - a template no sandbox and no domain uses that the manager let go of (drop_template).
        Not while an encode (its domain may have no sandbox until it commits) or a compaction
        holds blob ids: the next free or encode looks again."""
        if not self._encode_lock.acquire(blocking=False):
            return
        try:
            if not self._compact_lock.acquire(blocking=False):
                return
            try:
                with self._lock:
                    if not self._sandboxes and self._table.reset_if_empty():
                        self._changed = True
                    if self._table.drop_empty_domains():
                        self._changed = True
                    used = ({sb.template_id for sb in self._sandboxes.values()}
                            | {d.template_id for d in self._table.domains.values()} | set(self._templates))
                    for t_id in [t for t in self._template_paths if t not in used]:
                        del self._template_paths[t_id]
                        self._changed = True
            finally:
                self._compact_lock.release()
        finally:
            self._encode_lock.release()

    def compact_arena(self, arena_id: int) -> None:
        """Move the live blobs of an arena to the current one and drop it (compaction.py).
        Must not be called with the state lock held."""
        with self._compact_lock:
            self._compact(arena_id)

    def _compact(self, arena_id: int) -> None:
        with self._lock:
            if arena_id not in self._arenas.arenas:
                return
            job = plan_compaction(self._table, self._arenas, arena_id)
            self._changed = True
        if job is None:
            return
        try:
            try:
                copy_payloads(job)
            finally:
                job.close()
            crash_point("after-compact-copy")
        except BaseException as err:
            with self._lock:
                release_reserved(job, self._arenas)
            if isinstance(err, OSError) and is_no_space(err):
                raise StoreFull(str(self.root), "no room to copy an arena's live blobs") from err
            raise
        with self._lock:
            switch_compaction(job, self._table, self._arenas)
        crash_point("after-compact-switch")
