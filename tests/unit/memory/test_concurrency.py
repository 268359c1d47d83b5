"""Decoding on a fault-handler thread while another thread encodes, frees and compacts."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from azqemu.memory.arena import ARENA_HEADER_BYTES
from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.store import PageStore
from azqemu.memory.zstdlib import native_available


def test_decode_while_encoding_and_freeing(store_dir, small_set, small_template) -> None:
    idx_a, pages_a = small_set.sandboxes[0]
    errors: list[BaseException] = []
    with PageStore(store_dir, arena_bytes=ARENA_HEADER_BYTES + (32 << 10)) as store:
        store.encode("a", "d", idx_a, pages_a, small_template)
        stored = store.stored_pages("a")
        expect = pages_a[np.searchsorted(idx_a, stored)]
        stop = threading.Event()

        def faults() -> None:
            buf = np.empty(PAGE_SIZE, np.uint8)
            rng = np.random.default_rng(1)
            try:
                while not stop.is_set():
                    for row in rng.integers(0, len(stored), 50).tolist():
                        store.decode_page_into("a", int(stored[row]), buf)
                        if not np.array_equal(buf, expect[row]):
                            raise AssertionError(f"wrong page {stored[row]}")
                    rows = rng.integers(0, len(stored), 64)
                    if not np.array_equal(store.decode("a", stored[rows]), expect[rows]):
                        raise AssertionError("wrong bulk decode")
            except BaseException as err:  # noqa: BLE001 - reported to the main thread
                errors.append(err)

        t = threading.Thread(target=faults)
        t.start()
        try:
            for _round in range(3):
                for k in (1, 2):
                    idx, pages = small_set.sandboxes[k]
                    store.encode(f"s{k}", "d", idx, pages, small_template)
                store.discard("s1", store.stored_pages("s1")[::2])
                store.free_sandbox("s2")
                store.free_sandbox("s1")
                store.flush()
        finally:
            stop.set()
            t.join()
        store.check_consistency()
    assert not errors, errors[0]


@pytest.mark.skipif(not native_available(), reason="_pagecodec.so not built")
def test_native_and_python_loops_choose_alike(store_dir, small_set, small_template) -> None:
    """The C loop mirrors the Python loop: same choices, same payload sizes."""
    results = []
    for native in (True, False):
        with PageStore(store_dir / f"n{native}") as store:
            if not native:
                store.zstd.native = None
            for k, (idx, pages) in enumerate(small_set.sandboxes):
                r = store.encode(f"s{k}", "d", idx, pages, small_template)
                results.append((native, k, r.pages, r.bytes, r.tries))
            store.flush()
    half = len(results) // 2
    for a, b in zip(results[:half], results[half:]):
        assert a[2:] == b[2:]
    # And either decodes the other's store.
    for native in (True, False):
        with PageStore(store_dir / f"n{not native}", templates=(small_template,)) as store:
            if not native:
                store.zstd.native = None
            for k, (idx, pages) in enumerate(small_set.sandboxes):
                stored = store.stored_pages(f"s{k}")
                np.testing.assert_array_equal(store.decode(f"s{k}", stored), pages[np.searchsorted(idx, stored)])
