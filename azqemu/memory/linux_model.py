"""A model of what Linux's own tools would make of the same images: KSM plus zram.

The baseline azqemu is measured against (DESIGN.md, "The Linux configuration"): clones with
copy-on-write RAM, KSM merging identical pages, and a zram swap device compressing each page
on its own. The model is deliberately generous to Linux:
- every identical page is merged, across sandboxes and with the template at any address (real
  KSM merges only anonymous pages, needs time to scan, and cannot merge an anonymous page with
  the template's page cache at another address);
- a merged page is stored once, compressed, its cost divided among the pages that share it;
- zero pages are free (zram's same-filled pages, KSM's zero-page merging);
- a page compressing worse than ``RAW_THRESHOLD_BYTES`` is kept whole (4096 bytes), like zram's
  huge pages;
- no metadata is charged (zram's per-slot table, zsmalloc's size-class waste, KSM's rmap
  items are all ignored).
The compressor is LZ4 (``lz4.block``, acceleration 1: the kernel's ``lz4`` zram backend runs
the same algorithm). The kernel default ``lzo-rle`` is not available from Python; python-lzo's
LZO1X-1 is reported beside it for information only, as ``lzo1x``, never as lzo-rle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lz4.block
import lzo
import numpy as np

from azqemu.memory.kinds import PAGE_SIZE, RAW_THRESHOLD_BYTES
from azqemu.memory.pagehash import page_hashes_rows
from azqemu.memory.template import TemplateImage

COMPRESSOR = "lz4"


@dataclass
class LinuxModelResult:
    compressor: str
    bytes_before: int
    bytes_after: float
    pages: dict[str, int] = field(default_factory=dict)
    bytes_after_lzo1x: float = 0.0
    per_sandbox_after: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.bytes_before / self.bytes_after if self.bytes_after else float("inf")

    @property
    def ratio_lzo1x(self) -> float:
        return self.bytes_before / self.bytes_after_lzo1x if self.bytes_after_lzo1x else float("inf")

    def as_dict(self) -> dict[str, object]:
        return {"ratio": self.ratio, "compressor": self.compressor, "bytes_before": self.bytes_before,
                "bytes_after": int(round(self.bytes_after)), "pages": self.pages,
                "ratio_lzo1x_info": self.ratio_lzo1x}


def _zram_size(page: bytes, use_lzo: bool) -> int:
    n = len(lzo.compress(page, 1, False)) if use_lzo else len(lz4.block.compress(page, store_size=False))
    return PAGE_SIZE if n > RAW_THRESHOLD_BYTES else n


def linux_model(template: TemplateImage, sandboxes: list[tuple[np.ndarray, np.ndarray]],
                with_lzo: bool = True) -> LinuxModelResult:
    """Owned bytes of the sandboxes under the (idealised) Linux configuration."""
    tpl_keys = set(zip(template.keys_of(template.page_idx).tolist(), template.checks_of(template.page_idx).tolist()))
    # content -> list of sandbox numbers holding it (one entry per page)
    holders: dict[tuple[int, int], list[int]] = {}
    sample: dict[tuple[int, int], tuple[int, int]] = {}
    counts = {"zero": 0, "merged_with_template": 0, "merged_with_sibling": 0, "compressed": 0, "huge": 0}
    before = 0
    for s, (_idx, pages) in enumerate(sandboxes):
        pages = np.ascontiguousarray(pages)
        before += len(pages) * PAGE_SIZE
        nz = np.flatnonzero(pages.view(np.uint64).any(axis=1))
        counts["zero"] += len(pages) - len(nz)
        key, check = page_hashes_rows(pages, nz)
        for r, k, c in zip(nz.tolist(), key.tolist(), check.tolist()):
            kk = (k, c)
            if kk in tpl_keys:
                counts["merged_with_template"] += 1
                continue
            lst = holders.get(kk)
            if lst is None:
                holders[kk] = [s]
                sample[kk] = (s, r)
            else:
                lst.append(s)
                counts["merged_with_sibling"] += 1
    per = [0.0] * len(sandboxes)
    per_lzo = [0.0] * len(sandboxes)
    for kk, lst in holders.items():
        s, r = sample[kk]
        page = sandboxes[s][1][r].tobytes()
        size = _zram_size(page, False)
        counts["huge" if size == PAGE_SIZE else "compressed"] += 1
        share = size / len(lst)
        size_lzo = _zram_size(page, True) if with_lzo else 0
        share_lzo = size_lzo / len(lst)
        for h in lst:
            per[h] += share
            per_lzo[h] += share_lzo
    return LinuxModelResult(COMPRESSOR, before, float(sum(per)), counts, float(sum(per_lzo)), per)
