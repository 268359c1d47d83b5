"""Tool calls told apart by kind, and the pages the last call of each kind used.

A resume puts back the pages the coming tool call will touch. One hot set for every call (the
last phase's working set) predicts badly where calls alternate between shapes: in a
code-interpreter sandbox a long `load` call leaves the heap alone, its trims drop the heap's
prefetched pages, and the heap walk that comes next faults them back one by one (session 17,
long-lived-heap: bursts of 9,000-14,000 faults from the store). So each kind of call keeps the
pages its last phase used, and a resume for a call of a known kind brings back those, plus
what the last phase created (a new table is read by the next call, whatever its kind).

The kind is the orchestrator's name for the tool (``azq exec --kind``, the API's ``kind``)
or, without one, the command's words: calls whose sets of words (letters and underscores,
two or more; numbers, quoting and punctuation ignored, since a call's arguments change and
its program does not; nor does the ``sh -c`` around a script) overlap by at least
``SAME_KIND_JACCARD`` are one kind. On the built-in workloads' plans the repeats of one
command overlap by 0.64-1.0 (most by 0.9 and above) and the commands of different steps by
0.62 at most (coding-agent's read and edit, both sed on one file: those two are one kind,
as long-lived-heap's small inspect and summary reads can be). A command nothing resembles is a new
kind; until one of its phases ends, its resume brings back what a sibling's last call of
that kind used (``KindBook``: sandboxes of one sharing domain are clones of one template, so
their heaps and page caches sit at the same addresses), or else the last phase's set.
Predictions only: a page left out faults in, one too many is dropped by the next trim.

Which of a prediction goes first. A call's resume continues the vCPUs and places the hot
set beside the call (session 21), in address order; the pages the guest touches before the
prefetch reaches them fault one by one. They are much the same every call (qemu-ga, the fork
and exec of the tool, the libraries and page cache it reads first): on a search-heavy probe 500-
900 of a call's 8,000-9,000 predicted pages, every call (session 29). So the pages a resume
found already present are remembered (``note_early``) and placed before the vCPUs continue
next time (``early``), up to ``MAX_EARLY_PAGES``: a few milliseconds in place of as many faults.

A prediction is not always worth placing. A prefetched page the call does not touch is held
until a trim finds it cold; one it does touch saves a fault. For a kind whose last call ran
long (5 s and more), when the faults its whole set could save are under a tenth of the call
while every unused page is held for much of it, such a resume places nothing and the call's
pages come on first touch (``prefetch_pays``). On long-tools at 8 sandboxes (15 s calls)
agentzip's owned memory went from 1.03x linux's to 0.87x, its median tool call from 1.05x
linux's to 1.12x (docs/figures.md, session 19). A fault's stall is ~100 us on an idle host
(the service and the wake-ups), plus, on a busy one, the vCPU's wait for a CPU once served:
the mean wait per time on a CPU of the sandbox's vCPU threads over its last call
(host/schedstat.py), which was 13-26 us with one sandbox here and is milliseconds where 16 TCG
guests share two cores. Charged the idle figure alone, a call slowed by the busy host looked
long, left its prefetch out, took its pages by faults that cost milliseconds each and ran
longer still: on many-small-files at 16, 40% of resumes placed nothing and the median commit
took 1,673 faults and 9.8 s against 1.9 s for copy-on-write clones (session 36).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import PurePosixPath

import numpy as np
import xxhash

from azqemu.pages import in_sorted, intersect_idx, setdiff_idx, union_idx, unique_idx

SAME_KIND_JACCARD = 0.6
MAX_KINDS = 8                 # per sandbox, least recently used first out
MAX_BOOK_KINDS = 16           # per sharing domain
MAX_WORDS = 512               # words kept per kind (a command's first ones)
STDIN_WORDS_BYTES = 4096      # code sent on stdin (`python3 -`) says the kind as well
# A fault's stall as the guest sees it on an idle host (azq bench restore: 61-99 us median
# here; a busy host adds the vCPU's wait for a CPU: CallKinds.fault_stall_s), and the share of
# a call that faults in place of a prefetch may cost before the prefetch pays.
FAULT_STALL_S = 100e-6
PREFETCH_SKIP_SHARE = 0.10
# Shorter calls keep their prefetch whatever its size: what they hold unused is held only that
# long (the next wait compresses it), while their faults are a direct share of their latency.
PREFETCH_SKIP_MIN_S = 5.0
# Pages placed before the vCPUs continue at most (16 MiB: ~5-10 ms of decode and copy here).
MAX_EARLY_PAGES = 4096
WORD_RE = re.compile(r"[A-Za-z_][A-Za-z_]{1,}")
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "busybox"})
SHELL_SCRIPT_FLAG_RE = re.compile(r"^-[a-z]*c$")      # -c, -lc, -ec


def command_words(argv: list[str], stdin: bytes | None = None) -> np.ndarray:
    """The command's distinct words as sorted 64-bit hashes (at most MAX_WORDS). A shell
    that runs a script (``sh -c SCRIPT``) is left out: it says nothing of the kind."""
    if len(argv) >= 3 and PurePosixPath(argv[0]).name in SHELLS and SHELL_SCRIPT_FLAG_RE.match(argv[1]):
        argv = argv[2:]
    text = "\n".join(argv)
    if stdin:
        text += "\n" + stdin[:STDIN_WORDS_BYTES].decode("utf-8", "replace")
    words = dict.fromkeys(WORD_RE.findall(text))        # first occurrences, in order
    hashes = [xxhash.xxh3_64_intdigest(w.encode()) for w in list(words)[:MAX_WORDS]]
    return unique_idx(np.array(hashes, dtype=np.uint64))


def prefetch_pays(pages: int, call_s: float | None, fault_stall_s: float = FAULT_STALL_S) -> bool:
    """Whether placing ``pages`` before a call that is expected to run ``call_s`` (None:
    unknown) pays: the call is short (PREFETCH_SKIP_MIN_S), or the faults the pages could save,
    ``fault_stall_s`` each, stall the guest for more than PREFETCH_SKIP_SHARE of it."""
    return (call_s is None or call_s < PREFETCH_SKIP_MIN_S
            or pages * fault_stall_s > PREFETCH_SKIP_SHARE * call_s)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Overlap of two sorted word sets (1.0 for two empty ones)."""
    common = int(np.count_nonzero(in_sorted(a, b)))
    union = len(a) + len(b) - common
    return common / union if union else 1.0


@dataclass
class _Kind:
    name: str | None              # the orchestrator's name, or None (told from the words)
    words: np.ndarray
    used_at: int                  # the call counter when last seen (for eviction)
    pages: np.ndarray | None = None   # its last phase's working set (_pack)
    call_s: float | None = None       # how long its last call ran (s; None: none ended yet)


def _best_match(kinds: dict[int, _Kind], words: np.ndarray, name: str | None) -> int | None:
    """The kind of ``kinds`` a call is: the one of the same name, or (no name) the one whose
    words overlap most, by SAME_KIND_JACCARD at least."""
    best, best_j = None, SAME_KIND_JACCARD
    for kid, k in kinds.items():
        if name is not None or k.name is not None:
            if k.name == name:
                return kid
            continue
        j = jaccard(words, k.words)
        if j >= best_j:
            best, best_j = kid, j
    return best


def _evict(kinds: dict[int, _Kind], room_for: int) -> list[int]:
    """Forget the least recently used kinds until one more fits in ``room_for``."""
    gone = sorted(kinds, key=lambda i: kinds[i].used_at)[:max(0, len(kinds) - room_for + 1)]
    for kid in gone:
        del kinds[kid]
    return gone


class KindBook:
    """The kinds of tool call of one sharing domain (one tenant's clones of one template) and
    the working set each last had in any of its sandboxes. Pages are shared, not copied."""

    def __init__(self, max_kinds: int = MAX_BOOK_KINDS) -> None:
        self.max_kinds = max_kinds
        self._kinds: dict[int, _Kind] = {}
        self._ticks = 0
        self._lock = threading.Lock()

    def publish(self, name: str | None, words: np.ndarray, pages: np.ndarray) -> None:
        with self._lock:
            self._ticks += 1
            kid = _best_match(self._kinds, words, name)
            if kid is None:
                _evict(self._kinds, self.max_kinds)
                kid = self._ticks
                self._kinds[kid] = _Kind(name, words, self._ticks)
            self._kinds[kid].pages, self._kinds[kid].used_at = pages, self._ticks

    def look_up(self, name: str | None, words: np.ndarray) -> np.ndarray | None:
        """The working set a sibling's last call of this kind had (packed), or None."""
        with self._lock:
            kid = _best_match(self._kinds, words, name)
            return None if kid is None else self._kinds[kid].pages

    @property
    def nbytes(self) -> int:
        """Its words and the working sets it holds (most also held by a sandbox's CallKinds)."""
        with self._lock:
            return int(sum(k.words.nbytes + (0 if k.pages is None else k.pages.nbytes) for k in self._kinds.values()))


class CallKinds:
    """One sandbox's kinds of tool call and their working sets. Thread-safe: an exec notes
    its call while a compression of the same sandbox may be ending its phase."""

    def __init__(self, pages: int, max_kinds: int = MAX_KINDS, siblings: KindBook | None = None) -> None:
        self.pages = pages
        self.max_kinds = max_kinds
        self.siblings = siblings
        self._kinds: dict[int, _Kind] = {}
        self._phase: set[int] = set()           # kinds called since the last phase ended
        self._fresh = np.empty(0, dtype=np.uint32)  # pages the last phase created (u32: held a phase)
        self._trimmed = np.empty(0, dtype=np.int64)  # pages trims dropped in this phase
        self._early = np.empty(0, dtype=np.uint32)   # pages to place before the vCPUs continue
        self._calls = 0
        self._next_id = 0
        self._wake_s = 0.0      # the vCPUs' mean wait for a CPU in the last call (note_end)
        self._lock = threading.Lock()

    def note(self, argv: list[str], stdin: bytes | None = None, name: str | None = None) -> int:
        """The kind of this call (a new one if nothing resembles it), noted as run in the
        current phase."""
        words = command_words(argv, stdin) if name is None else np.empty(0, dtype=np.uint64)
        with self._lock:
            self._calls += 1
            kid = self._match(words, name)
            if kid is None:
                kid = self._add(_Kind(name, words, self._calls))
            self._kinds[kid].used_at = self._calls
            self._phase.add(kid)
            return kid

    def note_end(self, kid: int | None, call_s: float, wake_s: float | None = None) -> None:
        """A call of kind ``kid`` ran for ``call_s`` (the next one is expected to run as long),
        the sandbox's vCPUs waiting ``wake_s`` on average each time they got a CPU (None: not
        measured; the next faults are charged as the last call's were)."""
        with self._lock:
            if wake_s is not None:
                self._wake_s = max(0.0, float(wake_s))
            k = self._kinds.get(kid) if kid is not None else None
            if k is not None:
                k.call_s = float(call_s)

    def fault_stall_s(self) -> float:
        """What a fault costs the guest now: the idle host's stall plus the wait for a CPU the
        vCPU had after each wake-up in the last call."""
        with self._lock:
            return FAULT_STALL_S + self._wake_s

    def call_s(self, kid: int | None) -> float | None:
        """How long the last call of this kind ran; None when unknown."""
        with self._lock:
            k = self._kinds.get(kid) if kid is not None else None
            return None if k is None else k.call_s

    def predict(self, kid: int | None) -> np.ndarray | None:
        """Pages a call of this kind is expected to touch (sorted): what its last phase here
        used, or else what a sibling's did; None when neither is known (the caller falls back
        on the last phase's set)."""
        with self._lock:
            k = self._kinds.get(kid) if kid is not None else None
            if k is None:
                return None
            pages = k.pages
            if pages is None and self.siblings is not None:
                pages = self.siblings.look_up(k.name, k.words)
            if pages is None:
                return None
            return union_idx(self._unpack(pages), self._fresh.astype(np.int64))

    def end_phase(self, used: np.ndarray, fresh: np.ndarray) -> None:
        """A phase ended (its sandbox compressed): ``used`` is every page it touched, kept as
        the working set of each kind called in it; ``fresh`` the pages it created."""
        packed = self._pack(np.asarray(used, dtype=np.int64))
        with self._lock:
            ran = [self._kinds[kid] for kid in self._phase if kid in self._kinds]
            for k in ran:
                k.pages = packed
            self._phase.clear()
            self._fresh = np.asarray(fresh, dtype=np.int64).astype(np.uint32)
            self._trimmed = np.empty(0, dtype=np.int64)
        if self.siblings is not None:
            for k in ran:
                self.siblings.publish(k.name, k.words, packed)

    def note_trimmed(self, pages: np.ndarray) -> None:
        """Pages a trim dropped in this phase: what a running sandbox's call may get back."""
        with self._lock:
            self._trimmed = union_idx(self._trimmed, np.asarray(pages, dtype=np.int64))

    def trimmed(self, pages: np.ndarray) -> np.ndarray:
        """Those of ``pages`` (sorted) that trims dropped in this phase. Pages the compression
        dropped are not among them: a resume without its prefetch left them to faults."""
        with self._lock:
            return intersect_idx(pages, self._trimmed)

    def early(self, pages: np.ndarray) -> np.ndarray:
        """Those of ``pages`` (sorted) to place before the vCPUs continue: the guest touched
        them before the prefetch beside the call got there, last time."""
        with self._lock:
            return intersect_idx(pages, self._early.astype(np.int64))

    def note_early(self, placed: np.ndarray, raced: np.ndarray) -> None:
        """A resume beside a call: ``placed`` went before the vCPUs continued, ``raced`` (found
        present by the prefetch) were touched first. Both go first next time; past
        MAX_EARLY_PAGES, the newest race losers."""
        early = union_idx(np.asarray(placed, dtype=np.int64), np.asarray(raced, dtype=np.int64))
        if len(early) > MAX_EARLY_PAGES:
            early = unique_idx(np.asarray(raced, dtype=np.int64))[:MAX_EARLY_PAGES]
        early = early[(early >= 0) & (early < self.pages)]
        with self._lock:
            self._early = early.astype(np.uint32)

    @property
    def kinds(self) -> int:
        return len(self._kinds)

    @property
    def nbytes(self) -> int:
        """Memory held: the kinds' page maps (shared between kinds of one phase) and words."""
        with self._lock:
            maps = {id(k.pages): k.pages.nbytes for k in self._kinds.values() if k.pages is not None}
            return int(sum(maps.values()) + sum(k.words.nbytes for k in self._kinds.values())
                       + self._fresh.nbytes + self._trimmed.nbytes + self._early.nbytes)

    def _pack(self, used: np.ndarray) -> np.ndarray:
        """A working set in the smaller of two forms: sorted u32 page indices (a coding
        agent's few thousand pages) or a bit per page (a heap of tens of thousands)."""
        used = unique_idx(used[(used >= 0) & (used < self.pages)])
        if 4 * len(used) < (self.pages + 7) // 8:
            return used.astype(np.uint32)
        bits = np.zeros(self.pages, dtype=bool)
        bits[used] = True
        return np.packbits(bits, bitorder="little")

    def _unpack(self, packed: np.ndarray) -> np.ndarray:
        """Page indices of a working set (a sibling's is of the same size: one template)."""
        if packed.dtype == np.uint32:
            idx = packed.astype(np.int64)
            return idx[idx < self.pages]
        if len(packed) != (self.pages + 7) // 8:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(np.unpackbits(packed, count=self.pages, bitorder="little"))

    def _match(self, words: np.ndarray, name: str | None) -> int | None:
        return _best_match(self._kinds, words, name)

    def _add(self, kind: _Kind) -> int:
        for gone in _evict(self._kinds, self.max_kinds):
            self._phase.discard(gone)
        kid = self._next_id
        self._next_id += 1
        self._kinds[kid] = kind
        return kid


class SplitResume:
    """One resume beside a call in two parts (SandboxMemory.prefetch's ``part``): "early"
    places the pages ``CallKinds.early`` names, the vCPUs still paused; "rest" the others, the
    vCPUs running, and tells the kinds which pages the guest touched before it got there."""

    def __init__(self, calls: CallKinds) -> None:
        self.calls = calls
        self.placed = np.empty(0, dtype=np.int64)   # by the early part
        self.seconds = 0.0                          # the early part's time

    def pages(self, part: str, want: np.ndarray, compressed: bool) -> np.ndarray:
        """Of the predicted ``want`` (sorted), those this part places."""
        if part == "early":
            return self.calls.early(want) if compressed else want[:0]
        return setdiff_idx(want, self.placed) if part == "rest" and len(self.placed) else want

    def early_done(self, placed: np.ndarray, seconds: float) -> None:
        self.placed, self.seconds = placed, seconds

    def rest_done(self, present: np.ndarray | None) -> tuple[int, float]:
        """The rest placed (``present``: what its prefetch found present; None: it placed
        nothing). Returns the early part's pages and seconds: one resume, as its event and the
        bench count it."""
        if present is not None:
            self.calls.note_early(self.placed, present)
        out = (len(self.placed), self.seconds)
        self.placed, self.seconds = self.placed[:0], 0.0
        return out
