"""The lifecycle service against a fake host: clone batches are all or nothing, a taken name
is refused before anything is made, destroy and pause/compress keep the books straight."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from azqemu.daemon.lifecycle import Lifecycle
from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.registry import Registry
from azqemu.daemon.states import State
from azqemu.errors import ConfigError, DomainStateError, SandboxExists, SandboxNotFound, VirtError
from azqemu.sched import policy as policy_mod
from azqemu.sched.actions import SchedState
from azqemu.virt.clones import SandboxRecord, SandboxRepo
from azqemu.virt.identity import vm_paths
from azqemu.virt.templates import TemplateMeta


class FakeClone:
    """Stands in for virt.clones.clone_one: makes the domain, the socket dir and the record
    as the real one does, and fails for the names in ``fail``."""

    def __init__(self, host: Any, sandbox_meta_of: Any, fail: set[str] | None = None) -> None:
        self.host = host
        self.meta_of = sandbox_meta_of
        self.fail = fail or set()
        self.calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, host: Any, tmpl: TemplateMeta, name: str, *, sharing_domain: str, ram_mode: str,
                 fill: Any, repo: SandboxRepo, env: dict[str, str], ram_backing: str, policy: str,
                 grace_s: float, ksm_merge: bool = False) -> SandboxRecord:
        with self._lock:
            self.calls.append({"name": name, "ram_mode": ram_mode, "ram_backing": ram_backing, "policy": policy,
                               "env": env, "ksm_merge": ksm_merge})
        if name in self.fail:
            raise VirtError(f"cannot start {name}")
        dom = host.add(name, self.meta_of(template=tmpl.name, ram_mode=ram_mode, sharing_domain=sharing_domain))
        vm_paths(name).vm_dir.mkdir(parents=True)
        rec = SandboxRecord(name=name, template=tmpl.name, sharing_domain=sharing_domain, ram_mode=ram_mode,
                            uuid=dom.uuid, created_at=0.0, policy=policy, grace_s=grace_s, user_paused=False)
        repo.save(rec)
        return rec


@pytest.fixture
def clone(host: Any, sandbox_meta_of: Any) -> FakeClone:
    return FakeClone(host, sandbox_meta_of)


@pytest.fixture
def life(registry: Registry, memory: MemoryService, clone: FakeClone) -> Lifecycle:
    return Lifecycle(registry, memory, clone_fn=clone)


def test_batch_names_skip_taken_ones_and_get_scheduling_state(life: Lifecycle, registry: Registry,
                                                              template: TemplateMeta, clone: FakeClone) -> None:
    registry.sandboxes.save(SandboxRecord("base-1", "base", "default", "eager", "u", 0.0))
    out = life.clone_batch("base", count=3, policy="none-cow", grace_s=2.5)
    assert sorted(r["name"] for r in out) == ["base-0", "base-2", "base-3"]
    assert {c["ram_mode"] for c in clone.calls} == {"cow"}
    assert {c["ram_backing"] for c in clone.calls} == {"file-private"}
    assert {c["env"] == {} for c in clone.calls} == {True}  # no export library without userfaultfd
    for n in ("base-0", "base-2", "base-3"):
        st = registry.sched[n]
        assert st.policy.name == "none-cow" and st.grace_s == 2.5
        assert registry.record(n).policy == "none-cow"
    assert {c["ksm_merge"] for c in clone.calls} == {False}   # KSM merges only the linux policy's
    life.clone_batch("base", count=1, policy="linux", name_prefix="lx-")
    assert clone.calls[-1]["name"] == "lx-0" and clone.calls[-1]["ksm_merge"] is True


def test_failed_clone_removes_the_whole_batch(life: Lifecycle, registry: Registry, host: Any,
                                              template: TemplateMeta, clone: FakeClone) -> None:
    clone.fail = {"t-2"}
    with pytest.raises(VirtError, match="cannot start t-2"):
        life.clone_batch("base", names=["t-0", "t-1", "t-2", "t-3"], policy="agentzip")
    assert sorted(c["name"] for c in clone.calls) == ["t-0", "t-1", "t-2", "t-3"]
    assert host.doms == {}
    assert registry.sandboxes.list() == []
    assert registry.sched == {}
    for n in ("t-0", "t-1", "t-3"):
        assert not vm_paths(n).vm_dir.exists()


@pytest.mark.parametrize("taken_by", ["domain", "record", "scheduling state"])
def test_taken_name_is_refused_before_anything_is_made(life: Lifecycle, registry: Registry, host: Any,
                                                       template: TemplateMeta, clone: FakeClone,
                                                       sandbox_meta_of: Any, taken_by: str) -> None:
    if taken_by == "domain":
        host.add("x", sandbox_meta_of())
    elif taken_by == "record":
        registry.sandboxes.save(SandboxRecord("x", "base", "default", "eager", "u", 0.0))
    else:
        registry.sched["x"] = SchedState(policy_mod.get("manual"))
    with pytest.raises(SandboxExists) as err:
        life.clone_batch("base", names=["fresh", "x"])
    assert err.value.name == "x"
    assert clone.calls == []
    assert "fresh" not in host.doms
    if taken_by == "domain":
        assert not host.doms["x"].destroyed  # the existing one is never touched


def test_bad_requests_are_refused_with_the_exact_error(life: Lifecycle, template: TemplateMeta,
                                                       clone: FakeClone) -> None:
    with pytest.raises(ConfigError, match=r"clone count 0 out of range \(1-256\)"):
        life.clone_batch("base", count=0)
    with pytest.raises(ConfigError, match="unknown RAM mode 'ballooned'"):
        life.clone_batch("base", ram_mode="ballooned")
    with pytest.raises(ConfigError, match="lazy clones are not available here"):
        life.clone_batch("base", ram_mode="lazy")
    assert clone.calls == []


def test_destroy_forgets_everything_of_the_sandbox(life: Lifecycle, registry: Registry, host: Any,
                                                   template: TemplateMeta) -> None:
    life.clone_batch("base", names=["d-0"])
    registry.settle("d-0", State.COMPRESSED)
    life.destroy("d-0")
    assert "d-0" not in host.doms
    assert "d-0" not in registry.sched and "d-0" not in registry.paused_by_azq
    with pytest.raises(SandboxNotFound):
        registry.record("d-0")
    with pytest.raises(SandboxNotFound):
        life.destroy("d-0")


def test_exec_refuses_a_sandbox_its_user_paused_and_starts_a_wait(life: Lifecycle, registry: Registry,
                                                                  host: Any, template: TemplateMeta) -> None:
    life.clone_batch("base", names=["e-0"], policy="agentzip")
    assert registry.record("e-0").user_paused is False
    life.pause("e-0")
    assert registry.record("e-0").user_paused is True      # a restarted manager leaves it paused
    with pytest.raises(DomainStateError) as err:
        life.exec("e-0", ["true"])
    assert (err.value.state, err.value.required) == ("paused", "running")
    assert host.doms["e-0"].state() == "paused"  # not resumed: azqemu did not pause it
    ph = registry.sched["e-0"].tracker.current()
    assert (ph.phase, ph.source) == ("wait", "exec")  # the end of the call starts a wait
    with pytest.raises(ConfigError, match="no command given"):
        life.exec("e-0", [])
    life.resume("e-0")
    assert registry.record("e-0").user_paused is False and host.doms["e-0"].state() == "running"


def test_compress_without_userfaultfd_is_refused_and_leaves_the_sandbox_running(
        life: Lifecycle, registry: Registry, host: Any, template: TemplateMeta) -> None:
    life.clone_batch("base", names=["c-0"])
    with pytest.raises(ConfigError, match="cannot compress 'c-0'"):
        life.compress("c-0")
    assert host.doms["c-0"].state() == "running"
    assert "c-0" not in registry.paused_by_azq


def test_resume_continues_a_sandbox_azqemu_paused_and_clears_its_mark(
        life: Lifecycle, registry: Registry, host: Any, template: TemplateMeta) -> None:
    life.clone_batch("base", names=["r-0"])
    host.doms["r-0"].suspend()
    registry.settle("r-0", State.COMPRESSED)
    out = life.resume("r-0")
    assert host.doms["r-0"].state() == "running"
    assert "r-0" not in registry.paused_by_azq
    assert out["prefetched_pages"] == 0 and out["resume_s"] >= 0.0
