"""A page store driven by several threads at once, and the model that says what every page must
decode to: writers encoding, discarding and freeing, flushers, a compactor and readers that
check the bytes of what they decode (test_concurrent_io.py).

Every page's content is a pure function of (sandbox, page, version), mixing the kinds the store
keeps (template-equal, zero, duplicates across sandboxes, template deltas, compressible pages
of their own), never RAW, so a model of {sandbox: {page: version}} says exactly what the store
holds. Each sandbox has one writer thread, so its model is exact whenever that writer is between
two calls; readers accept any version a page ever had (a concurrent re-encode), or NotStored.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.store import NotStored, PageStore
from azqemu.memory.template import TemplateImage

from .conftest import make_template, text_page

N_PAGES = 96
POOL = 48
_pool = np.stack([text_page(70_000 + i) for i in range(POOL)])
_tpl_pages = [text_page(80_000 + i) for i in range(N_PAGES)]


def template() -> TemplateImage:
    return make_template(_tpl_pages)


def content(s: int, p: int, v: int) -> np.ndarray:
    """Page ``p`` of sandbox number ``s`` at version ``v``."""
    k = (p + v) % 5
    if k == 0:
        return _tpl_pages[p].copy()                              # TEMPLATE
    if k == 1:
        return np.zeros(PAGE_SIZE, np.uint8)                      # ZERO
    if k == 2:
        return _pool[(3 * p + v) % POOL].copy()                   # the same in every sandbox: DUP
    out = (_tpl_pages[p] if k == 3 else _pool[(13 * s + p + v) % POOL]).copy()
    out[64 * (p % 32):64 * (p % 32) + 12] = np.frombuffer(np.array([s, p, v], "<u4").tobytes(), np.uint8)
    return out                                                    # TDELTA / ZSTD or SDELTA


@dataclass
class Model:
    """What the store must hold: {sandbox name: {page: version}}, and every version each page
    ever had (for readers racing a writer)."""

    pages: dict[str, dict[int, int]] = field(default_factory=dict)
    history: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def copy(self) -> dict[str, dict[int, int]]:
        with self.lock:
            return {n: dict(p) for n, p in self.pages.items()}


def number(name: str) -> int:
    return int(name.split("-")[1])


def encode(store: PageStore, model: Model, name: str, pages: list[int], tpl: TemplateImage, rng: random.Random) -> None:
    """The writer of ``name`` re-encodes ``pages`` with new versions."""
    s = number(name)
    with model.lock:
        vers = {p: max(model.history.get((name, p), {-1})) + 1 for p in pages}
        for p, v in vers.items():
            model.history.setdefault((name, p), set()).add(v)
    idx = np.array(sorted(pages), dtype=np.int64)
    data = np.stack([content(s, int(p), vers[int(p)]) for p in idx])
    res = store.encode(name, "d", idx, data, tpl, owner=f"uuid-{name}", use_siblings=rng.random() < 0.7)
    assert len(res.raw_idx) == 0, "the model assumes no RAW page"
    with model.lock:
        cur = dict(model.pages.get(name, {}))
        cur.update(vers)
        model.pages[name] = cur


def discard(store: PageStore, model: Model, name: str, pages: list[int]) -> None:
    store.discard(name, np.array(pages, dtype=np.int64))
    with model.lock:
        cur = dict(model.pages[name])
        for p in pages:
            cur.pop(p, None)
        model.pages[name] = cur


def free(store: PageStore, model: Model, name: str) -> None:
    store.free_sandbox(name, tombstone=True)
    with model.lock:
        del model.pages[name]


def writer(store: PageStore, model: Model, names: list[str], tpl: TemplateImage, seed: int,
           stop: threading.Event, errors: list[BaseException], flush_every: int = 0) -> None:
    """Encode, discard and free the sandboxes ``names`` (this thread's own) until ``stop``."""
    rng = random.Random(seed)
    try:
        for name in names:
            encode(store, model, name, list(range(N_PAGES)), tpl, rng)
        i = 0
        while not stop.is_set():
            i += 1
            name = rng.choice(names)
            held = model.pages.get(name)
            r = rng.random()
            if held is None:
                encode(store, model, name, rng.sample(range(N_PAGES), rng.randint(8, N_PAGES)), tpl, rng)
            elif r < 0.55:
                encode(store, model, name, rng.sample(range(N_PAGES), rng.randint(1, 40)), tpl, rng)
            elif r < 0.85 and held:
                discard(store, model, name, rng.sample(sorted(held), min(len(held), rng.randint(1, 30))))
            elif r < 0.93:
                free(store, model, name)
            if flush_every and i % flush_every == 0:
                store.flush()
    except BaseException as err:  # noqa: BLE001 - reported to the test
        errors.append(err)


def reader(store: PageStore, model: Model, names: list[str], seed: int, stop: threading.Event,
           errors: list[BaseException], counts: dict[str, int]) -> None:
    """Decode random pages (one at a time, the fault path, and in bulk, the prefetch path) and
    check each is a version its page had."""
    rng = random.Random(seed)
    buf = np.empty(PAGE_SIZE, np.uint8)
    try:
        while not stop.is_set():
            name = rng.choice(names)
            s = number(name)
            ps = [rng.randrange(N_PAGES) for _ in range(8)]
            for p in ps:
                try:
                    store.decode_page_into(name, p, buf)
                except NotStored:
                    counts["not_stored"] = counts.get("not_stored", 0) + 1
                    continue
                check(model, name, s, p, buf)
                counts["pages"] = counts.get("pages", 0) + 1
            try:
                got = store.decode(name, np.array(sorted(set(ps)), dtype=np.int64))
            except NotStored:
                continue
            for p, page in zip(sorted(set(ps)), got):
                check(model, name, s, p, page)
            counts["bulk"] = counts.get("bulk", 0) + 1
    except BaseException as err:  # noqa: BLE001 - reported to the test
        errors.append(err)


def native_reader(store: PageStore, model: Model, names: list[str], seed: int, stop: threading.Event,
                  errors: list[BaseException], counts: dict[str, int]) -> None:
    """Decode random pages through the C lookup the native fault thread uses (a NativeView of
    each sandbox, kept current by the store) and check each is a version its page had; a page
    it cannot produce must be one the Python path cannot produce either (not stored now)."""
    from azqemu.memory.nativestore import DEC_NOT_STORED, DEC_OK

    rng = random.Random(seed)
    buf = np.empty(PAGE_SIZE, np.uint8)
    views = {name: store.native_view(name) for name in names}
    try:
        while not stop.is_set():
            name = rng.choice(names)
            view = views[name]
            assert view is not None
            s = number(name)
            for p in [rng.randrange(N_PAGES) for _ in range(8)]:
                rc = view.decode_into(p, buf)
                if rc == DEC_OK:
                    check(model, name, s, p, buf)
                    counts["native_pages"] = counts.get("native_pages", 0) + 1
                elif rc == DEC_NOT_STORED:
                    counts["native_not_stored"] = counts.get("native_not_stored", 0) + 1
                else:
                    raise AssertionError(f"native lookup of {name} page {p} failed with code {rc}")
    except BaseException as err:  # noqa: BLE001 - reported to the test
        errors.append(err)
    finally:
        for view in views.values():
            if view is not None:
                store.release_native_view(view)


def check(model: Model, name: str, s: int, p: int, page: np.ndarray) -> None:
    with model.lock:
        versions = sorted(model.history.get((name, p), set()))
    if not any(np.array_equal(page, content(s, p, v)) for v in versions):
        raise AssertionError(f"{name} page {p} decoded to no version it ever had ({versions})")


def verify_reopened(root: object, expect: dict[str, dict[int, int]]) -> int:
    """Reopen the store at ``root`` and check it holds exactly ``expect``; returns pages checked."""
    tpl = template()
    n = 0
    with PageStore(root, templates=(tpl,)) as store:
        store.check_consistency()
        assert store.sandboxes() == sorted(expect), (store.sandboxes(), sorted(expect))
        for name, pages in expect.items():
            idx = np.array(sorted(pages), dtype=np.int64)
            np.testing.assert_array_equal(store.stored_pages(name), idx)
            got = store.decode(name, idx)
            want = np.stack([content(number(name), int(p), pages[int(p)]) for p in idx]) if len(idx) else got
            np.testing.assert_array_equal(got, want, err_msg=f"sandbox {name}")
            n += len(idx)
    return n


def run_threads(targets: list[Callable[[], None]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=t, name=f"t{i}", daemon=True) for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    return threads
