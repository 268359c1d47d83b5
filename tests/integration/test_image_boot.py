"""Boot the built guest image with plain qemu-system-x86_64 (no libvirt) and talk to qemu-ga.

Checks what every later layer relies on: the initramfs finds the root disk, init prints its
ready line, qemu-ga answers on org.qemu.guest_agent.0, the root is read-only, the workspace
is writable and its test suite passes in the guest. Reports the boot-to-agent time under
TCG. The libvirt-level boot is tested elsewhere (test_sandboxes.py).
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from azqemu.errors import ImageError
from azqemu.image import GuestImage, find_image

pytestmark = pytest.mark.vm

QEMU = "qemu-system-x86_64"
MEM_MIB = 512
BOOT_TIMEOUT_S = 120.0      # TCG boot takes ~2.5 s here; generous for a loaded CI machine
SYNC_INTERVAL_S = 0.1       # how often guest-sync is retried while the guest boots
EXEC_TIMEOUT_S = 120.0


class QgaClient:
    """The QEMU guest agent protocol over the chardev socket: JSON lines, guest-sync ids."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.buf = b""
        self.sync_id = int(time.time()) % 100000 * 1000

    def close(self) -> None:
        self.sock.close()

    def _readline(self, deadline: float) -> dict | None:
        while b"\n" not in self.buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return None
            if not chunk:
                raise EOFError("guest agent socket closed")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line) if line.strip() else {}

    def wait_ready(self, timeout_s: float) -> None:
        """Send guest-sync until one is answered, then drain the stale answers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.sync_id += 1
            # Until qemu-ga opens its port QEMU need not read the socket: a send may block while
            # the guest boots. It may, until the deadline (the socket kept _readline's short
            # timeout, and a send cut off by it would leave half a message in the stream).
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            self.sock.sendall(json.dumps({"execute": "guest-sync", "arguments": {"id": self.sync_id}}).encode()
                              + b"\n")
            reply = self._readline(min(deadline, time.monotonic() + SYNC_INTERVAL_S))
            if reply is not None:
                self.command("guest-sync", id=self.sync_id + 1)    # skips answers to earlier syncs
                self.sync_id += 1
                return
        raise AssertionError(f"qemu-ga did not answer within {timeout_s} s")

    def command(self, name: str, timeout_s: float = 30.0, **arguments: object) -> object:
        message: dict[str, object] = {"execute": name}
        if arguments:
            message["arguments"] = arguments
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._readline(deadline)
            if reply is None:
                raise AssertionError(f"{name}: no answer within {timeout_s} s")
            if "error" in reply:
                raise AssertionError(f"{name}: {reply['error']}")
            if name == "guest-sync" and reply.get("return") != arguments.get("id"):
                continue
            return reply.get("return")

    def run(self, script: str, timeout_s: float = EXEC_TIMEOUT_S) -> tuple[int, str, str]:
        """Run a shell script in the guest; (exit code, stdout, stderr)."""
        started = self.command("guest-exec", path="/bin/sh", arg=["-c", script], **{"capture-output": True})
        assert isinstance(started, dict)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.command("guest-exec-status", pid=started["pid"])
            assert isinstance(status, dict)
            if status["exited"]:
                out, err = (base64.b64decode(status.get(k, "")).decode(errors="replace")
                            for k in ("out-data", "err-data"))
                return status.get("exitcode", -1), out, err
            time.sleep(0.1)
        raise AssertionError(f"guest command did not finish within {timeout_s} s: {script}")


@pytest.fixture(scope="module")
def guest_image() -> GuestImage:
    if shutil.which(QEMU) is None:
        pytest.skip(f"{QEMU} is not installed")
    try:
        return find_image()
    except ImageError as err:
        pytest.skip(f"{err} (as root) to run the image boot test")


@pytest.fixture(scope="module")
def booted(guest_image: GuestImage) -> Iterator[dict]:
    """One TCG guest for the whole module; only the QEMU started here is ever killed."""
    workdir = Path(tempfile.mkdtemp(prefix="azq-imgboot-"))
    qga_path, agent_path, console = workdir / "qga.sock", workdir / "agent.sock", workdir / "console.log"
    argv = [QEMU, "-accel", "tcg", "-machine", "q35", "-m", str(MEM_MIB), "-smp", "1",
            "-nographic", "-no-reboot", "-nic", "none",
            "-kernel", str(guest_image.kernel), "-initrd", str(guest_image.initrd),
            "-append", guest_image.cmdline,
            "-drive", f"file={guest_image.rootfs},if=virtio,format=raw,readonly=on",
            "-device", "virtio-serial-pci",
            "-chardev", f"socket,id=qga0,path={qga_path},server=on,wait=off",
            "-device", "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
            "-chardev", f"socket,id=azq0,path={agent_path},server=on,wait=off",
            "-device", "virtserialport,chardev=azq0,name=org.azqemu.agent.0"]
    started = time.monotonic()
    with open(console, "wb") as console_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=console_file,
                                stderr=subprocess.STDOUT)
    client = None
    try:
        while not qga_path.exists():
            if proc.poll() is not None:
                raise AssertionError(f"QEMU exited ({proc.returncode}): {console.read_text(errors='replace')[-2000:]}")
            if time.monotonic() - started > 30:
                raise AssertionError("QEMU did not create the guest agent socket")
            time.sleep(0.02)
        client = QgaClient(qga_path)
        agent_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        agent_sock.connect(str(agent_path))
        try:
            client.wait_ready(BOOT_TIMEOUT_S)
        except AssertionError as err:
            raise AssertionError(f"{err}; console:\n{console.read_text(errors='replace')[-3000:]}") from err
        boot_s = time.monotonic() - started
        print(f"\nboot to guest-agent answer under TCG: {boot_s:.2f} s")
        yield {"client": client, "boot_s": boot_s, "console": console, "image": guest_image,
               "agent_sock": agent_sock}
    finally:
        if client is not None:
            client.close()
            agent_sock.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def test_guest_agent_answers_ping(booted: dict) -> None:
    assert booted["client"].command("guest-ping") == {}
    assert booted["boot_s"] < BOOT_TIMEOUT_S


def test_console_shows_init_ready(booted: dict) -> None:
    deadline = time.monotonic() + 5
    while "azq-guest: ready" not in booted["console"].read_text(errors="replace"):
        assert time.monotonic() < deadline, "no 'azq-guest: ready' line on the serial console"
        time.sleep(0.1)


def test_workspace_unittest_passes(booted: dict) -> None:
    code, out, err = booted["client"].run("cd /workspace/tally && python3 -m unittest -q")
    assert code == 0, f"exit {code}\n{out}\n{err}"
    assert "OK" in err


def test_root_read_only_state_writable(booted: dict) -> None:
    code, out, err = booted["client"].run(
        "touch /usr/x 2>/dev/null && echo root-writable; "
        "for d in /tmp /var /root /home /run /workspace; do touch $d/.probe || echo not-writable $d; done; "
        "git -C /workspace/tally status --porcelain | grep -v .probe; "
        "cat /etc/azq-image; hostname; ls /dev/virtio-ports; python3 --version")
    assert code == 0, err
    assert "root-writable" not in out and "not-writable" not in out, out
    assert f"key={booted['image'].key}" in out
    assert "org.qemu.guest_agent.0" in out
    assert "Python 3" in out


def test_qemu_ga_comes_back_after_a_kill(booted: dict) -> None:
    client = booted["client"]
    code, out, _ = client.run("pidof qemu-ga")
    assert code == 0
    # Kill qemu-ga from a detached process, so the guest-exec that asks has already returned.
    client.command("guest-exec", path="/bin/sh", arg=["-c", "sleep 0.5; kill -9 $(pidof qemu-ga)"])
    time.sleep(2)
    client.close()
    booted["client"] = client = QgaClient(booted["console"].parent / "qga.sock")
    client.wait_ready(30)
    code, new_pid, _ = client.run("pidof qemu-ga")
    assert code == 0 and new_pid.strip() != out.strip()


def test_in_guest_agent_slot(booted: dict) -> None:
    """guest-agent/ is installed and started when the image has it and the port exists."""
    client = booted["client"]
    code, out, _ = client.run("ls /usr/local/lib/azq-agent/")
    if "azq_guest_agent.py" not in out:
        pytest.skip("guest-agent/ had no azq_guest_agent.py when the image was built")
    if "azq-phase" in out:
        assert client.run("readlink /usr/local/bin/azq-phase")[1].strip() == "/usr/local/lib/azq-agent/azq-phase"
    deadline = time.monotonic() + 30
    while client.run("pgrep -f azq_guest_agent.py")[0] != 0:
        assert time.monotonic() < deadline, "the in-guest agent is not running"
        time.sleep(0.5)
    # It speaks JSON lines on its own port (the protocol is guest-agent/'s business).
    sock, data = booted["agent_sock"], b""
    sock.settimeout(10)
    while b"\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "agent port closed"
        data += chunk
    assert json.loads(data.split(b"\n", 1)[0])
