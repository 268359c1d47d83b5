"""Sharing domains, reference counts under any order of frees, and byte accounting."""

from __future__ import annotations

import tempfile
import threading

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from azqemu.memory import accounting
from azqemu.memory.accounting import domain_books, sandbox_books
from azqemu.memory.domainview import StoreDomainView
from azqemu.memory.kinds import FLAG_REF_TEMPLATE, PAGE_SIZE, Kind, RefType
from azqemu.memory.store import PageStore

from .conftest import SMALL_ARENA, make_template, text_page


def _edit(page: np.ndarray, lo: int, hi: int, v: int) -> np.ndarray:
    out = page.copy()
    out[lo:hi] = v
    return out


def test_domains_never_share(store, corpus) -> None:
    """Identical and similar new content in two domains: B never references A's blobs."""
    template = make_template([text_page(i) for i in range(4)], n_pages=64)
    new = np.stack([corpus.pyc[i] for i in range(6)])
    similar = np.stack([_edit(p, 600, 640, 0x44) for p in new])
    idx = np.arange(10, 16)
    store.encode("a1", "A", idx, new, template)
    store.encode("b1", "B", idx, new, template)            # same bytes, other domain
    store.encode("b2", "B", idx + 10, similar, template)   # similar bytes, other domain
    table = store._table
    dom_a = table.domains["A"].did
    for sb in ("b1", "b2"):
        refs = store._sandboxes[sb].index.blob_refs().astype(np.int64)
        assert (table.rows["domain"][refs] != dom_a).all()
        based = refs[table.rows["reftype"][refs] == 2]
        assert (table.rows["domain"][table.rows["ref"][based].astype(np.int64)] != dom_a).all()
    # b1 could not DUP a1's pages: it stored its own copies ...
    assert (store.page_kinds("b1", idx) != int(Kind.DUP)).all()
    # ... while within domain B, b2 does find b1's pages as SDELTA bases.
    assert (store.page_kinds("b2", idx + 10) == int(Kind.SDELTA)).any()
    # Within a domain, the same content is a DUP.
    store.encode("a2", "A", idx + 30, new, template)
    assert (store.page_kinds("a2", idx + 30) == int(Kind.DUP)).all()


def test_template_pages_are_shared_by_all_domains(store, corpus) -> None:
    tpl = [corpus.elf[i] for i in range(6)]
    template = make_template(tpl, n_pages=64)
    moved = np.stack(tpl[:3])
    for dom in ("A", "B"):
        store.encode(f"s{dom}", dom, np.array([40, 41, 42]), moved, template)
        assert (store.page_kinds(f"s{dom}", np.array([40, 41, 42])) == int(Kind.DUP)).all()
        assert store.owned_bytes(f"s{dom}").private_bytes == 0


def _accounting_holds(store: PageStore) -> None:
    total = 0
    for dom in store.domains():
        db = store.domain_bytes(dom)
        owned = [store.owned_bytes(s) for s in store.sandboxes() if store.domain_of(s) == dom]
        s = sum(o.total_bytes for o in owned)
        assert abs(s - db.total_bytes) <= 1e-6 * max(1, db.total_bytes) + 1, (dom, s, db)
        assert sum(o.index_bytes for o in owned) == db.index_bytes
        assert sum(o.raw_bytes for o in owned) == db.raw_bytes
        total += db.total_bytes
    assert store.total_bytes().total_bytes == total


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(order=st.permutations(list(range(5))), discard_first=st.booleans())
def test_refcounts_after_frees_in_any_order(store_dir, small_set, small_template, corpus, order, discard_first
                                            ) -> None:
    shared = np.stack([corpus.text[i] for i in range(8)])
    with PageStore(tempfile.mkdtemp(dir=store_dir), arena_bytes=SMALL_ARENA) as store:
        names = []
        for k in range(5):
            idx, pages = small_set.sandboxes[k % 3]
            # Everyone also holds the same 8 new pages (DUPs) and an edited copy (SDELTA bases).
            extra_idx = np.arange(2000 + k * 16, 2008 + k * 16)
            edited = shared.copy()
            edited[:, 100 + k:140 + k] = k
            all_idx = np.concatenate([idx, extra_idx, extra_idx + 8])
            all_pages = np.concatenate([pages, shared, edited])
            dom = "d0" if k < 4 else "d1"
            store.encode(f"s{k}", dom, all_idx, all_pages, small_template)
            names.append((f"s{k}", all_idx, all_pages))
        store.check_consistency()
        _accounting_holds(store)
        if discard_first:
            n, idx, _ = names[order[0]]
            store.discard(n, store.stored_pages(n)[::2])
            store.check_consistency()
            _accounting_holds(store)
        alive = {n for n, _, _ in names}
        for k in order:
            n, idx, pages = names[k]
            store.free_sandbox(n)
            alive.discard(n)
            store.check_consistency()
            _accounting_holds(store)
            for m, midx, mpages in names:
                if m in alive:
                    stored = store.stored_pages(m)
                    out = store.decode(m, stored)
                    np.testing.assert_array_equal(out, mpages[np.searchsorted(midx, stored)]
                                                  if np.all(np.diff(midx) > 0) else out)
        table = store._table
        assert not (table.rows["refcount"][:table.n] > 0).any()
        assert store._arenas.live_bytes == 0
        assert store.total_bytes().total_bytes == 0


def test_owned_bytes_fields(store, small_set, small_template) -> None:
    for k, (idx, pages) in enumerate(small_set.sandboxes):
        store.encode(f"s{k}", "d", idx, pages, small_template)
    ob = store.owned_bytes("s1")
    assert ob.total_bytes == ob.private_bytes + ob.shared_bytes + ob.index_bytes + ob.raw_bytes
    assert ob.raw_bytes == ob.raw_pages * PAGE_SIZE
    assert ob.shared_bytes > 0            # siblings share DUP blobs
    idx = store._sandboxes["s1"].index
    assert ob.index_bytes == len(idx.zt) + idx.n_entries * 10 + ob.raw_pages * 4
    _accounting_holds(store)
    tb = store.total_bytes()
    assert tb.sandboxes == 3 and tb.domains == 1 and tb.template_bytes == small_template.data_bytes


def test_owned_bytes_many_reads_as_one_at_a_time(store, small_set, small_template) -> None:
    """The books of many sandboxes in one pass (a sampling's) equal the one-by-one figures;
    names the store does not hold are left out, not an error."""
    for k, (idx, pages) in enumerate(small_set.sandboxes):
        store.encode(f"s{k}", "d" if k else "e", idx, pages, small_template)
    names = [f"s{k}" for k in range(len(small_set.sandboxes))]
    books = store.owned_bytes_many([*names, "gone"])
    assert sorted(books) == names
    for n in names:
        assert books[n] == store.owned_bytes(n)
    # The store's bytes and the sandboxes' books together (one walk of the blob table).
    total, together = store.books([*names, "gone"])
    assert total == store.total_bytes() and together == books
    assert total.total_bytes == sum(store.domain_bytes(d).total_bytes for d in ("d", "e"))


def test_books_from_the_snapshot_equal_the_books_of_the_live_table(store, small_set, small_template) -> None:
    """The copy taken under the lock holds everything the books read: the figures are those
    computed on the store's own table (young and pending similarity entries unmerged too)."""
    for k, (idx, pages) in enumerate(small_set.sandboxes):
        store.encode(f"s{k}", "d" if k else "e", idx, pages, small_template)
    names = [f"s{k}" for k in range(len(small_set.sandboxes))]
    with store._lock:
        live = sandbox_books(store._table, [store._sandboxes[n] for n in names])
        live_domains = {name: domain_books(store._table, d, [store._sandboxes[s] for s in sorted(d.sandboxes)])
                        for name, d in store._table.domains.items()}
    assert store.owned_bytes_many(names) == live
    for name, want in live_domains.items():
        assert store.domain_bytes(name) == want


def test_the_books_are_computed_without_the_store_lock(store, small_set, small_template, monkeypatch) -> None:
    """Every fault thread takes the store's lock: the arithmetic of a sampler's books must not
    run under it (only the copy does)."""
    for k, (idx, pages) in enumerate(small_set.sandboxes):
        store.encode(f"s{k}", "d", idx, pages, small_template)
    free: list[bool] = []
    real = accounting.blob_costs

    def checking(*args, **kwargs):
        t = threading.Thread(target=lambda: free.append(store._lock.acquire(blocking=False) and
                                                        (store._lock.release() or True)))
        t.start()
        t.join(10)
        return real(*args, **kwargs)
    monkeypatch.setattr(accounting, "blob_costs", checking)
    store.owned_bytes_many(["s0", "s1"])
    store.books(["s0"])
    assert free == [True, True]


def test_a_domain_view_gives_many_blobs_at_once_and_says_which_were_freed(store, corpus) -> None:
    """The encoder's batched lookup (DUP confirmation, SDELTA bases): each blob's verified
    bytes in the order asked, repeats and cached ones included; blobs freed since (a sibling's
    discard) and ids out of range are marked not live instead of raising."""
    template = make_template([text_page(i) for i in range(4)], n_pages=64)
    new = np.stack([corpus.pyc[i] for i in range(6)])
    similar = np.stack([_edit(p, 600, 640, 0x44) for p in new])
    other = np.stack([corpus.pyc[i] for i in range(6, 9)])
    idx = np.arange(10, 16)
    store.encode("b1", "B", idx, new, template)
    store.encode("b2", "B", idx, similar, template)        # SDELTA entries on b1's blobs
    store.encode("b3", "B", idx[:3], other, template)

    def blobs(sb: str, page_idx: np.ndarray) -> np.ndarray:
        found, _kind, flags, ref = store._sandboxes[sb].index.lookup(page_idx)
        assert found.all() and not (flags & FLAG_REF_TEMPLATE).any()
        return ref.astype(np.int64)
    ids2, ids3 = blobs("b2", idx), blobs("b3", idx[:3])
    assert (store._table.rows["reftype"][ids2] == int(RefType.BLOB)).any()
    store.discard("b3", idx[:3])
    assert (store._table.rows["refcount"][ids3] == 0).all()
    view = StoreDomainView(store._lock, store._table, store._arenas, store.zstd, store._table.domains["B"], template)
    got, live = view.blob_pages(np.concatenate([ids2, ids3, ids2[:2], [1 << 30]]))
    assert live.tolist() == [True] * 6 + [False] * 3 + [True] * 2 + [False]
    assert (got[:6] == similar).all() and (got[9:11] == similar[:2]).all()
    again, live = view.blob_pages(ids2[::-1])               # from the view's cache now
    assert live.all() and (again == similar[::-1]).all()
