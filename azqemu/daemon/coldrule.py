"""When a page of a running sandbox counts as cold: the trim's rule, adapted to the sandbox.

A trim (SandboxMemory.trim) drops copies a tool call has left alone for ``after_s``. Whether a
dropped page was still read shows only afterwards, by its fault (this kernel has no idle-page
bits to ask first): each such fault is a round trip to the manager while a vCPU waits. So the
rule follows what the sandbox's dropped pages did: when more than ``REFAULT_HIGH`` of them
came back, a page must be left alone twice as long before it counts as cold; below
``REFAULT_LOW`` half as long; between the two the rule holds. A tool call that reads its heap
again and again ends with few trims that cost it faults; one that writes build trees and logs
and moves on gets its pages compressed within seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from azqemu.pages import in_sorted, union_idx

AFTER_MIN_S = 2.0
AFTER_MAX_S = 64.0
REFAULT_HIGH = 0.25
REFAULT_LOW = 0.05
# Drops it takes to judge: fewer say little about a working set.
JUDGE_PAGES = 256
# A trim reads and hashes every copy its sandbox holds, vCPUs paused. In long-lived-heap at 8
# sandboxes half of the trims dropped under 2% of the copies (the tool call was using what it
# held) and took 43% of the trims' CPU: after such a trim the next waits twice as long, up to
# BACKOFF_MAX_S; a trim that pays brings the pace back. The pace outlives a compression: a
# sandbox whose last trim dropped little uses what it holds in the next tool call as well (in
# coding-agent at 16, the first trim of 33 of 34 such tool calls dropped under 5% again, against
# 8 of 35 after a trim that paid; docs/figures.md, session 28), so the next call's first trim
# waits for the pace too, counted from the resume (SandboxMemory.trim_due).
PAYOFF_SHARE = 0.02
BACKOFF_MAX_S = 32.0


@dataclass
class ColdRule:
    after_s: float = AFTER_MIN_S
    judged: int = 0                      # judgements made (for reports)
    last_refault: float = 0.0            # the share of dropped pages that came back, last judged
    pace_s: float = 0.0                  # least time between trims after trims that dropped little
    _dropped: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    _back: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    def note_dropped(self, pages: np.ndarray, resident_pages: int = 0, paid: int | None = None) -> None:
        """Pages a trim dropped (page indices) that a fault would show coming back, of the
        ``resident_pages`` copies it read; ``paid``: all it dropped (default: ``pages``). One
        that dropped under PAYOFF_SHARE of them doubles ``pace_s`` (from twice AFTER_MIN_S up
        to BACKOFF_MAX_S); one that paid brings it back to nothing."""
        pages = np.asarray(pages, dtype=np.int64)
        self._dropped = union_idx(self._dropped, pages)
        if resident_pages and (len(pages) if paid is None else paid) < PAYOFF_SHARE * resident_pages:
            self.pace_s = min(BACKOFF_MAX_S, max(2 * AFTER_MIN_S, 2 * self.pace_s))
        else:
            self.pace_s = 0.0

    def trim_gap_s(self, backoff: bool = True) -> float:
        """Least time between two trims: half the cold age (a page must stay unchanged that
        long), longer after trims that dropped little (``pace_s``) unless ``backoff`` is off
        (the agentzip-steady-trims ablation)."""
        return max(self.after_s / 2, self.pace_s if backoff else 0.0)

    def note_back(self, pages: np.ndarray) -> None:
        """Pages put back before a tool call because its kind used them (a running sandbox's
        refill): a dropped one among them came back as surely as by a fault, unseen."""
        self._back = union_idx(self._back, np.asarray(pages, dtype=np.int64))

    def judge(self, faulted: np.ndarray) -> float:
        """Given the pages that faulted since the drops were noted (or were put back:
        ``note_back``), adapt ``after_s`` and start a new window; returns ``after_s``."""
        if len(self._dropped) < JUDGE_PAGES:
            return self.after_s
        came = union_idx(faulted, self._back) if len(self._back) else faulted    # ascending
        back = float(in_sorted(self._dropped, came).mean())
        if back > REFAULT_HIGH:
            self.after_s = min(AFTER_MAX_S, self.after_s * 2)
        elif back < REFAULT_LOW:
            self.after_s = max(AFTER_MIN_S, self.after_s / 2)
        self.last_refault = back
        self.judged += 1
        self._dropped = self._back = np.empty(0, dtype=np.int64)
        return self.after_s

    def state_bytes(self) -> int:
        """Memory held for the rule between trims (the dropped pages noted)."""
        return int(self._dropped.nbytes + self._back.nbytes)

    def forget_drops(self) -> None:
        """A compression starts a new fault record: drops noted before it cannot be judged.
        The trims' pace stays (see PAYOFF_SHARE): a trim that pays resets it."""
        self._dropped = self._back = np.empty(0, dtype=np.int64)


@dataclass
class CopyHistory:
    """What the last trim saw of each copy it kept: its hash, since when the copy has had it
    (monotonic s), and whether it came out incompressible (RAW: left resident, not tried
    again while the hash holds). Rows sorted by page index."""

    idx: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    key: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    since: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float64))
    raw: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=bool))

    @classmethod
    def of_raw(cls, idx: np.ndarray, key: np.ndarray, now: float) -> CopyHistory:
        """The history a compression leaves: only the copies it left resident as RAW (sorted
        ``idx``), each with the hash it had, so trims do not try them again either."""
        return cls(np.asarray(idx, dtype=np.int64), np.asarray(key, dtype=np.uint64),
                   np.full(len(idx), now), np.ones(len(idx), dtype=bool))

    def look_up(self, idx: np.ndarray, key: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        """For copies ``idx`` (sorted) with hashes ``key`` now: since when each has had that
        hash (``now`` if it changed or is new) and whether it was RAW with it."""
        pos = np.searchsorted(self.idx, idx)
        seen = pos < len(self.idx)
        seen[seen] = self.idx[pos[seen]] == idx[seen]
        unchanged = seen.copy()
        unchanged[seen] = self.key[pos[seen]] == key[seen]
        since = np.full(len(idx), now)
        since[unchanged] = self.since[pos[unchanged]]
        raw = unchanged.copy()
        raw[unchanged] = self.raw[pos[unchanged]]
        return since, raw

    @property
    def nbytes(self) -> int:
        return int(self.idx.nbytes + self.key.nbytes + self.since.nbytes + self.raw.nbytes)

    def keep(self, idx: np.ndarray, key: np.ndarray, since: np.ndarray, raw: np.ndarray) -> None:
        self.idx, self.key, self.since, self.raw = idx, key, since, raw
