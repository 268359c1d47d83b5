"""``azq mem analyze``: what azqemu and the Linux model make of a template and its sandboxes.

Reads the template and sandbox RAM images (files or /proc/PID/fd/N of a QEMU memfd) through
their data extents, encodes every sandbox into a scratch page store in one sharing domain,
decodes everything back (timed, and compared with the original bytes, untimed), and runs the
Linux model (linux_model.py) on the same images. The result follows the stable JSON contract
of DESIGN.md ("Figures the benchmarks print").

Sandboxes are named by path today; ``resolver`` turns any other name (a running sandbox, once
the sandbox layer offers one) into something ``read_resident_pages`` can open.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from azqemu.errors import ConfigError, StoreError
from azqemu.memory.kinds import PAGE_SIZE, Kind
from azqemu.memory.linux_model import linux_model
from azqemu.memory.ram import RamLayout, read_resident_pages
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
from azqemu.memory.zstdlib import DEFAULT_LEVEL

MIB = 1 << 20
# Source a name resolves to: a path, or an open fd (e.g. a QEMU memfd passed over a socket).
RamSource = str | os.PathLike[str] | int
Resolver = Callable[[str], RamSource]


def path_resolver(name: str) -> RamSource:
    """The default resolver: a sandbox is named by the path of its RAM image."""
    if not os.path.exists(name):
        raise ConfigError(f"no RAM image at {name!r}")
    return name


def kind_ratios(pages: dict[str, int], stored_bytes: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Per representation: the bytes its pages held (``bytes_before``), the payload bytes
    stored for them (``bytes_after``: RAW pages count whole, ZERO and TEMPLATE nothing, a DUP
    nothing beyond the blob its first holder paid for) and ``ratio`` = before / after (None
    where nothing is stored). Metadata (blob rows, their index entries, the sandboxes'
    indexes) is not split per kind: ``metadata_fraction`` gives its share of the whole."""
    out = {}
    for kind, n in pages.items():
        before, after = int(n) * PAGE_SIZE, int(stored_bytes.get(kind, 0))
        out[kind] = {"pages": int(n), "bytes_before": before, "bytes_after": after,
                     "ratio": before / after if after else None}
    return out


def metadata_fraction(blob_metadata_bytes: int, index_bytes: int, total_after_bytes: float) -> float:
    """(blob metadata + index bytes) / everything the sandboxes own afterwards (payloads,
    metadata, indexes, RAW pages): the share of the output that is bookkeeping."""
    return (blob_metadata_bytes + index_bytes) / total_after_bytes if total_after_bytes else 0.0


def analyze_images(template: TemplateImage, sandboxes: list[tuple[str, np.ndarray, np.ndarray]], *,
                   domain: str = "analyze", store_dir: str | os.PathLike[str] | None = None,
                   zstd_level: int = DEFAULT_LEVEL, effort: int | None = None,
                   linux: bool = True) -> dict[str, Any]:
    """Core of the analyzer on images already in memory: [(name, page_idx, pages), ...]."""
    own_dir = store_dir is None
    root = Path(tempfile.mkdtemp(prefix="azq-analyze-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
                ) if own_dir else Path(store_dir)   # type: ignore[arg-type]
    try:
        store = PageStore(root, templates=(template,), zstd_level=zstd_level, effort=effort)
        pages_by_kind = {k.name: 0 for k in Kind}
        bytes_by_kind = {k.name: 0 for k in Kind}
        tries: dict[str, int] = {}
        encode_s = 0.0
        encode_cpu_s = 0.0
        before = 0
        for name, idx, pages in sandboxes:
            before += len(idx) * PAGE_SIZE
            r = store.encode(name, domain, idx, pages, template)
            encode_s += r.encode_s
            encode_cpu_s += r.cpu_s
            for k, v in r.pages.items():
                pages_by_kind[k] += v
            for k, v in r.bytes.items():
                bytes_by_kind[k] += v
            for k, v in r.tries.items():
                tries[k] = tries.get(k, 0) + v
        # Decode everything back, timed; compare with the originals, untimed.
        decode_s = 0.0
        decode_cpu_s = 0.0
        decoded = 0
        buf: np.ndarray | None = None
        for name, idx, pages in sandboxes:
            stored = store.stored_pages(name)
            if buf is None or len(buf) < len(stored):
                buf = np.empty((len(stored), PAGE_SIZE), dtype=np.uint8)
                buf[:] = 0          # fault the buffer in before timing, as a prefetcher would
            out = buf[:len(stored)]
            t0, c0 = time.perf_counter(), time.thread_time()
            store.decode(name, stored, out=out)
            decode_s += time.perf_counter() - t0
            decode_cpu_s += time.thread_time() - c0
            decoded += len(stored) * PAGE_SIZE
            pos = np.searchsorted(idx, stored)
            if not np.array_equal(out, pages[pos]):
                raise StoreError(f"round trip of {name!r} does not give back the original pages")
        owned = {name: store.owned_bytes(name) for name, _, _ in sandboxes}
        after = float(sum(o.total_bytes for o in owned.values()))
        dom = store.domain_bytes(domain)
        result: dict[str, Any] = {
            "azqemu": {
                "ratio": before / after if after else float("inf"),
                "bytes_before": before,
                "bytes_after": int(round(after)),
                "pages": pages_by_kind,
                "bytes": bytes_by_kind,
                "index_bytes": dom.index_bytes,
                "blob_metadata_bytes": dom.blob_bytes - dom.payload_bytes,
                "metadata_fraction": metadata_fraction(dom.blob_bytes - dom.payload_bytes, dom.index_bytes, after),
                "by_kind": kind_ratios(pages_by_kind, bytes_by_kind),
                "codec_attempts": tries,
                "zstd_level": zstd_level,
                "zstd_backend": store.zstd.backend,
                "sandboxes": {n: o.as_dict() for n, o in owned.items()},
            },
            "template": {"bytes": template.data_bytes, "pages": int(len(template.page_idx)),
                         "template_id": template.template_id},
            "throughput": {
                # Per core: bytes over the CPU time of the thread doing the work, so that other
                # load on a shared host does not count; wall-clock figures beside them.
                "encode_mib_s": before / MIB / encode_cpu_s if encode_cpu_s else float("inf"),
                "decode_mib_s": decoded / MIB / decode_cpu_s if decode_cpu_s else float("inf"),
                "encode_wall_mib_s": before / MIB / encode_s if encode_s else float("inf"),
                "decode_wall_mib_s": decoded / MIB / decode_s if decode_s else float("inf"),
                "encode_s": encode_s, "decode_s": decode_s, "encode_cpu_s": encode_cpu_s,
                "decode_cpu_s": decode_cpu_s, "decoded_bytes": decoded,
            },
        }
        store.close()
        if linux:
            lm = linux_model(template, [(idx, pages) for _, idx, pages in sandboxes])
            result["linux_model"] = lm.as_dict()
            result["azqemu_vs_linux"] = result["azqemu"]["ratio"] / lm.ratio if lm.ratio else None
        return result
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)


def analyze(template_path: RamSource, sandboxes: list[str], *, domain: str = "analyze",
            resolver: Resolver = path_resolver, layout: RamLayout | None = None,
            store_dir: str | os.PathLike[str] | None = None, zstd_level: int = DEFAULT_LEVEL,
            effort: int | None = None) -> dict[str, Any]:
    """Analyze a template image and sandbox images named through ``resolver``."""
    if not sandboxes:
        raise ConfigError("name at least one sandbox RAM image")
    t0 = time.perf_counter()
    if isinstance(template_path, int):
        idx, pages = read_resident_pages(template_path, layout)
        template = TemplateImage(page_idx=idx, pages=pages, size_bytes=os.fstat(template_path).st_size)
    else:
        if not os.path.exists(template_path):
            raise ConfigError(f"no template RAM image at {os.fspath(template_path)!r}")
        template = TemplateImage(template_path, layout)
    images = []
    for name in sandboxes:
        src = resolver(name)
        idx, pages = read_resident_pages(src, layout)
        images.append((name, idx, pages))
    read_s = time.perf_counter() - t0
    result = analyze_images(template, images, domain=domain, store_dir=store_dir, zstd_level=zstd_level,
                            effort=effort)
    result["throughput"]["read_s"] = read_s
    return result
