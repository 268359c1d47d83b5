"""Writers, flushers, a compactor and readers on one page store at once (storemodel.py): every
page a reader decodes is a version the page had, and the store reopened after the threads
stop holds exactly what the model says, byte for byte.

The store's flush writes its generation and a compaction copies its payloads outside the state
lock (memory/storewrite.py): this is the test that the steps in between (what dies during a
flush, a blob freed during a compaction's copy, an id reused meanwhile) never lose or mix a page.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from azqemu.memory import arena as arena_mod
from azqemu.memory import nativestore
from azqemu.memory.store import PageStore

from . import storemodel as sm

SMALL_ARENA = 1 << 20        # many arenas: compactions and drops happen often


def _flusher(store: PageStore, stop: threading.Event, errors: list[BaseException], counts: dict[str, int]) -> None:
    try:
        while not stop.is_set():
            store.flush()
            counts["flushes"] = counts.get("flushes", 0) + 1
            time.sleep(0.002)
    except BaseException as err:  # noqa: BLE001 - reported to the test
        errors.append(err)


def _compactor(store: PageStore, stop: threading.Event, errors: list[BaseException], counts: dict[str, int],
               seed: int) -> None:
    rng = random.Random(seed)
    try:
        while not stop.is_set():
            ids = list(store._arenas.arenas)      # a snapshot (one C-level copy under the GIL)
            if ids:
                store.compact_arena(rng.choice(ids))
                counts["compactions"] = counts.get("compactions", 0) + 1
            time.sleep(0.003)
    except BaseException as err:  # noqa: BLE001 - reported to the test
        errors.append(err)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_concurrent_encode_free_flush_compact_and_decode(store_dir, monkeypatch, seed: int) -> None:
    monkeypatch.setattr(arena_mod, "COMPACT_MIN_BYTES", 16 << 10)
    tpl = sm.template()
    model = sm.Model()
    names = [f"s-{i}" for i in range(6)]
    root = store_dir / "s"
    stop = threading.Event()
    errors: list[BaseException] = []
    counts: dict[str, int] = {}
    with PageStore(root, templates=(tpl,), arena_bytes=SMALL_ARENA) as store:
        threads = sm.run_threads(
            [lambda n=names[k::3], k=k: sm.writer(store, model, n, tpl, seed * 10 + k, stop, errors,
                                                     flush_every=7) for k in range(3)]
            + [lambda: _flusher(store, stop, errors, counts),
               lambda: _compactor(store, stop, errors, counts, seed)]
            + [lambda k=k: sm.reader(store, model, names, seed * 100 + k, stop, errors, counts) for k in range(2)]
            + ([lambda: sm.native_reader(store, model, names, seed * 1000, stop, errors, counts)]
               if nativestore.available() else []))
        time.sleep(3.0)
        stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a thread did not stop"
        assert not errors, errors
        store.flush()
        store.check_consistency()
        expect = model.copy()
    assert counts.get("pages", 0) > 100 and counts.get("flushes", 0) > 5, counts
    if nativestore.available():
        assert counts.get("native_pages", 0) > 100, counts
    assert sm.verify_reopened(root, expect) > 0
