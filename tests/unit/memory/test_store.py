"""The page store: persistence, damage and foreign files, checksums, discard, fault path."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from azqemu.errors import ChecksumMismatch, StoreCorrupt, StoreError, StoreForeign
from azqemu.memory.arena import ARENA_HEADER_BYTES
from azqemu.memory.kinds import PAGE_SIZE, Kind
from azqemu.memory.persist import STORE_FILE, index_file_name
from azqemu.memory.store import PageStore

from .conftest import SMALL_ARENA


def _fill(store: PageStore, small_set, template, names=("a", "b", "c"), domain="d") -> None:
    for name, (idx, pages) in zip(names, small_set.sandboxes):
        store.encode(name, domain, idx, pages, template)


def _expect(small_set, k: int, stored: np.ndarray) -> np.ndarray:
    idx, pages = small_set.sandboxes[k]
    return pages[np.searchsorted(idx, stored)]


def test_encode_result_and_kinds(store, small_set, small_template) -> None:
    idx, pages = small_set.sandboxes[0]
    res = store.encode("a", "d", idx, pages, small_template)
    assert sum(res.pages.values()) == len(idx)
    assert res.pages["ZERO"] > 0 and res.pages["TEMPLATE"] > 0 and res.pages["ZSTD"] > 0
    assert len(res.stored_idx) + len(res.raw_idx) == len(idx)
    np.testing.assert_array_equal(np.sort(res.stored_idx), store.stored_pages("a"))
    assert res.input_bytes == len(idx) * PAGE_SIZE and res.encode_s > 0


def test_an_encode_with_a_page_twice_is_refused_and_stores_nothing(store, small_set, small_template) -> None:
    idx, pages = small_set.sandboxes[0]
    twice = np.concatenate([idx[:5], idx[2:3]])          # unsorted, page idx[2] twice
    with pytest.raises(StoreError, match="duplicate page indices"):
        store.encode("a", "d", twice, pages[np.searchsorted(idx, twice)], small_template)
    assert "a" not in store.sandboxes()


def test_flush_and_reopen(store_dir, small_set, small_template) -> None:
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as s:
        _fill(s, small_set, small_template)
        s.free_sandbox("b")
        before = {n: s.owned_bytes(n) for n in ("a", "c")}
        s.flush()
    with PageStore(store_dir, templates=(small_template,)) as s:
        assert s.sandboxes() == ["a", "c"]
        for k, n in ((0, "a"), (2, "c")):
            stored = s.stored_pages(n)
            np.testing.assert_array_equal(s.decode(n, stored), _expect(small_set, k, stored))
            assert s.owned_bytes(n) == before[n]
        s.check_consistency()
        # The reopened store keeps working: encode more, free, flush again.
        idx, pages = small_set.sandboxes[1]
        s.encode("b2", "d", idx, pages, small_template)
        s.free_sandbox("a")
        s.flush()
    with PageStore(store_dir, templates=(small_template,)) as s:
        assert s.sandboxes() == ["b2", "c"]
        s.check_consistency()
    assert not (store_dir / index_file_name("a")).exists()
    assert not list(store_dir.glob(index_file_name("a").replace(".azqidx", "-g*.azqidx")))


def test_reopen_loads_the_template_from_its_path(store_dir, small_set) -> None:
    from azqemu.memory.ram import write_sparse_image
    from azqemu.memory.template import TemplateImage
    path = store_dir / "template.ram"
    write_sparse_image(path, small_set.template_idx, small_set.template_pages, small_set.size_bytes)
    tpl = TemplateImage(path)
    root = store_dir / "store"
    with PageStore(root, arena_bytes=SMALL_ARENA) as s:
        _fill(s, small_set, tpl, names=("a",))
        s.flush()
    with PageStore(root) as s:           # no template passed: reopened from the recorded path
        stored = s.stored_pages("a")
        np.testing.assert_array_equal(s.decode("a", stored), _expect(small_set, 0, stored))
    # A template that changed under the store is refused.
    data = bytearray(path.read_bytes())
    off = int(small_set.template_idx[3]) * PAGE_SIZE
    data[off] ^= 0xFF
    path.write_bytes(bytes(data))
    with PageStore(root) as s:
        with pytest.raises(StoreCorrupt, match="template image changed"):
            s.decode("a", s.stored_pages("a"))


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.fixture
def flushed(store_dir, small_set, small_template):
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as s:
        _fill(s, small_set, small_template)
        s.flush()
    return store_dir


def test_damaged_store_file_refused(flushed, small_template) -> None:
    _flip(flushed / STORE_FILE, 100)
    with pytest.raises(StoreCorrupt, match="checksum mismatch"):
        PageStore(flushed, templates=(small_template,))


def test_truncated_store_file_refused(flushed, small_template) -> None:
    data = (flushed / STORE_FILE).read_bytes()
    (flushed / STORE_FILE).write_bytes(data[:-7])
    with pytest.raises(StoreCorrupt, match="sizes"):
        PageStore(flushed, templates=(small_template,))


def test_huge_size_field_refused_without_allocating(flushed, small_template) -> None:
    with open(flushed / STORE_FILE, "r+b") as f:
        f.seek(16)
        f.write(struct.pack("<Q", 1 << 60))       # json_len
    with pytest.raises(StoreCorrupt):
        PageStore(flushed, templates=(small_template,))


def test_damaged_index_file_quarantines_that_sandbox(flushed, small_set, small_template) -> None:
    """One damaged index file costs its own sandbox only: quarantined (file moved aside,
    references released), the others load and decode exactly."""
    from azqemu.memory.persist import read_store
    meta, _ = read_store(flushed / STORE_FILE)
    fname = next(x["file"] for x in meta["sandboxes"] if x["name"] == "b")
    _flip(flushed / fname, 60)
    with PageStore(flushed, templates=(small_template,)) as s:
        assert s.sandboxes() == ["a", "c"] and list(s.quarantined) == ["b"]
        assert "checksum" in s.quarantined["b"]
        s.check_consistency()
        for k, n in ((0, "a"), (2, "c")):
            stored = s.stored_pages(n)
            np.testing.assert_array_equal(s.decode(n, stored), _expect(small_set, k, stored))
    assert (flushed / "quarantine" / fname).exists()
    with PageStore(flushed, templates=(small_template,)) as s:   # the quarantine was committed
        assert s.sandboxes() == ["a", "c"] and not s.quarantined
        s.check_consistency()


def test_foreign_store_file_refused(store_dir) -> None:
    (store_dir / STORE_FILE).write_bytes(b"\x7fELF" + os.urandom(200))
    with pytest.raises(StoreForeign):
        PageStore(store_dir)


def test_other_version_refused(flushed, small_template) -> None:
    with open(flushed / STORE_FILE, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 99))
    with pytest.raises(StoreForeign, match="version 99"):
        PageStore(flushed, templates=(small_template,))


def test_arena_of_another_store_refused(flushed, store_dir, small_set, small_template) -> None:
    other = store_dir / "other"
    with PageStore(other, arena_bytes=SMALL_ARENA) as s:
        _fill(s, small_set, small_template, names=("x",))
        s.flush()
    os.replace(other / "arena-000000.azq", flushed / "arena-000000.azq")
    with pytest.raises(StoreForeign, match="another store"):
        PageStore(flushed, templates=(small_template,))


def test_leftover_files_without_store_file_swept(store_dir, small_set, small_template) -> None:
    """Files of a store that never committed (a crash before its first flush) name nothing
    durable and nothing was dropped on their strength: swept, the store starts empty."""
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as s:
        _fill(s, small_set, small_template, names=("a",))     # never flushed
    (store_dir / "sbx-0123-g1.azqidx").write_bytes(b"half")
    with PageStore(store_dir) as s:
        assert s.sandboxes() == []
    assert sorted(p.name for p in store_dir.iterdir()) == ["reserve.azq"]


def test_damaged_payload_fails_checksum(store, small_set, small_template) -> None:
    idx, pages = small_set.sandboxes[0]
    store.encode("a", "d", idx, pages, small_template)
    zstd_pages = idx[store.page_kinds("a", idx) == int(Kind.ZSTD)]
    victim = int(zstd_pages[0])
    # Corrupt the blob's payload in place, keeping the frame decodable if possible: flip a
    # literal byte near the end of the payload.
    hit = store._sandboxes["a"].index.lookup_one(victim)
    assert hit is not None
    blob = hit[2]
    row = store._table.rows[blob]
    arena = store._arenas.arenas[int(row["arena"])]
    pos = int(row["offset"]) + int(row["length"]) - 2
    arena.mm[pos] ^= 0x01
    with pytest.raises((ChecksumMismatch, StoreCorrupt)) as err:
        store.decode("a", np.concatenate([zstd_pages[1:4], [victim]]))
    if isinstance(err.value, ChecksumMismatch):
        assert err.value.page_idx == victim
    buf = bytearray(b"\xee" * PAGE_SIZE)
    with pytest.raises((ChecksumMismatch, StoreCorrupt)):
        store.decode_page_into("a", victim, memoryview(buf))
    assert bytes(buf) == b"\xee" * PAGE_SIZE          # nothing handed out


def test_checksum_mismatch_names_the_page(store, small_set, small_template) -> None:
    """A payload that decodes to other bytes than were stored is caught by the checksum, in the
    bulk path (naming the page) and on the fault path (leaving the buffer untouched)."""
    idx, pages = small_set.sandboxes[0]
    store.encode("a", "d", idx, pages, small_template)
    stored = store.stored_pages("a")
    kinds = store.page_kinds("a", stored)
    for kind in (Kind.ZSTD, Kind.TDELTA, Kind.SDELTA):
        victims = stored[kinds == int(kind)]
        if len(victims) == 0:
            continue
        victim = int(victims[0])
        hit = store._sandboxes["a"].index.lookup_one(victim)
        assert hit is not None
        store._table.rows["check"][hit[2]] ^= np.uint64(1)
        with pytest.raises(ChecksumMismatch) as err:
            store.decode("a", np.concatenate([stored[kinds == int(Kind.TEMPLATE)][:3], [victim]]))
        assert err.value.page_idx == victim
        buf = bytearray(b"\xee" * PAGE_SIZE)
        with pytest.raises(ChecksumMismatch) as err:
            store.decode_page_into("a", victim, memoryview(buf))
        assert err.value.page_idx == victim and bytes(buf) == b"\xee" * PAGE_SIZE
        store._table.rows["check"][hit[2]] ^= np.uint64(1)
        np.testing.assert_array_equal(store.decode("a", np.array([victim]))[0], pages[np.searchsorted(idx, victim)])


def test_corrupt_template_memory_fails_checksum(store, small_set, small_template) -> None:
    from azqemu.memory.template import TemplateImage
    t = TemplateImage(page_idx=small_template.page_idx, pages=small_template.gather(small_template.page_idx),
                      size_bytes=small_template.size_bytes)
    idx, pages = small_set.sandboxes[0]
    store.encode("a", "d", idx, pages, t)
    tp = idx[store.page_kinds("a", idx) == int(Kind.TEMPLATE)]
    victim = int(tp[0])
    t.pages_z.flags.writeable = True
    t.pages_z[t.row(victim), 7] ^= 1
    with pytest.raises(ChecksumMismatch) as err:
        store.decode("a", np.array([victim]))
    assert err.value.page_idx == victim
    with pytest.raises(ChecksumMismatch):
        store.decode_page_into("a", victim, bytearray(PAGE_SIZE))


def test_discard_releases_pages(store, small_set, small_template) -> None:
    idx, pages = small_set.sandboxes[0]
    store.encode("a", "d", idx, pages, small_template)
    stored = store.stored_pages("a")
    gone = stored[::3]
    store.discard("a", gone)
    left = store.stored_pages("a")
    assert len(left) == len(stored) - len(gone) and not np.isin(gone, left).any()
    np.testing.assert_array_equal(store.decode("a", left), _expect(small_set, 0, left))
    with pytest.raises(StoreError, match="not in the store"):
        store.decode("a", gone[:1])
    with pytest.raises(StoreError, match="not in the store"):
        store.decode_page_into("a", int(gone[0]), bytearray(PAGE_SIZE))
    store.check_consistency()
    store.discard("a", left)
    assert store.owned_bytes("a").private_bytes == 0


def test_reencode_replaces_entries(store, small_set, small_template) -> None:
    idx, pages = small_set.sandboxes[0]
    store.encode("a", "d", idx, pages, small_template)
    # The next wait: a few pages changed again and are encoded anew.
    idx2, pages2 = small_set.sandboxes[1]
    sel = idx[:50]
    new = pages2[:50]
    store.encode("a", "d", sel, new, small_template)
    store.check_consistency()
    stored = store.stored_pages("a")
    expect = dict(zip(idx.tolist(), pages))
    expect.update(dict(zip(sel.tolist(), new)))
    out = store.decode("a", stored)
    for row, p in enumerate(stored.tolist()):
        np.testing.assert_array_equal(out[row], expect[p])


def test_decode_into_numpy_and_memoryview(store, small_set, small_template) -> None:
    idx, pages = small_set.sandboxes[0]
    store.encode("a", "d", idx, pages, small_template)
    stored = store.stored_pages("a")
    exp = _expect(small_set, 0, stored)
    buf = np.empty((len(stored), PAGE_SIZE), np.uint8)
    assert store.decode("a", stored, out=buf) is buf
    np.testing.assert_array_equal(buf, exp)
    one = np.empty(PAGE_SIZE, np.uint8)
    for row in range(0, len(stored), 7):
        store.decode_page_into("a", int(stored[row]), one)
        np.testing.assert_array_equal(one, exp[row])


def test_bad_inputs(store, small_template) -> None:
    with pytest.raises(StoreError, match="no sandbox"):
        store.decode("nope", np.array([1]))
    with pytest.raises(StoreError, match="duplicate"):
        store.encode("a", "d", np.array([1, 1]), np.zeros((2, PAGE_SIZE), np.uint8), small_template)
    store.encode("a", "d", np.array([1]), np.zeros((1, PAGE_SIZE), np.uint8), small_template)
    with pytest.raises(StoreError, match="belongs to domain"):
        store.encode("a", "other", np.array([2]), np.zeros((1, PAGE_SIZE), np.uint8), small_template)


def test_arena_compaction_keeps_pages(store_dir, small_set, small_template) -> None:
    with PageStore(store_dir, arena_bytes=ARENA_HEADER_BYTES + (64 << 10)) as s:
        _fill(s, small_set, small_template)
        n_arenas = len(s._arenas.arenas)
        assert n_arenas > 3
        s.free_sandbox("a")
        s.free_sandbox("c")
        s.check_consistency()
        assert len(s._arenas.arenas) < n_arenas
        stored = s.stored_pages("b")
        np.testing.assert_array_equal(s.decode("b", stored), _expect(small_set, 1, stored))
        s.flush()
    with PageStore(store_dir, templates=(small_template,)) as s:
        np.testing.assert_array_equal(s.decode("b", stored), _expect(small_set, 1, stored))


def test_missing_pages_are_key_errors(store, small_set, small_template) -> None:
    from azqemu.memory import NotStored
    idx, pages = small_set.sandboxes[0]
    store.encode("a", "d", idx, pages, small_template)
    with pytest.raises(NotStored) as err:
        store.decode_page_into("a", 1 << 30, bytearray(PAGE_SIZE))
    assert isinstance(err.value, KeyError) and isinstance(err.value, StoreError)
    assert err.value.page_idx == 1 << 30 and str(err.value) == f"page {1 << 30} of 'a' is not in the store"
    with pytest.raises(KeyError):
        store.stored_pages("nobody")


def test_restore_store_source_adapter(store, small_set, small_template) -> None:
    """The restore path's StoreSource serves pages from this store and refuses missing ones."""
    source_mod = pytest.importorskip("azqemu.restore.source")
    errors_mod = pytest.importorskip("azqemu.restore.errors")
    idx, pages = small_set.sandboxes[0]
    store.encode("a", "d", idx, pages, small_template)
    stored = store.stored_pages("a")
    src = source_mod.StoreSource(store, "a")
    buf = bytearray(PAGE_SIZE)
    src.fill(int(stored[5]) * PAGE_SIZE, memoryview(buf))
    assert bytes(buf) == pages[np.searchsorted(idx, stored[5])].tobytes()
    many = bytearray(PAGE_SIZE * 8)
    src.fill_pages(stored[:8] * PAGE_SIZE, memoryview(many))
    assert bytes(many) == pages[np.searchsorted(idx, stored[:8])].tobytes()
    missing = int(np.setdiff1d(np.arange(idx.max() + 2), stored)[0])
    with pytest.raises(errors_mod.PageUnavailable):
        src.fill(missing * PAGE_SIZE, memoryview(buf))
    with pytest.raises(errors_mod.PageUnavailable):
        src.fill_pages(np.array([int(stored[0]), missing]) * PAGE_SIZE, memoryview(bytearray(2 * PAGE_SIZE)))


def test_malformed_metadata_with_valid_checksum_refused(flushed, small_template) -> None:
    """A store file whose checksum is right but whose contents are nonsense is still refused."""
    from azqemu.memory.persist import read_store, write_store
    meta, body = read_store(flushed / STORE_FILE)
    meta["arenas"] = [{"id": "zero", "used": None, "live": 1}]
    write_store(flushed / STORE_FILE, meta, [bytes(body)])
    with pytest.raises(StoreCorrupt, match="malformed"):
        PageStore(flushed, templates=(small_template,))
    meta["arenas"] = []
    meta["n_blobs"] = 10 ** 12
    write_store(flushed / STORE_FILE, meta, [bytes(body)])
    with pytest.raises(StoreCorrupt, match="blob count"):
        PageStore(flushed, templates=(small_template,))


def test_dead_pages_leave_tmpfs_at_once(store_dir, small_set, small_template) -> None:
    """Re-encoding a sandbox frees its old blobs: the arena pages they filled are punched
    (the current arena included), the allocated bytes follow the live ones, and what is
    still live decodes exactly."""
    with PageStore(store_dir) as s:
        idx, pages = small_set.sandboxes[0]
        s.encode("a", "d", idx, pages, small_template)
        after_first = s.total_bytes()
        idx2, pages2 = small_set.sandboxes[1]
        for _ in range(4):  # the same pages again and again with other content: old blobs die
            s.encode("a", "d", idx, pages2[:len(idx)] if len(pages2) >= len(idx) else pages, small_template)
            s.encode("a", "d", idx, pages, small_template)
        tb = s.total_bytes()
        assert tb.arena_used_bytes > 4 * after_first.arena_used_bytes    # written: all of it
        assert tb.arena_allocated_bytes < 2 * after_first.arena_allocated_bytes + 8 * PAGE_SIZE
        assert tb.arena_allocated_bytes >= tb.arena_live_bytes
        stored = s.stored_pages("a")
        np.testing.assert_array_equal(s.decode("a", stored), _expect(small_set, 0, stored))
        s.check_consistency()


def test_part_dead_arenas_are_compacted_current_included(store_dir, small_set, small_template,
                                                         monkeypatch) -> None:
    """Blobs dying here and there leave pages part live, part dead, which punching cannot
    free: the arena (the current one too) is compacted once tmpfs holds more than twice
    its live bytes, and every page still decodes to its bytes."""
    from azqemu.memory import arena

    slack = 64 << 10
    monkeypatch.setattr(arena, "COMPACT_MIN_BYTES", slack)
    with PageStore(store_dir) as s:
        names = ("a", "b", "c")
        _fill(s, small_set, small_template, names)
        for name in names:
            stored = s.stored_pages(name)
            s.discard(name, stored[::3])
            s.discard(name, stored[1::3])
        tb = s.total_bytes()
        assert 0 not in s._arenas.arenas                      # the first (current) arena moved
        assert tb.arena_allocated_bytes <= 2 * tb.arena_live_bytes + slack + 2 * PAGE_SIZE
        for k, name in enumerate(names):
            stored = s.stored_pages(name)
            np.testing.assert_array_equal(s.decode(name, stored), _expect(small_set, k, stored))
        s.check_consistency()


def test_template_identity_ignores_zero_pages_filling_holes() -> None:
    """A copy-on-write clone's read of a hole allocates a zero page in the template's tmpfs
    file: the image stays the same template (same id, the page still a hole)."""
    from azqemu.memory.template import TemplateImage

    from .conftest import text_page

    pages = [text_page(1), text_page(2)]
    sparse = TemplateImage(page_idx=np.array([0, 5]), pages=np.stack(pages), size_bytes=8 * PAGE_SIZE)
    filled = TemplateImage(page_idx=np.array([0, 3, 5]),
                           pages=np.stack([pages[0], np.zeros(PAGE_SIZE, np.uint8), pages[1]]),
                           size_bytes=8 * PAGE_SIZE)
    assert filled.template_id == sparse.template_id
    assert filled.rows(np.array([0, 3, 5])).tolist() == [0, -1, 5]   # a row is the page index
