"""Host memory during a benchmark: a sampling thread, its time series, and per-sandbox accounting.

The density benchmark needs to know, every half second, what the host spends: RAM in use
(MemTotal - MemAvailable), shared memory (tmpfs, memfds: where guest RAM of shared backends
and the page store live), swap in use, zram's own memory, KSM's merged pages, and for each
sandbox's QEMU its RSS/PSS (from /proc/PID/smaps_rollup) and, given the guest RAM's hva range,
the resident, anonymous, KSM and swapped bytes of that range (from /proc/PID/smaps).
``HostMemSampler`` records these in a background thread; ``HostMemSeries`` holds them as
numpy arrays with time-weighted averages and peaks.

Per-sandbox owned memory under the Linux policy (DESIGN.md, "Benchmark definitions"): the
sandbox's private resident RAM, plus its share of KSM's merged pages, plus its share of
zram's memory. Template pages it maps but never copied belong to the template, reported once.
``linux_owned_bytes`` estimates this cheaply from smaps at every sample; ``exact_owned_bytes``
computes it page by page from /proc/PID/pagemap and /proc/kpagecount (root) to check the
estimate.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

PAGE_SIZE = 4096
KSM_DIR = Path("/sys/kernel/mm/ksm")
DEFAULT_INTERVAL_S = 0.5
HOST_KEYS = ("used_bytes", "shmem_bytes", "swap_used_bytes", "zram_mem_used_bytes", "zram_orig_bytes",
             "zram_compr_bytes", "ksm_pages_shared", "ksm_pages_sharing", "ksm_zero_pages")
PROC_KEYS = ("rss_bytes", "pss_bytes", "pss_anon_bytes", "pss_file_bytes", "pss_shmem_bytes", "swap_bytes",
             "ram_rss_bytes", "ram_anon_bytes", "ram_ksm_bytes", "ram_swap_bytes", "ram_pss_bytes",
             "owned_linux_bytes", "qemu_own_bytes", "owned_bytes")

# --- /proc/PID/pagemap (Documentation/admin-guide/mm/pagemap.rst), one u64 per virtual page --
PM_PFN_MASK = (1 << 55) - 1   # bits 0-54: page frame number (zero unless CAP_SYS_ADMIN)
PM_EXCLUSIVE = 1 << 56        # page exclusively mapped (Linux >= 4.2)
PM_FILE = 1 << 61             # file page or shared anonymous
PM_SWAP = 1 << 62
PM_PRESENT = 1 << 63
# /proc/kpageflags bits (include/uapi/linux/kernel-page-flags.h)
KPF_KSM = 21
KPF_ZERO_PAGE = 24


# ---------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------

def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo in bytes (the kB fields times 1024; HugePages_* counts as they are)."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def _kb_fields(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = out.get(key, 0) + int(parts[0]) * 1024
    return out


def read_smaps_rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in bytes: Rss, Pss, Pss_Anon, Pss_File, Pss_Shmem, Swap, SwapPss..."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return _kb_fields(f.read())


_VMA_HEADER_RE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) ", re.M)
_KB_FIELD_RE = re.compile(rb"^(\w+):\s+(\d+) kB$", re.M)


def read_vma_smaps(pid: int, start: int, end: int) -> dict[str, int]:
    """The smaps fields (bytes) summed over the VMAs that overlap [start, end).

    A VMA partly outside the range is counted whole: smaps has no finer grain. Guest RAM is
    normally one VMA, or a few when QEMU split it (madvise, mprotect), all inside the range.
    Only the matching VMAs' blocks are parsed (the kernel still walks every VMA to print
    smaps; that is most of the cost, ~1 ms for a QEMU process).
    """
    with open(f"/proc/{pid}/smaps", "rb") as f:
        text = f.read()
    totals: dict[str, int] = {}
    headers = list(_VMA_HEADER_RE.finditer(text))
    for k, h in enumerate(headers):
        if int(h.group(1), 16) < end and int(h.group(2), 16) > start:
            block_end = headers[k + 1].start() if k + 1 < len(headers) else len(text)
            for m in _KB_FIELD_RE.finditer(text, h.end(), block_end):
                key = m.group(1).decode()
                totals[key] = totals.get(key, 0) + int(m.group(2)) * 1024
    return totals


@dataclass(frozen=True)
class KsmStat:
    full_scans: int = 0
    pages_shared: int = 0       # KSM pages in use (each a merged physical page)
    pages_sharing: int = 0      # further mappings of those pages (the saving, in pages)
    pages_unshared: int = 0
    pages_volatile: int = 0
    ksm_zero_pages: int = 0     # pages merged with the zero page (use_zero_pages=1)

    @property
    def share_per_mapping(self) -> float:
        """The physical cost of one mapped KSM page on average: shared / (shared + sharing)."""
        total = self.pages_shared + self.pages_sharing
        return self.pages_shared / total if total else 0.0


def read_ksm(ksm_dir: Path = KSM_DIR) -> KsmStat:
    def get(name: str) -> int:
        try:
            return int((ksm_dir / name).read_text())
        except (OSError, ValueError):
            return 0
    return KsmStat(get("full_scans"), get("pages_shared"), get("pages_sharing"),
                   get("pages_unshared"), get("pages_volatile"), get("ksm_zero_pages"))


ZRAM_MM_STAT = ("orig_data_size", "compr_data_size", "mem_used_total", "mem_limit", "mem_used_max",
                "same_pages", "pages_compacted", "huge_pages", "huge_pages_since")


def read_zram_mm_stat(dev: str, sys_block: Path = Path("/sys/block")) -> dict[str, int]:
    """/sys/block/zramN/mm_stat (Documentation/admin-guide/blockdev/zram.rst): sizes in
    bytes, same_pages/pages_compacted/huge_pages in pages. Empty if the device is gone."""
    try:
        vals = (sys_block / dev / "mm_stat").read_text().split()
    except OSError:
        return {}
    return {n: int(v) for n, v in zip(ZRAM_MM_STAT, vals, strict=False)}


def read_zram_total(sys_block: Path = Path("/sys/block")) -> dict[str, int]:
    """mm_stat summed over every zram device (initialised or not)."""
    total = dict.fromkeys(ZRAM_MM_STAT, 0)
    for dev in sys_block.glob("zram*"):
        for k, v in read_zram_mm_stat(dev.name, sys_block).items():
            total[k] += v
    return total


# ---------------------------------------------------------------------------------------
# Accounting (Linux policy)
# ---------------------------------------------------------------------------------------

def zram_bytes_per_stored_byte(zram: dict[str, int]) -> float:
    """What one swapped-out byte costs in zram memory, all devices together (allocator
    overhead and same-filled pages included): mem_used_total / orig_data_size."""
    orig = zram.get("orig_data_size", 0)
    return zram.get("mem_used_total", 0) / orig if orig else 0.0


def linux_owned_bytes(vma: dict[str, int], ksm: KsmStat, zram: dict[str, int]) -> int:
    """Estimate of what one sandbox owns under the Linux policy, from its guest RAM VMA's smaps:

        private anonymous (Anonymous - KSM)          copy-on-write copies, mapped once
      + KSM bytes x shared/(shared+sharing)          its share of merged pages (host average)
      + swapped bytes x zram mem_used/orig_data      its share of zram's memory

    Pages of the template file it maps without copying are the template's, counted once
    elsewhere. The KSM and zram shares use host-wide averages; exact_owned_bytes() is exact.
    """
    anon = vma.get("Anonymous", 0)
    ksm_bytes = vma.get("KSM", 0)
    private = max(0, anon - ksm_bytes)
    return int(private + ksm_bytes * ksm.share_per_mapping
               + vma.get("Swap", 0) * zram_bytes_per_stored_byte(zram))


@dataclass(frozen=True)
class OwnedBytes:
    private_bytes: int          # anonymous pages mapped only here
    shared_anon_bytes: float    # anonymous pages mapped several times (KSM, fork), divided by mapcount
    swap_bytes: int             # swapped-out pages (their zram cost is swap_bytes x ratio)
    zram_bytes: float
    file_bytes: int             # resident file/shmem pages (the template's, not owned)
    zero_bytes: int             # pages mapping the shared zero page (free)

    @property
    def owned_bytes(self) -> int:
        return int(self.private_bytes + self.shared_anon_bytes + self.zram_bytes)


def exact_owned_bytes(pid: int, start: int, end: int, zram: dict[str, int] | None = None,
                      chunk_pages: int = 1 << 16) -> OwnedBytes:
    """Page-exact Linux-policy ownership of [start, end) in a process (root: PFNs are hidden
    from others). Reads /proc/PID/pagemap, then /proc/kpagecount and /proc/kpageflags for
    the anonymous pages that are not exclusively mapped (KSM pages and the like)."""
    ratio = zram_bytes_per_stored_byte(zram if zram is not None else read_zram_total())
    private = swap = file_pages = zero = 0
    shared = 0.0
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        cnt_fd = os.open("/proc/kpagecount", os.O_RDONLY)
        flg_fd = os.open("/proc/kpageflags", os.O_RDONLY)
        try:
            for lo in range(start, end, chunk_pages * PAGE_SIZE):
                hi = min(end, lo + chunk_pages * PAGE_SIZE)
                n = (hi - lo) // PAGE_SIZE
                raw = os.pread(fd, n * 8, lo // PAGE_SIZE * 8)
                pm = np.frombuffer(raw, dtype=np.uint64)
                present = (pm & np.uint64(PM_PRESENT)) != 0
                is_file = (pm & np.uint64(PM_FILE)) != 0
                excl = (pm & np.uint64(PM_EXCLUSIVE)) != 0
                swap += int(np.count_nonzero(~present & ((pm & np.uint64(PM_SWAP)) != 0)))
                file_pages += int(np.count_nonzero(present & is_file))
                anon = present & ~is_file
                private += int(np.count_nonzero(anon & excl))
                pfns = (pm[anon & ~excl] & np.uint64(PM_PFN_MASK)).astype(np.int64)
                if pfns.size and not pfns.any():
                    raise PermissionError("page frame numbers are hidden (needs CAP_SYS_ADMIN)")
                for pfn in pfns.tolist():
                    flags = int.from_bytes(os.pread(flg_fd, 8, pfn * 8), "little")
                    if flags >> KPF_ZERO_PAGE & 1:
                        zero += 1
                        continue
                    count = int.from_bytes(os.pread(cnt_fd, 8, pfn * 8), "little")
                    shared += 1.0 / count if count > 0 else 1.0
        finally:
            os.close(cnt_fd)
            os.close(flg_fd)
    finally:
        os.close(fd)
    return OwnedBytes(private_bytes=private * PAGE_SIZE, shared_anon_bytes=shared * PAGE_SIZE,
                      swap_bytes=swap * PAGE_SIZE, zram_bytes=swap * PAGE_SIZE * ratio,
                      file_bytes=file_pages * PAGE_SIZE, zero_bytes=zero * PAGE_SIZE)


def qemu_own_bytes(rollup: dict[str, int], ram_vma: dict[str, int]) -> int:
    """QEMU's own memory: the process's PSS minus its guest RAM's (the same for every policy;
    under TCG mostly the translation cache)."""
    return max(0, rollup.get("Pss", 0) - ram_vma.get("Pss", 0))


# ---------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------

@dataclass
class _Tracked:
    pid: int
    ram_range: tuple[int, int] | None
    owned_fn: Callable[[], float] | None = None


def sample_host(zram: dict[str, int] | None = None, ksm: KsmStat | None = None) -> dict[str, float]:
    mi = read_meminfo()
    zram = zram if zram is not None else read_zram_total()
    ksm = ksm if ksm is not None else read_ksm()
    return {
        "used_bytes": mi.get("MemTotal", 0) - mi.get("MemAvailable", 0),
        "shmem_bytes": mi.get("Shmem", 0),
        "swap_used_bytes": mi.get("SwapTotal", 0) - mi.get("SwapFree", 0),
        "zram_mem_used_bytes": zram.get("mem_used_total", 0),
        "zram_orig_bytes": zram.get("orig_data_size", 0),
        "zram_compr_bytes": zram.get("compr_data_size", 0),
        "ksm_pages_shared": ksm.pages_shared,
        "ksm_pages_sharing": ksm.pages_sharing,
        "ksm_zero_pages": ksm.ksm_zero_pages,
    }


def sample_process(pid: int, ram_range: tuple[int, int] | None, ksm: KsmStat,
                   zram: dict[str, int]) -> dict[str, float]:
    """One process's figures (NaN for what does not apply); raises ProcessLookupError/OSError
    when the process is gone."""
    nan = float("nan")
    out = dict.fromkeys(PROC_KEYS, nan)
    out["rss_bytes"] = psutil.Process(pid).memory_info().rss
    roll = read_smaps_rollup(pid)
    out.update(pss_bytes=roll.get("Pss", 0), pss_anon_bytes=roll.get("Pss_Anon", 0),
               pss_file_bytes=roll.get("Pss_File", 0), pss_shmem_bytes=roll.get("Pss_Shmem", 0),
               swap_bytes=roll.get("Swap", 0))
    if ram_range is not None:
        vma = read_vma_smaps(pid, *ram_range)
        out.update(ram_rss_bytes=vma.get("Rss", 0), ram_anon_bytes=vma.get("Anonymous", 0),
                   ram_ksm_bytes=vma.get("KSM", 0), ram_swap_bytes=vma.get("Swap", 0),
                   ram_pss_bytes=vma.get("Pss", 0), owned_linux_bytes=linux_owned_bytes(vma, ksm, zram),
                   qemu_own_bytes=qemu_own_bytes(roll, vma))
    return out


def _twa(t: np.ndarray, y: np.ndarray) -> float:
    """Time-weighted average of a sampled series (trapezoids; NaN samples left out)."""
    ok = ~np.isnan(y)
    t, y = t[ok], y[ok]
    if y.size == 0:
        return float("nan")
    if y.size == 1 or t[-1] <= t[0]:
        return float(np.mean(y))
    return float(np.sum((y[1:] + y[:-1]) * np.diff(t)) / 2 / (t[-1] - t[0]))


@dataclass
class HostMemSeries:
    """Sampled time series: ``t_s`` seconds since the sampler started; ``host[key]`` per
    HOST_KEYS; ``procs[label][key]`` per PROC_KEYS, NaN while the label was not tracked."""

    t_s: np.ndarray
    host: dict[str, np.ndarray]
    procs: dict[str, dict[str, np.ndarray]]
    marks: list[tuple[float, str]] = field(default_factory=list)
    interval_s: float = DEFAULT_INTERVAL_S
    sample_cost_s: float = 0.0      # mean wall time of one sample (the sampler's own cost)

    def avg(self, key: str, label: str | None = None) -> float:
        y = self.host[key] if label is None else self.procs[label][key]
        return _twa(self.t_s, y.astype(float))

    def peak(self, key: str, label: str | None = None) -> float:
        y = self.host[key] if label is None else self.procs[label][key]
        y = y.astype(float)
        return float(np.nanmax(y)) if y.size and not np.all(np.isnan(y)) else float("nan")

    def sum_over(self, key: str, labels: list[str] | None = None) -> np.ndarray:
        """A per-process key summed over labels at each sample (NaN counts as 0)."""
        labels = list(self.procs) if labels is None else labels
        total = np.zeros_like(self.t_s, dtype=float)
        for label in labels:
            total += np.nan_to_num(self.procs[label][key].astype(float))
        return total

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN becomes None)."""
        def clean(a: np.ndarray) -> list[Any]:
            return [None if isinstance(x, float) and np.isnan(x) else x for x in a.tolist()]
        return {"t_s": [round(x, 3) for x in self.t_s.tolist()],
                "host": {k: clean(v) for k, v in self.host.items()},
                "procs": {lbl: {k: clean(v) for k, v in d.items()} for lbl, d in self.procs.items()},
                "marks": [[round(t, 3), m] for t, m in self.marks],
                "interval_s": self.interval_s, "sample_cost_s": self.sample_cost_s}


class HostMemSampler:
    """Samples host memory every ``interval_s`` in a daemon thread.

        with HostMemSampler(0.5) as s:
            s.track("sb-0", qemu_pid, ram_range=find_guest_ram(qemu_pid))
            ...
            s.mark("tool-start sb-0")
        series = s.series

    Each sample reads /proc/meminfo, every zram device's mm_stat, KSM's counters, and per
    tracked process smaps_rollup (plus smaps for the RAM range): about 1-3 ms per 512 MiB
    QEMU here, so 16 sandboxes at 0.5 s cost a few percent of one core; the mean cost is
    recorded in the series (``sample_cost_s``) so a report can show it.
    """

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._t: list[float] = []
        self._host: dict[str, list[float]] = {k: [] for k in HOST_KEYS}
        self._procs: dict[str, dict[str, list[float]]] = {}
        self._marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._cost_total = 0.0
        self.series: HostMemSeries | None = None
        self.errors: list[str] = []

    def track(self, label: str, pid: int, ram_range: tuple[int, int] | None = None,
              owned_fn: Callable[[], float] | None = None) -> None:
        """Sample process ``pid`` under ``label`` from now on. ``ram_range`` is its guest
        RAM's hva range (find_guest_ram()); ``owned_fn`` returns the sandbox's owned bytes
        for policies whose accounting is not the Linux one (azqemu's store, a full copy's RAM
        file): recorded as ``owned_bytes``, which otherwise is ``owned_linux_bytes``."""
        with self._lock:
            self._tracked[label] = _Tracked(pid, ram_range, owned_fn)
            if label not in self._procs:
                n = len(self._t)
                self._procs[label] = {k: [float("nan")] * n for k in PROC_KEYS}

    def untrack(self, label: str) -> None:
        with self._lock:
            self._tracked.pop(label, None)

    def mark(self, label: str) -> None:
        with self._lock:
            self._marks.append((time.monotonic() - self._t0, label))

    def sample_once(self) -> None:
        t_start = time.perf_counter()
        zram = read_zram_total()
        ksm = read_ksm()
        host = sample_host(zram, ksm)
        with self._lock:
            tracked = dict(self._tracked)
        per: dict[str, dict[str, float]] = {}
        for label, tr in tracked.items():
            try:
                vals = sample_process(tr.pid, tr.ram_range, ksm, zram)
                vals["owned_bytes"] = float(tr.owned_fn()) if tr.owned_fn is not None else vals["owned_linux_bytes"]
                per[label] = vals
            except (psutil.Error, OSError) as err:
                self.errors.append(f"{label} (pid {tr.pid}): {type(err).__name__}")
        with self._lock:
            self._t.append(time.monotonic() - self._t0)
            for k in HOST_KEYS:
                self._host[k].append(float(host[k]))
            for label, cols in self._procs.items():
                row = per.get(label)
                for k in PROC_KEYS:
                    cols[k].append(float(row[k]) if row is not None else float("nan"))
        self._cost_total += time.perf_counter() - t_start

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            next_t += self.interval_s
            delay = next_t - time.monotonic()
            if delay < 0:            # fell behind (a slow sample): skip, do not bunch up
                next_t = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def start(self) -> HostMemSampler:
        if self._thread is not None:
            raise RuntimeError("sampler already started")
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="azq-hostmem", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> HostMemSeries:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        with self._lock:
            n = len(self._t)
            self.series = HostMemSeries(
                t_s=np.array(self._t, dtype=float),
                host={k: np.array(v, dtype=float) for k, v in self._host.items()},
                procs={lbl: {k: np.array(v, dtype=float) for k, v in cols.items()}
                       for lbl, cols in self._procs.items()},
                marks=list(self._marks), interval_s=self.interval_s,
                sample_cost_s=self._cost_total / n if n else 0.0)
        return self.series

    def __enter__(self) -> HostMemSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Baseline:
    """The idle host before a run: medians over a few seconds."""

    used_bytes: int
    shmem_bytes: int
    swap_used_bytes: int
    zram_mem_used_bytes: int
    duration_s: float
    spread_bytes: int           # max - min of used_bytes while measuring (noise on this host)


def idle_baseline(duration_s: float = 3.0, interval_s: float = 0.25) -> Baseline:
    """Measure the host before any sandbox exists; subtract ``used_bytes`` from host_used."""
    samples = []
    end = time.monotonic() + duration_s
    while True:
        samples.append(sample_host())
        if time.monotonic() >= end:
            break
        time.sleep(interval_s)
    used = np.array([s["used_bytes"] for s in samples])
    return Baseline(
        used_bytes=int(np.median(used)),
        shmem_bytes=int(np.median([s["shmem_bytes"] for s in samples])),
        swap_used_bytes=int(np.median([s["swap_used_bytes"] for s in samples])),
        zram_mem_used_bytes=int(np.median([s["zram_mem_used_bytes"] for s in samples])),
        duration_s=duration_s, spread_bytes=int(used.max() - used.min()))


def file_allocated_bytes(path: str | Path) -> int:
    """Bytes a (sparse) file really holds: st_blocks x 512. Works for a memfd through
    /proc/PID/fd/N. The owned memory of a full-copy clone (policy none) is its RAM file's."""
    return os.stat(path).st_blocks * 512


def find_ram_fd(pid: int, backing: str) -> Path:
    """/proc/PID/fd/N of the open file whose target contains ``backing`` (``memfd:pc.ram``,
    a path under /dev/shm): pass it to file_allocated_bytes()."""
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            if backing in os.readlink(fd):
                return fd
        except OSError:
            continue
    raise FileNotFoundError(f"process {pid} has no open file matching {backing!r}")


def latency_summary(latencies_s: list[float]) -> dict[str, float]:
    """{"median", "p95"} of tool-call latencies (the contract's tool_latency_s); NaN if none."""
    if not latencies_s:
        return {"median": float("nan"), "p95": float("nan")}
    a = np.asarray(latencies_s, dtype=float)
    return {"median": float(np.median(a)), "p95": float(np.percentile(a, 95))}


def policy_figures(series: HostMemSeries, labels: list[str] | None = None,
                   baseline: Baseline | None = None, owned_key: str = "owned_bytes") -> dict[str, Any]:
    """The memory part of one policy's entry in the density result: owned_bytes_avg/peak
    (the sandboxes' owned bytes summed at each sample; time-weighted average over the run),
    host_used_bytes_avg (above the idle baseline), qemu_own_bytes_avg (per sandbox), and the
    series the report plots. The runner adds tool_latency_s, compress_s_total,
    restore_s_total."""
    owned = series.sum_over(owned_key, labels)
    host = series.host["used_bytes"] - (baseline.used_bytes if baseline is not None else 0)
    labels = list(series.procs) if labels is None else labels
    own = [series.avg("qemu_own_bytes", lbl) for lbl in labels]
    own = [x for x in own if not np.isnan(x)]
    return {
        "owned_bytes_avg": int(_twa(series.t_s, owned)) if owned.size else 0,
        "owned_bytes_peak": int(owned.max()) if owned.size else 0,
        "host_used_bytes_avg": int(_twa(series.t_s, host)) if host.size else 0,
        "qemu_own_bytes_avg": int(np.mean(own)) if own else None,
        "series": {"t_s": [round(x, 3) for x in series.t_s.tolist()],
                   "owned_bytes": [int(x) for x in owned.tolist()],
                   "host_used_bytes": [int(x) for x in host.tolist()]},
    }
