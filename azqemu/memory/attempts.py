"""Which of the encoder's costlier attempts still pay, learned per sharing domain.

After a page's first payload (the XOR against its template page, or plain zstd), the encoder
tries more: plain zstd after the XOR, zstd with the template page as prefix, the SDELTA pair
against a similar page. Each is a zstd run (~20 us a page here), and on some domains one of
them almost never wins: on long-lived-heap, whose heap pages differ from the template by a
few hundred refcount bytes, plain zstd after the XOR won 9 of 4,975 tries in a compression.
Which ones pay depends on the guest's data, not on anything the code can know beforehand, so
the encoder measures: per attempt and per bucket of how good the best payload before it was
(<= 512, 1024, 2048 bytes, more), the bytes the attempt saved per try. An attempt that saves
under ``SAVED_BYTES_MIN`` bytes a try is made on one page in ``EXPLORE_ODDS``/256 from then
on (the tries still measure it: when the data changes, its odds come back). Counts are
halved every ``HALF_LIFE_TRIES`` so that the figure follows the domain's recent pages.

The price is bounded: at most ``SAVED_BYTES_MIN`` bytes a skipped page on average, against a
zstd run saved (`docs/memory.md`, "Attempts that pay").
"""

from __future__ import annotations

import random
import threading

import numpy as np

from azqemu.memory.zstdlib import ATTEMPT_SLOTS, ATTEMPTS

# An attempt saving less than this a try, on average, is made only to keep measuring it.
# 8 bytes is 0.2% of a page: a skip costs at most that on average, and saves one zstd run.
SAVED_BYTES_MIN = 8.0
# Out of 256: one page in 16 still makes a skipped attempt.
EXPLORE_ODDS = 16
# Tries per slot before its figure is trusted (until then: always tried).
WARMUP_TRIES = 256
# Counts halve past this many tries in a slot.
HALF_LIFE_TRIES = 8192


class AttemptOdds:
    """Tries and saved bytes per (attempt, bucket); the odds table the C loop draws from."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tries = np.zeros(ATTEMPT_SLOTS)
        self.saved = np.zeros(ATTEMPT_SLOTS)
        # The stdlib's generator: numpy.random would stay loaded in the manager (1.7 MiB) for a seed.
        self._rng = random.Random()

    def table(self) -> np.ndarray:
        """uint8 odds per slot: 255 (always) where the attempt pays or is not measured yet."""
        with self._lock:
            pays = (self.tries < WARMUP_TRIES) | (self.saved >= SAVED_BYTES_MIN * self.tries)
            return np.where(pays, 255, EXPLORE_ODDS).astype(np.uint8)

    def seed(self) -> int:
        with self._lock:
            return self._rng.randrange(1, 2**32)

    def note(self, astats: np.ndarray) -> None:
        """Add a batch's (tries, saved bytes) pairs (the C loop's astats)."""
        pairs = np.asarray(astats, dtype=np.float64).reshape(ATTEMPT_SLOTS, 2)
        with self._lock:
            self.tries += pairs[:, 0]
            self.saved += pairs[:, 1]
            old = self.tries > HALF_LIFE_TRIES
            self.tries[old] /= 2
            self.saved[old] /= 2

    def summary(self) -> dict[str, list[float | None]]:
        """Saved bytes per try by attempt (one figure per bucket; None: not tried)."""
        with self._lock:
            tries, saved = self.tries.copy(), self.saved.copy()
        per = [None if t == 0 else round(float(s / t), 1) for t, s in zip(tries.tolist(), saved.tolist())]
        n = len(per) // len(ATTEMPTS)
        return {name: per[i * n:(i + 1) * n] for i, name in enumerate(ATTEMPTS)}
