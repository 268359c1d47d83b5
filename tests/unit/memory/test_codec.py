"""Round trips of every representation, property-tested over random and structured pages."""

from __future__ import annotations

import struct
import tempfile
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from azqemu.memory.accounting import blob_costs
from azqemu.memory.blobtable import BLOB_DTYPE, DUP_INDEX_ENTRY_BYTES, in_domain_indices
from azqemu.memory.kinds import PAGE_SIZE, Kind, Method, RefType
from azqemu.memory.store import PageStore
from azqemu.memory.zstdlib import PageZstd, available_backends

from .conftest import SMALL_ARENA, make_template, random_page, text_page

ZSTD_DICT_MAGIC = struct.pack("<I", 0xEC30A437)
ZSTD_FRAME_MAGIC = struct.pack("<I", 0xFD2FB528)
BACKENDS = available_backends()


def _page_from(prefix: bytes, body: str, seed: int) -> np.ndarray:
    if body == "zero":
        tail = bytes(PAGE_SIZE)
    elif body == "random":
        tail = random_page(seed).tobytes()
    elif body == "text":
        tail = text_page(seed).tobytes()
    else:   # repeated short pattern
        pat = bytes((seed + i) % 256 for i in range(1 + seed % 13))
        tail = (pat * (PAGE_SIZE // len(pat) + 1))[:PAGE_SIZE]
    return np.frombuffer((prefix + tail)[:PAGE_SIZE], dtype=np.uint8).copy()


pages_strategy = st.builds(
    _page_from,
    st.sampled_from([b"", ZSTD_DICT_MAGIC, ZSTD_FRAME_MAGIC, ZSTD_DICT_MAGIC + b"\x00" * 4, ZSTD_FRAME_MAGIC * 3]),
    st.sampled_from(["zero", "random", "text", "pattern"]),
    st.integers(0, 1 << 16),
)


@pytest.mark.parametrize("enc", BACKENDS)
@pytest.mark.parametrize("dec", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(page=pages_strategy, ref=pages_strategy)
def test_zstd_backends_interoperate(enc: str, dec: str, page: np.ndarray, ref: np.ndarray) -> None:
    """Frames of either backend decode with the other, with and without a raw-content prefix,
    even when the reference begins with the zstd dictionary or frame magic."""
    a, b = PageZstd(backend=enc), PageZstd(backend=dec)
    for r in (None, ref):
        frame = a.compress(page, r)
        out = np.zeros(PAGE_SIZE, dtype=np.uint8)
        b.decompress_into(frame, out, r)
        np.testing.assert_array_equal(out, page)


def _edit(page: np.ndarray, positions: list[int], value: int) -> np.ndarray:
    out = page.copy()
    for p in positions:
        out[p % PAGE_SIZE] = value
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tpl_pages=st.lists(pages_strategy, min_size=4, max_size=8),
       new_pages=st.lists(pages_strategy, min_size=1, max_size=6),
       edits=st.lists(st.integers(0, PAGE_SIZE - 1), min_size=1, max_size=40),
       shift=st.integers(1, 200), effort=st.sampled_from([1, 2]))
def test_store_round_trip_every_representation(store_dir, tpl_pages, new_pages, edits, shift, effort) -> None:
    """Whatever the encoder picks, decode gives back the exact page (bulk and fault path)."""
    tpl_pages = [p if p.any() else text_page(99) for p in tpl_pages]
    n_t = len(tpl_pages)
    template = make_template(tpl_pages, n_pages=64)
    sandbox = [
        tpl_pages[0],                                   # TEMPLATE
        np.zeros(PAGE_SIZE, np.uint8),                  # ZERO
        tpl_pages[1],                                   # DUP of a template page elsewhere
        _edit(tpl_pages[2], edits, 0xAB),               # TDELTA (XOR) candidates
        np.roll(tpl_pages[3], shift),                   # prefix candidates
        _edit(tpl_pages[0], edits, 0x5A),               # SDELTA candidate (template elsewhere)
        random_page(shift),                             # RAW
        *new_pages,                                     # ZSTD and friends
        new_pages[0],                                   # in-batch DUP
    ]
    idx = np.array([0, 20, 21, 2, 3, 22] + list(range(23, 23 + len(sandbox) - 6)), dtype=np.int64)
    pages = np.stack(sandbox)
    with PageStore(tempfile.mkdtemp(dir=store_dir), arena_bytes=SMALL_ARENA, effort=effort) as store:
        res = store.encode("a", "d", idx, pages, template)
        assert sum(res.pages.values()) == len(idx)
        stored = store.stored_pages("a")
        np.testing.assert_array_equal(np.sort(np.concatenate([stored, res.raw_idx])), np.sort(idx))
        want = {int(i): pages[k] for k, i in enumerate(idx)}
        out = store.decode("a", stored)
        for row, p in enumerate(stored.tolist()):
            np.testing.assert_array_equal(out[row], want[p])
            buf = bytearray(PAGE_SIZE)
            store.decode_page_into("a", p, memoryview(buf))
            assert bytes(buf) == want[p].tobytes()
        # A sibling with the same new content stores DUPs of the first one's blobs, but for
        # PATCHes against a template page: outside the domain's indices, each a PATCH again.
        table = store._table

        def live_blobs(indexed: bool) -> int:
            rows = table.rows[:table.n]
            return int(((rows["refcount"] > 0)
                        & (in_domain_indices(rows["method"], rows["reftype"]) == indexed)).sum())
        before = live_blobs(True), live_blobs(False)
        res_b = store.encode("b", "d", idx, pages, template)
        assert res_b.pages["ZSTD"] == 0
        assert live_blobs(True) + live_blobs(False) - sum(before) <= before[1]
        np.testing.assert_array_equal(store.decode("b", store.stored_pages("b")), out)
    assert n_t >= 4


def test_each_kind_is_produced(store_dir, corpus) -> None:
    """A hand-made sandbox where each kind is the obvious choice gets exactly that kind."""
    tpl = [text_page(i) for i in range(8)]
    template = make_template(tpl, n_pages=64)
    other = corpus.elf[5]
    xor_page = _edit(tpl[2], list(range(100, 140)), 0x11)
    moved = _edit(tpl[5], list(range(300, 320)), 0x22)           # similar to template page 5, placed at 40
    pages = np.stack([tpl[0], np.zeros(PAGE_SIZE, np.uint8), tpl[3], xor_page, moved, other, random_page(1)])
    idx = np.array([0, 30, 31, 2, 40, 41, 42])
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as store:
        store.encode("a", "d", idx, pages, template)
        kinds = store.page_kinds("a", idx)
        assert [Kind(k).name for k in kinds] == ["TEMPLATE", "ZERO", "DUP", "TDELTA", "SDELTA", "ZSTD", "RAW"]
        np.testing.assert_array_equal(store.decode("a", idx[:-1]), pages[:-1])


def test_sdelta_against_a_sibling_blob(store_dir, corpus) -> None:
    template = make_template([text_page(i) for i in range(4)], n_pages=64)
    # A page with content (the corpus reads the host's .pyc files: some pages are mostly
    # zeros, where zstd alone is as small as a delta would be).
    new = next(p for p in corpus.pyc if len(zlib.compress(p.tobytes())) > 1500).copy()
    edited = _edit(new, list(range(500, 530)), 0x33)
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as store:
        store.encode("a", "d", np.array([10]), new[None], template)
        store.encode("b", "d", np.array([20]), edited[None], template)
        assert Kind(int(store.page_kinds("b", np.array([20]))[0])) == Kind.SDELTA
        np.testing.assert_array_equal(store.decode("b", np.array([20]))[0], edited)
        # The base outlives its first holder: freeing "a" keeps "b" decodable.
        store.free_sandbox("a")
        store.check_consistency()
        np.testing.assert_array_equal(store.decode("b", np.array([20]))[0], edited)
        buf = np.zeros(PAGE_SIZE, np.uint8)
        store.decode_page_into("b", 20, buf)
        np.testing.assert_array_equal(buf, edited)


def test_python_backend_store_round_trip(store_dir, small_set, small_template) -> None:
    idx, pages = small_set.sandboxes[0]
    with PageStore(store_dir, arena_bytes=SMALL_ARENA, zstd_backend="python") as store:
        store.encode("a", "d", idx, pages, small_template)
        stored = store.stored_pages("a")
        np.testing.assert_array_equal(store.decode("a", stored), pages[np.searchsorted(idx, stored)])
        store.flush()
    if "libzstd" in BACKENDS:
        with PageStore(store_dir, templates=(small_template,), zstd_backend="libzstd") as store:
            np.testing.assert_array_equal(store.decode("a", stored), pages[np.searchsorted(idx, stored)])


def test_empty_template(store_dir, corpus) -> None:
    """A template with no data at all (every page a hole) still works as a base."""
    from azqemu.memory.template import TemplateImage
    empty = TemplateImage(page_idx=np.zeros(0, np.int64), pages=np.zeros((0, PAGE_SIZE), np.uint8),
                          size_bytes=64 * PAGE_SIZE)
    pages = np.stack([corpus.elf[1], np.zeros(PAGE_SIZE, np.uint8), corpus.elf[1], corpus.text[2]])
    idx = np.array([1, 2, 3, 80])
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as store:
        store.encode("a", "d", idx, pages, empty)
        assert [Kind(k).name for k in store.page_kinds("a", idx)] == ["ZSTD", "ZERO", "DUP", "ZSTD"]
        np.testing.assert_array_equal(store.decode("a", idx), pages)


def test_patches_of_template_pages_stay_out_of_the_domain_indices(store_dir, corpus) -> None:
    """A page a few bytes from its template page is stored as a PATCH that enters neither
    the domain's DUP index nor its similarity index (blobtable.in_domain_indices); a new page
    does, and its cost carries the index entries. A sibling with the same near-template page
    stores its own PATCH, and both decode exactly, also after the DUP index is rebuilt."""
    tpl = [text_page(i) for i in range(8)]
    template = make_template(tpl, n_pages=64)
    near = _edit(tpl[2], [100, 101, 900], 0x11)
    new = next(p for p in corpus.pyc if len(zlib.compress(p.tobytes())) > 1500)
    pages = np.stack([near, new])
    idx = np.array([2, 40])
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as store:
        store.encode("a", "d", idx, pages, template)
        table, d = store._table, store._table.domains["d"]
        rows = table.rows[:table.n]
        live = np.flatnonzero(rows["refcount"] > 0)
        patch = live[(rows["method"][live] == int(Method.PATCH)) & (rows["reftype"][live] == int(RefType.TEMPLATE))]
        plain = np.setdiff1d(live, patch)
        assert len(patch) == 1 and len(plain) == 1
        table._dup_index(d)
        assert patch[0] not in d.dup_ids and plain[0] in d.dup_ids
        sim = table.sim_entries_per_blob(d)
        assert sim[patch[0]] == 0 and sim[plain[0]] > 0
        cost = blob_costs(table, d)
        assert cost[patch[0]] == rows["length"][patch[0]] + BLOB_DTYPE.itemsize
        assert cost[plain[0]] > rows["length"][plain[0]] + BLOB_DTYPE.itemsize + DUP_INDEX_ENTRY_BYTES
        store.encode("b", "d", idx, pages, template)
        assert list(store.page_kinds("b", idx)) == [int(Kind.TDELTA), int(Kind.DUP)]
        d.dup_dirty = True                      # as after a reopen: rebuilt from the table
        table._dup_index(d)
        assert not np.isin(d.dup_ids, patch).any()
        for sb in ("a", "b"):
            np.testing.assert_array_equal(store.decode(sb, idx), pages)
        store.check_consistency()


@pytest.mark.parametrize("native", [True, False])
def test_a_small_enough_delta_ends_the_attempts(store_dir, native: bool) -> None:
    """A page a few bytes from its template page (a walked or lightly updated heap, thousands
    of them a wait) costs no zstd attempt once a delta is small enough (SMALL_ENOUGH_BYTES):
    a short PATCH is taken as it is; an XOR delta that zstd makes small ends the search
    before plain zstd and the prefix attempt. Both loops, the C one and the Python fallback."""
    from azqemu.memory.encoder import SMALL_ENOUGH_BYTES
    tpl = [random_page(100 + i) for i in range(4)]
    template = make_template(tpl, n_pages=16)
    short = tpl[0].copy()
    short[[64, 700, 1900, 3000]] ^= 0x5A                        # a patch of a few runs
    spread = tpl[1].copy()
    spread[np.arange(0, PAGE_SIZE, 16)] ^= 0x01                 # 256 runs: no patch, a tiny XOR
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as store:
        if not native:
            store.zstd.native = None
        elif store.zstd.native is None:
            pytest.skip("_pagecodec.so not built")
        r = store.encode("a", "d", np.array([0]), short[None], template)
        assert r.tries["zstd"] == r.tries["xor"] == r.tries["prefix"] == 0, r.tries
        assert 0 < r.bytes["TDELTA"] <= SMALL_ENOUGH_BYTES
        r = store.encode("a", "d", np.array([1]), spread[None], template)
        assert r.tries["xor"] == 1 and r.tries["zstd"] == r.tries["prefix"] == 0, r.tries
        assert 0 < r.bytes["TDELTA"] <= SMALL_ENOUGH_BYTES
        np.testing.assert_array_equal(store.decode("a", np.array([0, 1])), np.stack([short, spread]))
