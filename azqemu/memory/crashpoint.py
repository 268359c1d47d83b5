"""Crash-point injection: named places where a test can have the process killed (SIGKILL).

CRIU's and SQLite's test suites kill the process at each step of an on-disk change and check
what a restart finds; this is the hook for doing the same to the page store and to a
compression. ``AZQ_CRASH_AT=<point>`` kills the process the first time it reaches ``<point>``,
``AZQ_CRASH_AT=<point>@<n>`` the n-th time (1-based). The variable is read once, at import:
when it is unset, ``crash_point`` is one comparison with None.

Points (where they are, and what a restart must find):
    after-encode              sandboxmem: pages encoded in memory, nothing durable, nothing dropped
    after-flush-snapshot      storewrite: what the next generation holds taken (state lock let go),
                              nothing of it written yet
    between-generation-files  generation: after each new index file, before the store file names it
    after-commit              storewrite: the new store file renamed in, nothing reclaimed yet
    after-reclaim             storewrite: old files unlinked, dead blobs punched, arenas dropped
    after-flush               sandboxmem: the generation naming the pages is durable, none dropped
    after-discard-batch       sandboxmem: after each punch run / DISCARD request to QEMU
    after-drop                sandboxmem, copy-on-write: a compression's copies dropped, its free
                              pages mapped and their entries released in memory, not committed
                              (the durable generation still names them: never served)
    after-free-compact        store: a sandbox freed (and arenas compacted) in memory, not flushed
    after-compact-copy        storewrite: an arena's live blobs copied to reserved room, not switched
    after-compact-switch      storewrite: the blobs point at their new places (in memory), the old
                              arena closed, its file kept until a generation naming them is durable
    after-pause               lifecycle: state ``compressing`` recorded, vCPUs paused, nothing encoded
  the resume path (a restart must find the sandbox ``compressed``, or ``running`` after the
  last one, and serve every page):
    before-prefetch           lifecycle: state ``resuming`` recorded, nothing put back yet
    after-prefetch            lifecycle: the hot set copied into QEMU (UFFDIO_COPY), vCPUs paused
                              (a tool call's resume, memsvc.prefetch_beside: vCPUs running)
    after-vcpu-resume         lifecycle: vCPUs continue, the record still says ``resuming``
    after-reattach            memsvc: a restarted manager made the sandbox's page sources (stored
                              pages assigned to the store), no fault served yet

Fault injection, the same way: ``AZQ_FAIL_AT=<point>[@<n>][*<k>]`` makes ``fail_point`` raise
the caller's error at the n-th hit and the k-1 hits after it (default: n=1, k=1). Points:
    commit                    generation: the store file is about to be written (a StoreFull,
                              as ENOSPC would give); k=2 also defeats the retry on the reserve
    flush-before-drop         sandboxmem: the flush that must commit a compression's pages
                              before QEMU drops them fails (StoreFull); only compressions hit it
    encode-chunk              sandboxmem: a compression or trim is cancelled before it encodes
                              its next chunk of pages (CompressCancelled, as a resume's cancel)
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

# The store's and the compression's points (tests/unit/memory/test_crash_points.py tries each
# on a simulated guest), and the daemon's lifecycle points (tests/integration/test_crash_compress.py,
# on real guests).
POINTS = ("after-encode", "after-flush-snapshot", "between-generation-files", "after-commit", "after-reclaim",
          "after-flush", "after-discard-batch", "after-free-compact", "after-compact-copy", "after-compact-switch")
LIFECYCLE_POINTS = ("after-pause", "before-prefetch", "after-prefetch", "after-vcpu-resume", "after-reattach")


def _parse(spec: str | None) -> tuple[str | None, int]:
    if not spec:
        return None, 0
    name, _, nth = spec.partition("@")
    return name, max(1, int(nth)) if nth.isdigit() else 1


_POINT, _NTH = _parse(os.environ.get("AZQ_CRASH_AT"))
_hits = 0
_FAIL_SPEC, _, _FAIL_TIMES = (os.environ.get("AZQ_FAIL_AT") or "").partition("*")
_FAIL, _FAIL_NTH = _parse(_FAIL_SPEC)
_FAIL_COUNT = int(_FAIL_TIMES) if _FAIL_TIMES.isdigit() else 1
_fail_hits = 0


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``AZQ_CRASH_AT`` names ``name`` (see the module doc)."""
    global _hits
    if _POINT is None or _POINT != name:
        return
    _hits += 1
    if _hits >= _NTH:
        os.kill(os.getpid(), signal.SIGKILL)


def fail_point(name: str, error: Callable[[], BaseException]) -> None:
    """Raise ``error()`` if ``AZQ_FAIL_AT`` names ``name`` for this hit (see the module doc)."""
    global _fail_hits
    if _FAIL is None or _FAIL != name:
        return
    _fail_hits += 1
    if _FAIL_NTH <= _fail_hits < _FAIL_NTH + _FAIL_COUNT:
        raise error()
