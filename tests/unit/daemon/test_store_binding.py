"""Store entries bound to the domain UUID: reconcile frees those of vanished or replaced
domains, a destroy interrupted after its free fails the sandbox, an unreadable store is
quarantined and the daemon still starts."""

from __future__ import annotations

from typing import Any

import numpy as np

from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.reconcile import reconcile
from azqemu.daemon.registry import Registry
from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.template import TemplateImage
from azqemu.virt.templates import TemplateMeta


class RecordingMemory(MemoryService):
    def __init__(self, base: MemoryService) -> None:
        super().__init__(base.cfg, base.templates, base.sandboxes, lazy_available=True)
        self.attached: list[tuple[str, str | None]] = []

    def attach(self, name: str, sharing_domain: str, tmpl: TemplateMeta, *, lazy_clone: bool,
               use_siblings: bool = True, owner: str | None = None) -> Any:
        self.attached.append((name, owner))


def _tpl() -> TemplateImage:
    pages = np.full((4, PAGE_SIZE), 7, dtype=np.uint8)
    return TemplateImage(page_idx=np.arange(4), pages=pages, size_bytes=16 * PAGE_SIZE)


def _store_pages(mem: MemoryService, name: str, owner: str) -> None:
    rng = np.random.default_rng(len(name))
    pages = rng.integers(0, 4, (8, PAGE_SIZE), dtype=np.uint8)      # compressible, not template
    mem.store.encode(name, "default@x", np.arange(8), pages, _tpl(), owner=owner)
    mem.store.flush()


def test_reconcile_frees_entries_of_gone_and_replaced_domains(registry: Registry, memory: MemoryService,
                                                              host: Any, sandbox_meta_of: Any,
                                                              template: TemplateMeta) -> None:
    same = host.add("same", sandbox_meta_of(ram_mode="lazy"))
    host.add("reused", sandbox_meta_of(ram_mode="lazy"))
    mem = RecordingMemory(memory)
    _store_pages(mem, "same", same.uuid)
    _store_pages(mem, "reused", "uuid-of-an-earlier-domain")   # a new clone got the old name
    _store_pages(mem, "vanished", "uuid-gone")

    report = reconcile(registry, mem)

    assert sorted(report["freed"]) == ["reused", "vanished"] and report["failed"] == []
    assert mem.store.sandboxes() == ["same"]
    assert sorted(mem.attached) == [("reused", host.doms["reused"].uuid), ("same", same.uuid)]
    # Durable: a restarted manager sees the same.
    mem.store.close()
    again = MemoryService(memory.cfg, memory.templates, memory.sandboxes, lazy_available=False)
    assert again.store.sandboxes() == ["same"] and again.store.owner_of("same") == same.uuid


def test_destroy_interrupted_after_its_free_fails_the_sandbox(registry: Registry, memory: MemoryService,
                                                              host: Any, sandbox_meta_of: Any,
                                                              template: TemplateMeta) -> None:
    dom = host.add("x-0", sandbox_meta_of(ram_mode="lazy"))
    mem = RecordingMemory(memory)
    _store_pages(mem, "x-0", dom.uuid)
    mem.release("x-0")            # destroy frees the pages; the manager dies before the domain goes
    mem.store.close()
    mem2 = RecordingMemory(memory)

    report = reconcile(registry, mem2)

    assert report["failed"] == ["x-0"] and "destroy" in mem2.failed["x-0"]
    assert mem2.attached == []    # not served from the template in place of its lost pages
    # Once the domain is gone the tombstone goes too.
    dom.destroy()
    mem2.failed.clear()
    reconcile(registry, mem2)
    assert mem2.store.tombstones() == {}


def test_tombstone_goes_once_the_domain_is_gone(memory: MemoryService) -> None:
    """A destroy's tombstone guards the moment between its free and the domain's end; after
    that a daemon that runs for weeks must not keep (and write into every generation) the
    name of every sandbox it ever destroyed."""
    mem = RecordingMemory(memory)
    for i in range(3):
        _store_pages(mem, f"x-{i}", f"uuid-{i}")
        mem.release(f"x-{i}")                       # a destroy: pages freed, name tombstoned
    assert mem.store.tombstones() == {"x-0": "uuid-0", "x-1": "uuid-1", "x-2": "uuid-2"}
    mem.domain_gone("x-0")
    mem.domain_gone("x-1")
    mem.domain_gone("never-stored")                 # nothing to forget: no error
    assert mem.store.tombstones() == {"x-2": "uuid-2"}
    mem.store.flush()
    mem.store.close()
    again = MemoryService(memory.cfg, memory.templates, memory.sandboxes, lazy_available=False)
    assert again.store.tombstones() == {"x-2": "uuid-2"}     # durable from the next generation on


def test_unreadable_store_is_quarantined_and_its_sandboxes_failed(registry: Registry, memory: MemoryService,
                                                                  host: Any, sandbox_meta_of: Any,
                                                                  template: TemplateMeta) -> None:
    dom = host.add("a", sandbox_meta_of(ram_mode="lazy"))
    host.add("b", sandbox_meta_of(ram_mode="lazy"))
    mem = RecordingMemory(memory)
    _store_pages(mem, "a", dom.uuid)
    mem.store.close()
    root = memory.store_root
    arena = next(root.glob("arena-*.azq"))
    arena.write_bytes(b"not an arena")

    mem2 = RecordingMemory(memory)
    report = reconcile(registry, mem2)

    assert report["failed"] == ["a"] and "quarantined" in mem2.failed["a"]
    assert mem2.attached == [("b", host.doms["b"].uuid)]
    assert mem2.store.sandboxes() == []
    assert [p.name.startswith("store.unreadable-") for p in root.parent.iterdir() if p != root] == [True]
