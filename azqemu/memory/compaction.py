"""Compaction of an arena without holding the store's lock while the bytes move.

An arena whose live share has fallen low (arena.py, ``compaction_candidates``) is compacted:
its live blobs are copied to the current arena and the arena is dropped. The copy is the slow
part (megabytes), and the restore path's faults need the store's state lock for every lookup,
so it runs in three steps (PageStore.compact_arena drives them, one compaction at a time):

1. ``plan_compaction`` (under the state lock): the arena stops being the one appended to, its
   live blobs and their rows are noted, room for them is reserved in the current arena
   (``ArenaSet.reserve``: counted used and live, so nothing drops or overwrites it), and the
   file descriptors the copy needs are dup(2)ed;
2. ``copy_payloads`` (no lock): the payloads are read through a mapping of the compaction's
   own and written into the reserved room (pwrite(2)). Meanwhile lookups keep decoding from
   the old locations: nothing points at the new ones yet, and the old arena cannot be closed
   under a reader (decoders copy payloads out under the lock; the arena is dropped only when
   nothing live is left in it, and a live blob not yet moved keeps it);
3. ``switch_compaction`` (under the state lock): each blob whose row is unchanged since step 1
   (still live, same arena object, same place and content) gets its new location; the room of
   a blob freed meanwhile is released (dead bytes). Then the arena, now without a live blob, is
   dropped: closed at once, its file unlinked only after a generation that names the new
   locations is durable (``ArenaSet.drop``: an arena the durable generation or the one being
   written names waits for the commit after).

A crash at any step reopens the last durable generation, which names the old locations and
whose arena files are all still there: a new location is named only by a generation written
after step 3, and the bytes it names were written (and are synced by that flush) before step 3.
Known race, handled: a blob freed during the copy may have its id reused by an encode before
step 3; its row then differs (arena, offset or hashes) and it is not switched.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from azqemu.memory.arena import Arena, ArenaSet
from azqemu.memory.blobtable import BlobTable

# The fields that identify a blob's payload: equal before and after the copy means the same blob.
_SAME_FIELDS = ("arena", "offset", "length", "key", "check", "method", "reftype", "ref", "domain")


@dataclass
class CompactJob:
    """One compaction between its steps (module docstring)."""

    arena: Arena                      # the arena compacted (its object: an id may be reused)
    blobs: np.ndarray                 # int64 ids of its live blobs at step 1
    rows: np.ndarray                  # their blob-table rows then (copies)
    new_arena: np.ndarray             # u2: where each goes
    new_offset: np.ndarray            # u4
    targets: list[Arena]              # the arenas the room was reserved in
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)   # (dup fd, at, from, size)
    src_fd: int = -1                  # dup of the compacted arena's fd

    def close(self) -> None:
        """Close the descriptors the job dup(2)ed (after step 2, whatever happened)."""
        for fd in {self.src_fd, *(s[0] for s in self.spans)} - {-1}:
            os.close(fd)
        self.src_fd, self.spans = -1, []


def plan_compaction(table: BlobTable, arenas: ArenaSet, arena_id: int) -> CompactJob | None:
    """Step 1, under the store's lock. None when there is nothing to copy (the arena is gone,
    or it held nothing live and was dropped here). Raises StoreFull when no room can be
    reserved: nothing changed then, except that the arena is no longer the current one."""
    a = arenas.arenas.get(arena_id)
    if a is None:
        return None
    rows = table.rows[:table.n]
    live = np.flatnonzero((rows["refcount"] > 0) & (rows["arena"] == arena_id)).astype(np.int64)
    if arenas.current is a:
        arenas.retire_current()         # appends go elsewhere from now on: its blobs only die
    if not len(live):
        arenas.drop(arena_id)
        return None
    snap = rows[live].copy()
    new_ids, new_offs, spans = arenas.reserve(snap["length"].astype(np.int64))
    job = CompactJob(a, live, snap, new_ids, new_offs, [s[0] for s in spans])
    try:
        job.src_fd = os.dup(a.fd)
        for t, start, base, size in spans:
            job.spans.append((os.dup(t.fd), start, base, size))
    except BaseException:
        job.close()
        release_reserved(job, arenas)
        raise
    return job


def copy_payloads(job: CompactJob) -> None:
    """Step 2, without the lock: the live payloads into the reserved room."""
    from azqemu.memory.zstdlib import _NATIVE

    offs = job.rows["offset"].astype(np.int64)
    lens = job.rows["length"].astype(np.uint32)
    # A mapping of our own: the arena's may be closed meanwhile (all its blobs freed). Pages
    # punched meanwhile read as zeros: they held only dead blobs, which are not switched.
    mm = mmap.mmap(job.src_fd, job.arena.capacity, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        if _NATIVE is not None:
            payload: bytes | np.ndarray = _gather_native(_NATIVE, mm, offs, lens)
        else:
            payload = b"".join([mm[o:o + n] for o, n in zip(offs.tolist(), lens.tolist())])
    finally:
        mm.close()
    ArenaSet.write_spans(payload, job.spans)


def _gather_native(native: object, mm: mmap.mmap, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The payloads back to back, copied by one C loop with the GIL released (ctypes.CDLL):
    faults are served meanwhile. The array over ``mm`` is gone when this returns (the
    mapping can be closed)."""
    src = np.frombuffer(mm, dtype=np.uint8)
    data = np.empty(int(lens.sum()), dtype=np.uint8)
    addrs = np.uint64(src.ctypes.data) + offs.astype(np.uint64)
    native.azq_gather(len(addrs), data.ctypes.data, addrs.ctypes.data, lens.ctypes.data)  # type: ignore[attr-defined]
    return data


def switch_compaction(job: CompactJob, table: BlobTable, arenas: ArenaSet) -> int:
    """Step 3, under the store's lock: switch the blobs that did not change, release the room
    of those that did, drop the arena. Returns the number of blobs moved."""
    rows = table.rows
    cur = rows[job.blobs]
    same = cur["refcount"] > 0
    for f in _SAME_FIELDS:
        same &= cur[f] == job.rows[f]
    # The arena dropped meanwhile (everything in it died; its id may be another arena's now),
    # or a room's arena closed under the copy: those blobs stay where they are / died.
    if arenas.arenas.get(int(job.arena.arena_id)) is not job.arena:
        same[:] = False
    alive = {t.arena_id for t in job.targets if arenas.arenas.get(t.arena_id) is t}
    same &= np.isin(job.new_arena, list(alive))
    moved = job.blobs[same]
    rows["arena"][moved] = job.new_arena[same]
    rows["offset"][moved] = job.new_offset[same]
    arenas.mark_written(sorted(alive))
    stale = ~same & np.isin(job.new_arena, list(alive))
    if stale.any():
        arenas.release_many(job.new_arena[stale].astype(np.int64), job.new_offset[stale].astype(np.int64),
                            job.rows["length"][stale].astype(np.int64))
    if arenas.arenas.get(int(job.arena.arena_id)) is job.arena:
        # Nothing is appended to a retired arena, so nothing live is left in it unless a room's
        # arena vanished under the copy (then those blobs stay, and so does the arena).
        left = (rows["refcount"][:table.n] > 0) & (rows["arena"][:table.n] == job.arena.arena_id)
        if not left.any():
            arenas.drop(job.arena.arena_id)
        else:
            job.arena.live = int(rows["length"][:table.n][left].sum())
    return len(moved)


def release_reserved(job: CompactJob, arenas: ArenaSet) -> None:
    """Give the room of an abandoned compaction back (under the store's lock): dead bytes."""
    alive = np.isin(job.new_arena, [t.arena_id for t in job.targets if arenas.arenas.get(t.arena_id) is t])
    if alive.any():
        arenas.release_many(job.new_arena[alive].astype(np.int64), job.new_offset[alive].astype(np.int64),
                            job.rows["length"][alive].astype(np.int64))
