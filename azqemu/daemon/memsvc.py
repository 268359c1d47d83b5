"""The memory service: the page store, the template images and each sandbox's guest RAM.

It owns the one ``PageStore`` (opened on first use), a ``TemplateImage`` per template, and
a ``SandboxMemory`` per sandbox whose RAM the daemon answers for (lazy clones from their
start, the others from their first compression). It attaches and releases that memory and
runs compress and prefetch on it; pausing and resuming the domain around them is the
lifecycle service's part.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from azqemu import config as config_mod
from azqemu.daemon.sandboxmem import SandboxMemory
from azqemu.errors import ConfigError, StoreCorrupt, StoreForeign
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
from azqemu.sched import policy as policy_mod
from azqemu.virt.clones import SandboxRecord, SandboxRepo
from azqemu.virt.identity import vm_paths
from azqemu.virt.templates import TemplateMeta, TemplateRepo

log = logging.getLogger(__name__)


class MemoryService:
    def __init__(self, cfg: config_mod.Config, templates: TemplateRepo, sandboxes: SandboxRepo, *,
                 lazy_available: bool) -> None:
        self.cfg = cfg
        self.templates = templates
        self.sandboxes = sandboxes
        # userfaultfd and the export library work here (doctor.restore_mode): without them
        # nothing can be compressed and clones copy their RAM.
        self.lazy_available = lazy_available
        self._store: PageStore | None = None
        self._store_lock = threading.Lock()
        self._template_images: dict[str, TemplateImage] = {}
        self.mem: dict[str, SandboxMemory] = {}

    # -- the store and the template images ----------------------------------------------
    @property
    def store_root(self) -> Path:
        return self.cfg.shm_dir / "store"

    @property
    def store(self) -> PageStore:
        with self._store_lock:
            if self._store is None:
                root = self.store_root
                try:
                    self._store = PageStore(root)
                except (StoreForeign, StoreCorrupt) as exc:
                    # Refuse to guess while a running sandbox may have pages in it; otherwise
                    # (a store of an older azqemu, a crash before any sandbox ran) start over.
                    if self.sandboxes.list():
                        raise
                    stale = root.with_name(f"store.unreadable-{int(time.time())}")
                    log.warning("%s; no sandbox uses it: moved to %s, starting a new store", exc, stale)
                    os.rename(root, stale)
                    shutil.rmtree(stale, ignore_errors=True)
                    self._store = PageStore(root)
            return self._store

    def opened_store(self) -> PageStore | None:
        """The store if it was opened (accounting must not create one to read it)."""
        return self._store

    def has_stored(self, name: str) -> bool:
        """Whether the store holds pages of ``name`` (without making a store where none is)."""
        return self.store_root.exists() and name in self.store.sandboxes()

    def template_image(self, tmpl: TemplateMeta) -> TemplateImage:
        with self._store_lock:
            img = self._template_images.get(tmpl.name)
            if img is None:
                img = TemplateImage(self.templates.ram_path(tmpl.name))
                self._template_images[tmpl.name] = img
            return img

    # -- a sandbox's memory -------------------------------------------------------------
    def get(self, name: str) -> SandboxMemory | None:
        return self.mem.get(name)

    def compressed(self, name: str) -> bool:
        mem = self.mem.get(name)
        return bool(mem is not None and mem.compressed)

    def attach(self, name: str, sharing_domain: str, tmpl: TemplateMeta, *,
               lazy_clone: bool, use_siblings: bool = True) -> SandboxMemory:
        """Take over a sandbox's RAM: connect to its export and, for a lazy clone or a
        sandbox with pages in the store, start serving its faults."""
        mem = SandboxMemory(name, sharing_domain, uffd_socket=vm_paths(name, self.cfg).uffd_socket,
                            store=self.store, template=self.template_image(tmpl),
                            template_ram=self.templates.ram_path(tmpl.name), lazy_clone=lazy_clone,
                            use_siblings=use_siblings)
        if lazy_clone or self.has_stored(name):
            mem.attach()
        self.mem[name] = mem
        return mem

    def cancel(self, name: str) -> None:
        """Stop a compression of ``name`` in progress at its next step (if there is one)."""
        mem = self.mem.get(name)
        if mem is not None:
            mem.cancel()

    def detach(self, name: str) -> None:
        """Stop answering for the RAM of ``name``; its pages stay in the store."""
        mem = self.mem.pop(name, None)
        if mem is not None:
            mem.detach()

    def release(self, name: str) -> None:
        """Detach, and free the sandbox's pages and references in the store."""
        self.detach(name)
        if self.has_stored(name):
            self.store.free_sandbox(name)
            self.store.flush()

    def compress(self, rec: SandboxRecord) -> dict[str, Any]:
        """Encode the sandbox's resident RAM into the store and punch it (vCPUs paused)."""
        mem = self.mem.get(rec.name)
        if mem is None:
            mem = self.attach(rec.name, rec.sharing_domain, self.templates.get(rec.template),
                              lazy_clone=rec.ram_mode == "lazy",
                              use_siblings=policy_mod.get(rec.policy).use_siblings)
        st = mem.compress()
        return {"name": rec.name, "resident_pages": st.resident_pages, "stored_pages": st.stored_pages,
                "raw_pages": st.raw_pages, "pages": st.pages_by_kind, "bytes": st.bytes_by_kind,
                "hot_pages": st.hot_pages, "mapped_pages": st.mapped_pages, "scan_s": st.scan_s,
                "encode_s": st.encode_s, "punch_s": st.punch_s, "total_s": st.total_s,
                "cancelled": st.cancelled, "stored_bytes": mem.stored_bytes(),
                "resident_bytes": mem.resident_bytes()}

    def prefetch(self, name: str, *, hot: bool) -> dict[str, Any]:
        """A compressed sandbox's hot set back (before its vCPUs continue); {} otherwise."""
        mem = self.mem.get(name)
        if mem is None or not mem.compressed:
            return {}
        st = mem.prefetch(hot=hot)
        return {"prefetched_pages": st.prefetched_pages, "prefetch_s": st.prefetch_s,
                "prefetch_mib_s": st.prefetch_mib_s}

    def memstats(self, name: str, *, reset: bool) -> dict[str, Any]:
        mem = self.mem.get(name)
        if mem is None:
            raise ConfigError(f"{name!r}: the manager does not serve its memory "
                              "(an eager clone that was never compressed)")
        return mem.memstats(reset=reset)

    def close(self) -> None:
        """Stop serving faults without unregistering: QEMU keeps its uffd, so a compressed
        guest waits for the next manager instead of reading zero pages."""
        for mem in list(self.mem.values()):
            mem.handler.stop()
        if self._store is not None:
            self._store.flush()
