"""Shared fixtures: small memory-like images built from host files (no VM needed)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
from tests.support.synthetic import Corpus, make_set

SMALL_ARENA = 1 << 20


@pytest.fixture(scope="session")
def corpus() -> Corpus:
    return Corpus.load(6 << 20, seed=3)


@pytest.fixture(scope="session")
def small_set(corpus: Corpus):
    c = Corpus(corpus.elf.copy(), corpus.pyc.copy(), corpus.text.copy())
    return make_set(c, template_pages=1536, sandboxes=3, resident_pages=700, seed=11)


@pytest.fixture(scope="session")
def small_template(small_set) -> TemplateImage:
    return TemplateImage(page_idx=small_set.template_idx, pages=small_set.template_pages,
                         size_bytes=small_set.size_bytes)


@pytest.fixture
def store_dir() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="azq-test-", dir=base) as d:
        yield Path(d)


@pytest.fixture
def store(store_dir: Path) -> Iterator[PageStore]:
    s = PageStore(store_dir, arena_bytes=SMALL_ARENA)
    yield s
    s.close()


def text_page(seed: int) -> np.ndarray:
    """A compressible page of text-like bytes, different for each seed."""
    rng = np.random.default_rng(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"memory", b"page", b"sandbox", b"template",
             b"zstd", b"kernel", b"agent", b"\n", b"    ", b"def ", b"return "]
    out = bytearray()
    while len(out) < PAGE_SIZE:
        out += words[int(rng.integers(len(words)))] + b" " + str(int(rng.integers(1 << 20))).encode()
    return np.frombuffer(bytes(out[:PAGE_SIZE]), dtype=np.uint8).copy()


def random_page(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, PAGE_SIZE, dtype=np.uint8)


def make_template(pages: list[np.ndarray], n_pages: int | None = None, start: int = 0) -> TemplateImage:
    idx = np.arange(start, start + len(pages), dtype=np.int64)
    size = (n_pages if n_pages is not None else start + len(pages)) * PAGE_SIZE
    return TemplateImage(page_idx=idx, pages=np.stack(pages), size_bytes=size)
