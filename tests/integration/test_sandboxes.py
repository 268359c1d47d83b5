"""Sandboxes under real libvirtd and real QEMU: clone, exec, isolation, destroy, restart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from azqemu import config as config_mod
from azqemu.client import Client
from azqemu.daemon import proc as daemonproc

# Every test needs root (the azq_env fixture); all but the last start guests.
pytestmark = pytest.mark.root


def _domains() -> set[str]:
    import libvirt

    conn = libvirt.open("qemu:///system")
    try:
        return {d.name() for d in conn.listAllDomains()}
    finally:
        conn.close()


@pytest.mark.vm
def test_clone_four_exec_isolation_and_destroy(template: str, azq) -> None:
    r = azq("clone", template, "-n", "4", "--name-prefix", "iso-", check=True)
    names = [f"iso-{i}" for i in range(4)]
    for n in names:
        assert f"{n}: cloned from {template}" in r.stdout
    assert set(names) <= _domains()
    for n in names:
        w = azq("exec", n, "--", "/bin/sh", "-c", f"echo {n} > /tmp/who && cat /tmp/who")
        assert w.returncode == 0, w.stderr
        assert w.stdout.strip() == n
    # A file written in one clone is not visible in another.
    assert azq("exec", "iso-1", "--", "cat", "/tmp/who").stdout.strip() == "iso-1"
    probe = azq("exec", "iso-2", "--", "/bin/sh", "-c", "test -e /tmp/only-in-0; echo $?")
    azq("exec", "iso-0", "--", "touch", "/tmp/only-in-0", check=True)
    probe = azq("exec", "iso-2", "--", "/bin/sh", "-c", "test -e /tmp/only-in-0; echo $?")
    assert probe.stdout.strip() == "1"
    # The command's own exit code and stderr come back as azq's.
    fail = azq("exec", "iso-3", "--", "/bin/sh", "-c", "echo oops >&2; exit 7")
    assert fail.returncode == 7 and fail.stderr.strip() == "oops"
    listed = azq("list", "--json", check=True).stdout
    for n in names:
        assert n in listed
    # KSM never merges these sandboxes' pages (only the linux policy's): QEMU runs with
    # mem-merge=off from <nosharepages/>.
    import json as json_mod

    pid = next(r["qemu_pid"] for r in json_mod.loads(listed) if r["name"] == "iso-0")
    assert "mem-merge=off" in Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")
    for n in names:
        azq("destroy", n, check=True)
    cfg = config_mod.load()
    assert not set(names) & _domains()
    for n in names:
        assert not (cfg.run_dir / "vm" / n).exists()
        assert not (cfg.sandboxes_dir / f"{n}.json").exists()


@pytest.mark.vm
def test_daemon_restart_keeps_sandboxes(template: str, daemon: dict, azq) -> None:
    azq("clone", template, "-n", "1", "--name-prefix", "keep-", check=True)
    azq("exec", "keep-0", "--", "/bin/sh", "-c", "echo kept > /tmp/mark", check=True)
    daemonproc.stop(daemon["proc"])
    daemon["proc"] = daemonproc.start()
    names = [s.name for s in Client().list_sandboxes()]
    assert "keep-0" in names
    assert azq("exec", "keep-0", "--", "cat", "/tmp/mark").stdout.strip() == "kept"
    azq("destroy", "keep-0", check=True)


@pytest.mark.vm
def test_bad_inputs_are_one_line_and_leave_nothing(template: str, azq) -> None:
    def one_line(r, code: int, text: str) -> None:
        assert r.returncode == code, (r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and text in lines[0], r.stderr

    one_line(azq("clone", "no-such-template"), 1, "unknown template 'no-such-template'")
    # azq exec keeps its own codes apart from the command's (README.md): 125 azqemu failed.
    one_line(azq("exec", "no-such-sandbox", "--", "true"), 125, "unknown sandbox 'no-such-sandbox'")
    one_line(azq("destroy", "no-such-sandbox"), 1, "unknown sandbox 'no-such-sandbox'")
    azq("clone", template, "-n", "1", "--name-prefix", "dup-", check=True)
    before = _domains()
    cfg = config_mod.load()
    # Duplicate name: the existing sandbox is untouched, nothing new appears.
    from azqemu.errors import SandboxExists

    with pytest.raises(SandboxExists, match="already exists"):
        Client().clone(template=template, names=["dup-0"])
    assert _domains() == before
    one_line(azq("template", "delete", template), 1, "still has 1 clone(s): dup-0")
    one_line(azq("exec", "dup-0", "--", "/no/such/cmd"), 127, "cannot run '/no/such/cmd' in 'dup-0'")
    one_line(azq("exec", "dup-0", "--timeout", "1", "--", "sleep", "30"), 124,
             "did not finish 'sleep' within 1 s")
    azq("destroy", "dup-0", check=True)
    assert not (cfg.sandboxes_dir / "dup-0.json").exists()


@pytest.mark.vm
def test_out_of_disk_space_leaves_no_template(daemon: dict, azq, tmp_path: Path) -> None:
    """A state directory on a tiny tmpfs: template create fails cleanly with DiskFull."""
    import subprocess

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    old_state = os.environ["AZQ_STATE_DIR"]
    try:
        daemonproc.stop(daemon["proc"])
        os.environ["AZQ_STATE_DIR"] = str(mnt / "state")
        daemon["proc"] = daemonproc.start()
        r = azq("template", "create", "tiny", "--mem", "256M")
        assert r.returncode == 1
        assert r.stderr.strip().startswith("azq: not enough space in")
        assert not any((mnt / "state" / "templates").glob("tiny*")) if (mnt / "state" / "templates").exists() else True
        assert not any(d.startswith("azq-template-tiny") for d in _domains())
    finally:
        daemonproc.stop(daemon["proc"])
        os.environ["AZQ_STATE_DIR"] = old_state
        subprocess.run(["umount", str(mnt)], check=False)
        daemon["proc"] = daemonproc.start()


def test_libvirtd_unreachable_is_one_line(azq_env: dict, tmp_path: Path) -> None:
    import subprocess
    import sys

    env = dict(os.environ, AZQ_LIBVIRT_URI="qemu+unix:///system?socket=/nonexistent/libvirt-sock",
               AZQ_RUN_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "azqemu", "daemon"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 1
    assert "azq: libvirtd does not answer at qemu+unix:///system?socket=/nonexistent/libvirt-sock" in r.stderr
    assert "Traceback" not in r.stderr
