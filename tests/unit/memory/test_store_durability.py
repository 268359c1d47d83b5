"""The store's write-ahead order without killing anything: what a crash at a given moment would
leave (a copy of the directory taken then), ENOSPC at encode and at flush, arena id reuse,
owners and tombstones. The kill -9 versions are in test_crash_points.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash

from azqemu.errors import StoreError
from azqemu.memory import arena as arena_mod
from azqemu.memory import persist
from azqemu.memory.arena import ARENA_HEADER_BYTES
from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.persist import STORE_FILE, StoreFull, read_store
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage

from .conftest import SMALL_ARENA, text_page


def _pages(seed: int, n: int) -> np.ndarray:
    return np.stack([text_page(seed * 10_000 + i) for i in range(n)])


def _crash_copy(src: Path, dst: Path) -> Path:
    """The directory as a process killed now would leave it (tmpfs keeps what was written)."""
    shutil.copytree(src, dst)
    return dst


def _decode_all(root: Path, tpl, name: str) -> tuple[np.ndarray, np.ndarray]:
    with PageStore(root, templates=(tpl,)) as s:
        s.check_consistency()
        idx = s.stored_pages(name)
        return idx, s.decode(name, idx)


def test_reclaim_waits_for_a_generation_that_no_longer_names_the_space(store_dir, small_template,
                                                                       tmp_path) -> None:
    idx = np.arange(200, dtype=np.int64)
    old, new = _pages(1, 200), _pages(2, 200)
    root = store_dir / "s"
    with PageStore(root, arena_bytes=SMALL_ARENA) as s:
        s.encode("a", "d", idx, old, small_template)
        s.flush()
        held_before = s.total_bytes().arena_allocated_bytes
        s.encode("a", "d", idx, new, small_template)       # the old blobs die, in memory
        s.encode("b", "d", idx, new, small_template)
        assert s._arenas.pending_release                    # not punched: generation 1 names them
        assert s.total_bytes().arena_allocated_bytes >= held_before
        crashed = _crash_copy(root, tmp_path / "crash1")
        s.flush()
        assert not s._arenas.pending_release and s.generation == 2
        after = _crash_copy(root, tmp_path / "crash2")
    got_idx, got = _decode_all(crashed, small_template, "a")   # generation 1, whole
    np.testing.assert_array_equal(got_idx, idx)
    np.testing.assert_array_equal(got, old)
    with PageStore(crashed, templates=(small_template,)) as s:
        assert s.sandboxes() == ["a"]
    got_idx, got = _decode_all(after, small_template, "a")
    np.testing.assert_array_equal(got, new)


def test_compacted_arena_stays_until_the_new_locations_are_durable(store_dir, small_template, tmp_path) -> None:
    """A free by one sandbox compacts an arena another sandbox's durable entries name: the
    arena file stays until the generation with the moved blobs is committed."""
    idx = np.arange(120, dtype=np.int64)
    root = store_dir / "s"
    with PageStore(root, arena_bytes=ARENA_HEADER_BYTES + (256 << 10)) as s:
        # Interleave two sandboxes' blobs in the same arenas.
        for k in range(4):
            s.encode("keep", "d", idx[k::4], _pages(10 + k, 30), small_template)
            s.encode("gone", "d", idx[k::4] + 1000, _pages(20 + k, 30), small_template)
        s.flush()
        expect_idx, expect = s.stored_pages("keep"), s.decode("keep", s.stored_pages("keep"))
        files_before = {p.name for p in root.glob("arena-*")}
        s.free_sandbox("gone")
        # What the free's compaction check does once tmpfs holds twice the live bytes: move
        # the live blobs of every arena (the other sandbox's) and drop the arenas.
        for aid in sorted(s._arenas.arenas):
            s.compact_arena(aid)
        assert set(s._arenas.pending_drop) == {int(n[6:12]) for n in files_before}
        assert {p.name for p in root.glob("arena-*")} >= files_before     # nothing unlinked yet
        crashed = _crash_copy(root, tmp_path / "crash")
        s.flush()
        assert not s._arenas.pending_drop
        assert not any((root / n).exists() for n in files_before - {a.path.name for a in s._arenas.arenas.values()})
    for where in (crashed, root):
        got_idx, got = _decode_all(where, small_template, "keep")
        np.testing.assert_array_equal(got_idx, expect_idx)
        np.testing.assert_array_equal(got, expect)


def test_uncommitted_files_are_swept_and_arena_ids_reused(store_dir, small_template, tmp_path) -> None:
    """A crash after new arenas and index files were written but before the store file named
    them: reopen sweeps them, and the next arena takes a free id (no FileExistsError)."""
    idx = np.arange(64, dtype=np.int64)
    root = store_dir / "s"
    with PageStore(root, arena_bytes=ARENA_HEADER_BYTES + (16 << 10)) as s:
        s.encode("a", "d", idx, _pages(3, 64), small_template)
        s.flush()
        named = sorted(p.name for p in root.iterdir())
        s.encode("b", "d", idx, _pages(4, 64), small_template)   # new arenas, not committed
        crashed = _crash_copy(root, tmp_path / "crash")
    (crashed / "sbx-0000000000000000-g9.azqidx").write_bytes(b"x")
    (crashed / "store.azq.tmp").write_bytes(b"x")
    assert sorted(p.name for p in crashed.iterdir()) != named
    with PageStore(crashed, templates=(small_template,)) as s:
        assert sorted(p.name for p in crashed.iterdir()) == named
        s.encode("b", "d", idx, _pages(4, 64), small_template)   # reuses the swept ids
        s.flush()
        np.testing.assert_array_equal(s.decode("b", idx), _pages(4, 64))


def test_arena_ids_stay_small_over_many_compactions(store_dir, small_template) -> None:
    idx = np.arange(32, dtype=np.int64)
    with PageStore(store_dir, arena_bytes=ARENA_HEADER_BYTES + (8 << 10)) as s:
        for round_ in range(60):
            s.encode("a", "d", idx, _pages(round_, 32), small_template)
            if round_ % 3 == 0:
                s.flush()
        s.flush()
        assert max(s._arenas.arenas) < 64
        np.testing.assert_array_equal(s.decode("a", idx), _pages(59, 32))


def test_arena_id_space_is_bounded(store_dir, monkeypatch) -> None:
    monkeypatch.setattr(arena_mod, "MAX_ARENAS", 3)
    a = arena_mod.ArenaSet(store_dir, os.urandom(16), ARENA_HEADER_BYTES + PAGE_SIZE)
    a.append([b"x" * 4000] * 3)
    with pytest.raises(StoreFull, match="arena ids"):
        a.append([b"x" * 4000])
    a.close()


def _fail_writes(monkeypatch, module) -> dict[str, bool]:
    state = {"on": False}
    real_write, real_pwrite = os.write, os.pwrite

    def write(fd: int, data) -> int:
        if state["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def pwrite(fd: int, data, offset: int) -> int:
        if state["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(module.os, "write", write)
    monkeypatch.setattr(module.os, "pwrite", pwrite)
    return state


def test_enospc_at_flush_keeps_the_previous_generation(store_dir, small_template, monkeypatch,
                                                         tmp_path) -> None:
    idx = np.arange(100, dtype=np.int64)
    root = store_dir / "s"
    with PageStore(root, arena_bytes=SMALL_ARENA) as s:
        s.encode("a", "d", idx, _pages(5, 100), small_template)
        s.flush()
        s.encode("a", "d", idx, _pages(6, 100), small_template)
        s.encode("b", "d", idx, _pages(7, 100), small_template)
        files = sorted(p.name for p in root.iterdir())
        full = _fail_writes(monkeypatch, persist)
        full["on"] = True
        with pytest.raises(StoreFull, match="page store full"):
            s.flush()
        assert isinstance(StoreFull("x", "y"), StoreError)
        assert s.generation == 1 and s._arenas.pending_release      # nothing reclaimed
        # No temporary or new file left; the reserve was spent on a second try, in vain.
        assert sorted(p.name for p in root.iterdir()) == [f for f in files if f != persist.RESERVE_FILE]
        crashed = _crash_copy(root, tmp_path / "crash")             # what a crash now would leave
        with PageStore(crashed, templates=(small_template,)) as other:
            assert other.sandboxes() == ["a"]
            np.testing.assert_array_equal(other.decode("a", idx), _pages(5, 100))
        full["on"] = False
        s.flush()
        assert s.generation == 2 and (root / persist.RESERVE_FILE).exists()   # taken back
    with PageStore(root, templates=(small_template,)) as s:
        np.testing.assert_array_equal(s.decode("a", idx), _pages(6, 100))
        np.testing.assert_array_equal(s.decode("b", idx), _pages(7, 100))


def test_enospc_at_encode_stores_nothing(store_dir, small_template, monkeypatch) -> None:
    idx = np.arange(100, dtype=np.int64)
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as s:
        s.encode("a", "d", idx, _pages(8, 100), small_template)
        full = _fail_writes(monkeypatch, arena_mod)
        full["on"] = True
        with pytest.raises(StoreFull):
            s.encode("a", "d", idx, _pages(9, 100), small_template)
        with pytest.raises(StoreFull):
            s.encode("c", "d", idx, _pages(9, 100), small_template)
        assert s.sandboxes() == ["a"]
        s.check_consistency()
        np.testing.assert_array_equal(s.decode("a", idx), _pages(8, 100))
        full["on"] = False
        s.encode("a", "d", idx, _pages(9, 100), small_template)
        s.flush()
        np.testing.assert_array_equal(s.decode("a", idx), _pages(9, 100))
        s.check_consistency()


def test_owner_binds_entries_and_tombstones_persist(store_dir, small_template) -> None:
    idx = np.arange(10, dtype=np.int64)
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as s:
        s.encode("x", "d", idx, _pages(1, 10), small_template, owner="uuid-1")
        with pytest.raises(StoreError, match="belong to domain UUID uuid-1"):
            s.encode("x", "d", idx, _pages(2, 10), small_template, owner="uuid-2")
        s.flush()
    with PageStore(store_dir) as s:
        assert s.owner_of("x") == "uuid-1"
        s.free_sandbox("x", tombstone=True)
        s.flush()
    with PageStore(store_dir) as s:
        assert s.sandboxes() == [] and s.tombstones() == {"x": "uuid-1"}
        s.encode("x", "d", idx, _pages(2, 10), small_template, owner="uuid-2")
        assert s.tombstones() == {} and s.owner_of("x") == "uuid-2"
        s.flush()


def test_domains_and_templates_nothing_uses_go(store_dir, small_template, small_set) -> None:
    """A daemon that runs for weeks, through templates made and deleted, keeps no record of
    the sharing domains and templates it is done with (nor writes them into every generation);
    the pages it still holds decode exactly, and a domain made later takes a free number."""
    other = TemplateImage(page_idx=small_set.template_idx, pages=small_set.template_pages ^ np.uint8(0x5A),
                          size_bytes=small_set.size_bytes)
    idx = np.arange(10, dtype=np.int64)
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as s:
        s.encode("a", "d1", idx, _pages(1, 10), small_template)
        s.encode("b", "d2", idx, _pages(2, 10), other)
        s.encode("c", "d1", idx + 20, _pages(3, 10), small_template)
        s.drop_template(other.template_id)          # still used by b: kept
        s.free_sandbox("b", tombstone=True)         # d2's last sandbox
        assert s.domains() == ["d1"]
        s.drop_template(other.template_id)          # the template was deleted
        s.flush()
    meta, _ = read_store(store_dir / STORE_FILE)
    assert [d["name"] for d in meta["domains"]] == ["d1"] and list(meta["templates"]) == [small_template.template_id]
    for name, at, seed in (("a", idx, 1), ("c", idx + 20, 3)):
        got_idx, got = _decode_all(store_dir, small_template, name)
        assert np.array_equal(got_idx, at) and np.array_equal(got, _pages(seed, 10))
    with PageStore(store_dir, templates=(small_template,)) as s:
        s.encode("e", "d3", idx, _pages(4, 10), small_template)   # number 1 again, d2's
        s.flush()
    got_idx, got = _decode_all(store_dir, small_template, "e")
    assert np.array_equal(got, _pages(4, 10))


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A real 6 MiB tmpfs (root only): ENOSPC from the kernel, not from a fake."""
    import subprocess
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _random_pages(seed: int, n: int) -> np.ndarray:
    """Pages that compress to ~2 KiB: half random, half zero."""
    out = np.zeros((n, PAGE_SIZE), np.uint8)
    out[:, :2048] = np.random.default_rng(seed).integers(0, 256, (n, 2048), dtype=np.uint8)
    return out


@pytest.mark.root
def test_real_enospc_keeps_every_durable_page_and_recovers(small_tmpfs: Path, small_template,
                                                           tmp_path: Path) -> None:
    """Fill a real small tmpfs: every StoreFull (at encode or at flush) leaves the last durable
    generation whole; freeing sandboxes and committing (on the reserve) gives the space back
    and the store works again."""
    root = small_tmpfs / "store"
    durable: dict[str, np.ndarray] = {}
    fulls = 0
    with PageStore(root, arena_bytes=ARENA_HEADER_BYTES + (256 << 10)) as s:
        assert (root / persist.RESERVE_FILE).stat().st_blocks * 512 >= persist.RESERVE_BYTES
        for k in range(40):
            name, pages = f"s{k}", _random_pages(k, 64)
            try:
                s.encode(name, "d", np.arange(64), pages, small_template)
                s.flush()
            except StoreFull:
                fulls += 1
                if name in s.sandboxes():
                    s.discard(name, np.arange(64))       # the caller keeps its pages
                break
            durable[name] = pages
        assert fulls == 1 and len(durable) >= 3
        crashed = _crash_copy(root, tmp_path / "crash")
        for name, pages in durable.items():
            np.testing.assert_array_equal(s.decode(name, np.arange(64)), pages)
        # Recover: destroy most sandboxes; the commit that frees them runs on the reserve.
        keep = sorted(durable)[:2]
        for name in sorted(durable)[2:]:
            s.free_sandbox(name)
        s.flush()
        s.encode("again", "d", np.arange(64), _random_pages(99, 64), small_template)
        s.flush()
        assert (root / persist.RESERVE_FILE).exists()              # taken back
        for name in keep:
            np.testing.assert_array_equal(s.decode(name, np.arange(64)), durable[name])
    with PageStore(crashed, templates=(small_template,)) as s:        # the state at StoreFull
        assert sorted(s.sandboxes()) == sorted(durable)
        for name, pages in durable.items():
            np.testing.assert_array_equal(s.decode(name, np.arange(64)), pages)
    with PageStore(root, templates=(small_template,)) as s:
        assert sorted(s.sandboxes()) == sorted([*keep, "again"])
        np.testing.assert_array_equal(s.decode("again", np.arange(64)), _random_pages(99, 64))
        s.check_consistency()


def test_injected_store_full_at_commit(store_dir, small_template, monkeypatch) -> None:
    """AZQ_FAIL_AT=commit@2*2: the second commit and its retry on the reserve fail as ENOSPC
    would; the one after succeeds (the hook the integration test uses in the daemon)."""
    import importlib

    from azqemu.memory import crashpoint
    monkeypatch.setenv("AZQ_FAIL_AT", "commit@2*2")
    importlib.reload(crashpoint)
    try:
        idx = np.arange(20, dtype=np.int64)
        with PageStore(store_dir, arena_bytes=SMALL_ARENA) as s:
            s.encode("a", "d", idx, _pages(1, 20), small_template)
            s.flush()
            s.encode("a", "d", idx, _pages(2, 20), small_template)
            with pytest.raises(StoreFull, match="injected"):
                s.flush()
            assert s.generation == 1
            s.flush()
            assert s.generation == 2
        with PageStore(store_dir, templates=(small_template,)) as s:
            np.testing.assert_array_equal(s.decode("a", idx), _pages(2, 20))
    finally:
        monkeypatch.delenv("AZQ_FAIL_AT")
        importlib.reload(crashpoint)


def test_free_ids_are_binary_and_a_version_2_store_still_opens(store_dir, small_template, tmp_path) -> None:
    """The free blob ids travel in the store file's binary part (version 3: a JSON list of them
    was dumped at every commit); a store written by version 2, the list in the JSON, opens
    with the same free ids and decodes every page."""
    with PageStore(store_dir, templates=(small_template,)) as s:
        s.encode("a", "d", np.arange(40), _pages(1, 40), small_template)
        s.encode("b", "d", np.arange(40), _pages(2, 40), small_template)
        s.flush()
        s.free_sandbox("b")
        s.flush()                   # "b"'s blob ids are free (or quarantined: free once reopened)
        free = np.union1d(s._table.free, s._table.quarantine).astype(np.int64)
        want = s.decode("a", s.stored_pages("a"))
    assert len(free) > 0
    meta, body = persist.read_store(store_dir / persist.STORE_FILE)
    assert "free" not in meta and meta["free_count"] == len(free)
    tail = np.frombuffer(body, dtype="<u4", count=meta["free_count"], offset=len(body) - 4 * meta["free_count"])
    np.testing.assert_array_equal(tail, free)
    with PageStore(store_dir, templates=(small_template,)) as s:
        np.testing.assert_array_equal(np.sort(s._table.free.astype(np.int64)), free)
    # The same generation as version 2 wrote it.
    old = _crash_copy(store_dir, tmp_path / "v2")
    v2_meta = {k: v for k, v in meta.items() if k != "free_count"}
    v2_meta["free"] = tail.astype(int).tolist()
    js = json.dumps(v2_meta, sort_keys=True).encode()
    rest = bytes(body[:len(body) - 4 * meta["free_count"]])     # the binary part less the free ids
    h = xxhash.xxh64(js)
    h.update(rest)
    (old / persist.STORE_FILE).write_bytes(
        persist._STORE_HEAD.pack(persist.STORE_MAGIC, 2, 0, len(js), len(rest), h.intdigest()) + js + rest)
    with PageStore(old, templates=(small_template,)) as s:
        s.check_consistency()
        np.testing.assert_array_equal(np.sort(s._table.free.astype(np.int64)), free)
        np.testing.assert_array_equal(s.decode("a", s.stored_pages("a")), want)
