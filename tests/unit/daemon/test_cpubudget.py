"""The compression's CPU budget: chunks are handed out until the calling thread has spent the
allowance (at least one always), every chunk handed out is recorded, 0 means no limit."""

from __future__ import annotations

import time

import numpy as np

from azqemu.daemon import cpubudget
from azqemu.daemon.cpubudget import CpuBudget


def _chunks(n: int):
    for i in range(n):
        yield np.arange(i * 4, i * 4 + 4), np.zeros((4, 8), np.uint8)


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_without_a_limit_every_chunk_goes() -> None:
    taken: list[np.ndarray] = []
    b = CpuBudget(0)
    got = [p for p, _ in b.chunks(_chunks(5), taken)]
    assert len(got) == 5 and len(taken) == 5 and not b.exceeded


def test_a_spent_budget_stops_after_the_chunk_that_spent_it() -> None:
    taken: list[np.ndarray] = []
    b = CpuBudget(0.02)
    got = []
    for part, _pages in b.chunks(_chunks(10), taken):
        got.append(part)
        _burn(0.015)                 # the encoder's work on this chunk
    assert b.exceeded and 1 <= len(got) <= 3, len(got)
    assert [t.tolist() for t in taken] == [g.tolist() for g in got]
    assert np.concatenate(taken).tolist() == list(range(4 * len(got)))


def test_the_allowance_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("AZQ_COMPRESS_CPU_BUDGET_S", "0.5")
    assert CpuBudget().limit_s == 0.5
    monkeypatch.setenv("AZQ_COMPRESS_CPU_BUDGET_S", "nonsense")
    assert CpuBudget().limit_s == cpubudget.DEFAULT_BUDGET_S
    monkeypatch.delenv("AZQ_COMPRESS_CPU_BUDGET_S")
    assert CpuBudget().limit_s == cpubudget.DEFAULT_BUDGET_S
