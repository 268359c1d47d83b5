"""The domain watcher against a fake host: a sandbox whose domain ended outside azqemu is
released at once; one azqemu destroyed itself, one that runs, and foreign domains are left.
(libvirt's real events, from ``virsh destroy``, are in tests/integration/test_events.py.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.registry import Registry
from azqemu.daemon.watch import DomainWatcher
from azqemu.errors import SandboxNotFound
from azqemu.sched import policy as policy_mod
from azqemu.sched.actions import SchedState
from azqemu.virt.clones import SandboxRecord
from azqemu.virt.identity import vm_paths


def _sandbox(registry: Registry, host: Any, meta: dict[str, str], name: str) -> Any:
    dom = host.add(name, meta)
    registry.sandboxes.save(SandboxRecord(name, "base", "default", "eager", dom.uuid, 0.0))
    registry.sched[name] = SchedState(policy_mod.get("manual"))
    vm_paths(name).vm_dir.mkdir(parents=True)
    return dom


def test_a_domain_destroyed_outside_is_released(registry: Registry, memory: MemoryService, host: Any,
                                                 sandbox_meta_of: Any) -> None:
    dom = _sandbox(registry, host, sandbox_meta_of(), "a")
    w = DomainWatcher(registry, memory)
    dom.destroy()  # virsh destroy
    assert w.handle_ending("a", "stopped", "destroyed")
    with pytest.raises(SandboxNotFound):
        registry.record("a")
    assert "a" not in registry.sched and not vm_paths("a").vm_dir.exists()
    assert w.lost_total == {"destroyed": 1}
    assert w.events()[-1]["event"] == "released"
    assert not w.handle_ending("a", "undefined", "removed")  # the second event finds nothing


def test_a_running_domain_and_an_unknown_name_are_left_alone(registry: Registry, memory: MemoryService,
                                                              host: Any, sandbox_meta_of: Any) -> None:
    _sandbox(registry, host, sandbox_meta_of(), "b")
    w = DomainWatcher(registry, memory)
    assert not w.handle_ending("b", "stopped", "destroyed")  # it runs (again): not ours to drop
    assert registry.record("b")
    w.on_event("foreign", "stopped", "destroyed")
    assert w.events() == [] and w.lost_total == {}


class Source:
    """An event source the test drives (stands in for libvirt's event loop only)."""

    def __init__(self, cb: Callable[[str, str, str], None]) -> None:
        self.cb = cb
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True


def test_events_are_handled_off_the_event_thread(registry: Registry, memory: MemoryService, host: Any,
                                                 sandbox_meta_of: Any) -> None:
    dom = _sandbox(registry, host, sandbox_meta_of(), "c")
    sources: list[Source] = []

    def factory(cb: Callable[[str, str, str], None]) -> Source:
        sources.append(Source(cb))
        return sources[-1]

    w = DomainWatcher(registry, memory, source_factory=factory)
    w.start()
    try:
        dom.destroy()
        sources[0].cb("c", "stopped", "crashed")
        deadline = time.monotonic() + 5
        while registry.sandboxes.path("c").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not registry.sandboxes.path("c").exists()
        assert w.lost_total == {"crashed": 1}
        assert [e["event"] for e in w.events()] == ["stopped", "released"]
    finally:
        w.stop()
    assert sources[0].stopped
