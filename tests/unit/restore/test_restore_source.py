"""Page sources: served / retry / unavailable, and the composite map of a RAM block."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azqemu.restore.errors import PageUnavailable
from azqemu.restore.source import (
    MAX_SOURCES,
    CompositeSource,
    PageSource,
    StoreSource,
    TemplateSource,
    ZeroSource,
    fill_pages,
    kind_in,
)

PS = 4096


def page(value: int) -> bytes:
    return bytes([value & 0xFF]) * PS


class DictStore:
    """The duck-typed store interface: decode_page_into(sandbox, page_idx, out)."""

    def __init__(self, pages: dict[tuple[str, int], bytes]) -> None:
        self.pages = pages
        self.calls = 0

    def decode_page_into(self, sandbox: str, page_idx: int, out: memoryview) -> None:
        self.calls += 1
        out[:] = self.pages[(sandbox, page_idx)]


class BulkStore(DictStore):
    def __init__(self, pages: dict[tuple[str, int], bytes]) -> None:
        super().__init__(pages)
        self.bulk_calls = 0

    def decode_pages_into(self, sandbox: str, page_idxs: np.ndarray, out: memoryview) -> None:
        self.bulk_calls += 1
        for i, idx in enumerate(page_idxs.tolist()):
            out[i * PS:(i + 1) * PS] = self.pages[(sandbox, idx)]


def offs(*pages: int) -> np.ndarray:
    return np.array(pages, dtype=np.int64) * PS


def buf(n: int = 1) -> memoryview:
    return memoryview(bytearray(b"\xee" * (n * PS)))


def test_zero_source_serves_zero() -> None:
    out = buf(3)
    assert ZeroSource().fill(0, out[:PS]) is True
    assert bytes(out[:PS]) == bytes(PS)
    assert fill_pages(ZeroSource(), offs(0, 7, 9), out, PS) is True
    assert bytes(out) == bytes(3 * PS)
    assert isinstance(ZeroSource(), PageSource)


def test_template_source_reads_data_holes_and_past_the_end(tmp_path) -> None:
    path = tmp_path / "template.ram"
    with open(path, "wb") as f:
        f.write(page(1))
        f.seek(3 * PS)          # pages 1, 2: a hole
        f.write(page(4)[:100])  # page 3: short, the rest is past EOF
    src = TemplateSource(path)
    out = buf()
    assert src.fill(0, out) and bytes(out) == page(1)
    assert src.fill(PS, out) and bytes(out) == bytes(PS)
    assert src.fill(3 * PS, out) and bytes(out) == page(4)[:100] + bytes(PS - 100)
    assert src.fill(10 * PS, out) and bytes(out) == bytes(PS)
    run = buf(5)
    assert fill_pages(src, offs(0, 1, 2, 3, 0), run, PS)
    assert bytes(run) == page(1) + bytes(2 * PS) + page(4)[:100] + bytes(PS - 100) + page(1)
    src.close()


def test_template_source_base_offset(tmp_path) -> None:
    path = tmp_path / "image"
    path.write_bytes(b"H" * PS + page(7))
    with TemplateSource(path, base_offset=PS) as src:
        out = buf()
        assert src.fill(0, out) and bytes(out) == page(7)


def test_template_source_missing_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        TemplateSource(tmp_path / "nope")


def test_store_source_uses_page_index_and_refuses_missing_pages() -> None:
    store = DictStore({("sb1", 5): page(5)})
    src = StoreSource(store, "sb1")
    out = buf()
    assert src.fill(5 * PS, out) is True and bytes(out) == page(5)
    with pytest.raises(PageUnavailable) as exc:
        src.fill(6 * PS, out)
    assert exc.value.offset == 6 * PS
    assert "no page 6 of 'sb1'" in exc.value.detail


def test_store_source_false_return_is_refused_not_zero() -> None:
    class NotHeld:
        def decode_page_into(self, sandbox: str, page_idx: int, out: memoryview) -> bool:
            return False

    out = buf()
    with pytest.raises(PageUnavailable):
        StoreSource(NotHeld(), "sb").fill(0, out)
    assert bytes(out) == b"\xee" * PS  # untouched: nobody may serve this as zero


def test_store_source_errors_of_the_store_pass_through() -> None:
    from azqemu.errors import ChecksumMismatch

    class Damaged:
        def decode_page_into(self, sandbox: str, page_idx: int, out: memoryview) -> None:
            raise ChecksumMismatch(page_idx)

    with pytest.raises(ChecksumMismatch):
        StoreSource(Damaged(), "sb").fill(3 * PS, buf())


def test_store_source_bulk_decode() -> None:
    pages = {("s", i): page(i) for i in range(10)}
    store = BulkStore(pages)
    out = buf(4)
    assert fill_pages(StoreSource(store, "s"), offs(3, 4, 8, 1), out, PS)
    assert store.bulk_calls == 1 and store.calls == 0
    assert bytes(out) == page(3) + page(4) + page(8) + page(1)
    plain = DictStore(pages)
    out2 = buf(4)
    assert fill_pages(StoreSource(plain, "s"), offs(3, 4, 8, 1), out2, PS)
    assert plain.calls == 4 and bytes(out2) == bytes(out)
    with pytest.raises(PageUnavailable) as exc:
        fill_pages(StoreSource(store, "s"), offs(3, 11), buf(2), PS)
    assert exc.value.offset == 3 * PS


def test_composite_routes_pages() -> None:
    store = DictStore({("s", i): page(i) for i in (2, 3, 9)})
    template = DictStore({("t", i): page(100 + i) for i in range(16)})
    comp = CompositeSource.for_sandbox(16, PS, stored=[2, 3, 9], store=StoreSource(store, "s"),
                                       template=StoreSource(template, "t"))
    out = buf()
    assert comp.fill(2 * PS, out) and bytes(out) == page(2)
    assert comp.fill(4 * PS, out) and bytes(out) == page(104)
    zero_default = CompositeSource.for_sandbox(16, PS, stored=np.zeros(16, bool), store=StoreSource(store, "s"))
    assert zero_default.fill(2 * PS, out) and bytes(out) == bytes(PS)
    assert list(comp.pages_of(comp.source_of(9))) == [2, 3, 9]


def test_composite_fill_pages_splits_by_source() -> None:
    store = DictStore({("s", i): page(i) for i in range(8)})
    template = BulkStore({("t", i): page(50 + i) for i in range(8)})
    comp = CompositeSource(8, PS, default=StoreSource(template, "t"))
    ss = StoreSource(store, "s")
    comp.assign(range(2, 5), ss)
    comp.assign(np.array([6]), ss)
    comp.assign([7], ZeroSource())
    out = buf(8)
    assert comp.fill_pages(offs(0, 1, 2, 3, 4, 5, 6, 7), out)
    expect = [page(50), page(51), page(2), page(3), page(4), page(55), page(6), bytes(PS)]
    assert bytes(out) == b"".join(expect)
    out = buf(3)
    assert comp.fill_pages(offs(6, 2, 3), out)  # a single source: no scatter
    assert bytes(out) == page(6) + page(2) + page(3)


def test_composite_retry_propagates() -> None:
    class Busy:
        def fill(self, offset: int, out: memoryview) -> bool:
            return False

    comp = CompositeSource(4, PS)
    comp.assign(slice(1, 2), Busy())
    assert comp.fill(PS, buf()) is False
    assert comp.fill_pages(offs(0, 1, 2, 3), buf(4)) is False


def test_composite_bounds() -> None:
    comp = CompositeSource(4, PS, base_offset=8 * PS)
    with pytest.raises(PageUnavailable) as exc:
        comp.fill(12 * PS, buf())
    assert exc.value.offset == 12 * PS
    assert comp.fill(8 * PS, buf())
    with pytest.raises(PageUnavailable):
        comp.fill_pages(offs(8, 12), buf(2))
    with pytest.raises(IndexError):
        comp.assign([4], ZeroSource())
    with pytest.raises(ValueError, match="not a power of two"):
        CompositeSource(4, 3000)


def test_composite_many_sources_limit() -> None:
    comp = CompositeSource(300, PS)
    for i in range(MAX_SOURCES - 1):
        comp.assign([i], ZeroSource())
    with pytest.raises(ValueError, match=f"at most {MAX_SOURCES}"):
        comp.assign([299], ZeroSource())
    # the refused source took no page
    assert [kind_in(comp.kinds, i) for i in (298, 299)] == [0, 0]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 41), st.lists(st.tuples(st.integers(0, 5), st.sets(st.integers(0, 40))), max_size=12))
def test_composite_nibbles_keep_every_page_apart(n: int, moves: list[tuple[int, set[int]]]) -> None:
    """Two pages share a byte of ``kinds``: moving one never moves its neighbour, whatever
    form ``pages`` takes, and every reader (the per-page one the fault paths use, the bulk
    ones) agrees with a plain list."""
    srcs = [ZeroSource() for _ in range(6)]
    comp = CompositeSource(n, PS, default=srcs[0])
    model = [0] * n
    for step, (s, pages) in enumerate(moves):
        pages = sorted(p for p in pages if p < n)
        form: object = [np.array(pages, dtype=np.int64), pages,
                        np.isin(np.arange(n), pages), range(0, 0)][step % 4]
        if step % 4 == 3 and pages:
            form = range(pages[0], pages[0] + 1)
            pages = pages[:1]
        comp.assign(form, srcs[s])
        for p in pages:
            model[p] = s
    want = [comp.index_of(srcs[s]) for s in model]
    assert len(comp.kinds) == (n + 1) // 2
    assert [kind_in(comp.kinds, i) for i in range(n)] == want
    assert comp.kind_of(np.arange(n)).tolist() == want
    assert [comp.source_of(i) is srcs[model[i]] for i in range(n)] == [True] * n
    for s, src in enumerate(srcs):
        if comp.index_of(src) >= 0:
            assert comp.pages_of(src).tolist() == [i for i in range(n) if model[i] == s]


def test_template_source_is_a_pagesource(tmp_path) -> None:
    p = tmp_path / "t"
    p.write_bytes(b"")
    with TemplateSource(p) as src:
        assert isinstance(src, PageSource)
    assert not os.path.exists(tmp_path / "nothing")
