"""Prometheus metrics: a daemon with AZQ_METRICS_ADDR, scraped by promtool and a real Prometheus.

The session's daemon is restarted with the metrics listener on a free port (same state
directory, so the session's template serves), and put back as it was afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from azqemu.client import Client
from azqemu.daemon import proc as daemonproc
from azqemu.host.doctor import restore_mode
from tests.support import services

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]


@pytest.fixture()
def metrics_addr(template: str, daemon: dict) -> Iterator[str]:
    mode, why = restore_mode()
    if mode != "lazy":
        pytest.skip(f"no userfaultfd export here (nothing to compress): {why}")
    addr = f"127.0.0.1:{services.free_port()}"
    daemonproc.stop(daemon["proc"])
    os.environ["AZQ_METRICS_ADDR"] = addr
    try:
        daemon["proc"] = daemonproc.start()
    finally:
        del os.environ["AZQ_METRICS_ADDR"]
    try:
        yield addr
    finally:
        daemonproc.stop(daemon["proc"])
        daemon["proc"] = daemonproc.start()


def scrape(addr: str) -> str:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=30) as r:
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_pass_promtool_and_prometheus_sees_stored_bytes(metrics_addr: str, template: str) -> None:
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix="metrics-", ram_mode="lazy")
    name = rec.name
    work = Path(tempfile.mkdtemp(prefix="azq-metrics-"))
    try:
        r = c.exec(name=name, argv=["/bin/sh", "-c", "head -c 8M /dev/urandom > /dev/shm/x; echo ok"])
        assert r.exit_code == 0
        st = c.compress(name=name)
        assert st.stored_bytes > 0
        text = scrape(metrics_addr)
        (work / "metrics.txt").write_text(text)
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        lines = samples(text)
        me = (("policy", "manual"), ("sandbox", name), ("template", template))
        assert lines["azqemu_sandbox_stored_bytes", me] > 0
        assert lines["azqemu_sandbox_compressed", me] == 1
        assert lines["azqemu_sandbox_state", tuple(sorted((*me, ("state", "paused"))))] == 1
        assert lines["azqemu_compress_duration_seconds_count", ()] >= 1
        assert lines["azqemu_store_live_bytes", ()] > 0
        assert lines["azqemu_manager_resident_memory_bytes", ()] > 0
        assert lines["azqemu_sandboxes_failed", ()] == 0

        with services.prometheus(metrics_addr, work / "prometheus") as prom:
            deadline = time.monotonic() + 60
            result: list[dict] = []
            while time.monotonic() < deadline and not result:
                result = prom.query(f'azqemu_sandbox_stored_bytes{{sandbox="{name}"}}')
                time.sleep(0.5)
            assert result, "Prometheus never scraped the daemon"
            assert float(result[0]["value"][1]) > 0
            # Resume: the restore histogram and the fault service histogram move.
            c.resume(name=name)
            assert c.exec(name=name, argv=["/bin/sh", "-c", "md5sum /dev/shm/x"]).exit_code == 0
            deadline = time.monotonic() + 30
            restored: list[dict] = []
            while time.monotonic() < deadline and not restored:
                restored = prom.query("azqemu_restore_duration_seconds_count > 0")
                time.sleep(0.5)
            assert restored, "no restore observed"
        assert samples(scrape(metrics_addr))["azqemu_fault_service_seconds_count", ()] > 0
    finally:
        c.destroy(name=name)
        shutil.rmtree(work, ignore_errors=True)
