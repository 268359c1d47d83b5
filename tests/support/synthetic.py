"""Synthetic but memory-like template and sandbox RAM images, for tests and perf figures.

Real template/sandbox images come from the sandbox layer; until then (and for unit tests
that must not boot a VM) this builds images from a real corpus of memory-like content found
on the host: pages of ELF binaries and shared libraries, Python bytecode (.pyc), text, and
synthetic heap pages (object headers, pointers into a few arenas, small integers, short
strings). The proportions default to what DESIGN.md measured on real clones (a 512 MiB
template, 4 clones after 5-8 s of tool calls): ~55% of a clone's resident pages identical to
the template at the same address, ~20% zero, ~8% identical to a sibling's page at another
address, the rest changed, of which only a minority are small edits of the same-address
template page ("changed pages mostly hold unrelated reused memory").
"""

from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass

import numpy as np

from azqemu.memory.kinds import PAGE_SIZE

_STDLIB = sysconfig.get_paths()["stdlib"]
_PURELIB = sysconfig.get_paths()["purelib"]
_SOURCES = {
    "elf": ["/usr/lib/x86_64-linux-gnu/*.so*", "/usr/lib/x86_64-linux-gnu/*/*.so*", "/usr/bin/*", "/usr/sbin/*"],
    "pyc": [f"{_STDLIB}/__pycache__/*.pyc", f"{_STDLIB}/*/__pycache__/*.pyc", f"{_PURELIB}/*/__pycache__/*.pyc",
            "/usr/lib/python3*/__pycache__/*.pyc"],
    "text": ["/usr/share/common-licenses/*", "/usr/share/doc/*/copyright", "/usr/include/*.h",
             f"{_STDLIB}/*.py", f"{_PURELIB}/*/*.py", "/etc/*.conf"],
}


def _read_pages(patterns: list[str], max_bytes: int, rng: np.random.Generator) -> np.ndarray:
    files: list[str] = []
    for pat in patterns:
        files.extend(glob.glob(pat))
    files = sorted(set(f for f in files if os.path.isfile(f)))
    rng.shuffle(files)   # type: ignore[arg-type]
    chunks: list[bytes] = []
    total = 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                data = fh.read(max(PAGE_SIZE, min(max_bytes - total, 1 << 20)))
        except OSError:
            continue
        n = len(data) // PAGE_SIZE
        if n == 0:
            data = data + bytes(PAGE_SIZE - len(data) % PAGE_SIZE)   # small text file: pad like page cache
            n = len(data) // PAGE_SIZE
        chunks.append(data[:n * PAGE_SIZE])
        total += n * PAGE_SIZE
        if total >= max_bytes:
            break
    if not chunks:
        return np.zeros((0, PAGE_SIZE), dtype=np.uint8)
    pages = np.frombuffer(b"".join(chunks), dtype=np.uint8).reshape(-1, PAGE_SIZE)
    return pages[pages.view(np.uint64).any(axis=1)]


def heap_pages(n: int, rng: np.random.Generator, text: np.ndarray | None = None) -> np.ndarray:
    """Pages that look like a language runtime's heap: 32-byte objects of type pointer,
    refcount, a pointer to another object and a small value or 8 bytes of text."""
    words = np.zeros((n, PAGE_SIZE // 8), dtype=np.uint64)
    arenas = np.array([0x7F3A_1200_0000, 0x7F3A_5600_0000, 0x5555_5600_0000], dtype=np.uint64)
    types = arenas[2] + np.arange(40, dtype=np.uint64) * np.uint64(0x1A0)
    objs = words.reshape(n, -1, 4)
    k = objs.shape[1]
    objs[:, :, 0] = types[rng.integers(0, len(types), size=(n, k))]
    objs[:, :, 1] = rng.integers(1, 6, size=(n, k)).astype(np.uint64)
    objs[:, :, 2] = arenas[rng.integers(0, 2, size=(n, k))] + (rng.integers(0, 1 << 20, size=(n, k)).astype(np.uint64) << np.uint64(5))
    small = rng.integers(0, 1000, size=(n, k)).astype(np.uint64)
    if text is not None and len(text):
        tw = text.view(np.uint64).reshape(-1)
        pick = tw[rng.integers(0, len(tw), size=(n, k))]
        objs[:, :, 3] = np.where(rng.random((n, k)) < 0.5, small, pick)
    else:
        objs[:, :, 3] = small
    free = rng.random((n, k)) < 0.15          # freed slots hold zeros
    objs[free] = 0
    return words.view(np.uint8).reshape(n, PAGE_SIZE)


@dataclass
class Corpus:
    elf: np.ndarray
    pyc: np.ndarray
    text: np.ndarray

    @classmethod
    def load(cls, max_bytes: int = 48 << 20, seed: int = 1) -> Corpus:
        rng = np.random.default_rng(seed)
        share = {"elf": 0.6, "pyc": 0.25, "text": 0.15}
        parts = {k: _read_pages(v, int(max_bytes * share[k]), rng) for k, v in _SOURCES.items()}
        if min(len(p) for p in parts.values()) < 16:
            # A bare host without these files: fall back to heap pages so tests still run.
            fill = heap_pages(max(64, max_bytes // PAGE_SIZE // 3), rng)
            parts = {k: (p if len(p) >= 16 else fill) for k, p in parts.items()}
        return cls(parts["elf"], parts["pyc"], parts["text"])

    def __post_init__(self) -> None:
        self._next = [0, 0, 0]
        self._perm: list[np.ndarray] | None = None

    def draw(self, n: int, rng: np.random.Generator, mix: tuple[float, float, float, float] = (0.5, 0.2, 0.1, 0.2)
             ) -> np.ndarray:
        """n pages from elf/pyc/text/heap in the given proportions, without replacement: a
        corpus page is used once per Corpus, so images share content only where the generator
        says so. When a source runs out, heap pages (always unique) stand in."""
        if self._perm is None:
            self._perm = [rng.permutation(len(s)) for s in (self.elf, self.pyc, self.text)]
        kinds = rng.choice(4, size=n, p=np.array(mix) / sum(mix))
        out = np.empty((n, PAGE_SIZE), dtype=np.uint8)
        for k, src in enumerate((self.elf, self.pyc, self.text)):
            sel = np.flatnonzero(kinds == k)
            take = min(len(sel), len(src) - self._next[k])
            if take:
                rows = self._perm[k][self._next[k]:self._next[k] + take]
                out[sel[:take]] = src[rows]
                self._next[k] += take
            kinds[sel[take:]] = 3
        sel = np.flatnonzero(kinds == 3)
        if len(sel):
            out[sel] = heap_pages(len(sel), rng, self.text)
        return out

    @property
    def n_pages(self) -> int:
        return len(self.elf) + len(self.pyc) + len(self.text)


@dataclass
class SyntheticSet:
    template_idx: np.ndarray
    template_pages: np.ndarray
    size_bytes: int
    sandboxes: list[tuple[np.ndarray, np.ndarray]]


def small_edit(pages: np.ndarray, rng: np.random.Generator, max_edits: int = 24) -> np.ndarray:
    """Copies with a few 8-byte words changed (pointer/counter updates)."""
    out = pages.copy()
    w = out.view(np.uint64)
    n = len(out)
    edits = rng.integers(1, max_edits + 1, size=n)
    rows = np.repeat(np.arange(n), edits)
    cols = rng.integers(0, PAGE_SIZE // 8, size=len(rows))
    w[rows, cols] = rng.integers(0, 1 << 62, size=len(rows), dtype=np.int64).astype(np.uint64)
    return out


def make_set(corpus: Corpus, *, template_pages: int = 16384, sandboxes: int = 4, resident_pages: int = 12000,
             seed: int = 7, same: float = 0.55, zero: float = 0.20, sibling: float = 0.08,
             edit_share: float = 0.10, moved_share: float = 0.15) -> SyntheticSet:
    """A template and sandboxes cloned from it.

    ``template_pages``: pages the template's RAM file spans (about 60% hold data, 40% holes).
    Per sandbox, ``resident_pages`` pages: ``same`` identical to the template at the same
    address, ``zero`` zero, ``sibling`` taken from a pool of new content shared by the
    siblings (each at its own random address), the rest changed: ``edit_share`` of it small
    edits of the same-address template page, ``moved_share`` edited copies of template pages
    from other addresses, the remainder new content.
    """
    rng = np.random.default_rng(seed)
    size_bytes = template_pages * PAGE_SIZE
    t_idx = np.sort(rng.choice(template_pages, size=int(template_pages * 0.6), replace=False)).astype(np.int64)
    t_pages = corpus.draw(len(t_idx), rng, mix=(0.55, 0.15, 0.1, 0.2))
    t_zero = rng.random(len(t_idx)) < 0.08       # a booted guest has some allocated zero pages
    t_pages[t_zero] = 0
    t_nonzero = t_idx[~t_zero]
    pool = corpus.draw(max(16, int(resident_pages * sibling * 1.5)), rng, mix=(0.4, 0.3, 0.1, 0.2))
    out: list[tuple[np.ndarray, np.ndarray]] = []
    row_of = np.full(template_pages, -1, dtype=np.int64)
    row_of[t_idx] = np.arange(len(t_idx))
    for _ in range(sandboxes):
        n_same = int(resident_pages * same)
        n_zero = int(resident_pages * zero)
        n_sib = int(resident_pages * sibling)
        n_rest = resident_pages - n_same - n_zero - n_sib
        n_edit = int(n_rest * edit_share)
        n_moved = int(n_rest * moved_share)
        n_new = n_rest - n_edit - n_moved
        same_idx = rng.choice(t_nonzero, size=min(n_same + n_edit, len(t_nonzero)), replace=False)
        edit_idx, same_idx = same_idx[:n_edit], same_idx[n_edit:]
        free_slots = np.setdiff1d(np.arange(template_pages), np.concatenate([same_idx, edit_idx]))
        other = rng.choice(free_slots, size=n_zero + n_sib + n_moved + n_new, replace=False)
        z_idx, s_idx = other[:n_zero], other[n_zero:n_zero + n_sib]
        m_idx = other[n_zero + n_sib:n_zero + n_sib + n_moved]
        new_idx = other[n_zero + n_sib + n_moved:]
        idx = np.concatenate([same_idx, edit_idx, z_idx, s_idx, m_idx, new_idx]).astype(np.int64)
        pages = np.empty((len(idx), PAGE_SIZE), dtype=np.uint8)
        a = 0
        pages[a:a + len(same_idx)] = t_pages[row_of[same_idx]]
        a += len(same_idx)
        pages[a:a + n_edit] = small_edit(t_pages[row_of[edit_idx]], rng)
        a += n_edit
        pages[a:a + n_zero] = 0
        a += n_zero
        pages[a:a + n_sib] = pool[rng.choice(len(pool), size=n_sib, replace=False)]
        a += n_sib
        src = rng.choice(t_nonzero, size=n_moved)
        pages[a:a + n_moved] = small_edit(t_pages[row_of[src]], rng, max_edits=48)
        a += n_moved
        pages[a:] = corpus.draw(n_new, rng)
        order = np.argsort(idx)
        out.append((idx[order], pages[order]))
    return SyntheticSet(t_idx, t_pages, size_bytes, out)
