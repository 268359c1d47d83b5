"""Host memory around a benchmark run: the idle baseline and tool-call latency figures.

The density benchmark subtracts the host's memory in use before any sandbox exists
(MemTotal - MemAvailable, a median over a few seconds: ``idle_baseline``) from what it samples
during the run, and summarises tool-call latencies (``latency_summary``). The per-sandbox
figures come from the daemon's accounting (``owned``), and the procfs readers and ownership
arithmetic behind both live in ``azqemu.host`` (procfs, memacct).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from azqemu.host.memacct import KsmStat, read_ksm, read_zram_total
from azqemu.host.procfs import read_meminfo

# Where host memory in use goes, from /proc/meminfo: the density benchmark reports each above
# idle beside host cost, so that a cost no sandbox figure shows (page tables of the guest-RAM
# mappings, kernel objects) is seen rather than guessed at.
HOST_PARTS = {"anon": "AnonPages", "shmem": "Shmem", "page_tables": "PageTables",
              "slab_unreclaimable": "SUnreclaim", "kernel_stack": "KernelStack"}


def host_parts(meminfo: dict[str, int]) -> dict[str, int]:
    """HOST_PARTS of one /proc/meminfo read, in bytes (0 where the kernel lacks a field)."""
    return {part: int(meminfo.get(field, 0)) for part, field in HOST_PARTS.items()}


def sample_host(zram: dict[str, int] | None = None, ksm: KsmStat | None = None) -> dict[str, float]:
    """One sample of the host: bytes in use, shmem, swap and zram; KSM's counters in pages."""
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
        **{f"{part}_bytes": float(v) for part, v in host_parts(mi).items()},
    }


@dataclass(frozen=True)
class Baseline:
    """The idle host before a run: medians over a few seconds."""

    used_bytes: int
    shmem_bytes: int
    swap_used_bytes: int
    zram_mem_used_bytes: int
    duration_s: float
    spread_bytes: int           # max - min of used_bytes while measuring (noise on this host)
    parts_bytes: dict[str, int] = field(default_factory=dict)   # HOST_PARTS, medians


# The idle baseline waits (up to SETTLE_TIMEOUT_S) until host memory in use stops moving by
# more than SETTLE_SPREAD_BYTES over its window: right after a template build or the previous
# policy's sandboxes, the kernel is still freeing exited QEMUs' memory, and a baseline taken
# then is too high (measured: a 1-sandbox point above the 2-sandbox one in a capacity sweep).
SETTLE_SPREAD_BYTES = 16 << 20
SETTLE_TIMEOUT_S = 30.0


# After a policy's run, before the next idle baseline, the host is given up to RETURN_TIMEOUT_S
# to come back within RETURN_SLACK_BYTES of its idle level before the run. Measured after the
# linux policy's teardown (swapoff, zram reset, KSM unmerged; 4 sandboxes): MemAvailable stood
# 41 MiB below its level before the run when the teardown returned, and was back within 8 s,
# falling by ~4 MiB a sample on the way: steady enough for ``idle_baseline``'s window. In a
# capacity sweep agentzip, run after linux at each fan-out, took such a baseline: its host
# cost at 4 sandboxes came out at -30 MiB (docs/figures.md, session 28).
RETURN_SLACK_BYTES = 16 << 20
RETURN_TIMEOUT_S = 30.0


def wait_back_to(used_bytes: int, timeout_s: float = RETURN_TIMEOUT_S, slack_bytes: int = RETURN_SLACK_BYTES,
                 interval_s: float = 0.5) -> float:
    """Wait until host memory in use (MemTotal - MemAvailable) is at most ``used_bytes`` plus
    ``slack_bytes``, or ``timeout_s`` passed; returns the seconds waited. Memory that stays
    longer is what the run left behind: the next baseline holds it and the run's
    ``host_idle_drift_bytes`` reports it."""
    t0 = time.monotonic()
    while True:
        mi = read_meminfo()
        if mi.get("MemTotal", 0) - mi.get("MemAvailable", 0) <= used_bytes + slack_bytes:
            break
        if time.monotonic() - t0 >= timeout_s:
            break
        time.sleep(interval_s)
    return time.monotonic() - t0


def counted_idle_bytes(before_bytes: int, after_bytes: int) -> int:
    """The idle host a policy's run is counted against: the lower of the idle figures taken
    before its sandboxes were made and after they were gone. A drop across the run is memory
    the host was still freeing when the first figure was taken (not the policy's doing: the
    teardown put swap, zram and KSM back, and ``wait_back_to`` waited); counting against the
    higher figure gave that policy the drop as a saving (linux, first after a template build:
    -60 MiB on long-tools, docs/figures.md session 31). A rise is memory that came during the
    run and stayed: the policy's cost, so the figure before stands. Either way the policy's
    host cost is the higher of the two readings."""
    return min(before_bytes, after_bytes)


def idle_baseline(duration_s: float = 3.0, interval_s: float = 0.25) -> Baseline:
    """Measure the host before any sandbox exists; subtract ``used_bytes`` from host_used.
    The window slides until it is steady (or SETTLE_TIMEOUT_S passed)."""
    samples: list[dict[str, float]] = []
    window = max(2, int(duration_s / interval_s) + 1)
    give_up = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        samples.append(sample_host())
        samples = samples[-window:]
        if len(samples) == window:
            recent = [s["used_bytes"] for s in samples]
            if max(recent) - min(recent) <= SETTLE_SPREAD_BYTES or time.monotonic() >= give_up:
                break
        time.sleep(interval_s)
    used = np.array([s["used_bytes"] for s in samples])
    return Baseline(
        used_bytes=int(np.median(used)),
        shmem_bytes=int(np.median([s["shmem_bytes"] for s in samples])),
        swap_used_bytes=int(np.median([s["swap_used_bytes"] for s in samples])),
        zram_mem_used_bytes=int(np.median([s["zram_mem_used_bytes"] for s in samples])),
        duration_s=duration_s, spread_bytes=int(used.max() - used.min()),
        parts_bytes={part: int(np.median([s[f"{part}_bytes"] for s in samples])) for part in HOST_PARTS})


def latency_summary(latencies_s: list[float]) -> dict[str, float]:
    """{"median", "p95"} of tool-call latencies (the contract's tool_latency_s); NaN if none."""
    if not latencies_s:
        return {"median": float("nan"), "p95": float("nan")}
    a = np.asarray(latencies_s, dtype=float)
    return {"median": float(np.median(a)), "p95": float(np.percentile(a, 95))}
