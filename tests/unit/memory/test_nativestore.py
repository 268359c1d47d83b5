"""The C lookup the native fault thread uses (memory/_storeview.c through nativestore.py):
every stored page decodes to the bytes the Python path gives, through every kind and method
the encoder picks, the views follow commits, discards and frees, and a damaged payload is
refused (a code, never wrong bytes). Concurrent writers, flushes and compactions against it:
test_concurrent_io.py."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from azqemu.errors import ChecksumMismatch, StoreError
from azqemu.host import threads
from azqemu.memory import nativestore
from azqemu.memory.kinds import PAGE_SIZE, Method
from azqemu.memory.nativestore import DEC_NOT_STORED, DEC_OK
from azqemu.memory.store import PageStore

pytestmark = pytest.mark.skipif(not nativestore.available(), reason="_storeview.so not built (make lib)")


def _fill(store: PageStore, small_set, template) -> list[str]:
    names = []
    for k, (idx, pages) in enumerate(small_set.sandboxes):
        name = f"s{k}"
        # Every other page hot: the LZ4 methods are exercised beside zstd's.
        hot = (np.arange(len(idx)) % 2 == 0) if k == 1 else None
        store.encode(name, "d", idx, pages, template, use_siblings=True, hot=hot)
        names.append(name)
    return names


def test_every_page_decodes_as_the_python_path_does(store, small_set, small_template) -> None:
    names = _fill(store, small_set, small_template)
    buf = np.empty(PAGE_SIZE, np.uint8)
    methods: set[int] = set()
    for name, (idx, _pages) in zip(names, small_set.sandboxes):
        view = store.native_view(name)
        assert view is not None
        try:
            stored = store.stored_pages(name)
            expect = store.decode(name, stored)
            for p, want in zip(stored.tolist(), expect):
                assert view.decode_into(p, buf) == DEC_OK, p
                assert np.array_equal(buf, want), f"{name} page {p}"
            for p in range(int(idx.max()) + 1, int(idx.max()) + 4):
                assert view.decode_into(p, buf) == DEC_NOT_STORED
            # The prefetch's bulk form goes through the view while it exists.
            bulk = np.zeros((len(stored), PAGE_SIZE), np.uint8)
            assert view.decode_many(stored, bulk)
            store.decode_pages_into(name, stored, memoryview(bulk).cast("B"))
            assert np.array_equal(bulk, expect)
        finally:
            store.release_native_view(view)
        with store._lock:
            sb = store._sandboxes[name]
            refs = sb.index.ref[(sb.index.flags & 1) == 0]
            methods |= set(store._table.rows["method"][refs].tolist())
    assert len(methods) >= 3, methods      # zstd, a delta method and LZ4 at least
    assert int(Method.PATCH) in methods, methods


def test_views_follow_discard_free_and_a_new_encode(store, small_set, small_template) -> None:
    idx, pages = small_set.sandboxes[0]
    store.encode("a", "d", idx, pages, small_template)
    view = store.native_view("a")
    assert view is not None
    buf = np.empty(PAGE_SIZE, np.uint8)
    try:
        p0 = int(store.stored_pages("a")[0])
        assert view.decode_into(p0, buf) == DEC_OK
        store.discard("a", np.array([p0]))
        assert view.decode_into(p0, buf) == DEC_NOT_STORED
        store.free_sandbox("a")
        assert view.decode_into(int(idx[-1]), buf) == DEC_NOT_STORED
        # The name again, other content: the view serves the new pages, not the old.
        idx2, pages2 = small_set.sandboxes[1]
        store.encode("a", "d", idx2, pages2, small_template)
        stored = store.stored_pages("a")
        want = store.decode("a", stored)
        for p, w in zip(stored.tolist(), want):
            assert view.decode_into(p, buf) == DEC_OK
            assert np.array_equal(buf, w)
    finally:
        store.release_native_view(view)


def test_a_damaged_payload_is_refused_not_served(store, small_set, small_template) -> None:
    idx, pages = small_set.sandboxes[0]
    store.encode("a", "d", idx, pages, small_template)
    view = store.native_view("a")
    assert view is not None
    buf = np.empty(PAGE_SIZE, np.uint8)
    try:
        with store._lock:
            sb = store._sandboxes["a"]
            e = int(np.flatnonzero((sb.index.flags & 1) == 0)[0])
            page, blob = int(sb.index.page[e]), int(sb.index.ref[e])
            row = store._table.rows[blob]
            arena = store._arenas.arenas[int(row["arena"])]
            at = int(row["offset"]) + int(row["length"]) // 2
            arena.mm[at] ^= 0xFF
        buf[:] = 0x5A
        rc = view.decode_into(page, buf)
        assert rc not in (DEC_OK, DEC_NOT_STORED)
        assert (buf == 0x5A).all(), "the caller's buffer was written before the check"
        with pytest.raises((ChecksumMismatch, StoreError)):
            store.decode_page_into("a", page, np.empty(PAGE_SIZE, np.uint8))
        # In bulk: the C loop stops at it and the Python decode raises, never a page handed out.
        bulk = np.zeros((2, PAGE_SIZE), np.uint8)
        pair = np.array(sorted({page, int(store.stored_pages("a")[0])}), dtype=np.int64)
        assert not view.decode_many(np.array([page]), bulk[:1])
        with pytest.raises((ChecksumMismatch, StoreError)):
            store.decode_pages_into("a", pair, memoryview(bulk[:len(pair)]).cast("B"))
    finally:
        store.release_native_view(view)


def test_the_state_lock_is_the_native_mutex(store) -> None:
    assert isinstance(store._lock, nativestore.NativeLock)
    with store._lock, store._lock:          # recursive, like the RLock it replaces
        assert store._lock.acquire(blocking=False)
        store._lock.release()


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread's priority needs CAP_SYS_NICE")
def test_the_holder_runs_above_the_fault_threads_until_its_outermost_release(store) -> None:
    """A niced holder (the compression worker) must not keep faults waiting for the CPU."""
    seen: list[int] = []

    def compressing() -> None:
        threads.set_thread_nice(threads.COMPRESS_NICE)
        with store._lock:
            seen.append(threads.thread_nice())
            with store._lock:
                pass
            seen.append(threads.thread_nice())      # still held: still raised
        seen.append(threads.thread_nice())
        assert store._lock.acquire(blocking=False)
        seen.append(threads.thread_nice())
        store._lock.release()
        seen.append(threads.thread_nice())
    t = threading.Thread(target=compressing)
    t.start()
    t.join(10)
    up = threads.STORE_LOCK_NICE
    assert seen == [up, up, threads.COMPRESS_NICE, up, threads.COMPRESS_NICE]


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread's priority needs CAP_SYS_NICE")
def test_the_release_leaves_a_cancellers_raise_and_a_thread_already_that_high(store) -> None:
    seen: list[int] = []

    def compressing() -> None:
        threads.set_thread_nice(threads.COMPRESS_NICE)
        with store._lock:
            threads.set_thread_nice(threads.PAUSED_GUEST_NICE)      # what a canceller does
        seen.append(threads.thread_nice())
        threads.set_thread_nice(threads.STORE_LOCK_NICE - 1)
        with store._lock:
            seen.append(threads.thread_nice())                      # not lowered to the raise
        seen.append(threads.thread_nice())
    t = threading.Thread(target=compressing)
    t.start()
    t.join(10)
    assert seen == [threads.PAUSED_GUEST_NICE, threads.STORE_LOCK_NICE - 1, threads.STORE_LOCK_NICE - 1]


def test_a_fault_that_finds_the_lock_held_is_counted_with_its_wait(store, small_set, small_template) -> None:
    names = _fill(store, small_set, small_template)
    page = int(store.stored_pages(names[0])[0])
    view = store.native_view(names[0])
    assert view is not None
    try:
        assert view.decode_into(page, np.empty(PAGE_SIZE, np.uint8)) == DEC_OK    # uncontended: not counted
        assert store.fault_lock_waits()["waits"] == 0
        done = threading.Event()

        def fault() -> None:
            view.decode_into(page, np.empty(PAGE_SIZE, np.uint8))
            done.set()
        with store._lock:
            t = threading.Thread(target=fault)
            t.start()
            assert not done.wait(0.05)                # held here: the fault side waits
        t.join(10)
        waits = store.fault_lock_waits()
        assert waits["waits"] == 1 and waits["wait_s"] >= 0.04 and waits["longest_us"] >= 40_000
        assert waits["over_1ms"] == 1
    finally:
        store.release_native_view(view)
