"""The memory service's template images: one mapping per template file, keyed by the file's
identity (a template made again under the same name is never decoded against the old image),
dropped when the template is deleted, and the manager's memory reported in parts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from azqemu.daemon.memsvc import MemoryService
from azqemu.host import selfmem
from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.ram import write_sparse_image
from azqemu.virt.templates import TemplateMeta


def _write_ram(memory: MemoryService, name: str, seed: int) -> Path:
    path = memory.templates.shm_dir(name) / "ram.img"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("ram.img.new")
    pages = np.random.default_rng(seed).integers(0, 256, (4, PAGE_SIZE), dtype=np.uint8)
    write_sparse_image(tmp, np.array([0, 2, 3, 9]), pages, 16 * PAGE_SIZE)
    tmp.rename(path)        # a new file (inode), as a re-created template has
    return path


def test_one_image_per_file_identity(memory: MemoryService, template: TemplateMeta) -> None:
    _write_ram(memory, "base", seed=1)
    first = memory.template_image(template)
    assert memory.template_image(template) is first
    # The template deleted and made again under the same name, with the same content: a new
    # file, so a new image (its id is the same: the same pages).
    _write_ram(memory, "base", seed=1)
    again = memory.template_image(template)
    assert again is not first and again.template_id == first.template_id
    # ... and with other content: another template id, never the old image.
    _write_ram(memory, "base", seed=2)
    other = memory.template_image(template)
    assert other is not again and other.template_id != first.template_id
    # Replaced images are not closed under sandboxes that may still use them.
    assert not first.closed and not again.closed


def test_dropped_with_its_template(memory: MemoryService, template: TemplateMeta) -> None:
    _write_ram(memory, "base", seed=3)
    img = memory.template_image(template)
    store = memory.store
    store.add_template(img)
    memory.drop_template("base")
    assert img.closed and img.template_id not in store._templates
    memory.drop_template("base")             # nothing left: no error
    # A template deleted behind the service's back goes at the next destroy.
    img = memory.template_image(template)
    memory.templates.delete("base", [])
    memory.release("gone-sandbox")
    assert img.closed


def test_manager_memory_in_parts() -> None:
    parts = selfmem.parse_status("Name:\tpython\nVmRSS:\t  3000 kB\nRssAnon:\t  1000 kB\n"
                                 "RssFile:\t  1500 kB\nRssShmem:\t   500 kB\n")
    assert parts == {"rss_bytes": 3000 << 10, "anon_bytes": 1000 << 10, "file_bytes": 1500 << 10,
                     "shmem_bytes": 500 << 10}
    live = selfmem.self_memory()
    assert live["anon_bytes"] > 0 and live["rss_bytes"] >= live["anon_bytes"]
    selfmem.trim_heap()
