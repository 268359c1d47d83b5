"""Restore figures: fault service time, the faulting thread's stall, prefetch throughput.

Prints figures and asserts no speed target; a run whose guest saw wrong data fails (the
benchmark did not measure what it claims). Uses the harness of tests/integration/test_uffd_export.py
(an unprivileged stand-in QEMU with libazq_uffd.so preloaded, memfd RAM) and the real
azqemu.restore handler and prefetcher in this process. Run:

    .venv/bin/python -m pytest -s tests/perf/test_restore_perf.py

Sources: ``raw`` copies saved page images (the mechanism's own cost), ``zstd`` decodes
each page with zstd level 1 (DESIGN.md measured 7.9 us per page in Python), ``template``
preads a RAM image file.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import test_uffd_export as harness  # noqa: E402

from azqemu.restore.export import UffdExport, UffdHandle  # noqa: E402
from azqemu.restore.handler import FaultHandler  # noqa: E402
from azqemu.restore.prefetch import Prefetcher  # noqa: E402
from azqemu.restore.source import StoreSource, TemplateSource  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.uffd,
              pytest.mark.skipif(harness._skip_reason() is not None, reason=str(harness._skip_reason()))]

PS = 4096
GUEST_MIB = 128
HOT_MIB = 100
built = harness.built  # the session fixture


class BulkArrayStore(harness.ArrayStore):
    """ArrayStore with the optional bulk decode (one call per prefetch chunk)."""

    def decode_pages_into(self, sandbox: str, page_idxs: np.ndarray, out: memoryview) -> None:
        np.take(self.data.reshape(-1, PS), page_idxs, axis=0,
                out=np.frombuffer(out, dtype=np.uint8).reshape(-1, PS))


class ZstdStore:
    """Pages compressed one by one with zstd-1, decoded per fault."""

    def __init__(self, raw: harness.ArrayStore, pages: np.ndarray) -> None:
        import zstandard

        c = zstandard.ZstdCompressor(level=1)
        self._d = zstandard.ZstdDecompressor()
        self.blobs = {int(i): c.compress(bytes(raw._mv[i * PS:(i + 1) * PS])) for i in pages}

    def decode_page_into(self, sandbox: str, page_idx: int, out: memoryview) -> None:
        out[:] = self._d.decompress(self.blobs[page_idx])


@pytest.fixture
def big_guest(built: harness.Built, request: pytest.FixtureRequest) -> Iterator[tuple[harness.Guest, UffdHandle]]:
    g = harness.Guest(built, getattr(request, "param", GUEST_MIB))
    h = UffdExport.connect(g.socket_path, 5)
    b = h.blocks[0]
    h.register(b.hva, b.size_bytes)
    yield g, h
    h.unregister(b.hva, b.size_bytes)
    h.close()
    g.close()


def pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else 0.0


def report(name: str, figures: dict[str, object]) -> None:
    print(f"\n[restore-perf] {name}: {json.dumps(figures)}")


@pytest.mark.parametrize("source_kind,verifiers", [("raw", 1), ("raw", 2), ("zstd", 1), ("template", 1)])
def test_fault_service_and_stall(big_guest, built, source_kind: str, verifiers: int) -> None:  # type: ignore[no-untyped-def]
    g, h = big_guest
    b = h.blocks[0]
    pages = np.arange(b.page_count)
    store = harness.ArrayStore(b.page_count)
    harness.save_and_punch(h, b, pages, store)
    image = None
    if source_kind == "raw":
        source = StoreSource(store, "perf")
    elif source_kind == "zstd":
        source = StoreSource(ZstdStore(store, pages), "perf")
    else:
        image = str(built.root / "perf-image")
        store.data.tofile(image)
        source = TemplateSource(image)
    with FaultHandler(h, source) as fh:
        g.run(verifiers=verifiers, passes=1, mutate=False)
        done = g.wait_done(120)
        t = fh.service_times_ns() / 1e3
        s = fh.stats()
    if image:
        source.close()
        os.unlink(image)
    report(f"faults source={source_kind} vcpus={verifiers}", {
        "faults": s.faults, "served": s.served, "already_present": s.already_present,
        "fault_service_us": {"median": round(pct(t, 50), 1), "p99": round(pct(t, 99), 1),
                             "max": round(float(t.max()) if len(t) else 0, 1)},
        "fault_stall_us": {"median": round(done["touch_med_ns"] / 1e3, 1),
                           "p99": round(done["touch_p99_ns"] / 1e3, 1)},
        "guest_pass_s": round(done["elapsed_ms"] / 1e3, 3),
        "errors": done["errors"],
    })
    assert done["errors"] == 0 and s.errors == 0, (done, s)


@pytest.mark.parametrize("big_guest", [2 * HOT_MIB + 8], indirect=True)
@pytest.mark.parametrize("layout", ["contiguous", "scattered", "isolated"])
@pytest.mark.parametrize("source_kind", ["raw-bulk", "raw-per-page", "template"])
def test_prefetch_hot_set(big_guest, built, layout: str, source_kind: str) -> None:  # type: ignore[no-untyped-def]
    g, h = big_guest
    b = h.blocks[0]
    pages = np.arange(b.page_count)
    store = BulkArrayStore(b.page_count) if source_kind == "raw-bulk" else harness.ArrayStore(b.page_count)
    harness.save_and_punch(h, b, pages, store)
    hot_pages = HOT_MIB * 2**20 // PS
    rng = np.random.default_rng(7)
    if layout == "contiguous":
        hot = np.arange(hot_pages)
    elif layout == "scattered":  # random pages: runs of 1 to a few pages
        hot = np.sort(rng.choice(b.page_count, size=hot_pages, replace=False))
    else:  # the worst case: every other page, each its own run and ioctl
        hot = np.arange(0, 2 * hot_pages, 2)
    image = None
    if source_kind == "template":
        image = str(built.root / "perf-image")
        store.data.tofile(image)
        source = TemplateSource(image)
    else:
        source = StoreSource(store, "perf")
    with Prefetcher(h.uffd) as pf:
        res = pf.prefetch(b, hot, source)
    with FaultHandler(h, source) as fh:  # the rest comes back on touch; the guest checks all
        g.run(verifiers=1, passes=1, mutate=False)
        done = g.wait_done(120)
        faults = fh.stats().faults
    if image:
        source.close()
        os.unlink(image)
    report(f"prefetch {HOT_MIB} MiB layout={layout} source={source_kind}", {
        "prefetch_mib_s": round(res.mib_s, 1), "prefetch_s": round(res.elapsed_s, 4),
        "decode_s": round(res.decode_s, 4), "copy_s": round(res.copy_s, 4),
        "runs": res.runs, "ioctls": res.ioctls, "pages_copied": res.pages_copied,
        "faults_after_prefetch": faults, "faults_without_prefetch": b.page_count,
        "errors": done["errors"],
    })
    assert done["errors"] == 0, done
