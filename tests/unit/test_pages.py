"""Page-run helpers of the ground-level ``azqemu.pages``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azqemu.pages import (
    PAGE_SIZE,
    Scratch,
    in_sorted,
    intersect_idx,
    not_in_ids,
    page_runs,
    scratch_rows,
    setdiff_idx,
    take_rows,
    union_idx,
    unique_counts,
    unique_idx,
)


def test_page_runs() -> None:
    starts, lengths = page_runs(np.array([1, 2, 3, 7, 9, 10]))
    assert starts.tolist() == [1, 7, 9] and lengths.tolist() == [3, 1, 2]
    starts, lengths = page_runs(np.array([], dtype=np.int64))
    assert len(starts) == 0


def test_take_rows_gathers_in_place_and_still_refuses_a_row_out_of_range() -> None:
    src = np.arange(6 * PAGE_SIZE, dtype=np.uint32).astype(np.uint8).reshape(6, PAGE_SIZE)
    scratch: Scratch = {}
    out = scratch_rows(scratch, "x", 3)
    got = take_rows(src, np.array([5, 0, 5]), out)
    assert got is out and np.array_equal(out, src[[5, 0, 5]])
    assert np.shares_memory(scratch_rows(scratch, "x", 2), out)    # the same buffer, kept
    for bad in ([6], [-1]):
        with pytest.raises(IndexError):
            take_rows(src, np.array(bad), out[:1])
    assert len(take_rows(src, np.empty(0, dtype=np.int64), out[:0])) == 0


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(0, 300), max_size=60), members=st.lists(st.integers(0, 300), max_size=60))
def test_in_sorted_is_isin_for_a_sorted_set(values: list[int], members: list[int]) -> None:
    """Binary-search membership against an ascending set (repeats allowed) answers as np.isin,
    whatever the values' order, dtype or repeats."""
    v = np.array(values, dtype=np.uint32)
    m = np.sort(np.array(members, dtype=np.int64))
    np.testing.assert_array_equal(in_sorted(v, m), np.isin(v, m))


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(0, 300), max_size=60), ids=st.lists(st.integers(0, 300), max_size=60))
def test_not_in_ids_is_the_negated_isin(values: list[int], ids: list[int]) -> None:
    """The flag table answers as ~np.isin, for u32 values against i64 ids, in any order."""
    v = np.array(values, dtype=np.uint32)
    i = np.array(ids, dtype=np.int64)
    np.testing.assert_array_equal(not_in_ids(v, i), ~np.isin(v, i))


_IDX = st.lists(st.integers(0, 300), max_size=60)


@settings(max_examples=200, deadline=None)
@given(a=_IDX, b=_IDX, sort_a=st.booleans(), b_dtype=st.sampled_from([np.int64, np.uint32]))
def test_set_helpers_are_numpys_set_functions(a: list[int], b: list[int], sort_a: bool, b_dtype: type) -> None:
    """The sort-based set functions give numpy's results, values and dtype, sorted input or not."""
    x = np.array(sorted(a) if sort_a else a, dtype=np.int64)
    y = np.array(b, dtype=b_dtype)
    for ours, numpys in ((union_idx, np.union1d), (setdiff_idx, np.setdiff1d), (intersect_idx, np.intersect1d)):
        got, want = ours(x, y), numpys(x, y)
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), ours.__name__
    assert unique_idx(x).tolist() == np.unique(x).tolist()
    u, c = unique_counts(y)
    wu, wc = np.unique(y, return_counts=True)
    assert u.dtype == wu.dtype and u.tolist() == wu.tolist() and c.tolist() == wc.tolist()
