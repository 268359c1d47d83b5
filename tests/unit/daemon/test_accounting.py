"""Accounting through the manager's facade against a fake host: owned, resident and stored
bytes per sandbox, the store's dead bytes shared out pro rata, QEMU's own memory cached."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from azqemu.daemon.manager import Manager
from azqemu.host import memacct, pagemap, procfs
from azqemu.memory.accounting import StoreBytes
from azqemu.virt.clones import SandboxRecord
from azqemu.virt.templates import TemplateMeta

PAGE = 4096
RESIDENT = {101: 10 * PAGE, 102: 20 * PAGE}          # memfd clones: the memfd's allocated bytes
COW_VMA = {"Anonymous": 10 * PAGE, "KSM": 2 * PAGE, "Swap": 4 * PAGE, "Pss": 5000}


class FakeMem:
    def __init__(self, stored: int, compressed: bool = False) -> None:
        self.stored = stored
        self.compressed = compressed
        self.compress_s_total = 0.5
        self.restore_s_total = 0.25
        self.sharing_domain = "d@0"

    def state_bytes(self) -> int:
        return 1000

    def stored_bytes(self, books: Any = None) -> int:
        return self.stored

    def memstats(self, *, reset: bool) -> dict[str, Any]:
        return {"handler": {"faults": 7, "served": 6, "errors": 0}}


@pytest.fixture
def ram_fds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Each memfd clone's RAM as QEMU's /proc/PID/fd/N shows it: a link to a file holding
    RESIDENT[pid] bytes: ``links`` by pid, which procfs.find_ram_fd answers with, and its
    ``lookups`` (the pids asked)."""
    links = {}
    for pid, size in RESIDENT.items():
        ram = tmp_path / f"memfd-{pid}"
        ram.write_bytes(b"\1" * size)
        links[pid] = tmp_path / f"fd-{pid}"
        links[pid].symlink_to(ram)
    lookups: list[int] = []
    monkeypatch.setattr(procfs, "find_ram_fd", lambda pid, backing=None: lookups.append(pid) or links[pid])
    return SimpleNamespace(links=links, lookups=lookups)


@pytest.fixture
def mgr(cfg: Any, host: Any, sandbox_meta_of: Any, template: TemplateMeta,
        monkeypatch: pytest.MonkeyPatch, ram_fds: SimpleNamespace) -> Manager:
    for name, mode, pid in (("m0", "eager", 101), ("m1", "eager", 102), ("c0", "cow", 103), ("down", "eager", None)):
        host.add(name, sandbox_meta_of(ram_mode=mode), pid=pid)
    m = Manager(cfg, host=host)
    for name in ("m0", "m1", "c0", "down"):  # adopted at start with policy manual: give them theirs
        rec = m.registry.record(name)
        m.registry.sandboxes.save(SandboxRecord(**{**rec.__dict__, "policy": "none-cow"}))
    m.memory.mem["m1"] = FakeMem(2000, compressed=True)  # type: ignore[assignment]
    m.memory.mem["c0"] = FakeMem(3000)  # type: ignore[assignment]
    # The store: 1500 bytes allocated in its arenas, 1000 of them live: every store byte
    # of a sandbox costs 1.5.
    totals = StoreBytes(domains=1, sandboxes=2, total_bytes=1000, arena_used_bytes=1500, arena_live_bytes=1000,
                        template_bytes=0, arena_allocated_bytes=1500)
    store = SimpleNamespace(total_bytes=lambda: totals, books=lambda names: (totals, {}),
                            domain_bytes=lambda d: SimpleNamespace(blob_bytes=700, payload_bytes=600, index_bytes=50),
                            owned_bytes_many=lambda names: {})
    monkeypatch.setattr(m.memory, "opened_store", lambda: store)
    monkeypatch.setattr(m.accounting, "ram_resident_bytes", lambda pid, mode: RESIDENT[pid])
    monkeypatch.setattr(procfs, "find_guest_ram", lambda pid, backing=None: (0, 1 << 30))
    monkeypatch.setattr(procfs, "read_vma_smaps", lambda pid, s, e: dict(COW_VMA) if pid == 103 else {"Pss": 1000})
    rollup = {"Pss": 100_000}
    monkeypatch.setattr(procfs, "read_smaps_rollup", lambda pid: dict(rollup))
    m.rollup = rollup  # type: ignore[attr-defined]
    # RssAnon of each QEMU (/proc/PID/status), the copy-on-write clone's RAM copies among it.
    rss_anon = {101: 40_000, 102: 40_000, 103: 40_000 + 10 * PAGE}

    def read_rss_anon(pid: int) -> int:
        if pid not in rss_anon:
            raise FileNotFoundError(f"/proc/{pid}/status")
        return rss_anon[pid]
    monkeypatch.setattr(procfs, "read_rss_anon", read_rss_anon)
    m.rss_anon = rss_anon  # type: ignore[attr-defined]
    # KSM: one physical page per four mappings; zram: one byte of memory per four swapped.
    monkeypatch.setattr(memacct, "read_ksm", lambda: memacct.KsmStat(pages_shared=1, pages_sharing=3))
    monkeypatch.setattr(memacct, "read_zram_total", lambda: {"orig_data_size": 4, "mem_used_total": 1})
    return m


def test_owned_sums_resident_and_stored_with_the_store_overhead(mgr: Manager) -> None:
    mgr.memory.compress_cpu_s["m1"] = 1.5
    mgr.memory.compress_cpu_loops_below_s["m1"] = 1.25
    out = mgr.op_owned()
    rows = out["sandboxes"]
    assert set(rows) == {"m0", "m1", "c0", "down"}
    assert (out["store_bytes"], out["store_live_bytes"]) == (1500, 1000)
    assert out["manager_rss_bytes"] > 0
    # The manager's memory in parts: its own (anon) and the page cache it maps.
    parts = out["manager_memory"]
    assert {"rss_bytes", "anon_bytes", "file_bytes", "shmem_bytes"} <= set(parts) and parts["anon_bytes"] > 0
    # ... and its own books: per-sandbox state, the store's and the templates' indices, glibc's heap.
    assert (parts["sandboxes"], parts["sandbox_state_bytes"]) == (2, 2000)
    assert parts["store_index_bytes"] == 150 and parts["template_index_bytes"] == 0
    assert parts["heap_in_use_bytes"] > 0 and "heap_free_bytes" in parts
    assert rows["m1"]["compress_cpu_s_total"] == 1.5
    assert rows["m1"]["compress_cpu_loops_below_s_total"] == 1.25

    assert rows["m0"] == {"name": "m0", "policy": "none-cow", "ram_mode": "eager",
                               "owned_bytes": 10 * PAGE, "resident_bytes": 10 * PAGE, "stored_bytes": 0,
                               "qemu_own_bytes": 99_000, "compress_s_total": 0.0, "restore_s_total": 0.0,
                               "compress_cpu_s_total": 0.0, "compress_cpu_loops_below_s_total": 0.0,
                               "compress_encoded_bytes_total": 0}
    # memfd clone with pages in the store: 2000 stored bytes x 1.5
    assert (rows["m1"]["resident_bytes"], rows["m1"]["stored_bytes"], rows["m1"]["owned_bytes"]) == \
        (20 * PAGE, 3000, 20 * PAGE + 3000)
    assert (rows["m1"]["compress_s_total"], rows["m1"]["restore_s_total"]) == (0.5, 0.25)
    # Copy-on-write clone: 8 private pages + 2 KSM pages x 1/4 + 4 swapped pages x 1/4 under
    # Linux, plus 3000 store bytes x 1.5 azqemu keeps for it.
    linux = 8 * PAGE + 2 * PAGE // 4 + 4 * PAGE // 4
    assert rows["c0"]["resident_bytes"] == 10 * PAGE
    assert rows["c0"]["owned_bytes"] == linux + 4500
    assert rows["c0"]["stored_bytes"] == linux - 8 * PAGE + 4500
    assert rows["c0"]["qemu_own_bytes"] == 95_000
    # A sandbox whose QEMU is not running owns nothing.
    assert (rows["down"]["owned_bytes"], rows["down"]["qemu_own_bytes"]) == (0, 0)
    assert sum(r["owned_bytes"] for r in rows.values()) == 10 * PAGE + 20 * PAGE + 3000 + linux + 4500


def test_without_ksm_pages_a_cow_clone_is_counted_from_its_page_tables(
        mgr: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    """KSM holding no page anywhere: the anonymous and swapped copies are counted with
    PAGEMAP_SCAN of the RAM range (no smaps, which prints every mapping of QEMU); the same
    formula, with no KSM share. The RAM range is looked up once per QEMU process."""
    monkeypatch.setattr(memacct, "read_ksm", lambda: memacct.KsmStat())
    monkeypatch.setattr(pagemap, "anon_page_counts", lambda pid, hva, n: (10, 4))
    smaps_reads: list[int] = []
    maps_reads: list[int] = []
    monkeypatch.setattr(procfs, "read_vma_smaps", lambda pid, s, e: smaps_reads.append(pid) or {"Pss": 5000})
    monkeypatch.setattr(procfs, "find_guest_ram", lambda pid, backing=None: maps_reads.append(pid) or (0, 1 << 30))
    row = mgr.op_owned(["c0"])["sandboxes"]["c0"]
    assert row["resident_bytes"] == 10 * PAGE
    assert row["owned_bytes"] == 10 * PAGE + 4 * PAGE // 4 + 4500
    assert row["qemu_own_bytes"] == 95_000          # smaps still gives QEMU's Pss, once per refresh
    mgr.op_owned(["c0"])
    assert smaps_reads == [103] and maps_reads == [103]


def test_a_memfd_clones_ram_file_is_found_once_per_qemu_process(
        mgr: Manager, ram_fds: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QEMU's open files are listed once per process to find the RAM memfd; later samples
    stat the same fd, after checking that its link still names the same file."""
    lookups, link = ram_fds.lookups, ram_fds.links[101]
    for _ in range(3):
        assert mgr.op_owned(["m0"])["sandboxes"]["m0"]["resident_bytes"] == 10 * PAGE
    assert lookups == [101]
    (tmp_path / "memfd-101").write_bytes(b"\1" * 12 * PAGE)         # the guest wrote more
    assert mgr.op_owned(["m0"])["sandboxes"]["m0"]["resident_bytes"] == 12 * PAGE
    assert lookups == [101]
    # The fd number names another file now: looked up again.
    other = tmp_path / "memfd-101-new"
    other.write_bytes(b"\1" * 3 * PAGE)
    link.unlink()
    link.symlink_to(other)
    assert mgr.op_owned(["m0"])["sandboxes"]["m0"]["resident_bytes"] == 3 * PAGE
    assert lookups == [101, 101]
    # Another QEMU process for the name (a new pid): looked up again.
    monkeypatch.setattr(mgr.accounting, "qemu_pid", lambda name: 102)
    assert mgr.op_owned(["m0"])["sandboxes"]["m0"]["resident_bytes"] == 20 * PAGE
    assert lookups == [101, 101, 102]
    # QEMU gone between the pid and the files: nothing resident, no error.
    monkeypatch.setattr(procfs, "find_ram_fd", lambda pid, backing=None: tmp_path / "gone")
    monkeypatch.setattr(mgr.accounting, "qemu_pid", lambda name: 101)
    link.unlink()
    assert mgr.op_owned(["m0"])["sandboxes"]["m0"]["resident_bytes"] == 0


def test_resident_bytes_find_the_ram_once_per_qemu_process(
        mgr: Manager, ram_fds: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pressure ablation's per-tick read: the memfd's fd and the copy-on-write RAM range
    are looked up once per QEMU process, as for owned; unknown or stopped sandboxes: None."""
    monkeypatch.setattr(pagemap, "anon_page_counts", lambda pid, hva, n: (7, 0))
    maps_reads: list[int] = []
    monkeypatch.setattr(procfs, "find_guest_ram", lambda pid, backing=None: maps_reads.append(pid) or (0, 1 << 30))
    acct = mgr.accounting
    for _ in range(3):
        assert acct.resident_bytes("m0") == 10 * PAGE
        assert acct.resident_bytes("c0") == 7 * PAGE
    assert ram_fds.lookups == [101] and maps_reads == [103]
    assert acct.resident_bytes("down") is None and acct.resident_bytes("nope") is None


def test_a_destroyed_sandboxs_caches_go_with_it(mgr: Manager) -> None:
    """Per-name caches are dropped when the sandbox is destroyed, not at a full sweep of
    every sandbox (which a daemon that only serves one sandbox's metrics never makes)."""
    acct = mgr.accounting
    mgr.op_owned(["m0", "m1", "c0"])
    caches = (acct._ram_fd, acct._ram_range, acct._qemu_own_cache)
    assert "m0" in acct._ram_fd and "c0" in acct._ram_range and "c0" in acct._qemu_own_cache
    del mgr.memory.mem["c0"]        # a stand-in for its store state: nothing to cancel or release
    mgr.lifecycle.destroy("m0")
    mgr.lifecycle.destroy("c0")
    assert not any(n in cache for cache in caches for n in ("m0", "c0"))
    assert "m1" in acct._qemu_own_cache


def test_owned_of_named_sandboxes_reports_unknown_ones_as_errors(mgr: Manager) -> None:
    rows = mgr.op_owned(["m0", "nope"])["sandboxes"]
    assert rows["nope"] == {"name": "nope", "error": "unknown sandbox 'nope'"}
    assert rows["m0"]["owned_bytes"] == 10 * PAGE


def test_without_a_store_there_is_no_overhead(mgr: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mgr.memory, "opened_store", lambda: None)
    out = mgr.op_owned(["m1"])
    assert (out["store_bytes"], out["store_live_bytes"]) == (0, 0)
    assert out["sandboxes"]["m1"]["stored_bytes"] == 2000


def test_qemu_own_bytes_are_read_again_only_after_the_refresh_period(mgr: Manager) -> None:
    assert mgr.op_owned(["m0"])["sandboxes"]["m0"]["qemu_own_bytes"] == 99_000
    mgr.rollup["Pss"] = 200_000  # type: ignore[attr-defined]
    assert mgr.op_owned(["m0"])["sandboxes"]["m0"]["qemu_own_bytes"] == 99_000  # cached
    mgr.accounting._qemu_own_cache.clear()
    assert mgr.op_owned(["m0"])["sandboxes"]["m0"]["qemu_own_bytes"] == 199_000


def test_qemu_own_bytes_follow_its_anonymous_memory_between_two_reads(mgr: Manager) -> None:
    """Between two PSS reads QEMU's own figure moves with its anonymous memory outside guest
    RAM (TCG's translation cache grows there); the RAM's own copies do not move it."""
    assert mgr.op_owned(["m0", "c0"])["sandboxes"]["c0"]["qemu_own_bytes"] == 95_000
    mgr.rss_anon[101] += 30 * PAGE        # type: ignore[attr-defined]  # m0's translation cache grew
    mgr.rss_anon[103] += 5 * PAGE         # type: ignore[attr-defined]  # c0: as much outside RAM ...
    rows = mgr.op_owned(["m0", "c0"])["sandboxes"]
    assert rows["m0"]["qemu_own_bytes"] == 99_000 + 30 * PAGE
    assert rows["c0"]["qemu_own_bytes"] == 95_000 + 5 * PAGE
    mgr.rss_anon[103] -= 8 * PAGE         # type: ignore[attr-defined]  # ... and shrank below the read
    assert mgr.op_owned(["c0"])["sandboxes"]["c0"]["qemu_own_bytes"] == 95_000 - 3 * PAGE
    # A status that cannot be read leaves the last figure as it was.
    del mgr.rss_anon[101]                 # type: ignore[attr-defined]
    assert mgr.op_owned(["m0"])["sandboxes"]["m0"]["qemu_own_bytes"] == 99_000


def test_list_and_dominfo_describe_state_memory_and_machine(mgr: Manager, host: Any) -> None:
    host.doms["m0"].suspend()
    host.doms.pop("m0")  # the domain vanished after the manager started
    rows = {r["name"]: r for r in mgr.op_list()}
    assert (rows["m0"]["domain_state"], rows["m0"]["qemu_pid"], rows["m0"]["resident_bytes"]) == \
        ("gone", None, None)
    assert (rows["m0"]["state"], rows["m0"]["failed_reason"]) == ("running", None)   # lifecycle: as recorded
    assert (rows["m1"]["state"], rows["m1"]["resident_bytes"], rows["m1"]["stored_bytes"],
            rows["m1"]["compressed"]) == ("running", 20 * PAGE, 2000, True)
    assert rows["down"]["resident_bytes"] is None  # no QEMU pid
    info = mgr.op_dominfo("c0")
    assert (info["mem_mib"], info["vcpus"], info["machine"], info["accel"]) == (64, 1, "pc", "tcg")
    assert info["stored_bytes"] == 3000 and info["compressed"] is False


def test_domstats_gives_state_bytes_and_counters(mgr: Manager) -> None:
    st = mgr.op_domstats("m1")
    assert (st["name"], st["state"], st["compressed"], st["stored_bytes"]) == ("m1", "running", True, 2000)
    assert st["resident_bytes"] == 20 * PAGE and st["owned_bytes"] == 20 * PAGE + 2000
    assert (st["compress_count"], st["restore_count"]) == (0, 0)
    assert (st["faults"], st["faults_served"], st["fault_errors"]) == (7, 6, 0)
    assert {"phase", "policy", "domain_state"} <= set(st)


def test_ping_reports_the_managers_memory_in_parts_read_at_most_once_a_second(mgr: Manager) -> None:
    p = mgr.op_ping()
    parts = p["manager_memory"]
    assert p["manager_rss_bytes"] == parts["rss_bytes"] > 0
    assert {"anon_bytes", "file_bytes", "shmem_bytes", "heap_free_bytes", "store_index_bytes",
            "template_index_bytes", "sandbox_state_bytes", "sandboxes"} <= set(parts)
    assert mgr.op_ping()["manager_memory"] is parts                 # cached ...
    assert mgr.accounting.manager_memory_cached(max_age_s=0.0) is not parts   # ... for a while


def test_the_arenas_dead_bytes_are_shared_out_pro_rata() -> None:
    tb = StoreBytes(domains=1, sandboxes=2, total_bytes=1000, arena_used_bytes=1500,
                    arena_live_bytes=1000, template_bytes=0, arena_allocated_bytes=1250)
    assert tb.dead_overhead == 1.25
    assert StoreBytes(0, 0, 0, 0, 0, 0).dead_overhead == 1.0       # an empty store
    # Compacted past what the books hold (allocated below live): no negative share.
    assert StoreBytes(1, 1, 1000, 900, 1000, 0, arena_allocated_bytes=900).dead_overhead == 1.0


def test_a_compressed_clones_copies_are_counted_again_only_when_something_moved(
        mgr: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compressed copy-on-write clone's guest is paused: its copies are counted once and
    that count is given back until its vCPUs run, the manager serves a fault for it, it is
    compressed again, it is no longer compressed, or STILL_COPIES_MAX_AGE_S passes."""
    from azqemu.daemon import accounting
    from azqemu.host import schedstat, threads
    monkeypatch.setattr(memacct, "read_ksm", lambda: memacct.KsmStat())
    scans: list[int] = []
    copies = [10]
    monkeypatch.setattr(pagemap, "anon_page_counts", lambda pid, hva, n: scans.append(pid) or (copies[0], 0))
    run_ns, faults, now = [1000], [0], [100.0]
    monkeypatch.setattr(threads, "threads_named", lambda pid, comm, prefix=False: [7])
    monkeypatch.setattr(schedstat, "wait_of", lambda pid, tids: schedstat.SchedWait(0, 1, run_ns[0]))
    monkeypatch.setattr(accounting.time, "monotonic", lambda: now[0])
    mem = FakeMem(3000, compressed=True)
    mem.handler = SimpleNamespace(fault_count=lambda: faults[0])  # type: ignore[attr-defined]
    mgr.memory.mem["c0"] = mem  # type: ignore[assignment]
    state = ["compressed"]
    monkeypatch.setattr(mgr.registry, "state_of", lambda name: (state[0], None))

    def resident() -> int:
        return int(mgr.op_owned(["c0"])["sandboxes"]["c0"]["resident_bytes"])

    assert resident() == 10 * PAGE and len(scans) == 1
    copies[0] = 12                   # not seen: nothing that could change them moved
    assert resident() == 10 * PAGE and len(scans) == 1
    for move in (lambda: run_ns.__setitem__(0, 2000),                  # its vCPUs ran
                 lambda: faults.__setitem__(0, 1),                     # a fault was served
                 lambda: mgr.memory.compress_count.__setitem__("c0", 1),   # compressed again
                 lambda: now.__setitem__(0, now[0] + accounting.STILL_COPIES_MAX_AGE_S)):
        copies[0] += 1
        move()
        assert resident() == copies[0] * PAGE
        assert resident() == copies[0] * PAGE       # and kept again
    n = len(scans)
    state[0] = "running"             # resumed: counted at every read
    assert resident() == copies[0] * PAGE and resident() == copies[0] * PAGE and len(scans) == n + 2
    mem.compressed = False
    state[0] = "compressed"
    resident()
    assert len(scans) == n + 3 and "c0" not in mgr.accounting._still
