"""The Linux configuration: the baseline azqemu is measured against, tuned as an operator would.

KSM merges identical private anonymous pages across the copy-on-write clones, a zram swap
device compresses what is swapped out, and each idle sandbox's guest RAM is pushed out
proactively (process_madvise MADV_PAGEOUT, or memory-cgroup reclaim), because waiting for
memory pressure would leave an idle sandbox resident. ``LinuxConfig`` sets this up and tears
it down, leaving the host exactly as it found it:

    with LinuxConfig() as cfg:              # records every value it will touch, then tunes
        ...                                 # run clones with private (share=off) RAM
        pageout(qemu_pid)                   # when a sandbox goes idle
        wait_ksm_converged()
    # swapoff (pages come back), zram device removed, KSM unmerged and restored, sysctls back

Choices (what a careful operator does, and why):
- zram compressor lzo-rle: the kernel's default, a better ratio than lz4 on guest pages at a
  similar speed (lz4 decompresses faster, zstd compresses better but costs 3-5x the CPU per
  page and is not built into every kernel: this host offers lzo-rle, lzo, lz4). The first of
  ZRAM_ALGORITHMS the kernel offers is used; the measurement DESIGN.md's linux_model compares
  against is lzo-rle too.
- zram disk size: what the sandboxes can ever swap, their guests' RAM together
  (``zram_disksize_for``), capped at half of MemTotal; half of MemTotal when no fleet is named.
  The disk size bounds the uncompressed data, and zram allocates its table (16 bytes a page of
  disk size) when the size is set, whatever it later holds: half of this host's 24 GiB cost
  48 MiB of vmalloc before a page went out, against 16 MiB for the 4 GiB of eight 512 MiB
  guests. Priority above every existing swap device so zram is used first.
- vm.swappiness=180 and vm.page-cluster=0: the values zram users run with (swap-in from zram
  is cheap, readahead of neighbouring swap slots is useless for it).
- zswap off while zram is the swap device (zswap in front of zram compresses twice).
- KSM: run=1, pages_to_scan=KSM_PAGES_TO_SCAN every KSM_SLEEP_MS, use_zero_pages=1 (zero
  pages map the shared zero page instead of a KSM stable node), advisor off so the figures do
  not depend on its auto-tuning.
- Teardown writes run=2 (unmerge) and then run=0 when KSM was off before: run=0 alone only
  stops ksmd and leaves merged pages in every process it touched (other users' too, since
  anything MADV_MERGEABLE is fair game), which is not the host we found. When KSM was already
  running, its settings are restored and nothing is unmerged.

What MADV_PAGEOUT does and does not take (measured here, Linux 6.18): it reclaims only pages
mapped once, so KSM-merged pages (mapped by several clones) stay resident, shared, which is
what the policy wants; a copy-on-write clone's private copies go to zram; template pages a
clone maps but never wrote stay in the template file's page cache unless this clone is their
only mapper (then the shmem page itself goes to swap and the next clone to touch it swaps it
in). 32 MiB of private pages went out in 45 ms, and lzo-rle stored half-zero pages at 1.87x
including zram's allocator overhead.

Measured with two real 512 MiB TCG guests (anonymous RAM, booted, the workspace tests run):
126 MiB resident each; KSM converged in 2.4 s (3 full scans) to 57 MiB owned each (67 MiB
merged between them, 30 MiB merged into the zero page); MADV_PAGEOUT of the whole RAM took
38 ms and sent the remaining 29 MiB of private pages to zram (2.15x), leaving 42 MiB owned;
the next tool call took 0.53 s as before. The smaps estimate matched the page-exact
accounting within 0.1 MiB. Note: after teardown, pages KSM had merged into the zero page
(use_zero_pages=1) stay mapped to it (run=2 does not give them private copies); that is what
a never-written page looks like, and no host setting differs.

A record of the previous values is written before anything changes (``RECORD_NAME`` in
RECORD_DIR, /run: host-wide like what it records, whatever AZQ_RUN_DIR a process uses), so ``LinuxConfig.recover()`` can restore a host after a crash of the process
that set it up. Only one LinuxConfig can be active on a host (a lock file).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from azqemu.errors import HostError, NotRoot
from azqemu.host.memacct import KsmStat, read_ksm, read_zram_mm_stat
from azqemu.pages import PAGE_SIZE

KSM_DIR = Path("/sys/kernel/mm/ksm")
ZSWAP_DIR = Path("/sys/module/zswap/parameters")
ZRAM_CONTROL = Path("/sys/class/zram-control")
SYSCTLS = {"swappiness": Path("/proc/sys/vm/swappiness"), "page-cluster": Path("/proc/sys/vm/page-cluster")}
# KSM, swap and sysctls are host-wide, so the record and the lock are too (not per AZQ_RUN_DIR:
# two test sessions with their own run directories must still exclude each other).
RECORD_DIR = Path("/run")
RECORD_NAME = "azqemu-linux-config.json"
LOCK_PATH = Path("/run/azqemu-linux-config.lock")

# Tuning (see the module docstring for the reasons).
ZRAM_ALGORITHMS = ("lzo-rle", "lz4", "zstd", "lzo")
ZRAM_SWAP_PRIORITY = 100
SWAPPINESS = 180
PAGE_CLUSTER = 0
# ksmd scans KSM_PAGES_TO_SCAN pages per wake-up and sleeps KSM_SLEEP_MS between: 2000 pages
# / 20 ms = 100k pages/s = 400 MiB/s of scanning, a full pass over 16 clones of 512 MiB in
# ~20 s, for roughly a third of one core while it has work. The kernel default (100 / 20 ms)
# would take 7 minutes per pass, longer than a benchmark run.
KSM_PAGES_TO_SCAN = 2000
KSM_SLEEP_MS = 20
KSM_UNMERGE_TIMEOUT_S = 120.0
# Only tunables are recorded and compared; counters (full_scans, pages_*) change by themselves.
KSM_TUNABLES = ("run", "pages_to_scan", "sleep_millisecs", "use_zero_pages", "merge_across_nodes",
                "max_page_sharing", "smart_scan", "advisor_mode", "advisor_max_cpu",
                "advisor_min_pages_to_scan", "advisor_max_pages_to_scan", "advisor_target_scan_time",
                "stable_node_chains_prune_millisecs")


# ---------------------------------------------------------------------------------------
# Reading and writing kernel knobs
# ---------------------------------------------------------------------------------------

def read_knob(path: Path) -> str:
    return path.read_text().strip()


def write_knob(path: Path, value: str | int) -> None:
    try:
        with open(path, "w") as f:
            f.write(f"{value}\n")
    except OSError as err:
        raise HostError(f"cannot write {value} to {path}: {err.strerror or err}") from err


def _selected(value: str) -> str:
    """'[none] scan-time' -> 'none' (sysfs lists choices with the active one in brackets)."""
    m = re.search(r"\[([^\]]+)\]", value)
    return m.group(1) if m else value


@dataclass(frozen=True)
class SwapEntry:
    name: str
    kind: str
    size_kib: int
    priority: int


def read_swaps(path: Path = Path("/proc/swaps")) -> list[SwapEntry]:
    entries = []
    for line in path.read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 5:
            entries.append(SwapEntry(cols[0], cols[1], int(cols[2]), int(cols[4])))
    return entries


def zram_devices() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for dev in sorted(Path("/sys/block").glob("zram*")):
        info = {}
        for attr in ("disksize", "initstate", "comp_algorithm", "mem_limit"):
            try:
                v = read_knob(dev / attr)
            except OSError:
                continue
            info[attr] = _selected(v) if attr == "comp_algorithm" else v
        out[dev.name] = info
    return out


@dataclass
class HostSnapshot:
    """Everything LinuxConfig may change, as comparable values."""

    ksm: dict[str, str]
    zswap: dict[str, str]
    sysctl: dict[str, str]
    swaps: list[dict[str, Any]]
    zram: dict[str, dict[str, str]]
    zram_loaded: bool

    @classmethod
    def take(cls) -> HostSnapshot:
        ksm = {}
        for name in KSM_TUNABLES:
            p = KSM_DIR / name
            if p.exists():
                v = read_knob(p)
                ksm[name] = _selected(v) if name == "advisor_mode" else v
        zswap = {p.name: read_knob(p) for p in sorted(ZSWAP_DIR.glob("*"))} if ZSWAP_DIR.is_dir() else {}
        return cls(ksm=ksm, zswap=zswap,
                   sysctl={k: read_knob(p) for k, p in SYSCTLS.items()},
                   swaps=[asdict(s) for s in read_swaps()],
                   zram=zram_devices(), zram_loaded=ZRAM_CONTROL.is_dir())

    def diff(self, other: HostSnapshot) -> list[str]:
        """Human-readable differences (empty when the host is as it was)."""
        out = []
        a, b = asdict(self), asdict(other)
        for section in a:
            if a[section] != b[section]:
                if isinstance(a[section], dict):
                    for k in sorted(set(a[section]) | set(b[section])):
                        if a[section].get(k) != b[section].get(k):
                            out.append(f"{section}.{k}: {a[section].get(k)!r} -> {b[section].get(k)!r}")
                else:
                    out.append(f"{section}: {a[section]!r} -> {b[section]!r}")
        return out


# ---------------------------------------------------------------------------------------
# KSM
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KsmConvergence:
    converged: bool
    elapsed_s: float
    full_scans: int          # full scans observed while waiting
    stat: KsmStat


def wait_ksm_converged(timeout_s: float = 300.0, poll_s: float = 0.1, tolerance_pages: int = 0,
                       tolerance_fraction: float = 0.01) -> KsmConvergence:
    """Wait until ksmd has completed two more full scans and pages_sharing held steady across
    the last of them (within max(tolerance_pages, tolerance_fraction * pages_sharing)).

    One full scan is not enough: a page is merged on the scan after the one that first saw it
    unchanged (ksmd's checksum test), so the scan after a change still merges.
    Returns converged=False at the timeout instead of raising: a benchmark reports it.
    """
    t0 = time.monotonic()
    first = read_ksm()
    last_scans = first.full_scans
    sharing_at_scan: list[int] = []
    stat = first
    while time.monotonic() - t0 < timeout_s:
        time.sleep(poll_s)
        stat = read_ksm()
        if stat.full_scans != last_scans:
            last_scans = stat.full_scans
            sharing_at_scan.append(stat.pages_sharing)
            if len(sharing_at_scan) >= 2:
                delta = abs(sharing_at_scan[-1] - sharing_at_scan[-2])
                if delta <= max(tolerance_pages, tolerance_fraction * sharing_at_scan[-1]):
                    return KsmConvergence(True, time.monotonic() - t0, stat.full_scans - first.full_scans, stat)
    return KsmConvergence(False, time.monotonic() - t0, stat.full_scans - first.full_scans, stat)


def _ksm_unmerge(timeout_s: float = KSM_UNMERGE_TIMEOUT_S) -> None:
    # Writing 2 unmerges synchronously in the writer's context (it returns when done, or
    # fails with ENOMEM when the unmerged copies do not fit).
    write_knob(KSM_DIR / "run", 2)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = read_ksm()
        if s.pages_shared == 0 and s.pages_sharing == 0:
            return
        time.sleep(0.05)
    raise HostError(f"KSM did not unmerge within {timeout_s:g} s")


# ---------------------------------------------------------------------------------------
# Proactive reclaim: process_madvise(MADV_PAGEOUT) and memory cgroups
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Set-up and teardown
# ---------------------------------------------------------------------------------------

@dataclass
class _Record:
    """What LinuxConfig changed, written to disk before each change."""

    before: dict[str, Any]
    zram_device: str | None = None          # e.g. "zram1", created by us with hot_add
    zram_node_created: bool = False         # we made /dev/zramN ourselves
    zram_module_loaded: bool = False        # we ran modprobe zram
    swapon: bool = False
    changed: list[str] = field(default_factory=list)   # knob paths we wrote


def _run(cmd: list[str]) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise HostError(f"{cmd[0]} failed: {err}") from err
    if r.returncode != 0:
        raise HostError(f"{' '.join(cmd)} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")


class LinuxConfig:
    """KSM + zram swap + proactive-reclaim tuning, restored exactly on exit (see module doc)."""

    def __init__(self, *, zram_disksize_bytes: int | None = None, zram_algorithm: str | None = None,
                 ksm_pages_to_scan: int = KSM_PAGES_TO_SCAN, ksm_sleep_ms: int = KSM_SLEEP_MS,
                 swappiness: int = SWAPPINESS, record_dir: Path = RECORD_DIR) -> None:
        self.zram_disksize_bytes = zram_disksize_bytes
        self.zram_algorithm = zram_algorithm
        self.ksm_pages_to_scan = ksm_pages_to_scan
        self.ksm_sleep_ms = ksm_sleep_ms
        self.swappiness = swappiness
        self.record_dir = record_dir
        self.record_path = record_dir / RECORD_NAME
        self.before: HostSnapshot | None = None
        self.zram_device: str | None = None
        self.algorithm: str | None = None
        self._rec: _Record | None = None
        self._lock_fd: int | None = None

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> LinuxConfig:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    # -- set-up ----------------------------------------------------------------------------
    def _save(self) -> None:
        assert self._rec is not None
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self._rec), indent=1))
        os.replace(tmp, self.record_path)

    def _set(self, path: Path, value: str | int) -> None:
        assert self._rec is not None
        if str(path) not in self._rec.changed:
            self._rec.changed.append(str(path))
            self._save()
        write_knob(path, value)

    def _lock(self) -> None:
        self.record_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise HostError("another azqemu Linux configuration is active on this host "
                            f"(lock {LOCK_PATH})") from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def setup(self) -> None:
        if os.geteuid() != 0:
            raise NotRoot("the Linux configuration (KSM, zram, swap)")
        self._lock()
        try:
            if self.record_path.exists():
                # A previous run died without teardown: put the host back first.
                LinuxConfig.recover(self.record_dir, _locked=True)
            self.before = HostSnapshot.take()
            self._rec = _Record(before=asdict(self.before))
            self._save()
            self._setup_sysctl()
            self._setup_zram()
            self._setup_ksm()
        except BaseException:
            try:
                self.teardown()
            except HostError:
                pass
            raise

    def _setup_sysctl(self) -> None:
        self._set(SYSCTLS["swappiness"], self.swappiness)
        self._set(SYSCTLS["page-cluster"], PAGE_CLUSTER)
        if (ZSWAP_DIR / "enabled").exists() and read_knob(ZSWAP_DIR / "enabled") in ("Y", "1"):
            self._set(ZSWAP_DIR / "enabled", "N")

    def _setup_zram(self) -> None:
        assert self._rec is not None
        if not ZRAM_CONTROL.is_dir():
            self._rec.zram_module_loaded = True
            self._save()
            _run(["modprobe", "zram", "num_devices=0"])
            if not ZRAM_CONTROL.is_dir():
                raise HostError("zram is not available (modprobe zram left no /sys/class/zram-control)")
        # Always a device of our own (hot_add): never reuse one that may belong to someone.
        idx = int(read_knob(ZRAM_CONTROL / "hot_add"))
        dev = f"zram{idx}"
        self._rec.zram_device = self.zram_device = dev
        self._save()
        sysdir = Path("/sys/block") / dev
        offered = read_knob(sysdir / "comp_algorithm").replace("[", "").replace("]", "").split()
        choice = self.zram_algorithm or next((a for a in ZRAM_ALGORITHMS if a in offered), None)
        if choice is None or choice not in offered:
            raise HostError(f"zram compressor {choice or ZRAM_ALGORITHMS[0]} not offered (kernel offers {' '.join(offered)})")
        self.algorithm = choice
        write_knob(sysdir / "comp_algorithm", choice)
        size = self.zram_disksize_bytes
        if size is None:
            size = _meminfo_bytes("MemTotal") // 2
        write_knob(sysdir / "disksize", size // PAGE_SIZE * PAGE_SIZE)
        node = Path("/dev") / dev
        for _ in range(100):   # devtmpfs creates the node asynchronously
            if node.exists():
                break
            time.sleep(0.01)
        if not node.exists():
            major, minor = map(int, read_knob(sysdir / "dev").split(":"))
            os.mknod(node, 0o600 | 0o060000, os.makedev(major, minor))
            self._rec.zram_node_created = True
            self._save()
        _run(["mkswap", str(node)])
        prio = max([ZRAM_SWAP_PRIORITY] + [s.priority + 1 for s in read_swaps()])
        self._rec.swapon = True
        self._save()
        _run(["swapon", "-p", str(min(prio, 32767)), str(node)])

    def _setup_ksm(self) -> None:
        if not KSM_DIR.is_dir():
            raise HostError("this kernel has no KSM (/sys/kernel/mm/ksm)")
        if (KSM_DIR / "advisor_mode").exists() and _selected(read_knob(KSM_DIR / "advisor_mode")) != "none":
            self._set(KSM_DIR / "advisor_mode", "none")
        self._set(KSM_DIR / "pages_to_scan", self.ksm_pages_to_scan)
        self._set(KSM_DIR / "sleep_millisecs", self.ksm_sleep_ms)
        self._set(KSM_DIR / "use_zero_pages", 1)
        self._set(KSM_DIR / "run", 1)

    # -- teardown --------------------------------------------------------------------------
    def teardown(self) -> None:
        """Undo everything setup() did, even partly; raise HostError listing what failed or
        what still differs from the snapshot, after trying every step."""
        try:
            if self._rec is not None:
                errors = _undo(self._rec)
                if not errors:
                    after = HostSnapshot.take()
                    before = HostSnapshot(**self._rec.before)
                    errors = [f"not restored: {d}" for d in before.diff(after)]
                if errors:
                    raise HostError("Linux configuration teardown: " + "; ".join(errors))
                self.record_path.unlink(missing_ok=True)
                self._rec = None
        finally:
            self._unlock()

    @staticmethod
    def recover(record_dir: Path = RECORD_DIR, *, _locked: bool = False) -> bool:
        """Restore a host from the record a crashed LinuxConfig left; True if there was one."""
        path = record_dir / RECORD_NAME
        if not path.exists():
            return False
        cfg = LinuxConfig(record_dir=record_dir)
        if not _locked:
            cfg._lock()
        try:
            cfg._rec = _Record(**json.loads(path.read_text()))
        except (ValueError, TypeError) as err:
            cfg._unlock()
            raise HostError(f"unreadable Linux configuration record {path}: {err}") from err
        if _locked:
            errors = _undo(cfg._rec)
            if errors:
                raise HostError("Linux configuration recovery: " + "; ".join(errors))
            path.unlink(missing_ok=True)
        else:
            cfg.teardown()
        return True

    # -- conveniences ----------------------------------------------------------------------
    def zram_stat(self) -> dict[str, int]:
        if self.zram_device is None:
            return {}
        return read_zram_mm_stat(self.zram_device)


def _undo(rec: _Record) -> list[str]:
    errors: list[str] = []
    before = HostSnapshot(**rec.before)

    def attempt(what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except (HostError, OSError, ValueError) as err:
            errors.append(f"{what}: {err}")

    dev = rec.zram_device
    if dev is not None:
        node = f"/dev/{dev}"
        if rec.swapon and any(s.name == node for s in read_swaps()):
            attempt("swapoff", _run, ["swapoff", node])      # pages come back into RAM
        if Path(f"/sys/block/{dev}").exists():
            attempt("zram reset", write_knob, Path(f"/sys/block/{dev}/reset"), 1)
            attempt("zram hot_remove", write_knob, ZRAM_CONTROL / "hot_remove", dev[4:])
        if rec.zram_node_created and Path(node).exists():
            attempt("remove device node", os.unlink, node)
    if rec.zram_module_loaded and not before.zram_loaded and ZRAM_CONTROL.is_dir():
        attempt("rmmod zram", _run, ["rmmod", "zram"])

    # KSM: unmerge if it was off, then every tunable back (run last).
    ksm_before = before.ksm
    changed = set(rec.changed)
    if str(KSM_DIR / "run") in changed and ksm_before.get("run") == "0":
        attempt("KSM unmerge", _ksm_unmerge)
    for name in KSM_TUNABLES:
        if name == "run" or str(KSM_DIR / name) not in changed or name not in ksm_before:
            continue
        attempt(f"KSM {name}", write_knob, KSM_DIR / name, ksm_before[name])
    if str(KSM_DIR / "run") in changed:
        attempt("KSM run", write_knob, KSM_DIR / "run", ksm_before.get("run", "0"))

    for name, value in before.zswap.items():
        if str(ZSWAP_DIR / name) in changed:
            attempt(f"zswap {name}", write_knob, ZSWAP_DIR / name, value)
    for name, path in SYSCTLS.items():
        if str(path) in changed:
            attempt(f"vm.{name}", write_knob, path, before.sysctl[name])
    return errors


def zram_disksize_for(guest_ram_bytes: int) -> int:
    """The zram disk size for sandboxes whose guests hold ``guest_ram_bytes`` of RAM together:
    all of it (a sandbox cannot swap more than its guest's RAM), in whole pages, capped at half
    of MemTotal. A careful operator sizes the device for the fleet it serves, since its table
    costs memory in proportion to the disk size from the moment the size is set."""
    if guest_ram_bytes <= 0:
        raise ValueError(f"guest RAM must be positive, got {guest_ram_bytes} bytes")
    size = min(int(guest_ram_bytes), _meminfo_bytes("MemTotal") // 2)
    return max(PAGE_SIZE, size // PAGE_SIZE * PAGE_SIZE)


def _meminfo_bytes(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise HostError(f"/proc/meminfo has no {key}")


@contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into SystemExit, and SIGINT into KeyboardInterrupt, for the
    block, so that ``with LinuxConfig()`` tears down when a benchmark is stopped politely
    (SIGKILL still needs ``recover()``). SIGINT is taken even when the process started with it
    ignored (as a shell starts a background job): ``kill -INT`` from an orchestrator stops the
    run as Ctrl-C does."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
