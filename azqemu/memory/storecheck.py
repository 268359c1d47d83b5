"""Verifying a page store: decode every stored page of every sandbox, report the damaged ones.

``azq store check`` (cli/store_cmds.py) runs this on a store no daemon has open. Every page
goes through the same verified decode the fault path uses (blob checksums, template page
hashes), in bulk; a batch that fails is decoded again page by page to name the damaged pages.
``repair`` frees the sandboxes that have damaged pages (their pages cannot be served; the
sandbox must be failed or destroyed) and commits a generation without them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from azqemu.errors import StoreError
from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.store import PageStore

# Pages decoded per bulk call: 16 MiB of output, reused.
CHECK_BATCH_PAGES = 4096
# Damaged pages listed per sandbox in a report (all are counted).
MAX_LISTED_PAGES = 64


@dataclass
class SandboxCheck:
    name: str
    domain: str
    owner: str | None
    pages: int = 0
    damaged_pages: int = 0
    damaged: list[int] = field(default_factory=list)     # the first MAX_LISTED_PAGES page indices
    errors: list[str] = field(default_factory=list)      # distinct error lines, a few

    @property
    def ok(self) -> bool:
        return self.damaged_pages == 0


@dataclass
class StoreCheck:
    root: str
    generation: int
    sandboxes: list[SandboxCheck]
    quarantined: dict[str, str]          # sandboxes whose index could not be loaded at open
    repaired: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.quarantined and all(s.ok for s in self.sandboxes)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def _note(res: SandboxCheck, page: int, exc: Exception) -> None:
    res.damaged_pages += 1
    if len(res.damaged) < MAX_LISTED_PAGES:
        res.damaged.append(page)
    line = str(exc)
    if len(res.errors) < 8 and line not in res.errors:
        res.errors.append(line)


def check_sandbox(store: PageStore, name: str) -> SandboxCheck:
    res = SandboxCheck(name, store.domain_of(name), store.owner_of(name))
    idx = store.stored_pages(name)
    res.pages = len(idx)
    buf = np.empty((min(CHECK_BATCH_PAGES, max(len(idx), 1)), PAGE_SIZE), dtype=np.uint8)
    one = np.empty(PAGE_SIZE, dtype=np.uint8)
    for start in range(0, len(idx), CHECK_BATCH_PAGES):
        chunk = idx[start:start + CHECK_BATCH_PAGES]
        try:
            store.decode(name, chunk, out=buf[:len(chunk)])
            continue
        except StoreError:
            pass
        for p in chunk.tolist():
            try:
                store.decode_page_into(name, int(p), one)
            except StoreError as exc:
                _note(res, int(p), exc)
    return res


def check_store(store: PageStore) -> StoreCheck:
    return StoreCheck(str(store.root), store.generation, [check_sandbox(store, n) for n in store.sandboxes()],
                      dict(store.quarantined))


def repair(store: PageStore, report: StoreCheck) -> list[str]:
    """Free every sandbox with a damaged page and commit; returns their names."""
    bad = [s.name for s in report.sandboxes if not s.ok]
    for name in bad:
        store.free_sandbox(name, tombstone=True)
    store.flush()
    report.repaired = bad
    return bad
