"""procfs readers: what /proc says about the host's and a process's memory.

Read-only, shared by the manager (resident and owned bytes of a sandbox, QEMU's own memory),
the Linux configuration and the benchmarks: /proc/meminfo, /proc/PID/smaps, smaps_rollup and
maps, and the open file descriptors of a QEMU (its guest-RAM memfd). All sizes in bytes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from azqemu.errors import HostError

# QEMU names a guest-RAM memfd after the backend type ("memory-backend-memfd") or its id.
RAM_MEMFD_NAMES = ("memory-backend-memfd", "pc.ram")


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo in bytes (the kB fields times 1024; HugePages_* counts as they are)."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def _kb_fields(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = out.get(key, 0) + int(parts[0]) * 1024
    return out


def read_rss_anon(pid: int) -> int:
    """The process's resident anonymous memory (RssAnon of /proc/PID/status, bytes): a kernel
    counter, read without walking any mapping (tens of microseconds against milliseconds for
    smaps)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise HostError(f"/proc/{pid}/status has no RssAnon")


def read_smaps_rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in bytes: Rss, Pss, Pss_Anon, Pss_File, Pss_Shmem, Swap, SwapPss..."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return _kb_fields(f.read())


_VMA_HEADER_RE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) ", re.M)


_KB_FIELD_RE = re.compile(rb"^(\w+):\s+(\d+) kB$", re.M)


def read_vma_smaps(pid: int, start: int, end: int) -> dict[str, int]:
    """The smaps fields (bytes) summed over the VMAs that overlap [start, end).

    A VMA partly outside the range is counted whole: smaps has no finer grain. Guest RAM is
    normally one VMA, or a few when QEMU split it (madvise, mprotect), all inside the range.
    Only the matching VMAs' blocks are parsed (the kernel still walks every VMA to print
    smaps; that is most of the cost, ~1 ms for a QEMU process).
    """
    with open(f"/proc/{pid}/smaps", "rb") as f:
        text = f.read()
    totals: dict[str, int] = {}
    headers = list(_VMA_HEADER_RE.finditer(text))
    for k, h in enumerate(headers):
        if int(h.group(1), 16) < end and int(h.group(2), 16) > start:
            block_end = headers[k + 1].start() if k + 1 < len(headers) else len(text)
            for m in _KB_FIELD_RE.finditer(text, h.end(), block_end):
                key = m.group(1).decode()
                totals[key] = totals.get(key, 0) + int(m.group(2)) * 1024
    return totals


def file_allocated_bytes(path: str | Path) -> int:
    """Bytes a (sparse) file really holds: st_blocks x 512. Works for a memfd through
    /proc/PID/fd/N. The owned memory of a full-copy clone (policy none) is its RAM file's."""
    return os.stat(path).st_blocks * 512


@dataclass(frozen=True)
class Mapping:
    start: int           # hva
    end: int
    perms: str
    offset: int
    inode: int
    path: str

    @property
    def size_bytes(self) -> int:
        return self.end - self.start


MAPS_RE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) ([0-9a-f]+) \S+ (\d+)\s*(.*)$")


def read_maps(pid: int) -> list[Mapping]:
    out = []
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:
        raise HostError(f"no process {pid}") from None
    for line in text.splitlines():
        m = MAPS_RE.match(line)
        if m:
            out.append(Mapping(int(m.group(1), 16), int(m.group(2), 16), m.group(3), int(m.group(4), 16),
                               int(m.group(5)), m.group(6)))
    return out


def find_guest_ram(pid: int, backing: str | None = None) -> tuple[int, int]:
    """The hva range of QEMU's guest RAM: the largest writable mapping whose path contains
    ``backing`` (a RAM file such as .../pc.ram, or 'memfd:'), else the largest writable
    mapping that is anonymous, a memfd or a file on /dev/shm or hugetlbfs.

    Heuristic: guest RAM is by far QEMU's largest mapping for any guest above ~64 MiB (under
    TCG the translation cache is ~43 MB, so give small guests an explicit ``backing``). A
    guest above ~2 GiB on q35 is still one mapping (QEMU maps the RAM block whole and only
    the guest-physical layout splits it).
    """
    best: Mapping | None = None
    for m in read_maps(pid):
        if "w" not in m.perms:
            continue
        if backing is not None:
            ok = backing in m.path
        else:
            ok = (m.path == "" or m.path.startswith("memfd:") or m.path.startswith("/dev/shm/")
                  or m.path.startswith("/dev/hugepages") or m.path.endswith("pc.ram")
                  or m.path.endswith("pc.ram (deleted)"))
        if ok and (best is None or m.size_bytes > best.size_bytes):
            best = m
    if best is None:
        raise HostError(f"no guest RAM mapping in process {pid}" + (f" matching {backing!r}" if backing else ""))
    return best.start, best.end


def find_ram_fd(pid: int, backing: str | None = None) -> Path:
    """/proc/PID/fd/N of QEMU's guest RAM: the open file whose target contains ``backing``
    (``memfd:pc.ram``, a path under /dev/shm), or by default the guest-RAM memfd (a domain
    has exactly one RAM backend). Opening that path gives a new description of the same file."""
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError as exc:
        raise HostError(f"cannot list the open files of process {pid}: {exc.strerror}") from exc
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if backing is not None:
            if backing in target:
                return entry
        elif any(target.startswith(f"/memfd:{n}") for n in RAM_MEMFD_NAMES):
            return entry
    what = repr(backing) if backing is not None else "guest RAM memfd"
    raise HostError(f"process {pid} has no open file matching {what}")
