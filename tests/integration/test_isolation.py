"""One QEMU cannot reach another's (issue 11): each sandbox's QEMU runs as a uid of its own
(libvirt's static DAC label), so a process with one sandbox's QEMU uid, as a guest that
escaped into its QEMU would be, cannot connect to another sandbox's QMP, export or agent
socket, nor open its QEMU's memory; its own sockets it can. The sandboxes still clone,
compress and resume with every byte exact (lazy and copy-on-write).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from azqemu.client import Client
from azqemu.virt.identity import QEMU_UID_FIRST, qemu_group_gid, vm_paths
from tests.support.guest import needs_lazy_restore, sh

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]

PROBE = """
import socket, sys
kind, path = sys.argv[1], sys.argv[2]
try:
    if kind == "connect":
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(path)
        print("OPEN", s.recv(64)[:16])
    else:
        open(path, "rb").close()
        print("OPEN")
except PermissionError as exc:
    print("EACCES", exc.errno)
except OSError as exc:
    print("ERROR", exc.errno, exc)
"""


@pytest.fixture(autouse=True)
def _needs_lazy() -> None:
    needs_lazy_restore()


def _as_uid(uid: int, gid: int, kind: str, path: Path) -> str:
    """Run the probe as ``uid``:``gid`` with no supplementary groups (what QEMU has)."""
    r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                        sys.executable, "-I", "-c", PROBE, kind, str(path)],
                       capture_output=True, text=True, timeout=30)
    return (r.stdout or r.stderr).strip()


def _proc_ids(pid: int) -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Uid"].split()[0]), int(fields["Gid"].split()[0])


def test_a_qemu_uid_cannot_reach_another_sandboxes_sockets_or_memory(template: str) -> None:
    if qemu_group_gid() is None or os.environ.get("AZQ_QEMU_OWN_UIDS") == "0":
        pytest.skip("no per-domain QEMU users here (QEMU runs as root, or AZQ_QEMU_OWN_UIDS=0)")
    c = Client()
    (a,) = c.clone(template=template, count=1, name_prefix="dac-lazy-", ram_mode="lazy")
    (b,) = c.clone(template=template, count=1, name_prefix="dac-cow-", ram_mode="cow")
    names = [a.name, b.name]
    try:
        info = {n: c.dominfo(n) for n in names}
        ids = {}
        for n in names:
            uid, gid = _proc_ids(info[n].qemu_pid)
            assert uid == info[n].qemu_uid and uid >= QEMU_UID_FIRST, (n, uid, info[n])
            assert gid == qemu_group_gid()
            ids[n] = (uid, gid)
        assert ids[a.name][0] != ids[b.name][0]
        for me, other in ((a.name, b.name), (b.name, a.name)):
            uid, gid = ids[me]
            theirs = vm_paths(other)
            for sock in (theirs.qmp_socket, theirs.uffd_socket, theirs.guest_agent_socket, theirs.azq_agent_socket):
                assert _as_uid(uid, gid, "connect", sock).startswith("EACCES"), (me, sock)
            assert _as_uid(uid, gid, "open", Path(f"/proc/{info[other].qemu_pid}/mem")).startswith("EACCES")
            # The same uid reaches its own QMP socket: the refusal above is the uid's.
            assert _as_uid(uid, gid, "connect", vm_paths(me).qmp_socket).startswith("OPEN"), me
        # Still sandboxes like any other: memory exact across a compression.
        for n in names:
            code, _ = sh(n, "head -c 8000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
            assert code == 0
            st = c.compress(name=n)
            assert st.stored_pages > 0
            c.resume(name=n, prefetch=False)
            assert sh(n, "md5sum -c /tmp/blob.md5")[0] == 0
    finally:
        for n in names:
            c.destroy(name=n)
