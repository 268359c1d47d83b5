"""The manager side of the userfaultfd export handshake.

``qemu-patches/libazq_uffd.so``, preloaded into QEMU, listens on a unix socket
(SOCK_SEQPACKET). The manager (root) connects, sends ``AZQ1 HELLO`` with an open
/dev/userfaultfd fd (SCM_RIGHTS), and receives the uffd the library made inside QEMU,
the fds behind the guest-RAM mappings and their layout. A manager that restarts
connects again and gets the same uffd (the library keeps its own reference). The
protocol is documented in ``qemu-patches/README.md``; this module is its only client.

The handle then does what DESIGN.md asks of the manager: register the RAM range right
before punching pages out of it, unregister it once every page is back, and wake
waiters after a reattach (their fault messages died with the previous manager).
"""

from __future__ import annotations

import dataclasses
import errno as _errno
import os
import socket
import time
from dataclasses import dataclass, field
from types import TracebackType

import numpy as np

from azqemu.errors import RestoreError
from azqemu.host import threads
from azqemu.host.procfs import RAM_MEMFD_NAMES
from azqemu.pages import page_runs
from azqemu.restore import uffd
from azqemu.restore import uffd_abi as abi
from azqemu.restore.errors import ExportProtocolError, ExportRefused, ExportUnavailable, UffdIoctlError

PROTO = "AZQ1"
# Bounds on what the library may send (it is inside QEMU, which runs guest-influenced
# code: treat the reply as untrusted input). Match qemu-patches/azq_uffd.c.
REPLY_MAX_BYTES = 65536
MAX_FDS = 65
MAX_BLOCKS = 256
# Ranges per DISCARD request (AZQ_DISCARD_MAX; a request line is at most 16 KiB).
DISCARD_MAX_RANGES = 512
# How often connect() retries while QEMU is still starting (socket not there yet).
CONNECT_RETRY_S = 0.05
# The library's thread in QEMU (pthread_setname_np in azq_uffd.c).
EXPORT_THREAD = "azq-uffd"


@dataclass(frozen=True)
class RamMapping:
    """One guest-RAM mapping in QEMU: ``size_bytes`` at host address ``hva`` map the
    backing file ``ram_fds[ram_fd_index]`` from ``offset``. ``name`` is the mapping's
    path as /proc/<pid>/maps shows it (``/memfd:NAME (deleted)`` or a /dev/shm path).

    A ``private`` block is a copy-on-write (MAP_PRIVATE) mapping of a template image: the
    pages the guest wrote are anonymous copies in QEMU, the others are the template's
    page cache. The library never hands out its fd (``ram_fd_index`` -1): pages leave it
    by ``UffdExport.discard`` (madvise inside QEMU), never by a punch of the file."""

    hva: int
    size_bytes: int
    offset: int
    page_size: int
    name: str
    ram_fd_index: int = 0
    private: bool = False

    @property
    def end_hva(self) -> int:
        return self.hva + self.size_bytes

    @property
    def page_count(self) -> int:
        return self.size_bytes // self.page_size

    def contains(self, hva: int) -> bool:
        return self.hva <= hva < self.hva + self.size_bytes

    def hva_of_page(self, page_idx: int) -> int:
        """Host address of page ``page_idx`` of this block (index from the block start)."""
        return self.hva + page_idx * self.page_size

    def offset_of_page(self, page_idx: int) -> int:
        """Offset in the backing file of page ``page_idx`` of this block."""
        return self.offset + page_idx * self.page_size


@dataclass
class UffdHandle:
    """What the export hands over. Owns its fds: ``close()`` (or ``with``) releases them;
    QEMU keeps its own uffd, so closing never exposes a punched page as zero."""

    uffd: int
    ram_fds: list[int]
    blocks: list[RamMapping]
    pid: int = 0
    features: int = 0            # enabled on the uffd (uffd_abi.UFFD_FEATURE_*)
    features_offered: int = 0    # what QEMU's kernel supports
    ioctls: int = 0
    created: bool = False
    peer_uffd_fd: int = -1
    socket_path: str = ""
    closed: bool = field(default=False, repr=False)

    def main_block(self) -> RamMapping:
        """The guest's RAM block: the memfd backend's (or pc.ram), else the largest one."""
        blocks = [b for b in self.blocks if any(n in b.name for n in RAM_MEMFD_NAMES)]
        if len(blocks) != 1:
            blocks = sorted(self.blocks, key=lambda b: b.size_bytes)[-1:]
        if not blocks:
            raise RestoreError("the export library reported no guest RAM block")
        return blocks[0]

    # -- registration (the manager-side path, see DESIGN.md) -----------------------------
    def register(self, hva: int, size_bytes: int, *, minor: bool = False) -> int:
        """UFFDIO_REGISTER in MISSING mode (plus MINOR for a private block, whose pages
        are in the template's page cache and so never "missing"); returns the range
        ioctls the kernel allows.

        Refuses (and undoes) a registration where a needed ioctl is not allowed (COPY,
        and CONTINUE and ZEROPAGE in MINOR mode): faults there could never be answered.
        """
        mode = abi.UFFDIO_REGISTER_MODE_MISSING
        need = 1 << abi._UFFDIO_COPY
        if minor:
            if not self.features & abi.UFFD_FEATURE_MINOR_SHMEM:
                raise UffdIoctlError("UFFDIO_REGISTER (MINOR mode: the uffd lacks MINOR_SHMEM)",
                                     _errno.EOPNOTSUPP, hva, size_bytes)
            mode |= abi.UFFDIO_REGISTER_MODE_MINOR
            need |= (1 << abi._UFFDIO_CONTINUE) | (1 << abi._UFFDIO_ZEROPAGE)
        ioctls = uffd.register(self.uffd, hva, size_bytes, mode)
        if ioctls & need != need:
            uffd.unregister(self.uffd, hva, size_bytes)
            raise UffdIoctlError(f"UFFDIO_REGISTER (range ioctls {ioctls:#x} lack {need:#x})",
                                 _errno.EINVAL, hva, size_bytes)
        return ioctls

    def unregister(self, hva: int, size_bytes: int) -> None:
        uffd.unregister(self.uffd, hva, size_bytes)

    def wake(self, hva: int, size_bytes: int) -> None:
        uffd.wake(self.uffd, hva, size_bytes)

    def register_all(self) -> int:
        ioctls = ~0
        for block in self.blocks:
            ioctls &= self.register(block.hva, block.size_bytes)
        return ioctls

    def wake_all(self) -> None:
        for block in self.blocks:
            self.wake(block.hva, block.size_bytes)

    # -- the backing ---------------------------------------------------------------------
    def ram_fd(self, block: RamMapping) -> int:
        if block.ram_fd_index < 0:
            raise ExportProtocolError(self.socket_path, f"no fd for RAM block {block.name!r}")
        return self.ram_fds[block.ram_fd_index]

    def punch(self, block: RamMapping, offset: int, size_bytes: int) -> None:
        """Punch [offset, offset+size_bytes) of the block's backing file (file offsets).

        Register the range first: a punched page of an unregistered range reads as zero.
        """
        uffd.punch_hole(self.ram_fd(block), offset, size_bytes)

    def block_of(self, hva: int) -> RamMapping | None:
        for block in self.blocks:
            if block.contains(hva):
                return block
        return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in [self.uffd, *self.ram_fds]:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> UffdHandle:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def parse_reply(text: bytes, nfds: int, socket_path: str = "") -> dict[str, object]:
    """Parse one reply of the library (``AZQ1 OK ... end`` or ``AZQ1 ERR <n> <NAME> <text>``).

    Raises ExportRefused for ERR and ExportProtocolError for anything malformed. For a
    HELLO reply the dict holds ``pid``, ``uffd_created``, ``uffd_fd_in_peer``,
    ``uffd_features``, ``uffd_ioctls``, ``fds`` and ``blocks`` (list of RamMapping).
    """
    def bad(detail: str) -> ExportProtocolError:
        return ExportProtocolError(socket_path, detail)

    if len(text) > REPLY_MAX_BYTES:
        raise bad(f"reply of {len(text)} bytes exceeds {REPLY_MAX_BYTES}")
    try:
        lines = text.decode("utf-8", "surrogateescape").split("\n")
    except UnicodeDecodeError as err:  # pragma: no cover - surrogateescape never raises
        raise bad("reply is not text") from err
    head = lines[0].split(" ", 4)
    if len(head) >= 2 and head[0] == PROTO and head[1] == "ERR":
        if len(head) < 4 or not head[2].lstrip("-").isdigit():
            raise bad(f"malformed error line {lines[0]!r}")
        raise ExportRefused(socket_path, int(head[2]), head[3], head[4] if len(head) > 4 else "")
    if lines[0] != f"{PROTO} OK":
        raise bad(f"unexpected first line {lines[0][:80]!r}")
    out: dict[str, object] = {"blocks": []}
    blocks: list[RamMapping] = []
    ended = False
    for line in lines[1:]:
        if ended:
            if line:
                raise bad("data after 'end'")
            continue
        if line == "end":
            ended = True
            continue
        key, _, rest = line.partition(" ")
        try:
            if key == "block":
                parts = rest.split(" ", 5)
                if len(parts) != 6:
                    raise ValueError("block needs 6 fields")
                hva, size, offset, page_size, fd_index = (int(parts[0], 0), int(parts[1]),
                                                          int(parts[2]), int(parts[3]), int(parts[4]))
                if len(blocks) >= MAX_BLOCKS:
                    raise ValueError(f"more than {MAX_BLOCKS} blocks")
                if page_size <= 0 or page_size & (page_size - 1):
                    raise ValueError(f"page size {page_size} is not a power of two")
                if size <= 0 or hva % page_size or size % page_size or offset % page_size:
                    raise ValueError("block not page aligned")
                if hva + size > 1 << 64 or offset < 0:
                    raise ValueError("block out of range")
                if not -1 <= fd_index < nfds - 1:
                    raise ValueError(f"RAM fd index {fd_index} but {nfds - 1} RAM fds")
                blocks.append(RamMapping(hva, size, offset, page_size, parts[5], fd_index))
            elif key == "private":
                # Marks the block at this address (listed before) as copy-on-write.
                at = int(rest, 0)
                for i, b in enumerate(blocks):
                    if b.hva == at:
                        blocks[i] = dataclasses.replace(b, private=True)
                        break
                else:
                    raise ValueError("private names no block listed before it")
            elif key in ("pid", "uffd_created", "uffd_fd_in_peer", "fds", "ranges"):
                out[key] = int(rest)
            elif key in ("uffd_features", "uffd_features_offered", "uffd_ioctls", "ioctls"):
                out[key] = int(rest, 16)
            elif key:
                pass  # unknown keys are for newer libraries: ignore, do not fail
        except ValueError as err:
            raise bad(f"line {line[:120]!r}: {err}") from err
    if not ended:
        raise bad("reply does not end with 'end'")
    out["blocks"] = blocks
    if "fds" in out and out["fds"] != nfds:
        raise bad(f"reply announces {out['fds']} fds, {nfds} arrived")
    return out


class UffdExport:
    """One connection to the export socket of a QEMU process."""

    def __init__(self, socket_path: str, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self._timeout_s = timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                sock.connect(socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError) as err:
                sock.close()
                # QEMU may not have loaded the library yet: wait for the socket.
                if time.monotonic() >= deadline:
                    raise ExportUnavailable(socket_path, f"{err.strerror} after {timeout_s:g} s") from err
                time.sleep(CONNECT_RETRY_S)
            except OSError as err:
                sock.close()
                raise ExportUnavailable(socket_path, err.strerror or str(err)) from err
        self._sock = sock

    def _request(self, line: str, fds: list[int]) -> tuple[bytes, list[int]]:
        self._sock.settimeout(self._timeout_s)
        try:
            if fds:
                socket.send_fds(self._sock, [line.encode() + b"\n"], fds)
            else:
                self._sock.send(line.encode() + b"\n")
            msg, got, flags, _ = socket.recv_fds(self._sock, REPLY_MAX_BYTES + 1, MAX_FDS,
                                                 socket.MSG_CMSG_CLOEXEC)
        except (TimeoutError, OSError) as err:
            raise ExportUnavailable(self.socket_path, f"{line.split()[1]}: {err}") from err
        if not msg:
            for fd in got:
                os.close(fd)
            raise ExportUnavailable(self.socket_path, "the export closed the connection")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            for fd in got:
                os.close(fd)
            raise ExportProtocolError(self.socket_path, "reply truncated")
        return msg, got

    def hello(self, dev_fd: int | None) -> UffdHandle:
        """HELLO: ``dev_fd`` is an open /dev/userfaultfd (needed the first time; the
        library makes the uffd from it and ignores it on later HELLOs)."""
        msg, got = self._request(f"{PROTO} HELLO", [dev_fd] if dev_fd is not None else [])
        try:
            reply = parse_reply(msg, len(got), self.socket_path)
            if not got:
                raise ExportProtocolError(self.socket_path, "HELLO reply carries no fds")
            blocks = reply["blocks"]
            assert isinstance(blocks, list)
            if not blocks:
                raise ExportProtocolError(self.socket_path, "HELLO reply lists no RAM block")
        except BaseException:
            for fd in got:
                os.close(fd)
            raise
        # DESIGN.md: set O_NONBLOCK on the received uffd before polling it (it is one
        # open file description with QEMU's copy, which never reads it).
        os.set_blocking(got[0], False)
        return UffdHandle(uffd=got[0], ram_fds=got[1:], blocks=blocks,  # type: ignore[arg-type]
                          pid=int(reply.get("pid", 0)),  # type: ignore[call-overload]
                          features=int(reply.get("uffd_features", 0)),  # type: ignore[call-overload]
                          features_offered=int(reply.get("uffd_features_offered", 0)),  # type: ignore[call-overload]
                          ioctls=int(reply.get("uffd_ioctls", 0)),  # type: ignore[call-overload]
                          created=bool(reply.get("uffd_created", 0)),
                          peer_uffd_fd=int(reply.get("uffd_fd_in_peer", -1)),  # type: ignore[call-overload]
                          socket_path=self.socket_path)

    def library_register(self, hva: int | None = None, size_bytes: int | None = None) -> int:
        """The library-side registration (all RAM blocks when no range is given).
        azqemu registers from the manager instead (``UffdHandle.register``)."""
        arg = "all" if hva is None else f"{hva:#x} {size_bytes}"
        msg, got = self._request(f"{PROTO} REGISTER {arg}", [])
        for fd in got:
            os.close(fd)
        return int(parse_reply(msg, len(got), self.socket_path).get("ioctls", 0))  # type: ignore[call-overload]

    def library_unregister(self, hva: int | None = None, size_bytes: int | None = None) -> None:
        arg = "all" if hva is None else f"{hva:#x} {size_bytes}"
        msg, got = self._request(f"{PROTO} UNREGISTER {arg}", [])
        for fd in got:
            os.close(fd)
        parse_reply(msg, len(got), self.socket_path)

    def discard(self, hva: int, size_bytes: int) -> None:
        """DISCARD: madvise(MADV_DONTNEED) inside QEMU on a range of a private block.

        The copied pages go; the next access reads the template's page, or faults to the
        uffd if the range is registered, which the caller must have done first (in MINOR
        mode) for every page whose content is not the template's. If the uffd asked for
        EVENT_REMOVE, QEMU's madvise waits until a fault handler has read the REMOVE event:
        keep the handler running across this call."""
        self.discard_ranges([(hva, size_bytes)])

    def discard_pages(self, block: RamMapping, pages: np.ndarray) -> int:
        """DISCARD of these pages (indices into ``block``), in runs; returns the requests made."""
        starts, lengths = page_runs(np.asarray(pages, dtype=np.int64))
        return self.discard_ranges([(block.hva + s * block.page_size, n * block.page_size)
                                    for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)])

    def discard_ranges(self, ranges: list[tuple[int, int]]) -> int:
        """DISCARD of many (hva, size_bytes) ranges, DISCARD_MAX_RANGES per request;
        returns the number of requests made."""
        requests = 0
        for i in range(0, len(ranges), DISCARD_MAX_RANGES):
            args = " ".join(f"{hva:#x} {size}" for hva, size in ranges[i:i + DISCARD_MAX_RANGES])
            msg, got = self._request(f"{PROTO} DISCARD {args}", [])
            for fd in got:
                os.close(fd)
            parse_reply(msg, len(got), self.socket_path)
            requests += 1
        return requests

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> UffdExport:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @classmethod
    def connect(cls, socket_path: str, timeout_s: float = 5.0) -> UffdHandle:
        """Connect, hand over a root-opened /dev/userfaultfd and return the handle.

        The same uffd comes back on every call for the life of the QEMU process.
        """
        with cls(socket_path, timeout_s) as export:
            dev_fd = uffd.open_dev()
            try:
                handle = export.hello(dev_fd)
            finally:
                os.close(dev_fd)
        # Its DISCARDs are what a guest paused for a trim waits for: behind eight busy guests
        # at the default priority, one took 50-150 ms to be scheduled (session 20).
        threads.set_nice_of_named(handle.pid, EXPORT_THREAD, threads.PAUSED_GUEST_NICE)
        return handle
