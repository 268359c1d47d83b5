"""The similarity index's C loops (_pagecodec.so) give exactly what its numpy fallback gives:
fingerprints, first hits with and without an excluded source, the layered lookup, the vote."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import azqemu.memory.simindex as simindex
from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.simindex import (
    N_SAMPLES,
    SAMPLE_WORD_OFFSETS,
    SAMPLE_WORDS,
    LayeredIndex,
    SimilarityIndex,
    best_candidates,
    sample_fingerprints,
)

pytestmark = pytest.mark.skipif(simindex._native() is None, reason="_pagecodec.so not built")


def numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simindex, "_native", lambda: None)


def pages_from(seed: int, n: int) -> np.ndarray:
    """Pages that share sample blocks with each other (so queries hit), some blocks constant."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 1 << 63, size=(8, 512), dtype=np.uint64)
    words = pool[rng.integers(0, len(pool), n)].copy()
    for i in range(n):
        for _ in range(int(rng.integers(0, 4))):       # rewrite a sample block or leave it shared
            off = SAMPLE_WORD_OFFSETS[int(rng.integers(0, N_SAMPLES))]
            fill = rng.integers(0, 3)
            blk = words[i, off:off + SAMPLE_WORDS]
            blk[:] = rng.integers(0, 1 << 63, SAMPLE_WORDS, dtype=np.uint64) if fill else rng.integers(0, 9)
    return words.view(np.uint8).reshape(n, PAGE_SIZE)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 40))
def test_fingerprints_match_numpy(seed: int, n: int) -> None:
    pages = pages_from(seed, n)
    want = simindex._numpy_fingerprints(pages, np.zeros((n, N_SAMPLES), np.uint64))
    got = sample_fingerprints(pages)
    assert np.array_equal(got, want)


def test_a_constant_sample_block_is_not_sampled() -> None:
    pages = pages_from(3, 2)
    words = pages.view(np.uint64).reshape(2, -1)
    off = SAMPLE_WORD_OFFSETS[2]
    words[1, off:off + SAMPLE_WORDS] = 0x4141414141414141
    got = sample_fingerprints(pages)
    assert got[1, 2] == 0 and (got[0] != 0).all() and (got[1, [0, 1, 3]] != 0).all()
    assert np.array_equal(got, simindex._numpy_fingerprints(pages, np.zeros((2, N_SAMPLES), np.uint64)))


def _index(seed: int, n: int, dtype: type) -> tuple[SimilarityIndex, np.ndarray]:
    pages = pages_from(seed, n)
    fps = sample_fingerprints(pages)
    rng = np.random.default_rng(seed + 1)
    sources = rng.integers(0, 50, n).astype(dtype)      # repeats: one fingerprint, many sources
    return SimilarityIndex.build(fps, sources), fps


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 60), q=st.integers(1, 30),
       dtype=st.sampled_from([np.int32, np.uint32, np.int64]), excl=st.booleans())
def test_query_matches_numpy(seed: int, n: int, q: int, dtype: type,
                             excl: bool) -> None:
    index, fps = _index(seed, n, dtype)
    rng = np.random.default_rng(seed + 2)
    ask = fps[rng.integers(0, n, q)].copy()
    ask[rng.random(ask.shape) < 0.2] = rng.integers(1, 1 << 63, dtype=np.uint64)     # misses
    exclude = rng.integers(0, 50, q).astype(np.int64) if excl else None
    got = index.query(ask, exclude=exclude)
    got_ex = index.excluded_hit.copy()
    with pytest.MonkeyPatch.context() as m:
        numpy_only(m)
        want = index.query(ask, exclude=exclude)
        want_ex = index.excluded_hit.copy()
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert np.array_equal(got_ex, want_ex)
    assert got[0].dtype == want[0].dtype == np.int64


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_old=st.integers(0, 50), n_young=st.integers(0, 20), q=st.integers(1, 30))
def test_layered_query_matches_numpy(seed: int, n_old: int, n_young: int,
                                     q: int) -> None:
    old, fps_old = _index(seed, n_old, np.uint32) if n_old else (SimilarityIndex.empty(), np.zeros((0, 4), np.uint64))
    young, fps_young = _index(seed + 7, n_young, np.uint32) if n_young else (SimilarityIndex.empty(),
                                                                            np.zeros((0, 4), np.uint64))
    both = np.concatenate([fps_old, fps_young, sample_fingerprints(pages_from(seed + 9, 3))])
    ask = both[np.random.default_rng(seed).integers(0, len(both), q)].copy()
    layered = LayeredIndex(old, young)
    got = layered.query(ask)
    with pytest.MonkeyPatch.context() as m:
        numpy_only(m)
        want = layered.query(ask)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_vote_takes_the_first_of_a_tie_and_skips_misses() -> None:
    cand = np.array([[5, 7, 5, 7], [-1, -1, -1, -1], [-1, 3, -1, -1], [2, 2, 9, 2]], dtype=np.int64)
    want = best_candidates(cand)
    got = simindex._native_best(simindex._native(), np.ascontiguousarray(cand))
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert got[0].tolist() == [5, -1, 3, 2] and got[1].tolist() == [2, 0, 1, 3]


def test_an_exclude_of_another_length_is_refused() -> None:
    index, fps = _index(5, 10, np.int64)
    with pytest.raises(ValueError, match="exclude"):
        index.query(fps, exclude=np.zeros(len(fps) + 1, np.int64))
