"""How long a fault-path lookup (``PageStore.decode_page_into``) waits while the store flushes
a generation of N MiB, or compacts an arena: figures for the report of issue 11 (point 6),
not a test (nothing is asserted; timings depend on the host).

A reader thread decodes random stored pages in a loop, timing each call, while the main thread
runs ``flush`` (every sandbox marked changed first, so the whole generation is rewritten) and
then ``compact_arena`` on arenas left half dead. Printed: the flush / compaction wall time and
the reader's median, 99th percentile and maximum per-call time while each ran.

Run: python -m tests.unit.memory.lookup_wait [--root DIR] [--mib N] [--rounds R] [--fsync-ms MS]
(``--root`` on tmpfs measures the copy and the CPU; on a disk it adds real fsyncs.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage

# Bytes a page costs in a generation's files: 36 (blob table row) + 10 (index entry).
GEN_BYTES_PER_PAGE = 46
RANDOM_BYTES_PER_PAGE = 384     # the rest zero: blobs of ~0.4 KiB, arenas stay small


def _pages(rng: np.random.Generator, n: int) -> np.ndarray:
    out = np.zeros((n, PAGE_SIZE), np.uint8)
    out[:, :RANDOM_BYTES_PER_PAGE] = rng.integers(0, 256, (n, RANDOM_BYTES_PER_PAGE), dtype=np.uint8)
    return out


class Reader:
    """Decodes random stored pages on its own thread and records each call's time."""

    def __init__(self, store: PageStore, names: list[str], stored: dict[str, np.ndarray]) -> None:
        self.store, self.names, self.stored = store, names, stored
        self.samples: list[tuple[float, float]] = []      # (start, duration)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="reader")

    def _run(self) -> None:
        buf = np.empty(PAGE_SIZE, np.uint8)
        rng = np.random.default_rng(7)
        clock = time.perf_counter
        while not self.stop.is_set():
            name = self.names[int(rng.integers(len(self.names)))]
            pages = self.stored[name]
            p = int(pages[int(rng.integers(len(pages)))])
            t0 = clock()
            self.store.decode_page_into(name, p, buf)
            self.samples.append((t0, clock() - t0))

    def window(self, start: float, end: float) -> np.ndarray:
        s = np.array(self.samples[-200_000:], dtype=np.float64).reshape(-1, 2)
        return s[(s[:, 0] + s[:, 1] >= start) & (s[:, 0] <= end), 1]


def _fmt(what: str, wall_s: float, waits: np.ndarray) -> str:
    if not len(waits):
        return f"{what}: {wall_s * 1e3:8.1f} ms, no lookup overlapped"
    return (f"{what}: {wall_s * 1e3:8.1f} ms | lookups {len(waits):6d}  median {np.median(waits) * 1e6:7.1f} us"
            f"  p99 {np.percentile(waits, 99) * 1e6:8.1f} us  max {waits.max() * 1e3:8.2f} ms")


def _slow_fsync(delay_s: float) -> None:
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def fsync(fd: int) -> None:
        time.sleep(delay_s)
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        time.sleep(delay_s)
        real_fdatasync(fd)

    os.fsync, os.fdatasync = fsync, fdatasync       # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/dev/shm")
    ap.add_argument("--mib", type=float, default=8.0, help="size of the generation's files")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sandboxes", type=int, default=8)
    ap.add_argument("--fsync-ms", type=float, default=0.0,
                    help="add this much to every fsync/fdatasync (a slow disk, simulated)")
    args = ap.parse_args()
    if args.fsync_ms:
        _slow_fsync(args.fsync_ms / 1e3)
    n_pages = int(args.mib * (1 << 20) / GEN_BYTES_PER_PAGE)
    per = n_pages // args.sandboxes
    work = Path(tempfile.mkdtemp(prefix="azq-lookwait-", dir=args.root))
    try:
        rng = np.random.default_rng(1)
        tpl = TemplateImage(page_idx=np.arange(4, dtype=np.int64), pages=np.zeros((4, PAGE_SIZE), np.uint8) + 1,
                            size_bytes=per * PAGE_SIZE)
        store = PageStore(work / "store", templates=(tpl,), arena_bytes=16 << 20)
        names = [f"s{k}" for k in range(args.sandboxes)]
        t0 = time.perf_counter()
        for name in names:
            store.encode(name, "d", np.arange(per, dtype=np.int64), _pages(rng, per), tpl)
        store.flush()
        # The reader decodes the second half of each sandbox's pages; the first half is released.
        stored = {n: store.stored_pages(n)[per // 2:] for n in names}
        spare = {n: store.stored_pages(n)[:per // 2] for n in names}
        print(f"root {args.root}: {args.sandboxes} sandboxes x {per} pages encoded in "
              f"{time.perf_counter() - t0:.1f} s; store.azq {(work / 'store' / 'store.azq').stat().st_size >> 10} KiB")
        reader = Reader(store, names, stored)
        reader.thread.start()
        time.sleep(0.3)
        idle = reader.window(time.perf_counter() - 0.25, time.perf_counter())
        print(_fmt("no flush    ", 0.25, idle))
        for r in range(args.rounds):
            # Every sandbox changes (one page of each released): the whole generation is written.
            for name in names:
                store.discard(name, spare[name][r:r + 1])
            time.sleep(0.05)
            t0 = time.perf_counter()
            store.flush()
            t1 = time.perf_counter()
            time.sleep(0.01)
            print(_fmt(f"flush {r}     ", t1 - t0, reader.window(t0, t1)))
        # Compaction: every other page of the first two sandboxes' first halves dies, then each arena is compacted.
        for name in names[:2]:
            store.discard(name, spare[name][args.rounds::2])
        store.flush()
        for aid in sorted(store._arenas.arenas)[:args.rounds]:
            time.sleep(0.05)
            t0 = time.perf_counter()
            store.compact_arena(aid)
            t1 = time.perf_counter()
            time.sleep(0.01)
            print(_fmt(f"compact {aid:3d} ", t1 - t0, reader.window(t0, t1)))
        store.flush()
        reader.stop.set()
        reader.thread.join()
        store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
