"""`azq store check`: every stored page decoded and verified, damaged sandboxes and pages
named, --repair frees them; refused while a daemon answers on its socket."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from azqemu.memory import storecheck
from azqemu.memory.kinds import Kind
from azqemu.memory.store import PageStore

from .conftest import SMALL_ARENA


def _damage_one_page(s: PageStore, name: str) -> int:
    idx = s.stored_pages(name)
    victim = int(idx[s.page_kinds(name, idx) == int(Kind.ZSTD)][0])
    hit = s._sandboxes[name].index.lookup_one(victim)
    assert hit is not None
    row = s._table.rows[hit[2]]
    mm = s._arenas.arenas[int(row["arena"])].mm
    pos = int(row["offset"]) + int(row["length"]) - 2
    mm[pos:pos + 1] = bytes([mm[pos] ^ 0x01])
    return victim


def azq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "azqemu", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120)


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_set, small_template) -> tuple[Path, int]:
    monkeypatch.setenv("AZQ_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("AZQ_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("AZQ_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "shm" / "store"
    from azqemu.memory.ram import write_sparse_image
    from azqemu.memory.template import TemplateImage
    tpl_path = tmp_path / "tpl.ram"
    write_sparse_image(tpl_path, small_set.template_idx, small_set.template_pages, small_set.size_bytes)
    tpl = TemplateImage(tpl_path)
    with PageStore(root, arena_bytes=SMALL_ARENA) as s:
        for name, (idx, pages) in zip(("a", "b"), small_set.sandboxes):
            s.encode(name, "d", idx, pages, tpl, owner=f"uuid-{name}")
        s.flush()
        victim = _damage_one_page(s, "b")
    return root, victim


def test_check_names_the_damaged_sandbox_and_page(shm) -> None:
    root, victim = shm
    with PageStore(root) as s:
        report = storecheck.check_store(s)
    by = {r.name: r for r in report.sandboxes}
    assert by["a"].ok and by["a"].pages > 0
    assert not by["b"].ok and by["b"].damaged == [victim] and by["b"].damaged_pages == 1
    assert not report.ok


def test_cli_check_reports_then_repairs(shm) -> None:
    root, victim = shm
    res = azq("store", "check", "--json")
    assert res.returncode == 1, res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] is False
    bad = [s for s in out["sandboxes"] if not s["damaged_pages"] == 0]
    assert [(s["name"], s["damaged"]) for s in bad] == [("b", [victim])]
    res = azq("store", "check", "--repair")
    assert res.returncode == 0, res.stderr
    assert "b: 1 of" in res.stdout and "DAMAGED" in res.stdout and "repaired: freed b" in res.stdout
    res = azq("store", "check")
    assert res.returncode == 0 and "a:" in res.stdout and "b:" not in res.stdout
    with PageStore(root) as s:
        assert s.sandboxes() == ["a"] and s.tombstones() == {"b": "uuid-b"}


def test_cli_check_refuses_while_a_daemon_answers(shm, tmp_path: Path) -> None:
    from azqemu import config as config_mod
    path = config_mod.load().daemon_socket
    path.parent.mkdir(parents=True, exist_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    try:
        res = azq("store", "check")
    finally:
        srv.close()
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [f"azq: the azqemu daemon is running ({path}): stop it first, "
                                       "'azq store check' opens the store itself"]
