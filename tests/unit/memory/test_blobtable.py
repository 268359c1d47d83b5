"""The blob table's DUP index and quarantine under churn: merged, not rebuilt, at each commit;
never a stale hit; ids reused only after their purge from the similarity index."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from azqemu.memory import blobtable
from azqemu.memory.blobtable import BlobTable
from azqemu.memory.simindex import SimilarityIndex


def _add(t: BlobTable, d: blobtable.DomainState, keys: list[int]) -> np.ndarray:
    ids = t.alloc(len(keys))
    t.rows["key"][ids] = keys
    t.rows["domain"][ids] = d.did
    t.incref(ids)
    t.add_dups(d, np.array(keys, dtype=np.uint64), ids)
    return ids


def _free(t: BlobTable, ids: np.ndarray) -> None:
    t.retire(t.decref(ids))


# Each step: ("add", domain, keys) or ("free", k-th live blob); keys from a small range so
# that equal keys (a DUP, a reused key after a free) are common.
STEPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 1), st.lists(st.integers(1, 40), min_size=1, max_size=8)),
    st.tuples(st.just("free"), st.integers(0, 10_000), st.just([]))), max_size=60)


@settings(max_examples=200, deadline=None)
@given(STEPS)
def test_dup_lookup_returns_only_live_blobs_of_the_domain_and_finds_the_newest(steps: list) -> None:
    t = BlobTable()
    doms = [t.domain("a", "tpl"), t.domain("b", "tpl")]
    live: list[tuple[int, int, int]] = []          # (id, domain index, key), in order of addition
    probe = np.arange(1, 41, dtype=np.uint64)
    for op, arg, keys in steps:
        if op == "add":
            ids = _add(t, doms[arg], keys)
            live.extend((int(i), arg, k) for i, k in zip(ids, keys))
        elif live:
            bid, _, _ = live.pop(arg % len(live))
            _free(t, np.array([bid]))
        t.reclaim(force=op == "free")        # ids freed are reused by the next adds
        for di, d in enumerate(doms):
            got = t.find_dups(d, probe)
            for k, b in zip(probe.tolist(), got.tolist()):
                mine = [x for x in live if x[1] == di and x[2] == k]
                if b >= 0:
                    assert (b, di, k) in mine            # live, this domain, this key
                elif mine:
                    # A miss only where the newest entry of that key in each layer (the young
                    # entries, the merged ones) is a dead blob's: it shadows older live ones
                    # of its layer until the index is rebuilt.
                    for keys, ids in ((d.dup_young_keys, d.dup_young_ids), (d.dup_keys, d.dup_ids)):
                        if (keys == k).any():
                            assert (int(ids[keys == k][-1]), di, k) not in mine


def test_churn_merges_the_dup_index_instead_of_rebuilding_it(monkeypatch) -> None:
    t = BlobTable()
    d = t.domain("a", "tpl")
    rebuilds = 0
    real = t.live_mask

    def counted() -> np.ndarray:
        nonlocal rebuilds
        rebuilds += 1
        return real()
    monkeypatch.setattr(t, "live_mask", counted)
    rng = np.random.default_rng(0)
    ids = _add(t, d, rng.integers(1, 2**63, 20_000).tolist())
    t.find_dups(d, np.zeros(1, np.uint64))
    for _ in range(20):                          # every round frees 200 blobs and adds 200
        _free(t, ids[:200])
        ids = np.concatenate([ids[200:], _add(t, d, rng.integers(1, 2**63, 200).tolist())])
        t.reclaim()
        keys = t.rows["key"][ids]
        assert (t.find_dups(d, keys) == ids).all()
    assert rebuilds == 1                          # 4,000 stale entries: under the rebuild mark
    _free(t, ids[:6000])
    t.find_dups(d, np.zeros(1, np.uint64))
    assert rebuilds == 2 and d.dup_stale == 0 and len(d.dup_keys) == len(ids) - 6000


def test_new_entries_wait_in_the_young_layer_until_they_are_an_eighth_of_the_index() -> None:
    t = BlobTable()
    d = t.domain("a", "tpl")
    rng = np.random.default_rng(1)
    old = _add(t, d, rng.integers(1, 2**63, 8000).tolist())
    t.find_dups(d, np.zeros(1, np.uint64))
    assert len(d.dup_keys) == 8000 and not len(d.dup_young_keys)
    young = _add(t, d, rng.integers(1, 2**63, 500).tolist())
    assert (t.find_dups(d, t.rows["key"][young]) == young).all()
    assert len(d.dup_keys) == 8000 and len(d.dup_young_keys) == 500      # the big one untouched
    assert (t.find_dups(d, t.rows["key"][old]) == old).all()
    more = _add(t, d, rng.integers(1, 2**63, 600).tolist())
    t.find_dups(d, np.zeros(1, np.uint64))
    assert len(d.dup_keys) == 9100 and not len(d.dup_young_keys)       # 1,100 > 8,000 / 8: merged
    both = np.concatenate([old, young, more])
    assert (t.find_dups(d, t.rows["key"][both]) == both).all()


def test_quarantined_ids_wait_for_the_purge_before_reuse() -> None:
    t = BlobTable()
    d = t.domain("a", "tpl")
    ids = _add(t, d, list(range(1, 101)))
    t.add_sim(d, np.tile(np.arange(4, dtype=np.uint64), (100, 1)) + ids[:, None].astype(np.uint64), ids)
    _free(t, ids[:10])
    t.reclaim()                                   # 10 ids: below the purge mark, kept out of reuse
    assert sorted(t.quarantine.tolist()) == ids[:10].tolist() and not len(t.free)
    fresh = _add(t, d, [500])
    assert int(fresh[0]) == 100                   # a new id, not a quarantined one
    t.reclaim(force=True)
    assert not len(t.quarantine) and sorted(t.free.tolist()) == ids[:10].tolist()
    assert not np.isin(t.sim_index(d).sources, ids[:10]).any()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 50)), max_size=12), min_size=1, max_size=8),
       st.lists(st.integers(0, 30), min_size=4, max_size=4))
def test_the_young_similarity_entries_answer_as_one_merged_index(commits: list, probe: list) -> None:
    """Entries added commit by commit and queried between commits: the layered index (a
    large one and a young one) names the candidates one fully merged index would."""
    t = BlobTable()
    d = t.domain("a", "tpl")
    fps = np.array([probe], dtype=np.uint64)
    for rows in commits:
        if rows:
            keys = np.array([[k, k + 100] for k, _ in rows], dtype=np.uint64)
            t.add_sim(d, np.concatenate([keys, keys], axis=1), np.array([s for _, s in rows], dtype=np.uint32))
        layered = t.sim_index(d)
        young = len(d.sim_young)
        merged = SimilarityIndex.merged([d.sim, d.sim_young])
        assert [x.tolist() for x in layered.query(fps)] == [x.tolist() for x in merged.query(fps)]
        assert len(layered) == len(merged) and young == len(d.sim_young)
    t._merge_sim(d)                              # a full merge
    assert len(d.sim_young) == 0


def test_a_blob_candidate_with_one_matching_sample_is_found() -> None:
    """Blob indices hold u32 sources: the rows' misses must not count as votes for a
    candidate (they once wrapped to 2^32-1 and outvoted a real single match)."""
    t = BlobTable()
    d = t.domain("a", "tpl")
    t.add_sim(d, np.array([[11, 12, 13, 14]], dtype=np.uint64), np.array([7], dtype=np.uint32))
    cand, votes = t.sim_index(d).query(np.array([[11, 0, 99, 98], [0, 0, 0, 0]], dtype=np.uint64))
    assert cand.tolist() == [7, -1] and votes.tolist() == [1, 0]
