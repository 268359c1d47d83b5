"""Arenas: large files (on tmpfs) that hold the encoded pages back to back.

Encoded pages never live as one Python object each: payloads are appended to the current
arena file with pwrite(2) and read through a shared mapping of it (mmap(2) MAP_SHARED of a
file we ftruncate(2)d to its capacity; on tmpfs untouched capacity allocates nothing). A blob is addressed by
(arena id, offset, length) in the store's blob table.

Freed blobs leave dead bytes behind. Each arena counts the dead bytes of every 4 KiB page of
its file; a page whose bytes are all dead is punched out of the file (FALLOC_FL_PUNCH_HOLE):
blobs are written back to back and a sandbox's blobs die together when it is compressed
again, so most dead bytes leave tmpfs soon after they die, current arena included. An arena
that holds only dead bytes is unlinked; one whose live share of what tmpfs holds for it falls below
``COMPACT_LIVE_FRACTION`` is compacted by the store (the current arena too), which moves its live blobs to the current
arena (it owns the table of locations; compaction.py) and then drops the file. After a reopen the counts
start from zero (pages already punched stay holes; the others wait for compaction).

Write-ahead order (docs/memory.md, "Crash consistency"): space a durable generation still
names is reclaimed only after a newer generation that does not name it is durable. The set
remembers, per arena, how far the last durable generation reaches (``durable``: arena id ->
its ``used`` then) and, while a flush writes the next one outside the store's lock, how far
that one reaches (``inflight``, set by ``begin_flush``). A dead blob below either mark waits in
``pending_release`` and an arena either names waits in ``pending_drop`` (closed, its file
kept, its id not reused). ``begin_flush`` hands what is pending then to the generation being
written, and ``finish_flush`` reclaims it once that generation is durable; what dies while it
is written waits for the generation after it (that one may still name it). A blob or arena
written after the last snapshot is reclaimed at once (nothing on disk names it). Arena ids are
the lowest free ones (ids are u16 in the blob table): ids of dropped arenas come back, never
past 65,535.

Space is taken in two steps, ``reserve`` (the fill level moves, under the store's lock) and
``write_spans`` (pwrite(2) of the bytes): an encode does both under the lock; a compaction
reserves under it and writes outside it, with file descriptors of its own (compaction.py).

On-disk form of an arena file: a 4 KiB header page, then payloads.
    header: magic "AZQARENA" | u32 version | u32 arena id | 16 bytes store uuid |
            u64 capacity | u64 xxh64 of the preceding header bytes
The header binds the file to its store: an arena of another store is refused as foreign.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from azqemu.errors import StoreCorrupt, StoreForeign
from azqemu.memory.persist import StoreFull, is_no_space
from azqemu.pages import unique_idx

ARENA_MAGIC = b"AZQARENA"
ARENA_VERSION = 1
ARENA_HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sII16sQ")
_HEADER_SUM = struct.Struct("<Q")
# 64 MiB: large enough that a sandbox's pages fill few files, small enough that compaction
# copies little at a time. u32 offsets bound it to 4 GiB.
DEFAULT_ARENA_BYTES = 64 << 20
MAX_ARENA_BYTES = 1 << 32
# Compact an arena (not the one being filled) once less than this share of it is live:
# "empirically set" trade-off between copy work and dead tmpfs memory.
COMPACT_LIVE_FRACTION = 0.5
# Below this much held, an arena is not worth a compaction.
COMPACT_MIN_BYTES = 1 << 20
# Arena ids are u16 in the blob table (BLOB_DTYPE["arena"]).
MAX_ARENAS = 1 << 16
# tmpfs allocates and frees whole pages.
FILE_PAGE_BYTES = 4096
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int


@dataclass
class Arena:
    arena_id: int
    path: Path
    capacity: int
    used: int          # write pointer (bytes from the start of the file, header included)
    live: int          # bytes of payloads still referenced
    fd: int
    mm: mmap.mmap
    addr: int = 0      # address of the mapping, once asked for (valid while mm is open)
    # Dead payload bytes in each 4 KiB page of the file (a page is punched when it is all dead).
    dead: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint16))
    punched_bytes: int = 0

    def __post_init__(self) -> None:
        if not len(self.dead):
            self.dead = np.zeros(-(-self.capacity // FILE_PAGE_BYTES), dtype=np.uint16)

    @property
    def payload_bytes(self) -> int:
        return self.used - ARENA_HEADER_BYTES


def _header_bytes(arena_id: int, store_uuid: bytes, capacity: int) -> bytes:
    head = _HEADER.pack(ARENA_MAGIC, ARENA_VERSION, arena_id, store_uuid, capacity)
    return head + _HEADER_SUM.pack(xxhash.xxh64_intdigest(head))


class ArenaSet:
    """The arena files of one store directory."""

    def __init__(self, root: Path, store_uuid: bytes, arena_bytes: int = DEFAULT_ARENA_BYTES) -> None:
        if not ARENA_HEADER_BYTES < arena_bytes <= MAX_ARENA_BYTES:
            raise ValueError("arena size out of range")
        self.root = root
        self.store_uuid = store_uuid
        self.arena_bytes = arena_bytes
        self.arenas: dict[int, Arena] = {}
        self.current: Arena | None = None
        # Write-ahead bookkeeping (module docstring): what the last durable generation names.
        self.durable: dict[int, int] = {}
        self.pending_release: list[tuple[int, np.ndarray, np.ndarray]] = []
        self.pending_bytes: dict[int, int] = {}
        self.pending_drop: dict[int, Path] = {}
        # The generation a flush is writing (begin_flush .. finish_flush / abort_flush): how far
        # it reaches per arena, and what its commit reclaims.
        self.inflight: dict[int, int] = {}
        self._flush_release: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._flush_drop: dict[int, Path] = {}
        self._written: set[int] = set()     # arenas appended to since the last flush
        # Called (under the store's lock) when an arena is opened or closed: the native lookup
        # reads the mappings (nativestore.py).
        self.on_change: Callable[[ArenaSet], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    @staticmethod
    def file_name(arena_id: int) -> str:
        return f"arena-{arena_id:06d}.azq"

    # -- lifecycle ----------------------------------------------------------------------
    def _new_arena(self) -> Arena:
        taken = self.arenas.keys() | self.pending_drop.keys() | self._flush_drop.keys()
        for arena_id in range(MAX_ARENAS):
            if arena_id in taken:
                continue
            path = self.root / self.file_name(arena_id)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue        # a file nobody named (swept at the next open): leave it
            except OSError as err:
                if is_no_space(err):
                    raise StoreFull(str(path), "no room for a new arena") from err
                raise
            break
        else:
            raise StoreFull(str(self.root), f"all {MAX_ARENAS} arena ids in use")
        try:
            os.ftruncate(fd, self.arena_bytes)
            os.pwrite(fd, _header_bytes(arena_id, self.store_uuid, self.arena_bytes), 0)
            mm = mmap.mmap(fd, self.arena_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as err:
            os.close(fd)
            os.unlink(path)
            if isinstance(err, OSError) and is_no_space(err):
                raise StoreFull(str(path), "no room for a new arena") from err
            raise
        arena = Arena(arena_id, path, self.arena_bytes, ARENA_HEADER_BYTES, 0, fd, mm)
        self.arenas[arena_id] = arena
        self.current = arena
        self._changed()
        return arena

    def open_existing(self, arena_id: int, used: int, live: int) -> Arena:
        """Reopen an arena file after checking its header (used/live come from the store meta)."""
        path = self.root / self.file_name(arena_id)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as err:
            raise StoreCorrupt(str(path), f"arena file missing: {err.strerror}") from err
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, _HEADER.size + _HEADER_SUM.size, 0)
            if len(head) < _HEADER.size + _HEADER_SUM.size or head[:8] != ARENA_MAGIC:
                raise StoreForeign(str(path), "no arena magic")
            magic, version, aid, uuid, capacity = _HEADER.unpack_from(head)
            (hsum,) = _HEADER_SUM.unpack_from(head, _HEADER.size)
            if version != ARENA_VERSION:
                raise StoreForeign(str(path), f"arena version {version}, this azqemu reads {ARENA_VERSION}")
            if hsum != xxhash.xxh64_intdigest(head[:_HEADER.size]):
                raise StoreCorrupt(str(path), "arena header checksum mismatch")
            if uuid != self.store_uuid:
                raise StoreForeign(str(path), "arena belongs to another store")
            if aid != arena_id or not ARENA_HEADER_BYTES < capacity <= MAX_ARENA_BYTES or size != capacity:
                raise StoreCorrupt(str(path), "arena header does not match the store")
            if not ARENA_HEADER_BYTES <= used <= capacity or not 0 <= live <= used - ARENA_HEADER_BYTES:
                raise StoreCorrupt(str(path), "arena fill level out of bounds")
            mm = mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        arena = Arena(arena_id, path, capacity, used, live, fd, mm)
        self.arenas[arena_id] = arena
        self._changed()
        return arena

    def close(self) -> None:
        arenas, self.arenas = self.arenas, {}
        self._changed()                 # before the mappings close
        self.arenas = arenas
        for a in self.arenas.values():
            try:
                a.mm.close()
            finally:
                os.close(a.fd)
        self.arenas.clear()
        self.current = None

    def begin_flush(self) -> list[tuple[int, int]]:
        """A generation naming the arenas as they are now (up to their ``used``) is about to be
        written outside the store's lock: from now on a blob or arena below its marks is
        reclaimed only after a later generation (module docstring). Returns (arena id, fd) of
        the arenas appended to since the last flush, each fd a dup(2) the caller syncs with
        ``sync_fds`` without the lock (the arena may be closed meanwhile) and closes.
        Called under the store's lock; one flush at a time (the store's flush lock)."""
        fds: list[tuple[int, int]] = []
        try:
            for aid in sorted(self._written):
                if aid in self.arenas:
                    fds.append((aid, os.dup(self.arenas[aid].fd)))
        except BaseException:
            for _aid, fd in fds:
                os.close(fd)
            raise
        self.inflight = {aid: a.used for aid, a in self.arenas.items()}
        self._flush_release, self.pending_release = self.pending_release, []
        self._flush_drop, self.pending_drop = self.pending_drop, {}
        self._written = set()
        return fds

    @staticmethod
    def sync_fds(root: Path, fds: list[tuple[int, int]]) -> None:
        """Make the payloads written before ``begin_flush`` durable before a generation names
        them: fdatasync(2) of each fd (a no-op on tmpfs, real on a disk). No lock needed."""
        for aid, fd in fds:
            try:
                os.fdatasync(fd)
            except OSError as err:
                if is_no_space(err):
                    raise StoreFull(str(root / ArenaSet.file_name(aid)), "arena data could not be synced") from err
                raise

    def finish_flush(self) -> list[Path]:
        """The generation of the last ``begin_flush`` is durable: its marks become ``durable``
        and what only older generations named is reclaimed (dead blobs counted and punched).
        Returns the files of the arenas it dropped, for the caller to unlink outside the lock
        (their ids are free again: a new arena that finds a file still there takes another)."""
        self.durable, self.inflight = self.inflight, {}
        batch, self._flush_release = self._flush_release, []
        for aid, offsets, lengths in batch:
            a = self.arenas.get(aid)
            if a is not None:           # else dropped meanwhile: its file goes with a later commit
                self._count_dead(a, offsets, lengths)
        self.pending_bytes = {}
        for aid, _offsets, lengths in self.pending_release:
            self.pending_bytes[aid] = self.pending_bytes.get(aid, 0) + int(lengths.sum())
        drops, self._flush_drop = self._flush_drop, {}
        return list(drops.values())

    def abort_flush(self, fds: list[tuple[int, int]]) -> None:
        """The generation of the last ``begin_flush`` was not committed: ``durable`` stays, what
        it would have reclaimed waits again, and the arenas it synced are synced next time."""
        self.inflight = {}
        self.pending_release = self._flush_release + self.pending_release
        self._flush_release = []
        self.pending_drop.update(self._flush_drop)
        self._flush_drop = {}
        self._written.update(aid for aid, _fd in fds if aid in self.arenas)

    def commit(self) -> None:
        """A generation naming exactly the arenas in ``self.arenas`` (up to their ``used``) is
        durable (the one just loaded: no flush in flight): reclaim what only older generations
        named (pending dead blobs are counted and punched, pending arenas unlinked, their ids
        free again)."""
        assert not self.inflight, "commit() with a flush in flight"
        self.durable = {aid: a.used for aid, a in self.arenas.items()}
        pending, self.pending_release = self.pending_release, []
        self.pending_bytes = {}
        for aid, offsets, lengths in pending:
            a = self.arenas.get(aid)
            if a is not None:           # else dropped meanwhile: its file goes below
                self._count_dead(a, offsets, lengths)
        drops, self.pending_drop = self.pending_drop, {}
        for path in drops.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def sweep(self) -> list[str]:
        """Unlink arena files this set does not hold (written after the generation that was
        loaded, or dropped after it): returns their names. Called at open, before any append."""
        known = {self.file_name(aid) for aid in self.arenas}
        gone = []
        for p in sorted(self.root.glob("arena-*.azq")):
            if p.name not in known:
                p.unlink()
                gone.append(p.name)
        return gone

    # -- data -------------------------------------------------------------------------------
    def append(self, payloads: list[bytes]) -> list[tuple[int, int]]:
        """Append payloads; returns (arena id, offset) per payload."""
        lengths = np.array([len(p) for p in payloads], dtype=np.int64)
        ids, offs = self.append_concat(b"".join(payloads), lengths)
        return list(zip(ids.tolist(), offs.tolist()))

    def append_concat(self, data: bytes, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append payloads given back to back in ``data``; returns (arena ids, offsets).

        As many payloads as fit in the current arena are written with one pwrite(2), not a
        store through the mapping: on tmpfs that is ~1.8x faster than page-faulting fresh
        pages in, and the shared mapping sees the data coherently. The caller holds the
        store's lock throughout (reserve and write).
        """
        ids, offs, spans = self.reserve(lengths)
        try:
            self.write_spans(data, [(a.fd, start, base, size) for a, start, base, size in spans])
        except BaseException as err:
            # ENOSPC (StoreFull): the fill levels are put back; nothing names the bytes
            # written, the next append overwrites them. Nothing was reserved after these
            # spans: the lock was held since.
            for a, start, _base, size in reversed(spans):
                a.used, a.live = start, a.live - size
            if isinstance(err, OSError) and is_no_space(err):
                raise StoreFull(str(self.root), "no room for encoded pages") from err
            raise
        self._written.update(a.arena_id for a, _start, _base, _size in spans)
        return ids, offs

    def reserve(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[tuple[Arena, int, int, int]]]:
        """Take room for payloads of ``lengths`` (back to back) in the current arena and new
        ones as they fill: returns (arena ids, offsets, spans), a span being (arena, file
        offset, offset in the payloads, size) for one pwrite. The room counts as used and
        live at once, so that nothing drops or overwrites it before it is written (or given
        back with ``release_many``). Called under the store's lock; raises StoreFull (nothing
        reserved) when no new arena can be made."""
        lengths = np.asarray(lengths, dtype=np.int64)
        n = len(lengths)
        ids = np.zeros(n, dtype=np.uint16)
        offs = np.zeros(n, dtype=np.uint32)
        ends = np.cumsum(lengths)
        spans: list[tuple[Arena, int, int, int]] = []
        i = 0
        try:
            while i < n:
                a = self.current
                if a is None or a.used + int(lengths[i]) > a.capacity:
                    a = self._new_arena()
                base = int(ends[i - 1]) if i else 0
                room = a.capacity - a.used
                j = int(np.searchsorted(ends, base + room, side="right"))
                if j <= i:
                    raise ValueError("payload larger than an arena")
                size = int(ends[j - 1]) - base
                spans.append((a, a.used, base, size))
                ids[i:j] = a.arena_id
                offs[i:j] = a.used + (ends[i:j] - lengths[i:j] - base)
                a.used += size
                a.live += size
                i = j
        except BaseException:
            for a, start, _base, size in reversed(spans):
                a.used, a.live = start, a.live - size
            raise
        return ids, offs, spans

    @staticmethod
    def write_spans(data: bytes | np.ndarray, spans: list[tuple[int, int, int, int]]) -> None:
        """pwrite(2) the reserved spans (fd, file offset, offset in ``data``, size). No lock
        needed: nothing reads reserved room before the blob table names it."""
        view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
        for fd, start, base, size in spans:
            done = 0
            while done < size:
                done += os.pwrite(fd, view[base + done:base + size], start + done)

    def mark_written(self, arena_ids: list[int]) -> None:
        """Arenas written outside the lock (a compaction's copies): synced by the next flush."""
        self._written.update(aid for aid in arena_ids if aid in self.arenas)

    def read(self, arena_id: int, offset: int, length: int) -> bytes:
        a = self.arenas.get(arena_id)
        if a is None or offset < ARENA_HEADER_BYTES or offset + length > a.used:
            raise StoreCorrupt(str(self.root), f"blob location {arena_id}:{offset}+{length} out of bounds")
        return a.mm[offset:offset + length]

    def gather(self, arena_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> bytes | np.ndarray:
        """The payloads at (arena, offset, length), back to back: a uint8 array copied by the C
        loop when _pagecodec.so is built, else bytes. Callers hold the store's lock (the
        mappings must stay open while they are read)."""
        from azqemu.memory.zstdlib import _NATIVE

        arena_ids = np.asarray(arena_ids, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.uint32)
        if len(arena_ids) == 0:
            return b""
        present = unique_idx(arena_ids)
        base = np.zeros(int(present.max()) + 1, dtype=np.uint64)
        used = np.zeros(len(base), dtype=np.int64)
        for aid in present.tolist():
            a = self.arenas.get(aid)
            if a is None:
                raise StoreCorrupt(str(self.root), f"blob location in missing arena {aid}")
            base[aid], used[aid] = self.address_of(a), a.used
        ends = offsets + lengths
        bad = (offsets < ARENA_HEADER_BYTES) | (ends > used[arena_ids])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise StoreCorrupt(str(self.root), f"blob location {int(arena_ids[i])}:{int(offsets[i])}"
                               f"+{int(lengths[i])} out of bounds")
        if _NATIVE is None:
            return b"".join([self.arenas[a].mm[o:o + n] for a, o, n in zip(arena_ids.tolist(), offsets.tolist(),
                                                                           lengths.tolist())])
        out = np.empty(int(lengths.sum()), dtype=np.uint8)
        src = base[arena_ids] + offsets.astype(np.uint64)
        _NATIVE.azq_gather(len(src), out.ctypes.data, src.ctypes.data, lengths.ctypes.data)
        return out

    @staticmethod
    def address_of(a: Arena) -> int:
        """Address of an arena's mapping (valid while it is open; the store's lock keeps it
        open for those who read through it)."""
        if not a.addr:
            # ctypes.addressof of a buffer export, released at once.
            obj = ctypes.c_char.from_buffer(a.mm)
            a.addr = ctypes.addressof(obj)
            del obj
        return a.addr

    def release(self, arena_id: int, length: int, offset: int | None = None) -> None:
        self.release_many(np.array([arena_id]), np.array([-1 if offset is None else offset]),
                          np.array([length]))

    def release_many(self, arena_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """Blobs died: count their bytes dead, punch the pages of the file now all dead, and
        drop an arena (not the current one) with nothing live left. An offset of -1 (not
        known) only lowers the live count. Blobs the last durable generation names are only
        counted dead at the next ``commit`` (module docstring)."""
        arena_ids = np.asarray(arena_ids, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        for aid in unique_idx(arena_ids).tolist():
            sel = arena_ids == aid
            a = self.arenas[aid]
            a.live -= int(lengths[sel].sum())
            if a.live <= 0 and a is not self.current:
                self.drop(aid)
                continue
            known = sel & (offsets >= 0)
            if not known.any():
                continue
            # Named by the last durable generation or by the one a flush is writing.
            mark = max(self.durable.get(aid, ARENA_HEADER_BYTES), self.inflight.get(aid, ARENA_HEADER_BYTES))
            named = known & (offsets < mark)
            if named.any():
                self.pending_release.append((aid, offsets[named], lengths[named]))
                self.pending_bytes[aid] = self.pending_bytes.get(aid, 0) + int(lengths[named].sum())
            now = known & ~named
            if now.any():
                self._count_dead(a, offsets[now], lengths[now])

    def _count_dead(self, a: Arena, offsets: np.ndarray, lengths: np.ndarray) -> None:
        ps = FILE_PAGE_BYTES
        ends = offsets + lengths
        first, last = offsets // ps, (ends - 1) // ps
        # Bytes of each blob in its first page, its last page and each page in between.
        one = first == last
        np.add.at(a.dead, first[one], lengths[one].astype(np.uint16))
        multi = ~one
        if multi.any():
            f, l_ = first[multi], last[multi]
            np.add.at(a.dead, f, ((f + 1) * ps - offsets[multi]).astype(np.uint16))
            np.add.at(a.dead, l_, (ends[multi] - l_ * ps).astype(np.uint16))
            spans = l_ - f - 1
            if spans.any():
                mids = np.concatenate([np.arange(x + 1, y) for x, y in zip(f[spans > 0].tolist(),
                                                                           l_[spans > 0].tolist())])
                np.add.at(a.dead, mids, np.uint16(ps))
        touched = unique_idx(np.concatenate([first, last]))
        full = touched[a.dead[touched] >= ps]
        if not len(full):
            return
        # Punch in runs; a page stays counted full, so it is never punched twice.
        a.dead[full] = ps + 1
        cuts = np.flatnonzero(np.diff(full) != 1) + 1
        for run in np.split(full, cuts):
            start, length = int(run[0]) * ps, len(run) * ps
            if _libc.fallocate(a.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, start, length) == 0:
                a.punched_bytes += length

    def drop(self, arena_id: int) -> None:
        """Close an arena nothing live is in any more; its file is unlinked now, or after the
        next commit if the last durable generation (or the one being written) names it."""
        a = self.arenas.pop(arena_id)
        self._changed()                 # before the mapping closes
        if self.current is a:
            self.current = None
        self._written.discard(arena_id)
        a.mm.close()
        os.close(a.fd)
        if arena_id in self.durable or arena_id in self.inflight:
            self.pending_drop[arena_id] = a.path
            return
        try:
            os.unlink(a.path)
        except FileNotFoundError:
            pass

    def compaction_candidates(self) -> list[int]:
        """Arenas whose live bytes are under COMPACT_LIVE_FRACTION of what tmpfs holds for
        them (dead pages already punched do not count), the current one included: small
        blobs of many sandboxes die a few at a time and leave pages part live, part dead."""
        out = []
        for a in self.arenas.values():
            # Dead bytes waiting for the next commit leave at that commit by punching: they
            # are no reason to copy the arena now.
            held = os.fstat(a.fd).st_blocks * 512 - ARENA_HEADER_BYTES - self.pending_bytes.get(a.arena_id, 0)
            if held > COMPACT_MIN_BYTES and a.live < COMPACT_LIVE_FRACTION * held:
                out.append(a.arena_id)
        return out

    def retire_current(self) -> None:
        """The next append opens a new arena (the current one is about to be compacted)."""
        self.current = None

    @property
    def used_bytes(self) -> int:
        return sum(a.payload_bytes for a in self.arenas.values())

    @property
    def allocated_bytes(self) -> int:
        """What the arena files hold in tmpfs (punched pages and untouched capacity excluded)."""
        return sum(os.fstat(a.fd).st_blocks * 512 for a in self.arenas.values())

    @property
    def live_bytes(self) -> int:
        return sum(a.live for a in self.arenas.values())
