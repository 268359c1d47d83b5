"""The built-in workloads whose steps need their template's warm-up (long-lived-heap: a
kernel process started there; service-agent: an HTTP service) run on this host too: warm-up
first, then every step, with the guest paths pointed at tmp_path (Debian's coreutils and the
host's python3). What a warm-up started is stopped after."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from azqemu.bench.workload import load

# Guest paths the workloads use -> where they go on this host (under tmp_path).
GUEST_PATHS = ("/run/kheap", "/run/svc", "/tmp/build", "/workspace/mono")


def _local(cmd: str, root: Path) -> str:
    for p in GUEST_PATHS:
        cmd = cmd.replace(p, str(root / p.strip("/").replace("/", "-")))
    return cmd


@pytest.mark.parametrize("name", ["long-lived-heap", "long-tools", "many-small-files", "service-agent"])
def test_warmup_then_steps_run_on_this_host(name: str, tmp_path: Path) -> None:
    wl = load(name)
    assert wl.template.warmup, "each new workload has its own template warm-up"
    pidfile = tmp_path / "run-kheap" / "kernel.pid"
    try:
        for cmd in wl.template.warmup:
            r = subprocess.run(["/bin/sh", "-c", _local(cmd, tmp_path)], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, (cmd[:80], r.stdout[-500:], r.stderr[-500:])
        if name == "long-lived-heap":
            pids = subprocess.run(["pgrep", "-f", "python3 kernel.py"], capture_output=True, text=True).stdout
            kernel = [int(p) for p in pids.split() if
                      Path(f"/proc/{p}/cwd").resolve() == (tmp_path / "run-kheap").resolve()]
            assert len(kernel) == 1
            pidfile.write_text(str(kernel[0]))
        for steps in wl.plan(2, seed=5, scale="small"):
            assert steps
            for s in steps:
                r = subprocess.run(["/bin/sh", "-c", _local(s.tool, tmp_path)], capture_output=True, text=True,
                                   timeout=120)
                assert r.returncode == 0, (s.label, r.stdout[-500:], r.stderr[-500:])
                if name == "long-lived-heap":
                    assert r.stdout.rstrip().endswith("azq-cell: ok")
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
        _stop_started_in(tmp_path)


def _stop_started_in(root: Path) -> None:
    """Stop the processes a warm-up left running with their directory under ``root``."""
    for proc in psutil.process_iter(["cwd"]):
        cwd = proc.info.get("cwd")
        if cwd and Path(cwd).is_relative_to(root):
            with contextlib.suppress(psutil.Error):
                proc.terminate()


def test_a_failing_cell_fails_the_tool_call(tmp_path: Path) -> None:
    wl = load("long-lived-heap")
    pid = None
    try:
        for cmd in wl.template.warmup[:1]:
            subprocess.run(["/bin/sh", "-c", _local(cmd, tmp_path)], check=True, capture_output=True, timeout=120)
        pid = next(int(p) for p in subprocess.run(["pgrep", "-f", "python3 kernel.py"], capture_output=True,
                                                  text=True).stdout.split()
                   if Path(f"/proc/{p}/cwd").resolve() == (tmp_path / "run-kheap").resolve())
        cell = _local("/run/kheap/cell", tmp_path)
        r = subprocess.run([cell], input="raise ValueError('boom')\n", capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "ValueError: boom" in r.stdout and r.stdout.rstrip().endswith("azq-cell: error")
        # The kernel survives a failing cell and keeps its heap.
        r = subprocess.run([cell], input="print(len(rows))\n", capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.startswith("250000")
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
