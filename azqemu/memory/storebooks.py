"""What a PageStore's bytes are and whose: the accounting queries (a base class of PageStore;
the state lives in store.py, the arithmetic in accounting.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from azqemu.errors import StoreError
from azqemu.memory.accounting import (
    DomainBytes,
    OwnedBytes,
    StoreBytes,
    domain_books,
    sandbox_books,
    store_books,
)
from azqemu.memory.arena import ArenaSet
from azqemu.memory.blobtable import BlobTable
from azqemu.memory.generation import StoredSandbox
from azqemu.memory.template import TemplateImage


class StoreBooks:
    """Owned bytes per sandbox, bytes per sharing domain and for the whole store."""

    _lock: threading.RLock
    _table: BlobTable
    _arenas: ArenaSet
    _sandboxes: dict[str, StoredSandbox]
    _templates: dict[str, TemplateImage]

    def owned_bytes_many(self, sandboxes: Iterable[str]) -> dict[str, OwnedBytes]:
        """``owned_bytes`` of each of ``sandboxes`` the store holds (others are left out)."""
        with self._lock:
            return sandbox_books(self._table, [sb for n in sandboxes if (sb := self._sandboxes.get(n)) is not None])

    def domain_bytes(self, domain: str) -> DomainBytes:
        with self._lock:
            d = self._table.domains.get(domain)
            if d is None:
                raise StoreError(f"no sharing domain {domain!r} in the page store")
            return domain_books(self._table, d, [self._sandboxes[s] for s in sorted(d.sandboxes)])

    def total_bytes(self) -> StoreBytes:
        return self.books(())[0]

    def books(self, sandboxes: Iterable[str]) -> tuple[StoreBytes, dict[str, OwnedBytes]]:
        """``total_bytes`` and ``owned_bytes_many`` at once (each domain's blob costs computed once)."""
        with self._lock:
            total, owned = store_books(self._table, self._sandboxes, sandboxes)
            return StoreBytes(len(self._table.domains), len(self._sandboxes), total,
                              self._arenas.used_bytes, self._arenas.live_bytes,
                              sum(t.data_bytes for t in self._templates.values()),
                              self._arenas.allocated_bytes), owned
