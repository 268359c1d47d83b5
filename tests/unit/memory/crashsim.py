"""A compress/resume/free/compaction scenario against the page store, with a simulated guest,
for the crash-point tests (test_crash_points.py): run as a subprocess with ``AZQ_CRASH_AT``
set, killed at that point, then checked by ``verify`` in the test process.

The "guest" of each sandbox is a sparse file on tmpfs standing for its RAM memfd: a resident
page is data, a page QEMU dropped is a hole (punched, as SandboxMemory._punch has QEMU do).
Every page's content is a pure function of (sandbox, page, version); ``truth-<sbx>`` holds the
current version of each page (the guest's own idea of its memory). The scenario follows
SandboxMemory.compress's order: encode, flush (durable), punch in runs, flush; a resume
puts pages back (decoded from the store, as the fault handler would) and the guest writes
some of them; a destroy frees a sandbox (compacting arenas its blobs shared).

Run: python -m tests.unit.memory.crashsim ROOT
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import numpy as np

from azqemu.memory import arena as arena_mod
from azqemu.memory.crashpoint import crash_point
from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.ram import data_extents
from azqemu.memory.store import NotStored, PageStore
from azqemu.memory.template import TemplateImage

N_PAGES = 240
SANDBOXES = (("s0", "d"), ("s1", "d"), ("s2", "d"), ("t0", "e"))
ARENA_BYTES = arena_mod.ARENA_HEADER_BYTES + (48 << 10)
PUNCH_RUN_PAGES = 40           # pages per punch "batch"
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _text(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    words = np.array([b"alpha ", b"beta ", b"kernel ", b"page ", b"sandbox ", b"zstd ", b"\n", b"def "], dtype=object)
    out = b"".join(words[rng.integers(0, len(words), 900)].tolist())
    return np.frombuffer((out * 2)[:PAGE_SIZE], dtype=np.uint8).copy()


def template_image() -> TemplateImage:
    pages = np.stack([_text(10_000 + p) for p in range(N_PAGES)])
    return TemplateImage(page_idx=np.arange(N_PAGES, dtype=np.int64), pages=pages, size_bytes=N_PAGES * PAGE_SIZE)


def page_bytes(tpl_pages: np.ndarray, sbx: int, p: int, v: int) -> np.ndarray:
    """Content of page ``p`` of sandbox number ``sbx`` at version ``v``: a mix of every kind
    (template-equal, zero, duplicates across sandboxes, template deltas, text, incompressible)."""
    k = (p + v) % 6
    if k == 0 and v == 0:
        return tpl_pages[p].copy()
    if k == 1 and v == 0:
        return np.zeros(PAGE_SIZE, np.uint8)
    if k == 2:
        return _text(7 * p + 1000 * v)               # the same in every sandbox: DUP across them
    if k == 3:
        out = tpl_pages[p].copy()
        out[(p * 37) % 4000:(p * 37) % 4000 + 64] = (sbx * 31 + v) % 251   # TDELTA
        return out
    if k == 5:
        return np.random.default_rng((sbx, p, v)).integers(0, 256, PAGE_SIZE, dtype=np.uint8)  # RAW
    return _text(100_000 * (sbx + 1) + 1000 * v + p)


class Guest:
    """One sandbox's RAM file and its truth (current version of each page)."""

    def __init__(self, root: Path, name: str, sbx: int, tpl_pages: np.ndarray) -> None:
        self.name, self.sbx, self.tpl = name, sbx, tpl_pages
        self.ram = root.parent / f"guest-{name}.ram"
        self.truth = root.parent / f"truth-{name}"

    def create(self) -> None:
        with open(self.ram, "wb") as f:
            f.truncate(N_PAGES * PAGE_SIZE)
        self.truth.write_bytes(bytes(N_PAGES))
        for p in range(N_PAGES):
            self.write(p, 0)

    def versions(self) -> np.ndarray:
        return np.frombuffer(self.truth.read_bytes(), dtype=np.uint8).astype(np.int64)

    def write(self, p: int, v: int) -> None:
        """The guest writes page ``p`` (resident afterwards), then its truth follows."""
        with open(self.ram, "r+b") as f:
            os.pwrite(f.fileno(), page_bytes(self.tpl, self.sbx, p, v).tobytes(), p * PAGE_SIZE)
        with open(self.truth, "r+b") as f:
            os.pwrite(f.fileno(), bytes([v]), p)

    def resident(self) -> np.ndarray:
        fd = os.open(self.ram, os.O_RDONLY)
        try:
            out = [np.arange(s // PAGE_SIZE, (s + n) // PAGE_SIZE) for s, n in data_extents(fd)]
        finally:
            os.close(fd)
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)

    def read(self, idx: np.ndarray) -> np.ndarray:
        with open(self.ram, "rb") as f:
            return np.stack([np.frombuffer(os.pread(f.fileno(), PAGE_SIZE, int(p) * PAGE_SIZE), np.uint8)
                             for p in idx]) if len(idx) else np.zeros((0, PAGE_SIZE), np.uint8)

    def punch(self, idx: np.ndarray) -> None:
        fd = os.open(self.ram, os.O_RDWR)
        try:
            for p in idx.tolist():
                if _libc.fallocate(fd, 0x03, p * PAGE_SIZE, PAGE_SIZE) != 0:   # PUNCH_HOLE | KEEP_SIZE
                    raise OSError(ctypes.get_errno(), "fallocate")
        finally:
            os.close(fd)


def compress(store: PageStore, g: Guest, domain: str, tpl: TemplateImage) -> None:
    """SandboxMemory.compress's order: encode, flush, punch in runs, flush."""
    idx = g.resident()
    res = store.encode(g.name, domain, idx, g.read(idx), tpl, owner=f"uuid-{g.name}")
    crash_point("after-encode")
    store.flush()
    crash_point("after-flush")
    stored = np.sort(res.stored_idx.astype(np.int64))
    for i in range(0, len(stored), PUNCH_RUN_PAGES):
        g.punch(stored[i:i + PUNCH_RUN_PAGES])
        crash_point("after-discard-batch")
    store.flush()


def resume(store: PageStore, g: Guest, pages: np.ndarray, new_version: int) -> None:
    """Put ``pages`` back from the store (faults), then the guest writes every other one."""
    held = np.intersect1d(pages, store.stored_pages(g.name))
    data = store.decode(g.name, held)
    with open(g.ram, "r+b") as f:
        for p, d in zip(held.tolist(), data):
            os.pwrite(f.fileno(), d.tobytes(), p * PAGE_SIZE)
    for p in held[::2].tolist():
        g.write(p, new_version)


def scenario(root: Path) -> None:
    arena_mod.COMPACT_MIN_BYTES = 16 << 10       # compaction happens at this scale
    tpl = template_image()
    guests = {name: Guest(root, name, i, tpl.pages) for i, (name, _) in enumerate(SANDBOXES)}
    for g in guests.values():
        g.create()
    store = PageStore(root, templates=(tpl,), arena_bytes=ARENA_BYTES)
    for name, domain in SANDBOXES:
        compress(store, guests[name], domain, tpl)
    # Resume two sandboxes, the guests change pages, compress again (old blobs die).
    for name, domain in SANDBOXES[:2]:
        resume(store, guests[name], np.arange(0, N_PAGES, 2), new_version=1)
        compress(store, guests[name], domain, tpl)
    # Destroy s1 (MemoryService.release, then the domain goes): its blobs die, arenas shared
    # with s0/s2 compact.
    store.free_sandbox("s1", tombstone=True)
    store.flush()
    guests["s1"].ram.unlink()
    guests["s1"].truth.unlink()
    # Another round on s0 and s2.
    for name, domain in (("s0", "d"), ("s2", "d")):
        resume(store, guests[name], np.arange(1, N_PAGES, 3), new_version=2)
        compress(store, guests[name], domain, tpl)
    store.close()


def verify(root: Path) -> dict[str, int]:
    """Reopen the store and check every page of every guest; returns counts. A page QEMU
    dropped (a hole) must decode to exactly its current version; a resident page the store
    also holds must decode to one of its earlier or current versions (never served: the
    guest has it) and never fail its checksum."""
    tpl = template_image()
    counts = {"pages_verified": 0, "wrong_pages": 0, "dropped_pages": 0, "missing_pages": 0, "failed_sandboxes": 0}
    with PageStore(root, templates=(tpl,), arena_bytes=ARENA_BYTES) as store:
        store.check_consistency()
        names = store.sandboxes()
        tombs = store.tombstones()
        for i, (name, _domain) in enumerate(SANDBOXES):
            g = Guest(root, name, i, tpl.pages)
            if name in tombs and g.ram.exists():
                # Killed between the destroy's free and the domain's end: the manager fails
                # this sandbox (MemoryService.free_stale) and serves none of its pages.
                assert name not in names
                counts["failed_sandboxes"] += 1
                g.ram.unlink()
                continue
            if not g.ram.exists():
                if name in names:              # destroyed after its free became durable? no:
                    stored = store.stored_pages(name)   # still durable: decodes (checksums)
                    store.decode(name, stored)
                    counts["pages_verified"] += len(stored)
                continue
            truth = g.versions()
            resident = set(g.resident().tolist())
            held = set(store.stored_pages(name).tolist()) if name in names else set()
            for p in range(N_PAGES):
                want = page_bytes(tpl.pages, i, p, int(truth[p]))
                if p in resident:
                    got = g.read(np.array([p]))[0]
                    if not np.array_equal(got, want):
                        counts["wrong_pages"] += 1
                    if p in held:
                        dec = store.decode(name, np.array([p]))[0]
                        if not any(np.array_equal(dec, page_bytes(tpl.pages, i, p, v)) for v in range(int(truth[p]) + 1)):
                            counts["wrong_pages"] += 1
                else:
                    counts["dropped_pages"] += 1
                    try:
                        dec = store.decode(name, np.array([p]))[0]
                    except NotStored:
                        counts["missing_pages"] += 1
                        continue
                    if not np.array_equal(dec, want):
                        counts["wrong_pages"] += 1
                counts["pages_verified"] += 1
        # The next compression works on what was recovered.
        for i, (name, domain) in enumerate(SANDBOXES):
            g = Guest(root, name, i, tpl.pages)
            if g.ram.exists() and len(g.resident()):
                compress(store, g, domain, tpl)
        store.check_consistency()
    return counts


if __name__ == "__main__":
    scenario(Path(sys.argv[1]))
