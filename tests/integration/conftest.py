"""Integration fixtures: a real libvirtd, a real daemon, a real template (made once per run).

Each test run uses its own state and run directories so a user's own azqemu state is never
touched; the guest image cache is shared (building it is the Makefile's job).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

TEMPLATE = "itest"


def _run_azq(*args: str, timeout: float = 600, check: bool = False,
             input_: str | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "azqemu", *args], capture_output=True, text=True,
                       timeout=timeout, input=input_)
    if check and r.returncode != 0:
        raise AssertionError(f"azq {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


@pytest.fixture(scope="session")
def azq_env() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("integration tests need root (libvirt qemu:///system)")
    base = Path(tempfile.mkdtemp(prefix="azq-itest-"))
    # QEMU runs as libvirt-qemu and maps template RAM images from here (copy-on-write clones).
    os.chmod(base, 0o755)
    run_dir = Path(f"/run/azq-itest-{os.getpid()}")
    env = {"AZQ_STATE_DIR": str(base / "state"), "AZQ_RUN_DIR": str(run_dir),
           "AZQ_SHM_DIR": f"/dev/shm/azq-itest-{os.getpid()}", "AZQ_LOG_DIR": str(base / "log")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # The host facts (KVM verdict) are probed once per boot into the run dir: share them.
    src_facts = Path("/run/azqemu/host.json")
    if src_facts.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(src_facts, run_dir / "host.json")
    try:
        yield env
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(env["AZQ_SHM_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def daemon(azq_env: dict[str, str]) -> Iterator[object]:
    from azqemu.daemon import proc as daemonproc

    proc = daemonproc.start()
    holder = {"proc": proc}
    try:
        yield holder
    finally:
        from azqemu.client import Client
        from azqemu.errors import AzqemuError

        try:
            for s in Client().list_sandboxes():
                try:
                    Client().destroy(s.name)
                except AzqemuError:
                    pass
        except AzqemuError:
            pass
        daemonproc.stop(holder["proc"])


@pytest.fixture(scope="session")
def template(daemon: object) -> str:
    from azqemu.client import Client

    Client().template_create(TEMPLATE, mem_mib=512, vcpus=1,
                  warmup=["cd /workspace/* && python3 -m unittest -q"])
    # Ready to clone: its working copy is on tmpfs before any clone (a clone that made it
    # would put the template's pages in the host memory a density run counts for it).
    assert (Path(os.environ["AZQ_SHM_DIR"]) / "templates" / TEMPLATE / "ram.img").exists()
    return TEMPLATE


@pytest.fixture()
def azq():
    return _run_azq
