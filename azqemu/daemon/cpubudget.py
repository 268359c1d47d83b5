"""A compression's CPU allowance for one LLM wait.

A compression runs while the sandbox waits for its LLM, on a host whose cores the other
sandboxes' guests keep busy: it runs niced (host/threads.py) and, past ``limit_s`` seconds of
its own thread's CPU, it stops reading further chunks. What it encoded so far is committed and
dropped as usual; the pages it did not reach stay resident, exactly as they were, and the next
wait's compression starts with them. So a sandbox that wrote much at once is compressed over a
few waits instead of taking a core for seconds in one.

``AZQ_COMPRESS_CPU_BUDGET_S`` sets the allowance (default 2 s, far above a typical wait's
0.1 s; 0 turns it off).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np

DEFAULT_BUDGET_S = 2.0


def budget_s() -> float:
    """The configured allowance in CPU seconds (0: unlimited)."""
    try:
        return max(0.0, float(os.environ.get("AZQ_COMPRESS_CPU_BUDGET_S", DEFAULT_BUDGET_S)))
    except ValueError:
        return DEFAULT_BUDGET_S


class CpuBudget:
    """CPU seconds of the calling thread since creation, against ``limit_s``."""

    def __init__(self, limit_s: float | None = None) -> None:
        self.limit_s = budget_s() if limit_s is None else limit_s
        self._t0 = time.thread_time()
        self.exceeded = False

    def spent_s(self) -> float:
        return time.thread_time() - self._t0

    def chunks(self, it: Iterator[tuple[np.ndarray, np.ndarray]],
               taken: list[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The (indices, pages) chunks of ``it`` while the budget lasts: each one handed out is
        appended to ``taken``; after the consumer is done with a chunk (the encoder), the next
        is read only if the budget is not spent (at least one chunk always goes)."""
        for part, pages in it:
            taken.append(part)
            yield part, pages
            if self.limit_s > 0 and self.spent_s() > self.limit_s:
                self.exceeded = True
                return
