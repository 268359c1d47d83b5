"""Map-back: pages of a copy-on-write clone that need no copy, mapped at compress time.

After a compression drops a copy-on-write clone's written pages, the pages that are not in
the store are mapped again at once, without costing the sandbox memory: template pages from
the template's page cache (UFFDIO_CONTINUE, MINOR mode: shared and read-only, a write copies
them), pages known to be zero (and template holes) as the zero page (UFFDIO_ZEROPAGE).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable

import numpy as np

from azqemu.host.pagemap import unmapped_pages
from azqemu.pages import page_runs, union_idx, unique_idx
from azqemu.restore import native
from azqemu.restore import uffd as uffd_ops
from azqemu.restore.errors import UffdIoctlError
from azqemu.restore.export import RamMapping

# One page-table page (512 eight-byte PTEs, x86-64 and arm64 with 4 KiB pages) maps 2 MiB of
# QEMU's address space: the unit in which mapping a page costs the host memory.
PTE_SPAN_BYTES = 2 << 20


def map_from_file(uffd: int, block: RamMapping, page_idxs: np.ndarray, *, zero: bool = False) -> int:
    """Map pages of a copy-on-write block from the template's page cache, in runs
    (UFFDIO_CONTINUE; the zero page over a hole of the template file), or with ``zero``
    the zero page itself (pages known to be zero). Costs no copy and no memory of the
    sandbox's own. Pages already mapped are skipped. Returns pages mapped."""
    idx = np.asarray(page_idxs, dtype=np.int64)
    if len(idx) > 1 and not bool((idx[1:] > idx[:-1]).all()):   # callers mostly pass sorted sets
        idx = unique_idx(idx)
    ps = block.page_size
    starts, lengths = page_runs(idx)
    if native.available():          # the same loop in C: a compression maps back hundreds of runs
        return native.map_runs(uffd, block.hva, ps, starts, lengths, zero=zero)
    mapped = 0
    for first, count in zip(starts.tolist(), lengths.tolist(), strict=True):
        page, end = first, first + count
        while page < end:
            hva = block.hva + page * ps
            try:
                if zero:
                    n = uffd_ops.zeropage(uffd, hva, (end - page) * ps) // ps
                else:
                    n = uffd_ops.continue_range(uffd, hva, (end - page) * ps) // ps
                mapped += n
            except UffdIoctlError as err:
                if err.errno == errno.EFAULT:      # a hole: nothing in the page cache
                    with contextlib.suppress(UffdIoctlError):
                        mapped += uffd_ops.zeropage(uffd, hva, ps) // ps
                elif err.errno != errno.EEXIST:    # EEXIST: mapped already (touched)
                    raise
                n = 1
            page += max(n, 1)
    return mapped


def untouched_in_page_tables(pid: int, block: RamMapping, dropped: np.ndarray | None) -> np.ndarray:
    """The pages of ``block`` neither present nor swapped in QEMU (process ``pid``), sorted,
    that lie in a 2 MiB span of its address space where a page is mapped, or was a moment ago
    (``dropped``): there a page table exists already and mapping a page costs 8 bytes.
    Mapping every untouched page of a 512 MiB guest costs 1 MiB of page tables per sandbox,
    host memory that no sandbox figure shows (measured at 16 sandboxes: PageTables 25.4 MiB
    above idle under agentzip against 11.9-12.1 under the other policies); a page of an
    untouched span is mapped on its first touch by the fault handler instead."""
    unmapped = unmapped_pages(pid, block.hva, block.page_count)
    if block.page_size != 4096 or not len(unmapped):
        return unmapped
    per_span = PTE_SPAN_BYTES // block.page_size
    off = (block.hva // block.page_size) % per_span      # spans are aligned in the address space
    held = np.ones(block.page_count, dtype=bool)
    held[unmapped] = False
    if dropped is not None:
        held[np.asarray(dropped, dtype=np.int64)] = True
    spans = np.zeros((off + block.page_count) // per_span + 1, dtype=bool)
    spans[(off + np.flatnonzero(held)) // per_span] = True
    return unmapped[spans[(off + unmapped) // per_span]]


def map_unstored(uffd: int, block: RamMapping, unmapped: np.ndarray, source_kind: np.ndarray, zero_kind: int,
                 template_rows: Callable[[np.ndarray], np.ndarray]) -> int:
    """Copy-on-write, after a drop: map the ``unmapped`` pages (sorted) that the store does not
    serve, free for the sandbox (8 bytes of page table each): those whose source is the
    template (``source_kind`` 0) from its page cache where ``template_rows`` (the template's
    row of each page, -1 for a hole) finds data, as the zero page over its holes and where the
    source is known zero (``zero_kind``). Returns the pages mapped."""
    from_template = unmapped[source_kind == 0]
    data = template_rows(from_template) >= 0
    zero = union_idx(from_template[~data], unmapped[source_kind == zero_kind])
    return (map_from_file(uffd, block, from_template[data])
            + map_from_file(uffd, block, zero, zero=True))
