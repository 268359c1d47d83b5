"""This process's own memory: its parts as the kernel counts them, and giving freed heap back.

The manager maps the template images (shared page cache, not its own) and allocates scan,
encode and decode buffers (its own, anonymous). ``self_memory`` splits its resident set
(/proc/self/status: RssAnon, RssFile, RssShmem) so that a report never mistakes the shared
template pages for the manager's. ``trim_heap`` hands freed heap back to the kernel (glibc
``malloc_trim``: without it a process that once held a large buffer keeps it resident), and
``bound_heap_caching`` makes glibc serve large buffers by mmap, returned at free, whatever
sizes it has seen before (no dynamic mmap threshold), from at most two heaps for all threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# Buffers from this size up are mmapped (and unmapped when freed).
MMAP_THRESHOLD_BYTES = 1 << 20
# glibc gives each thread that allocates its own heap ("arena", up to 8 per core) by default:
# the manager's many fault-handler threads would each keep freed memory the others cannot
# reuse (a 20 MiB arena held by one thread was seen). Python threads take turns under the GIL,
# so two arenas cost no contention worth the name.
ARENA_MAX = 2

_STATUS_FIELDS = {"VmRSS": "rss_bytes", "RssAnon": "anon_bytes", "RssFile": "file_bytes",
                  "RssShmem": "shmem_bytes"}


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


_LIBC = _libc()


def parse_status(text: str) -> dict[str, int]:
    """{rss_bytes, anon_bytes, file_bytes, shmem_bytes} from the text of /proc/PID/status."""
    out = dict.fromkeys(_STATUS_FIELDS.values(), 0)
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        name = _STATUS_FIELDS.get(key)
        parts = rest.split()
        if name and parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def self_memory(path: str = "/proc/self/status") -> dict[str, int]:
    """This process's resident memory in parts: rss = anon (its own) + file + shmem (shared
    page cache it maps, such as the template images)."""
    with open(path) as f:
        return parse_status(f.read())


def trim_heap() -> bool:
    """Give freed heap pages of every malloc arena back to the kernel (glibc only)."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(0))


def bound_heap_caching() -> None:
    """Buffers of MMAP_THRESHOLD_BYTES and more by mmap, at a fixed threshold, and at most
    ARENA_MAX malloc arenas (glibc only). Call it before the threads start."""
    if _LIBC is None:
        return
    if not _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        log.debug("mallopt refused the mmap threshold")
    if not _LIBC.mallopt(_M_ARENA_MAX, ARENA_MAX):
        log.debug("mallopt refused the arena limit")
