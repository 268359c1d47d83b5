"""Talking to a real guest in integration tests: shell commands through the daemon, and the
in-guest memory checker (tests/integration/guest_checker.py) that reports BAD on any wrong
byte. Shared by the memory-correctness tests (lazy memory, crash points)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from azqemu.client import Client

CHECKER = (Path(__file__).parents[1] / "integration" / "guest_checker.py").read_text()


def needs_lazy_restore() -> None:
    """Skip the calling test where this host has no userfaultfd export."""
    from azqemu.host.doctor import restore_mode

    mode, why = restore_mode()
    if mode != "lazy":
        pytest.skip(f"no userfaultfd export here: {why}")


def sh(name: str, cmd: str, timeout_s: float = 120) -> tuple[int, str]:
    r = Client().exec(name=name, argv=["/bin/sh", "-c", cmd], timeout_s=timeout_s)
    return r.exit_code, r.stdout.decode().strip()


def md5_ok(name: str, path: str = "/tmp/blob.md5") -> None:
    """The guest's own check of a file written before (``md5sum -c``): exact, or the test fails."""
    code, out = sh(name, f"md5sum -c {path}")
    assert code == 0, out


def start_checker(name: str, size_mib: int, tag: str) -> None:
    Client().exec(name=name, argv=["/bin/sh", "-c", "cat > /tmp/checker.py"],
                  stdin=CHECKER.encode())
    code, _ = sh(name, f"nohup python3 /tmp/checker.py {size_mib} /tmp/st-{tag} {name}-{tag} "
                       f">/dev/null 2>&1 & sleep 0.5; echo started")
    assert code == 0


def blob_and_checker(name: str, checker_mib: int, tag: str) -> int:
    """The guest's own pages to check across cycles: a compressible file (/tmp/blob, 20 MiB of
    text, its md5 beside it: ``md5_ok``) and a running memory checker of ``checker_mib`` MiB
    (``wait_rounds``). Returns the checker's first round."""
    code, out = sh(name, "seq 1 3000000 > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
    assert code == 0, out
    start_checker(name, checker_mib, tag)
    return wait_rounds(name, tag, 0)


def checker_rounds(name: str, tag: str) -> int:
    code, out = sh(name, f"cat /tmp/st-{tag} 2>/dev/null || echo NONE")
    assert not out.startswith("BAD"), f"{name}: guest saw wrong data: {out}"
    return int(out.split()[1]) if out.startswith("OK") else 0


def wait_rounds(name: str, tag: str, above: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = checker_rounds(name, tag)
        if n > above:
            return n
        time.sleep(0.3)
    raise AssertionError(f"{name}: checker {tag} made no progress past round {above}")
