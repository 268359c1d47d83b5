"""What a process's memory costs the host: KSM and zram statistics, and ownership.

Per-sandbox owned memory under the Linux configuration (DESIGN.md, "Benchmark definitions"):
the sandbox's private resident RAM, plus its share of KSM's merged pages, plus its share of
zram's memory. Template pages it maps but never copied belong to the template, reported once.
``linux_owned_bytes`` estimates this cheaply from smaps at every sample; ``exact_owned_bytes``
computes it page by page from /proc/PID/pagemap and /proc/kpagecount (root) to check the
estimate. ``qemu_own_bytes`` is QEMU's own memory beside its guest RAM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from azqemu.pages import PAGE_SIZE

# --- /proc/PID/pagemap (Documentation/admin-guide/mm/pagemap.rst), one u64 per virtual page --
KSM_DIR = Path("/sys/kernel/mm/ksm")


# --- /proc/PID/pagemap (Documentation/admin-guide/mm/pagemap.rst), one u64 per virtual page --
PM_PFN_MASK = (1 << 55) - 1   # bits 0-54: page frame number (zero unless CAP_SYS_ADMIN)


PM_EXCLUSIVE = 1 << 56        # page exclusively mapped (Linux >= 4.2)


PM_FILE = 1 << 61             # file page or shared anonymous


PM_SWAP = 1 << 62


PM_PRESENT = 1 << 63


# /proc/kpageflags bits (include/uapi/linux/kernel-page-flags.h)
KPF_ZERO_PAGE = 24


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


