"""classify_cheap: the C loop (_pagecodec.c's azq_classify) and the numpy fallback give the
same kinds as the definition, case by case and on random mixes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from azqemu.memory import encoder
from azqemu.memory.encoder import CLASSIFY_CHUNK_PAGES, Encoder, classify_cheap
from azqemu.memory.kinds import PAGE_SIZE, Kind
from azqemu.memory.template import TemplateImage
from azqemu.memory.zstdlib import PageZstd, classify_native, native_available

from .conftest import random_page, text_page

ZERO, TEMPLATE, RAW = int(Kind.ZERO), int(Kind.TEMPLATE), int(Kind.RAW)

# A template of 48 pages: data pages at 0-15 and 24-39, an allocated all-zero page at 20 (a hole
# by the image's rules), holes elsewhere; pages 48 and beyond are past the image.
N_TEMPLATE_PAGES = 48
DATA_IDX = [*range(16), *range(24, 40)]
ZERO_DATA_IDX = 20
HOLE_IDX = [i for i in range(N_TEMPLATE_PAGES) if i not in DATA_IDX]


def _template_page(i: int) -> np.ndarray:
    return text_page(1000 + i) if i % 2 else random_page(1000 + i)


@pytest.fixture(scope="module")
def template() -> TemplateImage:
    idx = [*DATA_IDX, ZERO_DATA_IDX]
    pages = np.stack([_template_page(i) for i in DATA_IDX] + [np.zeros(PAGE_SIZE, np.uint8)])
    return TemplateImage(page_idx=np.array(idx, np.int64), pages=pages, size_bytes=N_TEMPLATE_PAGES * PAGE_SIZE)


class Path:
    """Which classify_cheap path a test runs, and what the C loop answered (True: it did the work)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[bool] = []

    def check_taken(self) -> None:
        if self.name == "native":
            assert self.calls and all(self.calls), "the C loop declined arrays it should take"


@pytest.fixture(params=["native", "numpy"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the test through the C loop or through numpy."""
    p = Path(str(request.param))
    if p.name == "numpy":
        monkeypatch.setattr(encoder, "classify_native", lambda *a: False)
        return p
    if not native_available():
        pytest.skip("_pagecodec.so not built")

    def spy(*a: object) -> bool:
        ok = classify_native(*a)          # type: ignore[arg-type]
        p.calls.append(ok)
        return ok

    monkeypatch.setattr(encoder, "classify_native", spy)
    return p


def reference(page_idx: np.ndarray, pages: np.ndarray, template: TemplateImage) -> np.ndarray:
    """The definition, one page at a time: zero wins; else equal to the same-address template
    page (a hole or an index past the image has none)."""
    out = np.full(len(page_idx), RAW, np.uint8)
    for i, (idx, page) in enumerate(zip(page_idx.tolist(), pages.reshape(len(page_idx), PAGE_SIZE))):
        t = template.page(idx)
        if not page.any():
            out[i] = ZERO
        elif t is not None and np.array_equal(page, t):
            out[i] = TEMPLATE
    return out


def _edited(page: np.ndarray, pos: int, value: int | None = None) -> np.ndarray:
    out = page.copy()
    out[pos] = out[pos] ^ 0x01 if value is None else value
    return out


# (name, page index, page maker): every case of the definition and its edges.
CASES: list[tuple[str, int, Callable[[], np.ndarray]]] = [
    ("random at a data page", 3, lambda: random_page(7)),
    ("text at a data page", 4, lambda: text_page(7)),
    ("zero at a data page", 5, lambda: np.zeros(PAGE_SIZE, np.uint8)),
    ("template-equal", 6, lambda: _template_page(6)),
    ("template-equal, odd", 7, lambda: _template_page(7)),
    ("template except the last byte", 8, lambda: _edited(_template_page(8), PAGE_SIZE - 1)),
    ("template except the first byte", 9, lambda: _edited(_template_page(9), 0)),
    ("template except the last word's top byte", 10, lambda: _edited(_template_page(10), PAGE_SIZE - 8)),
    ("another address's template page", 11, lambda: _template_page(12)),
    ("zero at a hole", HOLE_IDX[0], lambda: np.zeros(PAGE_SIZE, np.uint8)),
    ("zero at an all-zero data page", ZERO_DATA_IDX, lambda: np.zeros(PAGE_SIZE, np.uint8)),
    ("non-zero at a hole", HOLE_IDX[1], lambda: random_page(8)),
    ("a template page at a hole", HOLE_IDX[2], lambda: _template_page(2)),
    ("only the last byte set", 13, lambda: _edited(np.zeros(PAGE_SIZE, np.uint8), PAGE_SIZE - 1, 1)),
    ("only the first byte set, at a hole", HOLE_IDX[3], lambda: _edited(np.zeros(PAGE_SIZE, np.uint8), 0, 0x80)),
    ("zero past the image", N_TEMPLATE_PAGES, lambda: np.zeros(PAGE_SIZE, np.uint8)),
    ("zero far past the image", 1 << 40, lambda: np.zeros(PAGE_SIZE, np.uint8)),
    ("non-zero past the image", N_TEMPLATE_PAGES + 5, lambda: random_page(9)),
    ("the last template page past the image", N_TEMPLATE_PAGES, lambda: _template_page(39)),
    ("the last data page, equal", 39, lambda: _template_page(39)),
    ("the first data page, equal", 0, lambda: _template_page(0)),
]
EXPECTED = [RAW, RAW, ZERO, TEMPLATE, TEMPLATE, RAW, RAW, RAW, RAW, ZERO, ZERO, RAW, RAW, RAW, RAW, ZERO, ZERO,
            RAW, RAW, TEMPLATE, TEMPLATE]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_each_case(template: TemplateImage, path: Path, case: int) -> None:
    _, idx, make = CASES[case]
    page_idx = np.array([idx], np.int64)
    pages = make().reshape(1, PAGE_SIZE)
    got = classify_cheap(page_idx, pages, template)
    assert got.tolist() == [EXPECTED[case]] == reference(page_idx, pages, template).tolist()
    path.check_taken()


def test_all_cases_in_one_batch_over_several_chunks(template: TemplateImage, path: Path) -> None:
    """Every case, repeated past CLASSIFY_CHUNK_PAGES in a shuffled order."""
    rng = np.random.default_rng(5)
    order = rng.integers(0, len(CASES), size=2 * CLASSIFY_CHUNK_PAGES + 17)
    page_idx = np.array([CASES[c][1] for c in order], np.int64)
    pages = np.stack([CASES[c][2]() for c in order])
    got = classify_cheap(page_idx, pages, template)
    np.testing.assert_array_equal(got, np.array([EXPECTED[c] for c in order], np.uint8))
    path.check_taken()


def test_empty(template: TemplateImage, path: Path) -> None:
    assert len(classify_cheap(np.zeros(0, np.int64), np.zeros((0, PAGE_SIZE), np.uint8), template)) == 0


def test_unaligned_and_strided_pages(template: TemplateImage, path: Path) -> None:
    """Pages at an odd address (the C loop reads them unaligned), and every other row of an
    array (not contiguous: the C loop declines, numpy does it)."""
    idx = np.array([c[1] for c in CASES], np.int64)
    pages = np.stack([c[2]() for c in CASES])
    expected = np.array(EXPECTED, np.uint8)
    buf = np.zeros(pages.nbytes + 1, np.uint8)
    buf[1:] = pages.reshape(-1)
    odd = buf[1:].reshape(len(idx), PAGE_SIZE)
    np.testing.assert_array_equal(classify_cheap(idx, odd, template), expected)
    path.check_taken()
    wide = np.zeros((2 * len(idx), PAGE_SIZE), np.uint8)
    wide[::2] = pages
    np.testing.assert_array_equal(classify_cheap(idx, wide[::2], template), expected)


def test_native_declines_what_it_cannot_read(template: TemplateImage) -> None:
    """Wrong dtypes, shapes or strides: False and ``kind`` untouched (numpy does those)."""
    n = 4
    pages = np.zeros((n, PAGE_SIZE), np.uint8)
    rows = template.rows(np.arange(n))
    kind = np.full(n, RAW, np.uint8)
    tz = template.pages_z
    assert not classify_native(np.zeros((2 * n, PAGE_SIZE), np.uint8)[::2], rows, tz, kind, ZERO, TEMPLATE)
    assert not classify_native(pages.view(np.uint64), rows, tz, kind, ZERO, TEMPLATE)
    assert not classify_native(pages[:, :100], rows, tz, kind, ZERO, TEMPLATE)
    assert not classify_native(pages, rows[:2], tz, kind, ZERO, TEMPLATE)
    assert not classify_native(pages, rows, tz, kind.astype(np.int64), ZERO, TEMPLATE)
    assert (kind == RAW).all()


@pytest.mark.skipif(not native_available(), reason="_pagecodec.so not built")
def test_native_refuses_a_row_outside_the_template(template: TemplateImage) -> None:
    """A row at or past the end of the rows given: -1 with nothing written (no read)."""
    n = 3
    kind = np.full(n, RAW, np.uint8)
    rows = np.array([0, -1, len(template.pages_z)], np.int64)
    assert not classify_native(np.zeros((n, PAGE_SIZE), np.uint8), rows, template.pages_z, kind, ZERO, TEMPLATE)
    assert (kind == RAW).all()


def test_a_closed_template_raises_as_before(path: Path) -> None:
    t = TemplateImage(page_idx=np.array([0], np.int64), pages=random_page(1).reshape(1, PAGE_SIZE),
                      size_bytes=2 * PAGE_SIZE)
    t.close()
    with pytest.raises(IndexError):
        classify_cheap(np.array([0, 1], np.int64), np.zeros((2, PAGE_SIZE), np.uint8), t)


def test_empty_template(path: Path) -> None:
    t = TemplateImage(page_idx=np.zeros(0, np.int64), pages=np.zeros((0, PAGE_SIZE), np.uint8), size_bytes=0)
    idx = np.array([0, 1, 7], np.int64)
    pages = np.stack([np.zeros(PAGE_SIZE, np.uint8), random_page(2), np.zeros(PAGE_SIZE, np.uint8)])
    assert classify_cheap(idx, pages, t).tolist() == [ZERO, RAW, ZERO]
    path.check_taken()


_page_maker = st.one_of(
    st.tuples(st.just("zero"), st.integers(0, 0)),
    st.tuples(st.just("random"), st.integers(0, 1 << 16)),
    st.tuples(st.just("template"), st.integers(0, 0)),
    st.tuples(st.just("template-edit"), st.integers(0, PAGE_SIZE - 1)),
    st.tuples(st.just("one-byte"), st.integers(0, PAGE_SIZE - 1)),
    st.tuples(st.just("other-template"), st.sampled_from(DATA_IDX)),
)


def _make(kind: str, arg: int, idx: int, template: TemplateImage) -> np.ndarray:
    own = template.page(idx)
    base = own.copy() if own is not None else random_page(idx)
    if kind == "zero":
        return np.zeros(PAGE_SIZE, np.uint8)
    if kind == "random":
        return random_page(arg)
    if kind == "template":
        return base
    if kind == "template-edit":
        return _edited(base, arg)
    if kind == "one-byte":
        return _edited(np.zeros(PAGE_SIZE, np.uint8), arg, 1 + arg % 255)
    return np.array(template.pages[arg])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.tuples(st.integers(0, N_TEMPLATE_PAGES + 8), _page_maker), min_size=1, max_size=40))
def test_native_and_numpy_agree_with_the_definition(template: TemplateImage, items: list) -> None:
    idx = np.array([i for i, _ in items], np.int64)
    pages = np.stack([_make(k, a, i, template) for i, (k, a) in items])
    expected = reference(idx, pages, template)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(encoder, "classify_native", lambda *a: False)
        np.testing.assert_array_equal(classify_cheap(idx, pages, template), expected)
    np.testing.assert_array_equal(classify_cheap(idx, pages, template), expected)   # C where built
    if native_available():
        kind = np.full(len(idx), RAW, np.uint8)
        assert classify_native(pages, template.rows(idx), template.pages_z, kind, ZERO, TEMPLATE)
        np.testing.assert_array_equal(kind, expected)


def test_plans_are_the_same_either_way(small_set, small_template) -> None:
    """A whole encoder plan on a synthetic sandbox: same kinds, targets and payloads."""
    idx, pages = small_set.sandboxes[0]
    plans = []
    for native in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not native:
                mp.setattr(encoder, "classify_native", lambda *a: False)
            plans.append(Encoder(PageZstd()).plan(idx, pages, small_template, None))
    a, b = plans
    np.testing.assert_array_equal(a.kind, b.kind)
    np.testing.assert_array_equal(a.target, b.target)
    np.testing.assert_array_equal(a.ref, b.ref)
    assert a.blobs.payload == b.blobs.payload
    assert (a.kind == ZERO).any() and (a.kind == TEMPLATE).any()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 7)), max_size=40), seed=st.integers(0, 2**16))
def test_rows_equal_in_c_and_in_numpy_agree_with_the_definition(pairs, seed, monkeypatch) -> None:
    """The encoder's bytewise confirmation of a hash match: page a[i] against page b[j]."""
    from azqemu.memory import zstdlib

    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, size=(12, PAGE_SIZE), dtype=np.uint8)
    b = rng.integers(0, 256, size=(8, PAGE_SIZE), dtype=np.uint8)
    a[:4] = b[:4]                         # equal rows to find
    a[4, :] = b[4]
    a[4, 4095] ^= 1                       # differs in its last byte only
    ai = np.array([p[0] for p in pairs], dtype=np.int64)
    bi = np.array([p[1] for p in pairs], dtype=np.int64)
    expect = np.array([np.array_equal(a[i], b[j]) for i, j in pairs], dtype=bool)
    assert zstdlib.rows_equal(a, ai, b, bi).tolist() == expect.tolist()
    monkeypatch.setattr(zstdlib, "_NATIVE", None)
    assert zstdlib.rows_equal(a, ai, b, bi).tolist() == expect.tolist()


@pytest.mark.skipif(not native_available(), reason="_pagecodec.so not built")
def test_rows_equal_refuses_rows_outside_in_c_and_numpy_says_so() -> None:
    from azqemu.memory import zstdlib

    a = np.zeros((2, PAGE_SIZE), dtype=np.uint8)
    with pytest.raises(IndexError):
        zstdlib.rows_equal(a, np.array([0, 5]), a, np.array([0, 1]))


@settings(max_examples=40, deadline=None)
@given(keep=st.lists(st.booleans(), min_size=0, max_size=24), seed=st.integers(0, 2**16))
def test_compact_rows_moves_the_kept_rows_up_in_place(keep, seed) -> None:
    """ramscan.without_rows's in-place compaction: rows kept, in order, at the front of the
    same buffer; what follows them is not read."""
    from azqemu.memory import zstdlib

    rng = np.random.default_rng(seed)
    pages = rng.integers(0, 256, size=(len(keep), PAGE_SIZE), dtype=np.uint8)
    rows = np.flatnonzero(np.array(keep, dtype=bool))
    expect = pages[rows].copy()
    moved = zstdlib.compact_rows(pages, rows)
    if not native_available():
        assert moved is None
        return
    assert moved is not None and (len(rows) == 0 or np.shares_memory(moved, pages))
    np.testing.assert_array_equal(moved, expect)


@pytest.mark.skipif(not native_available(), reason="_pagecodec.so not built")
def test_compact_rows_refuses_rows_out_of_order_or_range_and_moves_nothing() -> None:
    from azqemu.memory import zstdlib

    pages = np.repeat(np.arange(4, dtype=np.uint8)[:, None], PAGE_SIZE, axis=1)
    before = pages.copy()
    for rows in ([1, 1], [2, 1], [0, 4], [-1, 2]):
        with pytest.raises(IndexError):
            zstdlib.compact_rows(pages, np.array(rows))
        np.testing.assert_array_equal(pages, before)
    assert zstdlib.compact_rows(pages[::2], np.array([1])) is None      # not contiguous rows: the caller copies
    assert zstdlib.compact_rows(np.ascontiguousarray(pages[:, :100]), np.array([0])) is None
