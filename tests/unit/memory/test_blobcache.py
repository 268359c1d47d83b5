"""The encoder's decoded-blob cache: kept across encodes, never a stale page."""

from __future__ import annotations

import numpy as np

from azqemu.memory.blobcache import DecodedBlobCache
from azqemu.memory.domainview import StoreDomainView
from azqemu.memory.kinds import FLAG_REF_TEMPLATE, PAGE_SIZE

from .conftest import make_template, text_page


def _pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE_SIZE), dtype=np.uint8)


def test_entries_are_found_checked_and_replaced_oldest_first() -> None:
    c = DecodedBlobCache(capacity=4)
    assert c.held_bytes == 0                               # no buffer before the first page
    pages = _pages(6, 1)
    key, check = np.arange(6, dtype=np.uint64) + 100, np.arange(6, dtype=np.uint64) + 200
    assert (c.slots(np.arange(6), epoch=0) == -1).all()
    c.put(np.arange(3), key[:3], check[:3], pages[:3])
    slot = c.slots(np.array([2, 0, 5]), epoch=0)
    assert slot[2] == -1 and (slot[:2] >= 0).all()
    assert (c.pages(slot[:2]) == pages[[2, 0]]).all()
    # Another (key, check) in the row than the one decoded under: not valid.
    assert c.valid(slot[:2], key[[2, 0]], check[[2, 0]]).all()
    assert not c.valid(slot[:1], key[[2]], check[[2]] + 1).any()
    c.put(np.arange(3, 6), key[3:], check[3:], pages[3:])  # 6 pages in 4 slots: 0 and 1 go
    slot = c.slots(np.arange(6), epoch=0)
    assert (slot[:2] == -1).all() and (slot[2:] >= 0).all()
    assert (c.pages(slot[2:]) == pages[2:]).all()
    # A new epoch of the table (ids reusable): nothing is found any more.
    assert (c.slots(np.arange(6), epoch=1) == -1).all()
    c.put(np.arange(2), key[:2], check[:2], pages[:2])
    assert c.held_bytes == 4 * PAGE_SIZE
    c.clear()
    assert c.held_bytes == 0 and (c.slots(np.arange(2), epoch=1) == -1).all()


def test_siblings_reuse_decoded_bases_and_a_reused_id_is_decoded_again(store, corpus) -> None:
    """The sibling that follows finds the bases the first one decoded; after the table makes
    freed ids reusable, an id that names another blob gives that blob's bytes."""
    template = make_template([text_page(i) for i in range(4)], n_pages=64)
    idx = np.arange(10, 16)
    new = np.stack([corpus.pyc[i] for i in range(6)])

    def edited(v: int) -> np.ndarray:
        out = new.copy()
        out[:, 600:640] = v
        return out

    store.encode("keep", "A", idx, new, template)          # another domain: the table stays
    store.encode("b1", "B", idx, new, template)
    store.encode("b2", "B", idx, edited(0x44), template)   # SDELTA on b1's blobs: decoded
    first = store.blob_cache_stats()
    assert first["misses"] > 0 and first["held_bytes"] > 0
    store.encode("b3", "B", idx, edited(0x55), template)   # the same bases: from the cache
    second = store.blob_cache_stats()
    assert second["hits"] > first["hits"] and second["misses"] == first["misses"]
    for sb, want in (("b1", new), ("b2", edited(0x44)), ("b3", edited(0x55))):
        assert (store.decode(sb, idx) == want).all(), sb

    def blobs(sb: str) -> set[int]:
        found, _kind, flags, ref = store._sandboxes[sb].index.lookup(idx)
        return set(ref[found & ((flags & FLAG_REF_TEMPLATE) == 0)].tolist())
    old_ids = blobs("b1")
    for sb in ("b1", "b2", "b3"):
        store.free_sandbox(sb)
    store._table.reclaim(force=True)                       # the freed ids are reusable now
    other = np.stack([corpus.pyc[i] for i in range(20, 26)])
    store.encode("c1", "B", idx, other, template)
    assert blobs("c1") & old_ids                           # an id b1's page had names c1's now
    view = StoreDomainView(store._lock, store._table, store._arenas, store.zstd, store._table.domains["B"],
                           template, cache=store._blob_cache)
    ids = np.array(sorted(blobs("c1")), dtype=np.int64)
    got, live = view.blob_pages(ids)
    assert live.all()
    by_id = {b: i for i, b in enumerate(store._sandboxes["c1"].index.lookup(idx)[3].tolist())}
    assert all((got[j] == other[by_id[b]]).all() for j, b in enumerate(ids.tolist()))
