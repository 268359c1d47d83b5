"""The metrics module's own logic: the listener address and the fault service histogram's
books (the daemon's collector, scraped by promtool and a real Prometheus, is in
tests/integration/test_metrics.py)."""

from __future__ import annotations

import numpy as np
import pytest

from azqemu.daemon import metrics
from azqemu.errors import ConfigError


@pytest.mark.parametrize(("value", "want"), [("127.0.0.1:9464", ("127.0.0.1", 9464)),
                                             ("[::1]:9100", ("::1", 9100)), ("0.0.0.0:1", ("0.0.0.0", 1))])
def test_parse_addr(value: str, want: tuple[str, int]) -> None:
    assert metrics.parse_addr(value) == want


@pytest.mark.parametrize("value", ["9464", "host:", ":9464", "host:0", "host:65536", "host:x"])
def test_parse_addr_refuses(value: str) -> None:
    with pytest.raises(ConfigError, match="AZQ_METRICS_ADDR"):
        metrics.parse_addr(value)


def test_metrics_are_off_unless_configured() -> None:
    assert metrics.listen_from_env(None, env={}) is None  # type: ignore[arg-type]
    assert metrics.listen_from_env(None, env={"AZQ_METRICS_ADDR": " "}) is None  # type: ignore[arg-type]


class Ring:
    """The two things FaultServiceHistogram reads of a fault handler, with the handler's ring
    discipline (newest sample at (count - 1) & (size - 1); a reset restarts the count)."""

    def __init__(self, size: int) -> None:
        self.ring = np.zeros(size, dtype=np.int64)
        self.samples_recorded = 0

    def record(self, t_ns: int) -> None:
        self.ring[self.samples_recorded & (len(self.ring) - 1)] = t_ns
        self.samples_recorded += 1

    def service_times_ns(self) -> np.ndarray:
        return self.ring[:min(self.samples_recorded, len(self.ring))].copy()


def family_counts(h: metrics.FaultServiceHistogram) -> dict[str, float]:
    return {s.labels.get("le", s.name): s.value for s in h.family().samples}


def test_fault_histogram_counts_each_sample_once_in_its_bucket() -> None:
    h = metrics.FaultServiceHistogram((10e-6, 100e-6))
    r = Ring(8)
    for t in (5_000, 50_000, 500_000):
        r.record(t)
    h.update(r)  # type: ignore[arg-type]
    h.update(r)  # type: ignore[arg-type]  # nothing new: nothing counted twice
    c = family_counts(h)
    assert (c["1e-05"], c["0.0001"], c["+Inf"]) == (1, 2, 3)
    assert h.sum_s == pytest.approx(555e-6)
    r.record(10_000)  # exactly on a bound: counted in it (le)
    h.update(r)  # type: ignore[arg-type]
    assert family_counts(h)["1e-05"] == 2


def test_fault_histogram_follows_the_ring_around_and_counts_overruns() -> None:
    h = metrics.FaultServiceHistogram((1e-3,))
    r = Ring(4)
    for _ in range(3):
        r.record(1)
    h.update(r)  # type: ignore[arg-type]
    for _ in range(3):  # wraps: samples 3, 4, 5 at ring slots 3, 0, 1
        r.record(2_000_000)
    h.update(r)  # type: ignore[arg-type]
    c = family_counts(h)
    assert (c["0.001"], c["+Inf"], h.lost) == (3, 6, 0)
    for _ in range(10):  # more than the ring holds between two scrapes
        r.record(1)
    h.update(r)  # type: ignore[arg-type]
    assert h.lost == 6 and family_counts(h)["+Inf"] == 10


def test_fault_histogram_after_a_window_reset_counts_from_zero() -> None:
    h = metrics.FaultServiceHistogram((1e-3,))
    r = Ring(8)
    for _ in range(5):
        r.record(1)
    h.update(r)  # type: ignore[arg-type]
    r.samples_recorded = 0  # azq bench restore's reset
    r.record(1)
    r.record(1)
    h.update(r)  # type: ignore[arg-type]
    assert family_counts(h)["+Inf"] == 7


def test_listener_on_a_taken_port_is_a_config_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match="cannot listen"):
            metrics.MetricsListener(None, "127.0.0.1", port)  # type: ignore[arg-type]
