"""What a compression, a trim and a resume of a sandbox's memory did (SandboxMemory's results;
the daemon returns them as dicts, the API as CompressResult, TrimResult and ResumeResult)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from azqemu.errors import RestoreError
from azqemu.quantiles import quantiles


class CompressCancelled(RestoreError):
    def __init__(self, name: str, done: int = 0) -> None:
        super().__init__(f"compression of {name!r} cancelled by a resume")
        self.done = done  # stored pages already out of guest RAM


@dataclass
class CompressStats:
    resident_pages: int = 0
    stored_pages: int = 0
    raw_pages: int = 0
    pages_by_kind: dict[str, int] = field(default_factory=dict)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    hot_pages: int = 0
    mapped_pages: int = 0      # copy-on-write: pages mapped from the template or to the zero page
    scan_s: float = 0.0
    encode_s: float = 0.0
    punch_s: float = 0.0
    total_s: float = 0.0
    cancelled: bool = False
    unchanged_pages: int = 0   # copies still equal to their stored entries: not encoded again
    budget_stopped: bool = False   # the wait's CPU budget ran out (daemon/cpubudget.py)
    left_pages: int = 0        # copies it did not reach: resident as they were
    raw_untried_pages: int = 0   # incompressible, unchanged since the last one: not tried (rawrecord.py)
    tries: dict[str, int] = field(default_factory=dict)   # codec attempts (zstd, xor, prefix, sdelta, lz4, patch)

    def add_encoded(self, pages: dict[str, int], nbytes: dict[str, int], tries: dict[str, int]) -> None:
        """Count one encode call's pages and bytes per kind and codec attempts."""
        for total, part in ((self.pages_by_kind, pages), (self.bytes_by_kind, nbytes), (self.tries, tries)):
            for k, v in part.items():
                total[k] = total.get(k, 0) + v


@dataclass
class TrimStats:
    cold_after_s: float = 0.0  # the sandbox's rule when this trim ran
    resident_pages: int = 0    # copies the sandbox held
    dropped_pages: int = 0     # of which dropped (equal to their entries, or encoded now)
    zero_pages: int = 0        # of those, zero (freed by the guest): mapped to the zero page
    encoded_pages: int = 0     # written, hash unchanged for cold_after_s: encoded
    stored_pages: int = 0      # of those, now in the store (the rest mapped, or RAW and kept)
    changed_pages: int = 0     # to drop, but written while the trim ran beside the guest: kept
    encode_s: float = 0.0      # hashing and encoding, beside the guest (inside total_s)
    paused_s: float = 0.0      # vCPUs paused: the check and the drop (not the pause/resume calls)
    verify_s: float = 0.0      # of which: reading again and hashing the copies to drop
    drop_s: float = 0.0        # of which: discarding them inside QEMU
    map_s: float = 0.0         # of which: mapping the zero and template pages in their place
    total_s: float = 0.0


@dataclass
class ResumeStats:
    prefetched_pages: int = 0
    present_pages: int = 0     # predicted, but the guest touched them first (beside a call): faulted
    left_pages: int = 0        # predicted but left to first touch: the call runs long (callkinds.prefetch_pays)
    prefetch_s: float = 0.0
    prefetch_mib_s: float = 0.0
    decode_s: float = 0.0      # pages decoded from the store (overlaps copy_s: pipelined)
    copy_s: float = 0.0        # UFFDIO_COPY into QEMU
    total_s: float = 0.0


def memory_stats(mem: Any, *, reset: bool = False) -> dict[str, object]:
    """Restore figures for ``azq bench restore`` and dashboards.

    ``service_us`` is the handler's per-fault service time (fault message read to
    UFFDIO_COPY done) over the faults since the last reset (the newest RING_SIZE of
    them); ``reset`` starts a new window after reading. Fault counters are cumulative:
    callers take differences."""
    h = mem.handler.stats()
    t_ns = mem.handler.service_times_ns()
    if reset:
        mem.handler.reset_service_times()
    service: dict[str, float | int] = {"samples": int(len(t_ns))}
    if len(t_ns):
        t_us = t_ns / 1e3
        median, p90, p99 = quantiles(t_us, (50, 90, 99))
        service.update(min=float(t_us.min()), median=median, p90=p90, p99=p99, max=float(t_us.max()),
                       mean=float(t_us.mean()))
    counters = asdict(h)
    for k in ("service_us_median", "service_us_p99", "service_samples"):
        counters.pop(k)
    # Faults the C thread answered, by where the page came from: a first touch of the
    # template (or of a hole) is no sign of a trim or a hot set that missed; a store page is.
    native = mem.handler.native_counters()
    counters["native_from"] = {k: native.get(f"from_{k}", 0) for k in ("template", "zero", "store")}
    counters["mapped_around"] = native.get("around", 0)     # pages a first touch's span brought along
    # The C thread's reads without sleeping after a fault: batches they caught, the time spun.
    counters["spin"] = {"caught": native.get("spin_caught", 0), "s": native.get("spin_ns", 0) / 1e9}
    stored = (mem.store.owned_bytes(mem.name).as_dict() if mem.name in mem.store.sandboxes() else {})
    return {"name": mem.name, "compressed": mem.compressed, "registered": mem.registered,
            "copy_on_write": mem.cow, "store": stored, "call_kinds": mem.calls.kinds,
            # What a fault costs the guest by the last call's measure (callkinds.prefetch_pays).
            "fault_stall_s": mem.calls.fault_stall_s(),
            "handler": counters, "service_us": service,
            # The store's, shared by every sandbox: a fault that waited on its lock (cumulative).
            "store_lock_waits": mem.store.fault_lock_waits(),
            # Per attempt, by bucket of the best payload before it (<= 512, 1024, 2048 B, more).
            "encoder_saved_bytes_per_try": mem.store.attempt_summary(mem.sharing_domain),
            "last_compress": asdict(mem.last_compress), "last_resume": asdict(mem.last_resume),
            "compress_s_total": mem.compress_s_total, "restore_s_total": mem.restore_s_total}
