"""Interrupting a long benchmark: Ctrl-C or SIGTERM stops it within seconds, its sandboxes are
destroyed and the host is put back (the Linux configuration's swap, zram and KSM settings)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from azqemu.client import Client
from azqemu.host.linuxmm import HostSnapshot

pytestmark = [pytest.mark.vm, pytest.mark.root]
WORKLOAD = Path(__file__).parent / "data" / "interruptible.yaml"
STOP_WITHIN_S = 20.0
# What "within a few seconds" means here: the tool call in flight (a 250 s sleep) is abandoned,
# the sandboxes destroyed, the Linux configuration put back.
STOPPED_WITHIN_S = 8.0


def _bench_until(policy: str, marker: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "azqemu", "bench", "density", "-n", "2", "--scale", "small",
                             "--workload", str(WORKLOAD), "--policy", policy, "--grace", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            # as a shell starts a background job: SIGINT ignored, and the
                            # benchmark must take it anyway (an orchestrator's kill -INT)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if marker in line:
            return proc
        assert time.monotonic() < deadline, "the benchmark never reached its workload"
    raise AssertionError(f"the benchmark ended before {marker!r}: {proc.wait()}")


@pytest.mark.parametrize("sig, policy", [(signal.SIGINT, "none-cow"), (signal.SIGTERM, "linux")])
def test_a_signal_stops_the_benchmark_and_leaves_nothing(daemon: object, sig: int, policy: str) -> None:
    before = HostSnapshot.take()
    proc = _bench_until(policy, "running the workload")
    time.sleep(1.0)                          # inside a tool call or an LLM wait
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the benchmark ignored {signal.Signals(sig).name} for {STOP_WITHIN_S} s") from None
    stopped_s = time.monotonic() - t0
    assert rc != 0
    assert stopped_s < STOPPED_WITHIN_S, f"stopping took {stopped_s:.1f} s"
    assert [s.name for s in Client().list_sandboxes() if s.name.startswith("azq-d-")] == []
    assert HostSnapshot.take().diff(before) == []
    print(f"\n{signal.Signals(sig).name} under {policy}: stopped and cleaned up in {stopped_s:.1f} s")
