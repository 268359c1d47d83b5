"""Fakes for the daemon's services: a libvirt host of plain objects and a template on disk.

The fakes have only the few methods of ``virt.host.Host``/``Domain`` the daemon calls; real
libvirt is covered by tests/integration. Records, templates and socket directories are the
real ones, in a temporary state directory.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from azqemu import config as config_mod
from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.registry import Registry
from azqemu.errors import AgentError, DomainNotFound
from azqemu.virt.clones import SandboxRepo
from azqemu.virt.templates import TemplateMeta, TemplateRepo


class FakeDomain:
    def __init__(self, host: FakeHost, name: str, meta: dict[str, str], *, state: str, pid: int | None) -> None:
        self._host = host
        self.name = name
        self.uuid = str(uuid.uuid4())
        self._meta = dict(meta)
        self._state = state
        self.pid = pid
        self.destroyed = False

    def _alive(self) -> None:
        if self.destroyed:
            raise DomainNotFound(self.name)

    def state(self) -> str:
        self._alive()
        return self._state

    def metadata(self) -> dict[str, str]:
        self._alive()
        return dict(self._meta)

    def set_metadata(self, attrs: dict[str, str], labels: dict[str, str] | None = None) -> None:
        self._alive()
        self._meta.update(attrs)
        self.labels = dict(labels or {})

    def qemu_pid(self) -> int | None:
        return None if self.destroyed else self.pid

    def suspend(self) -> None:
        self._alive()
        self._state = "paused"

    def resume(self) -> None:
        self._alive()
        self._state = "running"

    def destroy(self, *, graceful: bool = False) -> None:
        self._alive()
        self.destroyed = True
        self._host.doms.pop(self.name, None)

    def agent_command(self, command_json: str, timeout_s: int) -> str:
        raise AgentError(f"guest agent of {self.name!r} is not connected yet")


class FakeHost:
    """What the daemon calls of ``virt.host.Host``: domains, get_domain, has_domain, qemu_pid, close."""

    def __init__(self) -> None:
        self.doms: dict[str, FakeDomain] = {}

    def add(self, name: str, meta: dict[str, str], *, state: str = "running", pid: int | None = None) -> FakeDomain:
        dom = FakeDomain(self, name, meta, state=state, pid=pid)
        self.doms[name] = dom
        return dom

    def domains(self) -> list[FakeDomain]:
        return list(self.doms.values())

    def get_domain(self, name: str) -> FakeDomain:
        try:
            return self.doms[name]
        except KeyError:
            raise DomainNotFound(name) from None

    def has_domain(self, name: str) -> bool:
        return name in self.doms

    def qemu_pid(self, name: str) -> int | None:
        dom = self.doms.get(name)
        return None if dom is None else dom.qemu_pid()

    def close(self) -> None:
        pass


def sandbox_meta(cfg: config_mod.Config, template: str = "base", ram_mode: str = "eager",
                 sharing_domain: str = "default") -> dict[str, str]:
    """The metadata virt.clones.clone_one gives a sandbox's domain."""
    return {"role": "sandbox", "template": template, "sharing-domain": sharing_domain,
            "state-dir": str(cfg.state_dir), "ram-mode": ram_mode}


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> config_mod.Config:
    # virt.identity and virt.clones read the configuration themselves: set it for them too.
    monkeypatch.setenv("AZQ_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("AZQ_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("AZQ_SHM_DIR", str(tmp_path / "shm"))
    return config_mod.load()


@pytest.fixture
def host() -> FakeHost:
    return FakeHost()


@pytest.fixture
def template(cfg: config_mod.Config) -> TemplateMeta:
    meta = TemplateMeta(name="base", image_key="k", kernel="/k", initrd="/i", rootfs="/r", cmdline="",
                        mem_mib=64, vcpus=1, machine="pc", accel="tcg", libvirt_type="qemu")
    d = TemplateRepo(cfg).dir("base")
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps(asdict(meta)))
    return meta


@pytest.fixture
def registry(cfg: config_mod.Config, host: FakeHost) -> Registry:
    return Registry(cfg, host, TemplateRepo(cfg), SandboxRepo(cfg))  # type: ignore[arg-type]


@pytest.fixture
def memory(cfg: config_mod.Config, registry: Registry) -> MemoryService:
    return MemoryService(cfg, registry.templates, registry.sandboxes, lazy_available=False)


@pytest.fixture
def sandbox_meta_of(cfg: config_mod.Config) -> Any:
    return lambda **kw: sandbox_meta(cfg, **kw)
