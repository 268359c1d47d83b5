"""Restore: bring compressed guest RAM back through userfaultfd.

- :mod:`.uffd_abi`  the userfaultfd kernel ABI (structures, ioctl numbers, flags)
- :mod:`.uffd`      the ioctls outside the fast paths (register, wake, punch)
- :mod:`.export`    the handshake with ``qemu-patches/libazq_uffd.so`` inside QEMU
- :mod:`.source`    where a page's content comes from (store, template, zero)
- :mod:`.handler`   the fault server thread (UFFDIO_COPY on every missing page)
- :mod:`.prefetch`  bulk restore of the hot set before the guest resumes
"""

from azqemu.restore.errors import (
    ExportProtocolError,
    ExportRefused,
    ExportUnavailable,
    PageUnavailable,
    UffdIoctlError,
)
from azqemu.restore.export import RamMapping, UffdExport, UffdHandle
from azqemu.restore.handler import FaultHandler, HandlerStats
from azqemu.restore.prefetch import Prefetcher, PrefetchResult, prefetch
from azqemu.restore.source import (
    CompositeSource,
    PageSource,
    StoreSource,
    TemplateSource,
    ZeroSource,
)

__all__ = [
    "CompositeSource", "ExportProtocolError", "ExportRefused", "ExportUnavailable", "FaultHandler",
    "HandlerStats", "PageSource", "PageUnavailable", "PrefetchResult", "Prefetcher", "RamMapping",
    "StoreSource", "TemplateSource", "UffdExport", "UffdHandle", "UffdIoctlError", "ZeroSource",
    "prefetch",
]
