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
    TableSnapshot,
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

    # Each query copies what it reads under the lock (TableSnapshot) and computes without it.
    def owned_bytes_many(self, sandboxes: Iterable[str]) -> dict[str, OwnedBytes]:
        """``owned_bytes`` of each of ``sandboxes`` the store holds (others are left out)."""
        with self._lock:
            names = [n for n in sandboxes if n in self._sandboxes]
            domains = {self._sandboxes[n].domain.name for n in names}
            snap = TableSnapshot.of(self._table, self._sandboxes, names, domains)
        return sandbox_books(snap, snap.sandboxes.values())

    def domain_bytes(self, domain: str) -> DomainBytes:
        with self._lock:
            if domain not in self._table.domains:
                raise StoreError(f"no sharing domain {domain!r} in the page store")
            snap = TableSnapshot.of(self._table, self._sandboxes, (), (domain,))
        return domain_books(snap, snap.domains[domain], snap.members[domain])

    def total_bytes(self) -> StoreBytes:
        return self.books(())[0]

    def books(self, sandboxes: Iterable[str]) -> tuple[StoreBytes, dict[str, OwnedBytes]]:
        """``total_bytes`` and ``owned_bytes_many`` at once (each domain's blob costs computed once)."""
        with self._lock:
            snap = TableSnapshot.of(self._table, self._sandboxes, sandboxes)
            n_sandboxes = len(self._sandboxes)
            arenas = (self._arenas.used_bytes, self._arenas.live_bytes, self._arenas.allocated_bytes)
            template_bytes = sum(t.data_bytes for t in self._templates.values())
        total, owned = store_books(snap)
        return StoreBytes(len(snap.domains), n_sandboxes, total, arenas[0], arenas[1], template_bytes, arenas[2]), owned
