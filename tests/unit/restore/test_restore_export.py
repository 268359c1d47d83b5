"""The export protocol, manager side: reply parsing and the errors a manager sees.

The library itself is exercised in tests/integration/test_uffd_export.py; here a fake
export (a SOCK_SEQPACKET server thread) produces the replies a real one cannot.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest

from azqemu.restore.errors import ExportProtocolError, ExportRefused, ExportUnavailable
from azqemu.restore.export import RamMapping, UffdExport, parse_reply

GOOD = (b"AZQ1 OK\npid 42\nuffd_created 1\nuffd_fd_in_peer 9\nuffd_features 0x138\n"
        b"uffd_features_offered 0x1ffff\nuffd_ioctls 0x8000000000000003\nfds 2\n"
        b"block 0x7f0000000000 536870912 0 4096 0 /memfd:memory-backend-memfd (deleted)\n"
        b"block 0x7f1000000000 2097152 536870912 4096 0 /memfd:memory-backend-memfd (deleted)\n"
        b"future_key whatever\nend\n")


def test_parse_good_reply() -> None:
    r = parse_reply(GOOD, 2)
    assert r["pid"] == 42 and r["uffd_created"] == 1 and r["uffd_fd_in_peer"] == 9
    assert r["uffd_features"] == 0x138 and r["uffd_features_offered"] == 0x1FFFF
    assert r["blocks"] == [
        RamMapping(0x7F0000000000, 512 << 20, 0, 4096, "/memfd:memory-backend-memfd (deleted)", 0),
        RamMapping(0x7F1000000000, 2 << 20, 512 << 20, 4096, "/memfd:memory-backend-memfd (deleted)", 0),
    ]
    b = r["blocks"][1]
    assert b.page_count == 512 and b.contains(0x7F1000000000) and not b.contains(b.end_hva)
    assert b.offset_of_page(1) == (512 << 20) + 4096 and b.hva_of_page(2) == 0x7F1000002000


def test_parse_error_reply() -> None:
    with pytest.raises(ExportRefused) as exc:
        parse_reply(b"AZQ1 ERR 25 ENOTTY the fd passed is not a character device\n", 0, "/run/x.sock")
    e = exc.value
    assert (e.socket_path, e.errno, e.errno_name, e.detail) == (
        "/run/x.sock", 25, "ENOTTY", "the fd passed is not a character device")
    assert str(e).startswith("userfaultfd export at /run/x.sock refused: ENOTTY: the fd passed")


def test_parse_private_block() -> None:
    """A copy-on-write mapping comes without an fd (-1) and is marked private."""
    r = parse_reply(b"AZQ1 OK\nfds 1\n"
                    b"block 0x7f0000000000 536870912 0 4096 -1 /dev/shm/azqemu/templates/t/ram.img\n"
                    b"private 0x7f0000000000\nend\n", 1)
    (b,) = r["blocks"]
    assert b.private and b.ram_fd_index == -1 and b.name.endswith("/ram.img")


@pytest.mark.parametrize("reply,nfds,detail", [
    (b"AZQ1 OK\nprivate 0x1000\nend\n", 1, "private names no block listed before it"),
    (b"HELLO\n", 0, "unexpected first line 'HELLO'"),
    (b"AZQ1 ERR x\n", 0, "malformed error line 'AZQ1 ERR x'"),
    (b"AZQ1 OK\nfds 2\n", 2, "reply does not end with 'end'"),
    (b"AZQ1 OK\nfds 2\nend\n", 1, "reply announces 2 fds, 1 arrived"),
    (b"AZQ1 OK\nend\nmore\n", 1, "data after 'end'"),
    (b"AZQ1 OK\nblock 0x1000 4096 0 4096 0\nend\n", 2, "block needs 6 fields"),
    (b"AZQ1 OK\nblock 0x1001 4096 0 4096 0 x\nend\n", 2, "block not page aligned"),
    (b"AZQ1 OK\nblock 0x1000 4096 0 3000 0 x\nend\n", 2, "page size 3000 is not a power of two"),
    (b"AZQ1 OK\nblock 0x1000 4096 0 4096 1 x\nend\n", 2, "RAM fd index 1 but 1 RAM fds"),
    (b"AZQ1 OK\nblock 0xfffffffffffff000 8192 0 4096 0 x\nend\n", 2, "block out of range"),
    (b"AZQ1 OK\npid many\nend\n", 1, "invalid literal"),
    (b"AZQ1 OK\n" + b"x" * 70000, 1, "reply of 70008 bytes exceeds 65536"),
])
def test_parse_rejects(reply: bytes, nfds: int, detail: str) -> None:
    with pytest.raises(ExportProtocolError) as exc:
        parse_reply(reply, nfds, "/s")
    assert detail in exc.value.detail


def test_parse_bounds_block_count() -> None:
    lines = b"".join(b"block 0x%x 4096 0 4096 -1 x\n" % (0x1000 * (i + 1)) for i in range(257))
    with pytest.raises(ExportProtocolError) as exc:
        parse_reply(b"AZQ1 OK\n" + lines + b"end\n", 1)
    assert "more than 256 blocks" in exc.value.detail


def test_connect_to_nothing(tmp_path) -> None:
    path = str(tmp_path / "none.sock")
    with pytest.raises(ExportUnavailable) as exc:
        UffdExport(path, timeout_s=0.2)
    assert exc.value.socket_path == path
    assert exc.value.detail == "No such file or directory after 0.2 s"


class FakeExport:
    """Answers each request with the next canned (bytes, fds) reply, or hangs up."""

    def __init__(self, path: str, replies: list[tuple[bytes, list[int]] | None]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(path)
        self.sock.listen(1)
        self.replies = replies
        self.requests: list[tuple[bytes, int]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            for reply in self.replies:
                msg, fds, _, _ = socket.recv_fds(conn, 1024, 4)
                self.requests.append((msg, len(fds)))
                for fd in fds:
                    os.close(fd)
                if reply is None:
                    return
                socket.send_fds(conn, [reply[0]], reply[1]) if reply[1] else conn.send(reply[0])

    def close(self) -> None:
        self.thread.join(2)
        self.sock.close()


def test_hello_through_a_fake_export(tmp_path) -> None:
    path = str(tmp_path / "fake.sock")
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    fake = FakeExport(path, [(GOOD, [r1, r2])])
    dev = os.open("/dev/null", os.O_RDWR)
    try:
        with UffdExport(path, timeout_s=2) as exp:
            h = exp.hello(dev)
        assert fake.requests == [(b"AZQ1 HELLO\n", 1)]
        assert h.pid == 42 and h.created and h.peer_uffd_fd == 9 and len(h.blocks) == 2
        assert os.get_blocking(h.uffd) is False  # O_NONBLOCK set on arrival
        assert h.block_of(0x7F1000000010) is h.blocks[1] and h.block_of(5) is None
        h.close()
        h.close()  # idempotent
    finally:
        os.close(dev)
        for fd in (r1, r2, w1, w2):
            try:
                os.close(fd)
            except OSError:
                pass
        fake.close()


def test_hello_reply_without_fds_is_refused(tmp_path) -> None:
    path = str(tmp_path / "fake.sock")
    fake = FakeExport(path, [(b"AZQ1 OK\nend\n", [])])
    try:
        with UffdExport(path, timeout_s=2) as exp, pytest.raises(ExportProtocolError) as exc:
            exp.hello(None)
        assert exc.value.detail == "HELLO reply carries no fds"
        assert fake.requests == [(b"AZQ1 HELLO\n", 0)]
    finally:
        fake.close()


def test_hello_reply_with_fds_but_no_block_closes_them(tmp_path) -> None:
    path = str(tmp_path / "fake.sock")
    r, w = os.pipe()
    fake = FakeExport(path, [(b"AZQ1 OK\nfds 1\nend\n", [r])])
    before = set(os.listdir("/proc/self/fd"))
    try:
        with UffdExport(path, timeout_s=2) as exp, pytest.raises(ExportProtocolError) as exc:
            exp.hello(None)
        assert exc.value.detail == "HELLO reply lists no RAM block"
    finally:
        fake.close()
        os.close(r)
        os.close(w)
    assert set(os.listdir("/proc/self/fd")) <= before  # the received copy was closed


def test_export_hangs_up(tmp_path) -> None:
    path = str(tmp_path / "fake.sock")
    fake = FakeExport(path, [None])
    try:
        with UffdExport(path, timeout_s=2) as exp, pytest.raises(ExportUnavailable) as exc:
            exp.hello(None)
        assert exc.value.detail == "the export closed the connection"
    finally:
        fake.close()


def test_library_register_error(tmp_path) -> None:
    path = str(tmp_path / "fake.sock")
    fake = FakeExport(path, [(b"AZQ1 ERR 9 EBADF no uffd yet\n", [])])
    try:
        with UffdExport(path, timeout_s=2) as exp, pytest.raises(ExportRefused) as exc:
            exp.library_register(0x1000, 4096)
        assert (exc.value.errno, exc.value.errno_name) == (9, "EBADF")
        assert fake.requests == [(b"AZQ1 REGISTER 0x1000 4096\n", 0)]
    finally:
        fake.close()
