"""Prometheus metrics of the daemon, served at ``/metrics`` when ``AZQ_METRICS_ADDR`` is set.

Opt-in: ``AZQ_METRICS_ADDR=host:port`` (e.g. ``127.0.0.1:9464``, ``[::1]:9464``) makes the
daemon listen there; unset, nothing listens. The per-sandbox figures are read from the
daemon's services at scrape time (``collect``), nothing is sampled in between: the same
owned / resident / stored bytes as ``azq list`` and the density benchmark (``Accounting``),
the phase the scheduler sees, the fault handler's service times. Compress and restore
durations are observed where they complete (``memsvc``), into ``durations``' histograms.

Names follow Prometheus conventions: ``azqemu_`` prefix, base units (bytes, seconds),
``_total`` for counters. Per-sandbox series carry ``sandbox``, ``template`` and ``policy``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from azqemu.daemon.durations import COMPRESS_SECONDS, RESTORE_SECONDS
from azqemu.errors import AzqemuError, ConfigError, DomainNotFound
from azqemu.host.memacct import KsmStat
from azqemu.memory.accounting import OwnedBytes
from azqemu.sched.phases import TOOL, UNKNOWN, WAIT

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from azqemu.daemon.manager import Manager
    from azqemu.restore.handler import FaultHandler

log = logging.getLogger(__name__)

ENV_ADDR = "AZQ_METRICS_ADDR"
PHASES = (TOOL, WAIT, UNKNOWN)
# libvirt's states (virt.host) and "gone": a record whose domain no longer exists.
STATES = ("running", "paused", "blocked", "shutdown", "shutoff", "crashed", "pmsuspended", "nostate", "gone")
FAILED_STATES = frozenset({"shutoff", "crashed", "gone"})
SANDBOX_LABELS = ["sandbox", "template", "policy"]

FAULT_BUCKETS_S = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3)


def parse_addr(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ConfigError otherwise."""
    host, sep, port = value.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{ENV_ADDR}={value!r}: expected HOST:PORT (e.g. 127.0.0.1:9464)")
    return host, int(port)


class FaultServiceHistogram:
    """A cumulative histogram of fault service times over every fault handler.

    Each handler keeps the service times of its newest faults in a ring (restore/handler.py);
    at each scrape the samples recorded since the previous one are counted into buckets. A
    handler that recorded more than its ring holds between two scrapes loses the oldest of
    them (``lost``); a reset of its window (``azq bench restore``) starts its count again."""

    def __init__(self, buckets_s: tuple[float, ...] = FAULT_BUCKETS_S) -> None:
        self.bounds_ns = np.array([b * 1e9 for b in buckets_s])
        self.buckets_s = buckets_s
        self.counts = np.zeros(len(buckets_s) + 1, dtype=np.int64)  # last: above every bound
        self.sum_s = 0.0
        self.lost = 0
        self._seen: weakref.WeakKeyDictionary[FaultHandler, int] = weakref.WeakKeyDictionary()

    def update(self, handler: FaultHandler) -> None:
        now = handler.samples_recorded
        prev = self._seen.get(handler, 0)
        if now < prev:  # the window was reset
            prev = 0
        self._seen[handler] = now
        if now == prev:
            return
        ring = handler.service_times_ns()
        size = len(ring)
        if now - prev > size:
            self.lost += now - prev - size
            prev = now - size
        idx = np.arange(prev, now) & (size - 1) if now > size else np.arange(prev, now)
        self.add_ns(ring[idx])

    def add_ns(self, t_ns: np.ndarray) -> None:
        self.counts += np.bincount(np.searchsorted(self.bounds_ns, t_ns, side="left"),
                                   minlength=len(self.counts))[:len(self.counts)]
        self.sum_s += float(t_ns.sum()) / 1e9

    def family(self) -> HistogramMetricFamily:
        cum = np.cumsum(self.counts)
        buckets = [(floatToGoString(b), float(c)) for b, c in zip(self.buckets_s, cum[:-1])]
        buckets.append(("+Inf", float(cum[-1])))
        return HistogramMetricFamily("azqemu_fault_service_seconds",
                                     "Time from reading a page fault to placing the page, every sandbox",
                                     buckets=buckets, sum_value=self.sum_s)


class DaemonCollector(Collector):
    """The daemon's figures, read from its services at each scrape."""

    def __init__(self, manager: Manager) -> None:
        self.m = manager
        self.faults = FaultServiceHistogram()
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # scrapes may overlap; the fault histogram's books are shared
            yield from self._collect()

    def _collect(self) -> Iterator[Metric]:
        m = self.m
        reg = m.registry
        g = {k: GaugeMetricFamily(f"azqemu_sandbox_{k}_bytes", doc, labels=SANDBOX_LABELS) for k, doc in (
            ("owned", "Host memory this sandbox owns: its guest RAM held alone plus its share of the store"),
            ("resident", "Guest RAM the host holds for this sandbox alone"),
            ("stored", "This sandbox's bytes in the page store (compressed pages, shares, index)"),
            ("qemu_own", "QEMU's own memory for this sandbox, guest RAM excluded"))}
        compressed = GaugeMetricFamily("azqemu_sandbox_compressed", "1 while the sandbox's RAM is compressed",
                                       labels=SANDBOX_LABELS)
        phase = GaugeMetricFamily("azqemu_sandbox_phase", "The sandbox's phase as the scheduler sees it "
                                  "(1 for the current one)", labels=[*SANDBOX_LABELS, "phase"])
        state = GaugeMetricFamily("azqemu_sandbox_state", "The domain's state (1 for the current one)",
                                  labels=[*SANDBOX_LABELS, "state"])
        faults = CounterMetricFamily("azqemu_sandbox_faults", "Page faults the manager served for this "
                                     "sandbox since its memory was attached", labels=SANDBOX_LABELS)
        info = GaugeMetricFamily("azqemu_sandbox_info", "Static facts of a sandbox",
                                 labels=[*SANDBOX_LABELS, "ram_mode", "sharing_domain"])
        failed = 0
        records = reg.sandboxes.list()
        store_bytes, store_live, overhead, books = self._store([r.name for r in records])
        host_mm = m.accounting.read_host_mm()
        for rec in records:
            st = reg.sched.get(rec.name)
            policy = st.policy.name if st is not None else rec.policy
            labels = [rec.name, rec.template, policy]
            try:
                dom_state = reg.host.get_domain(rec.name).state()
            except DomainNotFound:
                dom_state = "gone"
            except AzqemuError:
                dom_state = "nostate"
            mem = m.memory.get(rec.name)
            # A fault handler that died, or stored pages lost (memsvc's ``failed``, where it has one).
            mem_failed = (mem is not None and mem.handler.last_error is not None
                          or rec.name in getattr(m.memory, "failed", {}))
            failed += dom_state in FAILED_STATES or mem_failed
            info.add_metric([*labels, rec.ram_mode, rec.sharing_domain], 1)
            for s in STATES:
                state.add_metric([*labels, s], 1 if s == dom_state else 0)
            current = st.tracker.current().phase if st is not None else UNKNOWN
            for p in PHASES:
                phase.add_metric([*labels, p], 1 if p == current else 0)
            compressed.add_metric(labels, 1 if mem is not None and mem.compressed else 0)
            if mem is not None:
                faults.add_metric(labels, mem.handler.stats().faults)
                self.faults.update(mem.handler)
            row = self._owned(rec.name, overhead, host_mm, books) if dom_state not in FAILED_STATES else {}
            for k, fam in g.items():
                fam.add_metric(labels, float(row.get(f"{k}_bytes", 0)))
        yield from g.values()
        yield from (compressed, phase, state, faults, info)
        yield self.faults.family()
        yield GaugeMetricFamily("azqemu_sandboxes", "Sandboxes the daemon has records of", value=len(records))
        yield GaugeMetricFamily("azqemu_sandboxes_failed", "Sandboxes whose domain is gone, shut off or "
                                "crashed, or whose fault handler died", value=failed)
        yield GaugeMetricFamily("azqemu_store_allocated_bytes", "Page-store arena bytes on tmpfs (host memory), "
                                "dead bytes not yet reclaimed included", value=store_bytes)
        yield GaugeMetricFamily("azqemu_store_live_bytes", "Page-store arena bytes in use", value=store_live)
        yield GaugeMetricFamily("azqemu_manager_resident_memory_bytes", "Resident memory of the manager process",
                                value=psutil.Process().memory_info().rss)
        parts = GaugeMetricFamily("azqemu_manager_memory_bytes", "The manager's memory by part "
                                  "(Accounting.manager_memory: anon, file, shmem, heap_free, store_index, "
                                  "template_index, sandbox_state)", labels=["part"])
        for key, value in m.accounting.manager_memory().items():
            if key.endswith("_bytes") and key != "rss_bytes":
                parts.add_metric([key[:-len("_bytes")]], float(value))
        yield parts
        lost = CounterMetricFamily("azqemu_sandboxes_lost", "Sandboxes whose domain ended outside azqemu "
                                   "(virsh destroy, a crash, a guest shutdown), released at once, by cause",
                                   labels=["cause"])
        watcher = getattr(m, "watcher", None)
        for cause, n in (watcher.lost_total.items() if watcher is not None else ()):
            lost.add_metric([cause], n)
        yield lost
        yield CounterMetricFamily("azqemu_fault_service_lost_samples",
                                  "Fault service times recorded but not counted (ring overrun between scrapes)",
                                  value=self.faults.lost)

    def _store(self, names: list[str]) -> tuple[int, int, float, dict[str, OwnedBytes]]:
        """The store's bytes, its dead-bytes overhead, and the store books of ``names`` (the
        blob table walked once per scrape, not once per sandbox)."""
        store = self.m.memory.opened_store()
        if store is None:
            return 0, 0, 1.0, {}
        tb, books = store.books(names)
        return int(tb.arena_allocated_bytes), int(tb.arena_live_bytes), tb.dead_overhead, books

    def _owned(self, name: str, overhead: float, host_mm: tuple[KsmStat, dict[str, int]],
               books: dict[str, OwnedBytes]) -> dict[str, Any]:
        try:
            return self.m.accounting.owned(name, store_overhead=overhead, host_mm=host_mm, books=books)
        except (AzqemuError, OSError) as exc:  # a sandbox going away during the scrape
            log.debug("metrics: owned bytes of %s: %s", name, exc)
            return {}


def make_registry(manager: Manager) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(DaemonCollector(manager))
    registry.register(COMPRESS_SECONDS)
    registry.register(RESTORE_SECONDS)
    return registry


class MetricsListener:
    """The ``/metrics`` HTTP listener (prometheus-client's WSGI server in a thread)."""

    def __init__(self, manager: Manager, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        try:
            self._server: WSGIServer
            self._server, self._thread = start_http_server(port, host, registry=make_registry(manager))
        except OSError as exc:
            raise ConfigError(f"metrics: cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        self.address = f"{host}:{self._server.server_port}"
        log.info("metrics at http://%s/metrics", self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def listen_from_env(manager: Manager, env: dict[str, str] | None = None) -> MetricsListener | None:
    """Start the listener if ``AZQ_METRICS_ADDR`` is set (ConfigError if it is malformed)."""
    import os

    value = (env if env is not None else os.environ).get(ENV_ADDR, "").strip()
    if not value:
        return None
    return MetricsListener(manager, *parse_addr(value))
