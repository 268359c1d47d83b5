"""This process's own memory: its parts as the kernel counts them, and giving freed heap back.

The manager maps the template images (shared page cache, not its own) and allocates scan,
encode and decode buffers (its own, anonymous). ``self_memory`` splits its resident set
(/proc/self/status: RssAnon, RssFile, RssShmem) so that a report never mistakes the shared
template pages for the manager's. ``trim_heap`` hands freed heap back to the kernel (glibc
``malloc_trim``: without it a process that once held a large buffer keeps it resident), and
``bound_heap_caching`` makes glibc serve large buffers by mmap, returned at free, whatever
sizes it has seen before (no dynamic mmap threshold), from at most two heaps for all threads.
``heap_stats`` reads glibc's own books (``mallinfo2``): bytes in use, bytes free but held in
its heaps, bytes in mmapped chunks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# Buffers from this size up are mmapped (and unmapped when freed). 256 KiB rather than glibc's
# 128 KiB-and-growing: a compression's page arrays (2 MiB chunks, the encoder's buffers) and the
# per-sandbox arrays of 256 KiB and more (the fault handler's 512 KiB service-time ring, a
# calloc: its pages stay untouched until faults are timed) get mappings of their own, so none
# of them is left in the middle of the heap where a freed range cannot go back to the kernel.
MMAP_THRESHOLD_BYTES = 256 << 10
# glibc gives each thread that allocates its own heap ("arena", up to 8 per core) by default:
# the manager's many fault-handler threads would each keep freed memory the others cannot
# reuse (a 20 MiB arena held by one thread was seen). Python threads take turns under the GIL,
# so two arenas cost no contention worth the name.
ARENA_MAX = 2


class _Mallinfo2(ctypes.Structure):
    """struct mallinfo2 (glibc >= 2.33, malloc.h): ten size_t counters, summed over arenas."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_STATUS_FIELDS = {"VmRSS": "rss_bytes", "RssAnon": "anon_bytes", "RssFile": "file_bytes",
                  "RssShmem": "shmem_bytes"}


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


_LIBC = _libc()
if _LIBC is not None and hasattr(_LIBC, "mallinfo2"):
    _LIBC.mallinfo2.restype = _Mallinfo2
    _LIBC.mallinfo2.argtypes = []


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


def heap_stats() -> dict[str, int]:
    """glibc's heap books (mallinfo2, every arena): ``heap_bytes`` obtained from the kernel for
    its heaps (brk and arena heaps), ``heap_in_use_bytes`` handed out from them,
    ``heap_free_bytes`` free in them (held by glibc for reuse; the part malloc_trim already
    gave back with MADV_DONTNEED is counted too, since glibc keeps the address range),
    ``mmapped_bytes`` in chunks of their own mapping (unmapped at free). Empty without glibc."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return {}
    mi = _LIBC.mallinfo2()
    return {"heap_bytes": int(mi.arena), "heap_in_use_bytes": int(mi.uordblks),
            "heap_free_bytes": int(mi.fordblks), "mmapped_bytes": int(mi.hblkhd), "mmapped_chunks": int(mi.hblks)}


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
