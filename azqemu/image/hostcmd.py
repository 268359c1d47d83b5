"""Host commands of the image build: running tools, fetching packages, cleaning up after them.

A build runs debootstrap, apt-get, dpkg-deb, chroot, mkfs.ext4 and friends on the host as
root. This module runs them so that a failure becomes one ImageError line (the output's
tail goes to the log), an interrupted build kills what it started, and a build dir is
deleted without following a mount out of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from azqemu.errors import ImageError
from azqemu.image.recipe import KERNEL_ENV

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 20
TOOL_PACKAGES = {"debootstrap": "debootstrap", "mkfs.ext4": "e2fsprogs", "e2fsck": "e2fsprogs",
                 "depmod": "kmod", "apt-get": "apt", "dpkg-deb": "dpkg", "chroot": "coreutils"}

Progress = Callable[[str], None]        # receives one line per build step


def run(argv: list[str], what: str, cwd: Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a build tool; a failure becomes one ImageError line, its output's tail the log.

    The tool gets its own process group, and any exception here (Ctrl-C, the SIGTERM that
    build_image turns into one) kills the whole group: debootstrap's dpkg and chroot
    children must not go on writing into a build dir that is being deleted.
    """
    log.debug("run: %s", " ".join(argv))
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except FileNotFoundError as err:
        package = TOOL_PACKAGES.get(Path(argv[0]).name, argv[0])
        raise ImageError(f"{what}: {argv[0]} not found (apt-get install {package})") from err
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = (stderr or stdout or "").strip().splitlines()[-STDERR_TAIL_LINES:]
        log.error("%s failed (exit %d): %s\n%s", what, proc.returncode, " ".join(argv), "\n".join(tail))
        last = tail[-1].strip() if tail else "no output"
        raise ImageError(f"{what} failed (exit {proc.returncode}): {last}")
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while building, so the build dir is cleaned up
    (Python's default SIGTERM ends the process without running finally blocks)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def apt_download(package: str, dest: Path, say: Progress) -> Path:
    """``apt-get download`` one package into dest. On failure the package lists are
    refreshed once (a fresh machine has none; an old one may name removed versions) and
    the download retried; a kernel that is still missing names where to find another."""
    dest.mkdir(parents=True, exist_ok=True)
    # Sandbox user root: dest is a private build dir that _apt cannot enter.
    argv = ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package]
    try:
        run(argv, f"apt-get download {package}", cwd=dest)
    except ImageError:
        say(f"apt-get download {package} failed: running apt-get update once")
        run(["apt-get", "update", "-q"], "apt-get update")
        try:
            run(argv, f"apt-get download {package}", cwd=dest)
        except ImageError as err:
            hint = ""
            if package.startswith("linux-image-"):
                hint = (f"; set [kernel] abi in recipe.toml (or {KERNEL_ENV}) to one listed by "
                        "apt-cache policy 'linux-image-6.1.0-*-amd64'")
            raise ImageError(f"{err}{hint}") from err
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise ImageError(f"apt-get download {package} left no .deb in {dest}")
    return debs[-1]


def deb_version(deb: Path) -> str:
    return run(["dpkg-deb", "-f", str(deb), "Version"], f"dpkg-deb -f {deb.name}").stdout.strip()


def unmount_under(path: Path) -> None:
    """Unmount anything a killed debootstrap left mounted below path (deepest first)."""
    prefix = str(path.resolve()) + "/"
    try:
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return
    for mount_point in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount_point], check=False, capture_output=True)


def kill_users_of(path: Path) -> None:
    """SIGKILL processes working inside path: after a builder was SIGKILLed, its debootstrap
    (own session) and the dpkg it chroot'ed into the tree may still run. Found by their
    root or cwd (/proc/PID/root, /proc/PID/cwd) or an argument naming the path."""
    prefix = str(path.resolve())
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            places = [os.readlink(proc_dir / "root"), os.readlink(proc_dir / "cwd"),
                      *(proc_dir / "cmdline").read_bytes().decode(errors="replace").split("\0")]
        except OSError:
            continue                        # gone meanwhile, or a kernel thread
        if any(p == prefix or p.startswith(prefix + "/") for p in places):
            with contextlib.suppress(OSError):
                os.kill(int(proc_dir.name), signal.SIGKILL)
                log.warning("killed pid %s left working in %s", proc_dir.name, path)


def remove_tree(path: Path) -> None:
    """Delete a build dir without ever following a mount out of it."""
    if not path.exists():
        return
    unmount_under(path)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False, capture_output=True)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
