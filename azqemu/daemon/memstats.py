"""What a compression, a trim and a resume of a sandbox's memory did (SandboxMemory's results;
the daemon returns them as dicts, the API as CompressResult, TrimResult and ResumeResult)."""

from __future__ import annotations

from dataclasses import dataclass, field

from azqemu.errors import RestoreError


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


@dataclass
class TrimStats:
    cold_after_s: float = 0.0  # the sandbox's rule when this trim ran
    resident_pages: int = 0    # copies the sandbox held
    dropped_pages: int = 0     # of which dropped (equal to their entries, or encoded now)
    encoded_pages: int = 0     # written, hash unchanged for cold_after_s: encoded
    stored_pages: int = 0      # of those, now in the store (the rest mapped, or RAW and kept)
    encode_s: float = 0.0      # hashing and encoding (inside total_s)
    total_s: float = 0.0       # vCPUs paused for this long (plus the pause/resume calls)


@dataclass
class ResumeStats:
    prefetched_pages: int = 0
    prefetch_s: float = 0.0
    prefetch_mib_s: float = 0.0
    decode_s: float = 0.0      # pages decoded from the store (overlaps copy_s: pipelined)
    copy_s: float = 0.0        # UFFDIO_COPY into QEMU
    total_s: float = 0.0
