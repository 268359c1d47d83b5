"""The userfaultfd export end to end, without QEMU.

``uffd_guest.c`` stands in for QEMU: it runs as an unprivileged user (65534) with
``libazq_uffd.so`` preloaded, maps a memfd or /dev/shm file MAP_SHARED, fills it with a
known pattern and checks every page on command while a mutator rewrites some. The test
is the manager (root): it connects to the library's socket, hands over
/dev/userfaultfd, receives the uffd, the RAM fd and the layout, registers the range,
saves and punches pages, and serves the faults with azqemu.restore. The guest's own
checks must never fail, a killed manager must leave the guest waiting (never reading a
zero page), and a new manager must get the same uffd and finish the work.

Run as ``python tests/integration/test_uffd_export.py --manager ...`` this file is also
the killable manager process of the kill test (see ``manager_main``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from azqemu.host.pagemap import private_pages, read_private_pages
from azqemu.restore import uffd_abi as abi
from azqemu.restore.errors import ExportRefused, ExportUnavailable
from azqemu.restore.export import PROTO, RamMapping, UffdExport, UffdHandle
from azqemu.restore.handler import FaultHandler
from azqemu.restore.prefetch import Prefetcher
from azqemu.restore.source import CompositeSource, MappedSource, StoreSource, TemplateSource

REPO = Path(__file__).resolve().parents[2]
LIB_SRC = REPO / "qemu-patches" / "azq_uffd.c"
GUEST_SRC = Path(__file__).with_name("uffd_guest.c")
NOBODY = 65534
OTHER_UID = 65533
PS = 4096
MUT_STRIDE = 8  # uffd_guest.c: every 8th page belongs to the mutator
KCMP_FILE = 0
SYS_KCMP = 312  # x86_64


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (the manager opens /dev/userfaultfd)"
    if not os.path.exists("/dev/userfaultfd"):
        return "no /dev/userfaultfd (Linux 6.1+)"
    for tool in ("gcc", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    return None


pytestmark = [pytest.mark.root, pytest.mark.uffd,
              pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


@dataclasses.dataclass
class Built:
    root: Path
    lib: Path
    guest: Path
    sockdir: Path


@pytest.fixture(scope="session")
def built() -> Iterator[Built]:
    """Build the library (the Makefile's command) and the guest where uid 65534 can read them."""
    root = Path(tempfile.mkdtemp(prefix="azq-uffd-test-"))
    try:
        root.chmod(0o755)
        lib, guest = root / "libazq_uffd.so", root / "uffd_guest"
        subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-pthread",
                        "-o", str(lib), str(LIB_SRC)], check=True)
        subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-o", str(guest),
                        str(GUEST_SRC)], check=True)
        sockdir = root / "sock"
        sockdir.mkdir()
        os.chown(sockdir, NOBODY, NOBODY)  # what the manager does for libvirt-qemu
        yield Built(root, lib, guest, sockdir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Guest:
    """The stand-in QEMU process and its line protocol (see uffd_guest.c)."""

    _n = 0

    def __init__(self, built: Built, size_mib: int, backend: str = "memfd", *,
                 socket_path: str | None = None, uid: int = NOBODY, event_remove: bool = False) -> None:
        Guest._n += 1
        self.socket_path = socket_path or str(built.sockdir / f"guest{Guest._n}.sock")
        self.stderr_path = built.root / f"guest{Guest._n}.stderr"
        self.backend = backend
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "env",
                 f"LD_PRELOAD={built.lib}", f"AZQ_UFFD_SOCKET={self.socket_path}",
                 *(["AZQ_UFFD_EVENT_REMOVE=1"] if event_remove else []),
                 str(built.guest), str(size_mib), backend],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
        self._replies: queue.Queue[str] = queue.Queue()
        self._done: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._reply(10)
        assert ready.startswith("READY"), ready + self.stderr()
        f = parse_kv(ready)
        self.hva, self.size, self.pages, self.pid = f["hva"], f["size"], f["pages"], f["pid"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            (self._done if line.startswith("DONE") else self._replies).put(line.strip())

    def _reply(self, timeout_s: float) -> str:
        try:
            return self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"guest did not answer within {timeout_s} s\n{self.stderr()}") from None

    def cmd(self, line: str, timeout_s: float = 10) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        return self._reply(timeout_s)

    def run(self, verifiers: int = 2, passes: int = 2, mutate: bool = True) -> None:
        assert self.cmd(f"RUN {verifiers} {passes} {int(mutate)}") == "STARTED"

    def wait_done(self, timeout_s: float = 60) -> dict[str, float]:
        try:
            done = self._done.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"guest run not done within {timeout_s} s: {self.status()}\n"
                                 f"{self.stderr()}") from None
        return parse_kv(done)

    def status(self) -> dict[str, float]:
        return parse_kv(self.cmd("STATUS"))

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("EXIT\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.backend != "memfd":
            try:
                os.unlink(self.backend.removeprefix("private:"))
            except FileNotFoundError:
                pass


def parse_kv(line: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in line.split()[1:]:
        key, _, value = part.partition("=")
        try:
            out[key] = int(value, 0)
        except ValueError:
            out[key] = float(value)
    return out


@pytest.fixture
def guest(built: Built) -> Iterator[Guest]:
    g = Guest(built, 16)
    yield g
    g.close()


class ArrayStore:
    """In-test page store: saved page images, with the store's decode_page_into method."""

    def __init__(self, pages: int) -> None:
        self.data = np.zeros(pages * PS, dtype=np.uint8)
        self.held = np.zeros(pages, dtype=bool)
        self._mv = memoryview(self.data)

    def decode_page_into(self, sandbox: str, page_idx: int, out: memoryview) -> None:
        if not self.held[page_idx]:
            raise KeyError(page_idx)
        out[:] = self._mv[page_idx * PS:(page_idx + 1) * PS]


def save_and_punch(handle: UffdHandle, block: RamMapping, pages: np.ndarray, store: ArrayStore) -> None:
    """The compressor's part, run while the guest is quiescent: save, then punch."""
    fd = handle.ram_fd(block)
    starts = pages[np.concatenate(([True], np.diff(pages) != 1))]
    lengths = np.diff(np.concatenate((np.flatnonzero(np.concatenate(([True], np.diff(pages) != 1))),
                                      [len(pages)])))
    for s, n in zip(starts.tolist(), lengths.tolist()):
        off = block.offset_of_page(s)
        got = os.preadv(fd, [store._mv[s * PS:(s + n) * PS]], off)
        assert got == n * PS
        store.held[s:s + n] = True
        handle.punch(block, off, n * PS)


def kcmp_same_file(pid1: int, fd1: int, pid2: int, fd2: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(SYS_KCMP), ctypes.c_int(pid1), ctypes.c_int(pid2),
                      ctypes.c_int(KCMP_FILE), ctypes.c_ulong(fd1), ctypes.c_ulong(fd2))
    assert rc >= 0, os.strerror(ctypes.get_errno())
    return rc == 0


def wait_until(pred, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def assert_clean(done: dict[str, float], guest: Guest) -> None:
    assert done["errors"] == 0 and done["zero_pages"] == 0, f"{done}\n{guest.stderr()}"


# -- the handshake ---------------------------------------------------------------------

def test_handshake_gives_uffd_ram_fd_and_layout(guest: Guest) -> None:
    st = os.stat(guest.socket_path)
    assert (oct(st.st_mode & 0o777), st.st_uid) == ("0o600", NOBODY)
    with UffdExport.connect(guest.socket_path, 5) as h:
        assert h.created and h.pid == guest.pid
        assert h.features & abi.UFFD_FEATURE_MISSING_SHMEM
        # Not asked unless AZQ_UFFD_EVENT_REMOVE=1: every madvise of a registered range would
        # wait for its event to be read (test_discard_is_reported_and_refilled asks for it).
        assert not h.features & abi.UFFD_FEATURE_EVENT_REMOVE
        assert h.features & h.features_offered == h.features
        assert h.blocks == [RamMapping(guest.hva, guest.size, 0, PS, "/memfd:azq-guest-ram (deleted)", 0)]
        assert len(h.ram_fds) == 1 and os.fstat(h.ram_fds[0]).st_size == guest.size
        with open(f"/proc/{guest.pid}/mem", "rb") as mem:  # the fd really backs the mapping
            mem.seek(guest.hva + 5 * PS)
            assert mem.read(PS) == os.pread(h.ram_fds[0], PS, 5 * PS)
        assert kcmp_same_file(guest.pid, h.peer_uffd_fd, os.getpid(), h.uffd)
        with UffdExport.connect(guest.socket_path, 5) as again:
            assert not again.created and again.peer_uffd_fd == h.peer_uffd_fd
            assert kcmp_same_file(os.getpid(), h.uffd, os.getpid(), again.uffd)
            assert kcmp_same_file(os.getpid(), h.ram_fds[0], os.getpid(), again.ram_fds[0])
    guest.close()
    assert not os.path.exists(guest.socket_path)  # removed at exit


def test_dev_shm_backend(built: Built) -> None:
    path = f"/dev/shm/azq-uffd-test-{os.getpid()}"
    g = Guest(built, 8, path)
    try:
        with UffdExport.connect(g.socket_path, 5) as h:
            assert h.blocks == [RamMapping(g.hva, g.size, 0, PS, path, 0)]
            serve_rounds(g, h, rounds=1, seed=3)
    finally:
        g.close()
    assert not os.path.exists(path)


def test_private_mapping_discard_and_minor_faults(built: Built) -> None:
    """A copy-on-write mapping (MAP_PRIVATE of a tmpfs file): reported without its fd,
    DISCARD refused outside it, and the compressor's cycle on it (read the written pages,
    register MISSING+MINOR, discard) leaves a guest that reads its own bytes back."""
    path = f"/dev/shm/azq-uffd-cow-{os.getpid()}"
    g = Guest(built, 8, "private:" + path)
    try:
        with UffdExport.connect(g.socket_path, 5) as h:
            (b,) = h.blocks
            assert b.private and b.ram_fd_index == -1 and h.ram_fds == [] and b.name == path
            assert h.features & abi.UFFD_FEATURE_MINOR_SHMEM
            with UffdExport(g.socket_path, 5) as exp:
                for hva, size in ((b.hva + 1, PS), (b.hva, b.size_bytes + PS), (b.hva - PS, PS)):
                    with pytest.raises(ExportRefused) as exc:
                        exp.discard(hva, size)
                    assert exc.value.errno_name == "EINVAL"
            idx, pages = read_private_pages(g.pid, b.hva, b.page_count)
            assert idx.tolist() == list(range(b.page_count))  # the guest wrote every page
            store = ArrayStore(b.page_count)
            store.data[:] = pages.reshape(-1)
            store.held[:] = True
            comp = CompositeSource(b.page_count, PS, default=MappedSource())
            comp.assign(idx, StoreSource(store, "g"))
            h.register(b.hva, b.size_bytes, minor=True)
            with FaultHandler(h, comp) as handler:
                with UffdExport(g.socket_path, 5) as exp:
                    exp.discard(b.hva, b.size_bytes)
                assert len(private_pages(g.pid, b.hva, b.page_count)) == 0
                g.run()
                assert_clean(g.wait_done(), g)
                assert handler.stats().served >= b.page_count
    finally:
        g.close()
    assert not os.path.exists(path)


def test_library_side_registration(guest: Guest) -> None:
    with UffdExport(guest.socket_path, 5) as exp:
        with pytest.raises(ExportRefused) as exc:
            exp.library_register()
        assert (exc.value.errno_name, exc.value.detail) == (
            "EBADF", "no uffd yet: send HELLO with /dev/userfaultfd first")
    with UffdExport.connect(guest.socket_path, 5) as h, UffdExport(guest.socket_path, 5) as exp:
        ioctls = exp.library_register()
        assert ioctls & (1 << abi._UFFDIO_COPY)
        b = h.blocks[0]
        store = ArrayStore(guest.pages)
        save_and_punch(h, b, np.arange(0, guest.pages, 3), store)
        with FaultHandler(h, StoreSource(store, "g")):
            guest.run()
            assert_clean(guest.wait_done(), guest)
        exp.library_unregister(b.hva, b.size_bytes)
        with pytest.raises(ExportRefused) as exc:
            exp.library_register(b.hva + 1, PS)
        assert exc.value.errno_name == "EINVAL"
        assert exc.value.detail.startswith(f"UFFDIO_REGISTER {b.hva + 1:#x}+4096:")


# -- negative handshakes: exact errors -------------------------------------------------

def test_first_hello_needs_the_device_fd(guest: Guest) -> None:
    with UffdExport(guest.socket_path, 5) as exp, pytest.raises(ExportRefused) as exc:
        exp.hello(None)
    e = exc.value
    assert (e.errno, e.errno_name, e.detail) == (
        22, "EINVAL", "the first HELLO must carry an open /dev/userfaultfd fd (SCM_RIGHTS)")


def test_hello_with_the_wrong_device(guest: Guest) -> None:
    null = os.open("/dev/null", os.O_RDWR)
    r, w = os.pipe()
    try:
        with UffdExport(guest.socket_path, 5) as exp:
            with pytest.raises(ExportRefused) as exc:
                exp.hello(null)
            assert (exc.value.errno_name, exc.value.detail) == (
                "ENOTTY", "USERFAULTFD_IOC_NEW on the passed fd (is it /dev/userfaultfd?): "
                          "Inappropriate ioctl for device")
            with pytest.raises(ExportRefused) as exc:
                exp.hello(r)
            assert (exc.value.errno_name, exc.value.detail) == (
                "ENOTTY", "the fd passed is not a character device (/dev/userfaultfd)")
    finally:
        for fd in (null, r, w):
            os.close(fd)
    with UffdExport.connect(guest.socket_path, 5) as h:  # nothing was spoiled
        assert h.created


def test_unknown_request_and_stray_fds(guest: Guest) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(guest.socket_path)
    with sock:
        sock.send(b"AZQ1 FROB\n")
        assert sock.recv(4096) == (b"AZQ1 ERR 71 EPROTO unknown request 'AZQ1 FROB' "
                                   b"(expected AZQ1 HELLO|REGISTER|UNREGISTER|DISCARD)\n")
        # DISCARD acts on copy-on-write (private) RAM only; this guest's RAM is shared.
        sock.send(f"{PROTO} DISCARD {guest.hva:#x} {PS}\n".encode())
        assert sock.recv(4096) == (f"AZQ1 ERR 22 EINVAL {guest.hva:#x}+{PS} is not inside a private "
                                   "RAM block\n").encode()
        sock.send(f"{PROTO} DISCARD 0x1000\n".encode())
        assert sock.recv(4096) == b"AZQ1 ERR 22 EINVAL expected '<hva-hex> <len>' pairs (512)\n"
        null = os.open("/dev/null", os.O_RDONLY)
        socket.send_fds(sock, [f"{PROTO} REGISTER all\n".encode()], [null])
        os.close(null)
        assert sock.recv(4096) == b"AZQ1 ERR 22 EINVAL only HELLO carries an fd\n"


def test_other_users_cannot_connect(guest: Guest, built: Built) -> None:
    code = ("import socket,sys\ns=socket.socket(socket.AF_UNIX,socket.SOCK_SEQPACKET)\n"
            "try:\n s.connect(sys.argv[1])\nexcept PermissionError:\n print('EACCES')\n")
    out = subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                          sys.executable, "-c", code, guest.socket_path],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "EACCES", out.stderr


def test_qemus_own_uid_is_refused(guest: Guest) -> None:
    """Every QEMU runs as the same user: a process with that uid (another sandbox's QEMU that
    a guest escaped into) can open the socket but must not get the uffd or the RAM fd."""
    code = ("import socket,sys\ns=socket.socket(socket.AF_UNIX,socket.SOCK_SEQPACKET)\n"
            "s.connect(sys.argv[1])\nprint(s.recv(4096).decode().strip())\n")  # refused before any request
    out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                          sys.executable, "-c", code, guest.socket_path],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == f"AZQ1 ERR 13 EACCES peer uid {NOBODY} is not root (only the manager is served)", \
        out.stderr


def test_process_without_shared_ram(built: Built) -> None:
    sock = str(built.sockdir / "noram.sock")
    proc = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "env",
                             f"LD_PRELOAD={built.lib}", f"AZQ_UFFD_SOCKET={sock}", "sleep", "30"],
                            stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(ExportRefused) as exc:
            UffdExport.connect(sock, 5)
        assert (exc.value.errno_name, exc.value.detail) == (
            "ENOENT", "no tmpfs/hugetlbfs mapping (guest RAM) in this process")
    finally:
        proc.terminate()
        proc.wait()
        # sleep dies of SIGTERM without exit(): the file stays (QEMU exits cleanly and
        # removes it; after a SIGKILL the manager must, or the next bind takes it over).
        os.unlink(sock)


def test_without_the_variable_the_library_does_nothing(built: Built) -> None:
    proc = subprocess.Popen(["env", "-u", "AZQ_UFFD_SOCKET", f"LD_PRELOAD={built.lib}", "sleep", "30"])
    try:
        time.sleep(0.2)
        comms = [Path(f"/proc/{proc.pid}/task/{t}/comm").read_text().strip()
                 for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert comms == ["sleep"]  # no azq-uffd thread
    finally:
        proc.terminate()
        proc.wait()


def test_stale_socket_taken_over_live_one_kept(built: Built) -> None:
    path = str(built.sockdir / "stale.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(path)  # a socket file nobody listens on: what a killed QEMU leaves
    stale.close()
    os.chown(path, NOBODY, NOBODY)
    first = Guest(built, 4, socket_path=path)
    second = Guest(built, 4, socket_path=path)
    try:
        assert "cannot listen on" in second.stderr() and "Address already in use" in second.stderr()
        with UffdExport.connect(path, 5) as h:
            assert h.pid == first.pid
    finally:
        second.close()
        first.close()


def test_connect_times_out_while_qemu_is_not_there(built: Built) -> None:
    t0 = time.monotonic()
    with pytest.raises(ExportUnavailable) as exc:
        UffdExport.connect(str(built.sockdir / "later.sock"), 0.3)
    assert exc.value.detail == "No such file or directory after 0.3 s"
    assert 0.3 <= time.monotonic() - t0 < 2


# -- serving ---------------------------------------------------------------------------

def serve_rounds(guest: Guest, h: UffdHandle, rounds: int, seed: int, verifiers: int = 2) -> list[FaultHandler]:
    """Rounds of: save + punch (first all pages, then a random 60%), run the guest's checks
    with faults served, prefetch what was not faulted, check everything is back."""
    b = h.blocks[0]
    rng = np.random.default_rng(seed)
    h.register(b.hva, b.size_bytes)  # DESIGN: register right before punching
    handlers = []
    with Prefetcher(h.uffd, chunk_bytes=1 << 20) as pf:
        for r in range(rounds):
            pages = np.arange(b.page_count) if r == 0 else np.sort(
                rng.choice(b.page_count, size=b.page_count * 6 // 10, replace=False))
            store = ArrayStore(b.page_count)
            save_and_punch(h, b, pages, store)
            source = CompositeSource.for_sandbox(b.page_count, PS, stored=pages,
                                                 store=StoreSource(store, guest.socket_path))
            with FaultHandler(h, source) as fh:
                guest.run(verifiers=verifiers, passes=2, mutate=True)
                done = guest.wait_done()
                assert_clean(done, guest)
                s = fh.stats()
                assert s.errors == 0 and s.served > 0, s
                hot = fh.hot_pages()
                assert set(hot.tolist()) <= set(pages.tolist())
                rest = np.setdiff1d(pages, hot)
                res = pf.prefetch(b, rest, source)
                assert res.pages_copied + res.pages_present == len(rest)
            handlers.append(fh)
    h.unregister(b.hva, b.size_bytes)  # everything is back
    guest.run(verifiers=1, passes=1, mutate=False)  # no manager now: nothing may be missing
    assert_clean(guest.wait_done(10), guest)
    return handlers


def test_rounds_with_two_vcpus_and_a_mutator(guest: Guest) -> None:
    with UffdExport.connect(guest.socket_path, 5) as h:
        handlers = serve_rounds(guest, h, rounds=4, seed=1)
    first = handlers[0].stats()
    assert first.served == guest.pages  # every page punched and faulted back once
    assert first.faults >= first.served


def test_discard_is_reported_and_refilled(built: Built) -> None:
    """With AZQ_UFFD_EVENT_REMOVE=1 (RAM a balloon may discard), QEMU's discards are reported."""
    guest = Guest(built, 16, event_remove=True)
    try:
        with UffdExport.connect(guest.socket_path, 5) as h:
            assert h.features & abi.UFFD_FEATURE_EVENT_REMOVE
            b = h.blocks[0]
            h.register(b.hva, b.size_bytes)
            store = ArrayStore(guest.pages)
            save_and_punch(h, b, np.arange(0, 64), store)
            source = CompositeSource.for_sandbox(b.page_count, PS, stored=np.arange(0, 64),
                                                 store=StoreSource(store, "g"))
            with FaultHandler(h, source) as fh:
                # QEMU's balloon discard (punch + MADV_DONTNEED) blocks until the event is read.
                assert guest.cmd("DISCARD 100 8", timeout_s=5) == "DISCARDED 8"
                wait_until(lambda: fh.stats().removes == 1, 5, "the REMOVE event")
                assert fh.discarded_pages().tolist() == list(range(100, 108))
                # The guest reuses the freed pages: their first write faults, gets a page, and
                # is overwritten. Pages 0..63 come back from the store.
                assert guest.cmd("REFILL", timeout_s=10) == "REFILLED 8"
                guest.run()
                assert_clean(guest.wait_done(), guest)
                assert fh.stats().errors == 0
            h.unregister(b.hva, b.size_bytes)
    finally:
        guest.close()


# -- inside a real QEMU ------------------------------------------------------------------

def qmp(sock: socket.socket, command: str, **arguments: object) -> object:
    msg = {"execute": command, **({"arguments": arguments} if arguments else {})}
    sock.sendall(json.dumps(msg).encode() + b"\n")
    buf = b""
    while True:
        chunk = sock.recv(65536)
        assert chunk, "QMP closed"
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            reply = json.loads(line)
            if "return" in reply:
                return reply["return"]
            assert "error" not in reply, reply


@pytest.mark.vm  # a real QEMU (TCG, no libvirtd, no guest image)
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="no qemu-system-x86_64")
def test_inside_qemu_as_unprivileged_user_with_seccomp(built: Built) -> None:
    """The library inside qemu-system-x86_64 (TCG, paused, memfd RAM, libvirt's -sandbox
    flags, QEMU's user): QEMU's own reads of punched RAM (pmemsave) are served exactly."""
    try:
        import pwd
        uid = pwd.getpwnam("libvirt-qemu").pw_uid
    except KeyError:
        uid = NOBODY
    qdir = built.root / "qemu"
    qdir.mkdir()
    os.chown(qdir, uid, uid)
    usock, qsock, dump = qdir / "uffd.sock", qdir / "qmp.sock", qdir / "dump"
    mem_mib = 64
    proc = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "env",
         f"LD_PRELOAD={built.lib}", f"AZQ_UFFD_SOCKET={usock}",
         "qemu-system-x86_64", "-machine", "q35,memory-backend=pc.ram", "-accel", "tcg", "-m", f"{mem_mib}M",
         "-object", f"memory-backend-memfd,id=pc.ram,size={mem_mib}M,share=on",
         "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
         "-S", "-nodefaults", "-display", "none", "-qmp", f"unix:{qsock},server=on,wait=off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: qsock.exists() or proc.poll() is not None, 20, "QEMU's QMP socket")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        q = socket.socket(socket.AF_UNIX)
        q.connect(str(qsock))
        q.recv(65536)  # greeting
        qmp(q, "qmp_capabilities")
        with UffdExport.connect(str(usock), 10) as h:
            assert h.pid == proc.pid  # setpriv and env exec: same process
            ram = [b for b in h.blocks if b.size_bytes == mem_mib << 20]
            assert len(ram) == 1, h.blocks
            b = ram[0]
            assert b.name == "/memfd:memory-backend-memfd (deleted)"
            fd = h.ram_fd(b)
            pattern = np.arange(b.size_bytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            os.pwrite(fd, pattern.tobytes(), b.offset)  # vCPUs never ran (-S)
            image = str(qdir / "image")
            pattern.tofile(image)
            h.register(b.hva, b.size_bytes)
            h.punch(b, b.offset, b.size_bytes)
            with TemplateSource(image) as src, FaultHandler(h, src) as fh:
                qmp(q, "pmemsave", val=0, size=b.size_bytes, filename=str(dump))
                s = fh.stats()
                h.unregister(b.hva, b.size_bytes)
            got = np.fromfile(dump, dtype=np.uint64)
            hole = slice(0xA0000 // 8, 0x100000 // 8)  # VGA window and BIOS: not RAM at those gpas
            got[hole] = pattern[hole]
            assert np.array_equal(got, pattern)
            assert s.errors == 0 and s.served >= b.page_count - (0x60000 // PS)
        qmp(q, "quit")
        assert proc.wait(10) == 0
        assert not usock.exists()  # removed at QEMU's exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the killed manager ------------------------------------------------------------------

def manager_main(argv: list[str]) -> int:
    """A manager process the test can kill -9: serves faults from an image, and with
    --stall-after N hangs inside the N+1st fill, holding fault messages it read."""
    sock, image, stall_after = argv[0], argv[1], int(argv[2])
    h = UffdExport.connect(sock, 5)
    inner = TemplateSource(image)

    class Stalling:
        served = 0

        def fill(self, offset: int, out: memoryview) -> bool:
            if Stalling.served >= stall_after:
                time.sleep(3600)
            Stalling.served += 1
            return inner.fill(offset, out)

    fh = FaultHandler(h, Stalling() if stall_after >= 0 else inner)
    fh.start()
    print(f"SERVING created={int(h.created)}", flush=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.sigwait({signal.SIGTERM})
    return 0


def start_manager(guest: Guest, image: str, stall_after: int) -> subprocess.Popen[str]:
    """A manager process: this file's stalling one, or (stall_after < 0) the standalone
    server ``python -m tests.support.uffd_serve``."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if stall_after >= 0:
        argv = [sys.executable, __file__, "--manager", guest.socket_path, image, str(stall_after)]
        expect = "SERVING created=0"
    else:
        argv = [sys.executable, "-m", "tests.support.uffd_serve", "--socket", guest.socket_path, "--image", image]
        expect = f"SERVING pid={guest.pid} uffd_created=0 blocks=1"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(expect), line  # the uffd existed already
    return proc


def is_stalled(guest: Guest, settle_s: float = 0.3) -> bool:
    a = guest.status()
    time.sleep(settle_s)
    b = guest.status()
    return (a["verified"], a["mutated"]) == (b["verified"], b["mutated"])


def stalled(guest: Guest, settle_s: float = 0.3) -> dict[str, float]:
    """Status, after checking that nothing moves for settle_s."""
    a = guest.status()
    time.sleep(settle_s)
    b = guest.status()
    assert (a["verified"], a["mutated"]) == (b["verified"], b["mutated"]), (a, b)
    assert b["running"] == 1 and b["errors"] == 0 and b["zero_pages"] == 0, b
    return b


def test_standalone_server_serves_and_stops_on_sigterm(guest: Guest, built: Built) -> None:
    image = str(built.root / "image-serve")
    with UffdExport.connect(guest.socket_path, 5) as setup:
        b = setup.blocks[0]
        with open(image, "wb") as f:
            f.write(os.pread(setup.ram_fd(b), b.size_bytes, b.offset))
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.uffd_serve", "--socket", guest.socket_path,
                             "--image", image, "--register"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(f"SERVING pid={guest.pid} uffd_created=0")
        with UffdExport.connect(guest.socket_path, 5) as h:  # registered by the server
            h.punch(b, b.offset, b.size_bytes)
        guest.run()
        assert_clean(guest.wait_done(), guest)
        proc.send_signal(signal.SIGTERM)
        stats = json.loads(proc.stdout.readline())
        assert proc.wait(10) == 0
        assert stats["served"] == guest.pages and stats["errors"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(image)
    with UffdExport.connect(guest.socket_path, 5) as h:
        h.unregister(b.hva, b.size_bytes)


@pytest.mark.parametrize("stall_after", [200, -1], ids=["stalled-manager", "killed-anytime"])
def test_killed_manager_leaves_the_guest_waiting(guest: Guest, built: Built, stall_after: int) -> None:
    image = str(built.root / f"image-{stall_after}")
    total = guest.pages
    with UffdExport.connect(guest.socket_path, 5) as setup:  # register, save, punch, let go
        b = setup.blocks[0]
        setup.register(b.hva, b.size_bytes)
        with open(image, "wb") as f:
            f.write(os.pread(setup.ram_fd(b), b.size_bytes, b.offset))
        setup.punch(b, b.offset, b.size_bytes)
        peer_fd = setup.peer_uffd_fd
    # No manager holds the uffd now; only the library does. The guest must wait.
    guest.run(verifiers=2, passes=2, mutate=True)
    assert stalled(guest)["verified"] == 0

    m1 = start_manager(guest, image, stall_after)
    try:
        if stall_after >= 0:
            wait_until(lambda: guest.status()["verified"] > 0, 10, "progress under the first manager")
            # The manager hangs inside its 201st fill, holding fault messages it read.
            wait_until(lambda: is_stalled(guest), 20, "the first manager to hang")
        else:
            time.sleep(0.05)
        m1.kill()
        m1.wait()
    finally:
        if m1.poll() is None:
            m1.kill()
            m1.wait()
    # Dead manager: threads may finish pages already present, then block for good (or,
    # killed late, the run may have completed: either way no wrong data).
    wait_until(lambda: is_stalled(guest), 20, "the guest to block")
    if guest.status()["running"]:
        before = stalled(guest)
        assert before["verified"] < 2 * (total - total // 8)
    else:
        assert stall_after < 0, "a hung manager cannot have served everything"
    with UffdExport.connect(guest.socket_path, 5) as h:
        assert not h.created and h.peer_uffd_fd == peer_fd
        assert kcmp_same_file(guest.pid, peer_fd, os.getpid(), h.uffd)  # the SAME uffd
        with TemplateSource(image) as src, FaultHandler(h, src) as fh:  # start() wakes the range
            done = guest.wait_done(60)
            assert_clean(done, guest)
            assert fh.stats().errors == 0
        h.unregister(b.hva, b.size_bytes)
    os.unlink(image)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--manager":
    sys.exit(manager_main(sys.argv[2:]))
