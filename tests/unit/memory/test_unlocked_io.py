"""Flushes and compactions do their I/O outside the lock faults take (storewrite.py): a
fault-path lookup completes while a flush is stuck in fsync/write/fdatasync or a compaction in
its copy, and the write-ahead order still holds around them (space freed while a generation is
written waits for the next one, an arena compacted meanwhile stays until a generation naming
the new places is durable, generations are written one at a time and in order)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from azqemu.memory import generation as generation_mod
from azqemu.memory.arena import ARENA_HEADER_BYTES
from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.store import PageStore

from .conftest import SMALL_ARENA, text_page

BLOCK_TIMEOUT_S = 20.0


def _pages(seed: int, n: int) -> np.ndarray:
    return np.stack([text_page(seed * 10_000 + i) for i in range(n)])


class Blocker:
    """Makes ``os.<call>`` wait in the thread named ``thread`` (once: the first call) until
    released; ``entered`` is set when it is waiting. A call that is never released gives up
    after BLOCK_TIMEOUT_S and says so (``timed_out``): a lookup that waited for it shows."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, call: str, thread: str) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.timed_out = False
        self.calls = 0
        real = getattr(os, call)

        def blocking(*args: Any) -> Any:
            if threading.current_thread().name == thread:
                self.calls += 1
                if self.calls == 1:
                    self.entered.set()
                    self.timed_out = not self.release.wait(BLOCK_TIMEOUT_S)
            return real(*args)

        monkeypatch.setattr(os, call, blocking)

    def start(self, target: Any, name: str, *args: Any) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        assert self.entered.wait(BLOCK_TIMEOUT_S), "the blocked call was never reached"
        return t

    def finish(self, t: threading.Thread) -> None:
        assert t.is_alive() and not self.timed_out, "the lookups waited for the blocked I/O"
        self.release.set()
        t.join(BLOCK_TIMEOUT_S)
        assert not t.is_alive()


def _lookups(store: PageStore, expect: dict[str, tuple[np.ndarray, np.ndarray]]) -> int:
    """Every page of every sandbox through the fault path, one at a time, then in bulk."""
    buf = np.empty(PAGE_SIZE, np.uint8)
    n = 0
    for name, (idx, pages) in expect.items():
        for p, want in zip(idx.tolist(), pages):
            store.decode_page_into(name, p, buf)
            np.testing.assert_array_equal(buf, want)
            n += 1
        np.testing.assert_array_equal(store.decode(name, idx), pages)
    return n


def _crash_copy(src: Path, dst: Path) -> Path:
    """The directory as a process killed now would leave it (tmpfs keeps what was written)."""
    shutil.copytree(src, dst)
    return dst


def _verify(root: Path, tpl: Any, expect: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    with PageStore(root, templates=(tpl,)) as s:
        s.check_consistency()
        assert s.sandboxes() == sorted(expect)
        for name, (idx, pages) in expect.items():
            np.testing.assert_array_equal(s.stored_pages(name), idx)
            np.testing.assert_array_equal(s.decode(name, idx), pages)


@pytest.mark.parametrize("call", ["fsync", "write", "fdatasync"])
def test_lookups_complete_while_a_flush_is_blocked(store_dir, small_template, monkeypatch, call: str) -> None:
    idx = np.arange(150, dtype=np.int64)
    expect = {n: (idx, _pages(k, 150)) for k, n in enumerate(("a", "b", "c"))}
    root = store_dir / "s"
    with PageStore(root, arena_bytes=SMALL_ARENA) as s:
        for n in ("a", "b"):
            s.encode(n, "d", idx, expect[n][1], small_template)
        s.flush()
        s.encode("c", "d", idx, expect["c"][1], small_template)     # what the next generation adds
        blocker = Blocker(monkeypatch, call, "flusher")
        t = blocker.start(s.flush, "flusher")
        assert _lookups(s, expect) == 450
        # The rest of the store's work goes on too; it belongs to the generation after.
        s.discard("a", idx[:10])
        s.encode("e", "d", idx[:20], _pages(9, 20), small_template)
        assert s.owned_bytes("b").stored_pages == 150 and s.entries_match("b", idx[:1], np.zeros(1), np.zeros(1)).shape == (1,)
        blocker.finish(t)
        assert s.generation == 2
        crashed = _crash_copy(root, store_dir / "crash")
        s.flush()
        assert s.generation == 3
    _verify(crashed, small_template, expect)                          # generation 2: a, b, c whole
    expect["a"] = (idx[10:], expect["a"][1][10:])
    expect["e"] = (idx[:20], _pages(9, 20))
    _verify(root, small_template, expect)


def test_lookups_complete_while_a_compaction_copies(store_dir, small_template, monkeypatch) -> None:
    """A compaction stuck in its copy: lookups decode from the old places; blobs freed during
    the copy are not switched; the old arena stays until a generation names the new places."""
    idx = np.arange(120, dtype=np.int64)
    root = store_dir / "s"
    keep, gone = _pages(1, 120), _pages(2, 120)
    with PageStore(root, arena_bytes=ARENA_HEADER_BYTES + (256 << 10)) as s:
        for k in range(4):             # the two sandboxes' blobs interleaved in the same arenas
            s.encode("keep", "d", idx[k::4], keep[k::4], small_template)
            s.encode("gone", "d", idx[k::4] + 1000, gone[k::4], small_template)
        s.flush()
        s.free_sandbox("gone")
        s.flush()
        aid = min(s._arenas.arenas)
        in_arena = s._table.rows["arena"][s._sandboxes["keep"].index.blob_refs().astype(np.int64)] == aid
        keep_idx = s._sandboxes["keep"].index.page[in_arena].astype(np.int64)
        assert len(keep_idx) > 8
        blocker = Blocker(monkeypatch, "pwrite", "compactor")
        t = blocker.start(s.compact_arena, "compactor", aid)
        assert aid in s._arenas.arenas
        expect = {"keep": (idx, keep)}
        assert _lookups(s, expect) == 120
        # Freed while they are copied: their copies are dropped, not switched in.
        died = keep_idx[:4]
        s.discard("keep", died)
        s.encode("other", "d", idx[:30], _pages(3, 30), small_template)      # appends go on
        blocker.finish(t)
        assert aid not in s._arenas.arenas and aid in s._arenas.pending_drop
        assert (root / s._arenas.file_name(aid)).exists()                      # generation 2 names it
        left = np.setdiff1d(idx, died)
        expect = {"keep": (left, keep[left]), "other": (idx[:30], _pages(3, 30))}
        assert _lookups(s, expect) == len(left) + 30
        s.check_consistency()
        crashed = _crash_copy(root, store_dir / "crash")
        s.flush()
        assert not (root / s._arenas.file_name(aid)).exists()
    _verify(crashed, small_template, {"keep": (idx, keep)})
    _verify(root, small_template, expect)


def test_space_freed_during_a_flush_waits_for_the_next_generation(store_dir, small_template, monkeypatch) -> None:
    idx = np.arange(200, dtype=np.int64)
    root = store_dir / "s"
    a, b = _pages(4, 200), _pages(5, 200)
    with PageStore(root, arena_bytes=SMALL_ARENA) as s:
        s.encode("a", "d", idx, a, small_template)
        s.encode("b", "d", idx, b, small_template)
        s.flush()
        s.discard("a", idx[:50])                      # dies before the snapshot: reclaimed at its commit
        blocker = Blocker(monkeypatch, "fsync", "flusher")
        t = blocker.start(s.flush, "flusher")
        s.discard("b", idx)                           # dies while generation 2 (which names it) is written
        assert s._arenas.pending_release
        blocker.finish(t)
        assert s.generation == 2
        pending = s._arenas.pending_release
        assert pending and sum(len(o) for _a, o, _l in pending) == 200   # b's blobs, not punched yet
        crashed = _crash_copy(root, store_dir / "crash")
        held = s.total_bytes().arena_allocated_bytes
        s.flush()
        assert not s._arenas.pending_release and s.total_bytes().arena_allocated_bytes < held
    _verify(crashed, small_template, {"a": (idx[50:], a[50:]), "b": (idx, b)})
    _verify(root, small_template, {"a": (idx[50:], a[50:]), "b": (idx[:0], b[:0])})


def test_compaction_during_a_flush_keeps_the_arena_for_the_generation_after(store_dir, small_template,
                                                                           monkeypatch) -> None:
    idx = np.arange(120, dtype=np.int64)
    root = store_dir / "s"
    with PageStore(root, arena_bytes=ARENA_HEADER_BYTES + (256 << 10)) as s:
        for k in range(4):
            s.encode("keep", "d", idx[k::4], _pages(10 + k, 30), small_template)
            s.encode("gone", "d", idx[k::4] + 1000, _pages(20 + k, 30), small_template)
        s.flush()
        expect = {"keep": (s.stored_pages("keep"), s.decode("keep", s.stored_pages("keep")))}
        old = {s._arenas.file_name(a) for a in s._arenas.arenas}
        s.free_sandbox("gone")
        blocker = Blocker(monkeypatch, "fsync", "flusher")
        t = blocker.start(s.flush, "flusher")         # generation 2 names keep's blobs where they are
        for aid in sorted(s._arenas.arenas):
            s.compact_arena(aid)                      # ... and they move meanwhile
        assert _lookups(s, expect) == 120
        blocker.finish(t)
        assert s.generation == 2
        assert all((root / n).exists() for n in old)              # generation 2 still names them
        crashed = _crash_copy(root, store_dir / "crash")
        s.flush()
        assert not any((root / n).exists() for n in old - {a.path.name for a in s._arenas.arenas.values()})
    _verify(crashed, small_template, expect)
    _verify(root, small_template, expect)


def test_flushes_wait_for_each_other_and_commit_in_order(store_dir, small_template, monkeypatch) -> None:
    written: list[int] = []
    real = generation_mod.write_store

    def write_store(path: Path, meta: dict[str, Any], binary: list[Any]) -> None:
        written.append(int(meta["generation"]))
        real(path, meta, binary)

    monkeypatch.setattr(generation_mod, "write_store", write_store)
    idx = np.arange(40, dtype=np.int64)
    pages = {n: _pages(30 + k, 40) for k, n in enumerate("abc")}
    root = store_dir / "s"
    with PageStore(root, arena_bytes=SMALL_ARENA) as s:
        s.encode("a", "d", idx, pages["a"], small_template)
        s.flush()
        s.encode("b", "d", idx, pages["b"], small_template)
        blocker = Blocker(monkeypatch, "fsync", "f1")
        t1 = blocker.start(s.flush, "f1")
        s.encode("c", "d", idx, pages["c"], small_template)      # after f1's snapshot
        t2 = threading.Thread(target=s.flush, name="f2", daemon=True)
        t2.start()
        time.sleep(0.2)
        assert t2.is_alive()                                      # waits for f1, not for a lookup
        assert _lookups(s, {n: (idx, pages[n]) for n in "abc"}) == 120
        blocker.finish(t1)
        t2.join(BLOCK_TIMEOUT_S)
        assert s.generation == 3
        s.flush()                                                 # nothing changed: nothing written
    assert written == [1, 2, 3]
    _verify(root, small_template, {n: (idx, pages[n]) for n in "abc"})


def test_a_failed_flush_gives_its_snapshot_back(store_dir, small_template, monkeypatch) -> None:
    """A flush that fails after its snapshot (here: every write refused) leaves the previous
    generation durable, the changes dirty again (also those made while it ran) and nothing
    reclaimed; the next flush writes them all."""
    import errno

    idx = np.arange(60, dtype=np.int64)
    root = store_dir / "s"
    with PageStore(root, arena_bytes=SMALL_ARENA) as s:
        s.encode("a", "d", idx, _pages(40, 60), small_template)
        s.flush()
        s.encode("a", "d", idx, _pages(41, 60), small_template)   # the old blobs die: pending
        s.encode("b", "d", idx, _pages(42, 60), small_template)
        pending = len(s._arenas.pending_release)
        entered, go = threading.Event(), threading.Event()
        real_write = os.write

        def failing_write(fd: int, data: Any) -> int:
            if threading.current_thread().name == "flusher":
                entered.set()
                go.wait(BLOCK_TIMEOUT_S)
                raise OSError(errno.EIO, "injected")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", failing_write)
        errors: list[BaseException] = []

        def flush() -> None:
            try:
                s.flush()
            except OSError as err:
                errors.append(err)

        t = threading.Thread(target=flush, name="flusher", daemon=True)
        t.start()
        assert entered.wait(BLOCK_TIMEOUT_S)
        s.discard("a", idx[:5])                                     # while it runs
        go.set()
        t.join(BLOCK_TIMEOUT_S)
        assert errors and s.generation == 1
        assert len(s._arenas.pending_release) > pending and not s._arenas.inflight
        assert not [p for p in root.iterdir() if p.name.endswith(".tmp") or "-g2." in p.name]
        monkeypatch.setattr(os, "write", real_write)
        s.flush()
        assert s.generation == 2 and not s._arenas.pending_release
    _verify(root, small_template, {"a": (idx[5:], _pages(41, 60)[5:]), "b": (idx, _pages(42, 60))})
