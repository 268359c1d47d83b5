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
arena (it owns the table of locations) and then drops the file. After a reopen the counts
start from zero (pages already punched stay holes; the others wait for compaction).

Write-ahead order (docs/memory.md, "Crash consistency"): space a durable generation still
names is reclaimed only after a newer generation that does not name it is durable. The set
remembers, per arena, how far the last durable generation reaches (``durable``: arena id ->
its ``used`` then). A dead blob below that mark waits in ``pending_release`` and an arena
that generation names waits in ``pending_drop`` (closed, its file kept, its id not reused)
until ``commit`` is called with the newer generation; a blob or arena written after the last
commit is reclaimed at once (nothing on disk names it). Arena ids are the lowest free ones
(ids are u16 in the blob table): ids of dropped arenas come back, never past 65,535.

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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from azqemu.errors import StoreCorrupt, StoreForeign
from azqemu.memory.persist import StoreFull, is_no_space

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
        self._written: set[int] = set()     # arenas appended to since the last flush

    @staticmethod
    def file_name(arena_id: int) -> str:
        return f"arena-{arena_id:06d}.azq"

    # -- lifecycle ----------------------------------------------------------------------
    def _new_arena(self) -> Arena:
        taken = self.arenas.keys() | self.pending_drop.keys()
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
        return arena

    def close(self) -> None:
        for a in self.arenas.values():
            try:
                a.mm.close()
            finally:
                os.close(a.fd)
        self.arenas.clear()
        self.current = None

    def flush(self) -> None:
        """Make the payloads written since the last flush durable (before a generation names
        them). fdatasync(2): a no-op on tmpfs, real on a disk-backed store."""
        for aid in sorted(self._written):
            a = self.arenas.get(aid)
            if a is not None:
                try:
                    os.fdatasync(a.fd)
                except OSError as err:
                    if is_no_space(err):
                        raise StoreFull(str(a.path), "arena data could not be synced") from err
                    raise
        self._written.clear()

    def commit(self) -> None:
        """A generation naming exactly the arenas in ``self.arenas`` (up to their ``used``) is
        durable: reclaim what only older generations named (pending dead blobs are counted and
        punched, pending arenas unlinked, their ids free again)."""
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
        pages in, and the shared mapping sees the data coherently.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        n = len(lengths)
        ids = np.zeros(n, dtype=np.uint16)
        offs = np.zeros(n, dtype=np.uint32)
        ends = np.cumsum(lengths)
        view = memoryview(data)
        i = 0
        # On a failure (ENOSPC: StoreFull) the fill levels are put back: nothing names the
        # bytes written, the next append overwrites them.
        touched: list[tuple[Arena, int, int]] = []
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
                start = a.used
                touched.append((a, a.used, a.live))
                self._written.add(a.arena_id)
                done = 0
                while done < size:
                    done += os.pwrite(a.fd, view[base + done:base + size], start + done)
                ids[i:j] = a.arena_id
                offs[i:j] = start + (ends[i:j] - lengths[i:j] - base)
                a.used += size
                a.live += size
                i = j
        except BaseException as err:
            for a, used, live in touched:
                a.used, a.live = used, live
            if isinstance(err, OSError) and is_no_space(err):
                raise StoreFull(str(self.root), "no room for encoded pages") from err
            raise
        return ids, offs

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
        present = np.unique(arena_ids)
        base = np.zeros(int(present.max()) + 1, dtype=np.uint64)
        used = np.zeros(len(base), dtype=np.int64)
        for aid in present.tolist():
            a = self.arenas.get(aid)
            if a is None:
                raise StoreCorrupt(str(self.root), f"blob location in missing arena {aid}")
            if not a.addr:
                # ctypes.addressof of a buffer export, released at once: the address stays
                # valid while the mapping is open, and the store's lock keeps it open here.
                obj = ctypes.c_char.from_buffer(a.mm)
                a.addr = ctypes.addressof(obj)
                del obj
            base[aid], used[aid] = a.addr, a.used
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
        for aid in np.unique(arena_ids).tolist():
            sel = arena_ids == aid
            a = self.arenas[aid]
            a.live -= int(lengths[sel].sum())
            if a.live <= 0 and a is not self.current:
                self.drop(aid)
                continue
            known = sel & (offsets >= 0)
            if not known.any():
                continue
            named = known & (offsets < self.durable.get(aid, ARENA_HEADER_BYTES))
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
        touched = np.unique(np.concatenate([first, last]))
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
        """Close an arena nothing live is in any more; its file is unlinked now, or at the next
        ``commit`` if the last durable generation names it."""
        a = self.arenas.pop(arena_id)
        if self.current is a:
            self.current = None
        self._written.discard(arena_id)
        a.mm.close()
        os.close(a.fd)
        if arena_id in self.durable:
            self.pending_drop[arena_id] = a.path
            return
        try:
            os.unlink(a.path)
        except FileNotFoundError:
            pass

    def compact(self, arena_id: int, rows: np.ndarray) -> None:
        """Move the live blobs of an arena to the current one (``rows``: the blob table's rows,
        their locations updated in place), then drop it: closed now, its file unlinked at the
        next commit if the last durable generation names it."""
        live = np.flatnonzero((rows["refcount"] > 0) & (rows["arena"] == arena_id))
        payloads = [self.read(arena_id, int(rows["offset"][b]), int(rows["length"][b])) for b in live]
        if self.current is not None and self.current.arena_id == arena_id:
            self.retire_current()
        locs = self.append(payloads)
        for b, (a, o) in zip(live, locs):
            rows["arena"][b] = a
            rows["offset"][b] = o
        self.drop(arena_id)

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
