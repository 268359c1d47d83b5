"""The density benchmark's workload template follows the guest image."""

from __future__ import annotations

from typing import Any

from azqemu.api.models import Template
from azqemu.bench import density
from azqemu.bench.workload import load


class _Image:
    def __init__(self, key: str) -> None:
        self.key = key


class _Daemon:
    """The three template operations of the client (azqemu.client) the benchmark uses, on a dict."""

    def __init__(self, templates: dict[str, int]) -> None:
        self.templates = templates          # name -> clones
        self.calls: list[tuple[str, str]] = []

    def template_list(self) -> list[Template]:
        return [Template(name=n, mem_mib=512, vcpus=1, clones=k) for n, k in self.templates.items()]

    def template_create(self, name: str, **_kw: Any) -> None:
        self.calls.append(("template_create", name))
        self.templates[name] = 0

    def template_delete(self, name: str) -> None:
        self.calls.append(("template_delete", name))
        del self.templates[name]


def test_template_is_remade_for_a_new_image_and_the_old_one_goes(monkeypatch) -> None:
    wl = load("coding-agent")
    d = _Daemon({"base": 0})
    monkeypatch.setattr(density, "find_image", lambda: _Image("aaaa"))
    first = density.ensure_workload_template(d, wl, lambda _m: None)  # type: ignore[arg-type]
    assert density.ensure_workload_template(d, wl, lambda _m: None) == first  # type: ignore[arg-type]
    assert d.calls == [("template_create", first)]
    monkeypatch.setattr(density, "find_image", lambda: _Image("bbbb"))
    second = density.ensure_workload_template(d, wl, lambda _m: None)  # type: ignore[arg-type]
    assert second != first and second.startswith("wl-coding-agent-") and len(second) <= 48
    assert d.calls[1:] == [("template_delete", first), ("template_create", second)]
    assert set(d.templates) == {"base", second}              # other templates untouched


def test_a_template_in_use_is_kept(monkeypatch) -> None:
    wl = load("coding-agent")
    monkeypatch.setattr(density, "find_image", lambda: _Image("aaaa"))
    d = _Daemon({})
    old = density.ensure_workload_template(d, wl, lambda _m: None)  # type: ignore[arg-type]
    d.templates[old] = 3
    monkeypatch.setattr(density, "find_image", lambda: _Image("bbbb"))
    density.ensure_workload_template(d, wl, lambda _m: None)  # type: ignore[arg-type]
    assert old in d.templates
