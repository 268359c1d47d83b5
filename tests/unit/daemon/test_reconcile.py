"""Reconcile against a fake host: records of vanished domains are dropped, running sandboxes
without a record adopted, template builds of a dead manager removed, other managers' left."""

from __future__ import annotations

from typing import Any

import pytest

from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.reconcile import reconcile
from azqemu.daemon.registry import Registry
from azqemu.errors import SandboxNotFound
from azqemu.virt.clones import SandboxRecord
from azqemu.virt.identity import vm_paths
from azqemu.virt.templates import TemplateMeta


class RecordingMemory(MemoryService):
    """Records attach() instead of connecting to a QEMU; ``compressed_names`` are compressed."""

    def __init__(self, base: MemoryService, compressed_names: set[str]) -> None:
        super().__init__(base.cfg, base.templates, base.sandboxes, lazy_available=True)
        self.attached: list[tuple[str, str, str, bool]] = []
        self.compressed_names = compressed_names

    def attach(self, name: str, sharing_domain: str, tmpl: TemplateMeta, *, lazy_clone: bool,
               use_siblings: bool = True, owner: str | None = None) -> Any:
        self.attached.append((name, sharing_domain, tmpl.name, lazy_clone))

    def compressed(self, name: str) -> bool:
        return name in self.compressed_names


def _record(name: str, policy: str = "manual", grace_s: float = 1.0, state: str = "running",
            user_paused: bool | None = None) -> SandboxRecord:
    return SandboxRecord(name, "base", "default", "eager", "u", 0.0, policy=policy, grace_s=grace_s, state=state,
                         user_paused=user_paused)


def test_records_follow_libvirt(registry: Registry, memory: MemoryService, host: Any, cfg: Any,
                                sandbox_meta_of: Any, template: TemplateMeta) -> None:
    host.add("kept", sandbox_meta_of())
    registry.sandboxes.save(_record("kept", policy="agentzip", grace_s=3.0))
    registry.sandboxes.save(_record("vanished"))
    vm_paths("vanished").vm_dir.mkdir(parents=True)
    adopted = host.add("orphan", sandbox_meta_of(ram_mode="cow", sharing_domain="task7"))
    build = host.add("azq-template-x", {"role": "template-build", "state-dir": str(cfg.state_dir)})
    foreign = host.add("theirs", {**sandbox_meta_of(), "state-dir": "/elsewhere"})
    (registry.templates.root / "half.tmp-123").mkdir(parents=True)

    report = reconcile(registry, memory)

    assert report == {"kept": ["kept"], "dropped": ["vanished"], "adopted": ["orphan"],
                      "removed": ["azq-template-x"], "freed": [], "failed": [],
                      "continued": []}
    with pytest.raises(SandboxNotFound):
        registry.record("vanished")
    assert not vm_paths("vanished").vm_dir.exists()
    rec = registry.record("orphan")
    assert (rec.template, rec.sharing_domain, rec.ram_mode, rec.uuid, rec.policy) == \
        ("base", "task7", "cow", adopted.uuid, "manual")
    assert build.destroyed and not foreign.destroyed
    with pytest.raises(SandboxNotFound):
        registry.record("theirs")
    assert set(registry.sched) == {"kept", "orphan"}
    assert (registry.sched["kept"].policy.name, registry.sched["kept"].grace_s) == ("agentzip", 3.0)
    assert registry.sched["orphan"].policy.name == "manual"
    assert not (registry.templates.root / "half.tmp-123").exists()


def test_lazy_clones_get_their_memory_back_and_compressed_ones_stay_azqemus(
        registry: Registry, memory: MemoryService, host: Any, sandbox_meta_of: Any,
        template: TemplateMeta) -> None:
    host.add("lazy", sandbox_meta_of(ram_mode="lazy", sharing_domain="t1"), state="paused")
    host.add("eager", sandbox_meta_of(), state="paused")
    registry.sandboxes.save(_record("lazy", state="compressed"))
    registry.sandboxes.save(_record("eager"))
    mem = RecordingMemory(memory, compressed_names={"lazy"})

    reconcile(registry, mem)

    assert mem.attached == [("lazy", "t1", "base", True)]
    # Paused and compressed: azqemu paused it, a tool call resumes it. The eager one was
    # paused by its user and stays so.
    assert registry.paused_by_azq == {"lazy"}
    assert registry.state_of("lazy") == ("compressed", None) and registry.state_of("eager") == ("running", None)
    assert registry.slot("eager").user_paused


def test_a_second_reconcile_changes_nothing(registry: Registry, memory: MemoryService, host: Any,
                                            sandbox_meta_of: Any, template: TemplateMeta) -> None:
    host.add("a", sandbox_meta_of())
    first = reconcile(registry, memory)
    second = reconcile(registry, memory)
    assert first["adopted"] == ["a"]
    assert second == {"kept": ["a"], "dropped": [], "adopted": [], "removed": [], "freed": [], "failed": [],
                      "continued": []}


def test_a_sandbox_paused_by_a_trim_of_a_manager_that_died_runs_again(
        registry: Registry, memory: MemoryService, host: Any, sandbox_meta_of: Any, template: TemplateMeta) -> None:
    """A trim pauses the vCPUs for its drop without a state of its own: a manager killed there
    left a running sandbox paused. The record says whether its user paused it (azq pause)."""
    trimmed = host.add("trimmed", sandbox_meta_of(ram_mode="cow"), state="paused")
    mine = host.add("mine", sandbox_meta_of(ram_mode="cow"), state="paused")
    registry.sandboxes.save(_record("trimmed", user_paused=False))
    registry.sandboxes.save(_record("mine", user_paused=True))

    report = reconcile(registry, memory)

    assert report["continued"] == ["trimmed"]
    assert trimmed.state() == "running" and not registry.slot("trimmed").user_paused
    assert mine.state() == "paused" and registry.slot("mine").user_paused
    assert registry.state_of("trimmed") == registry.state_of("mine") == ("running", None)
