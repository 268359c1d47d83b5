"""Paths and settings shared by every part of azqemu.

Everything configurable comes from the environment (``AZQ_*``) so that the CLI, the daemon
and the tests agree without passing a config file around.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LOG_DIR = "/var/log/azqemu"


@dataclass(frozen=True)
class Config:
    state_dir: Path          # templates (device state, RAM image, metadata), sandbox records
    run_dir: Path            # daemon socket, per-sandbox sockets
    image_cache_dir: Path    # built guest images, keyed by recipe content
    libvirt_uri: str
    shm_dir: Path            # page-store arenas (tmpfs)
    log_dir: Path = Path(DEFAULT_LOG_DIR)   # the daemon's log, whatever starts it

    @property
    def daemon_log(self) -> Path:
        """The daemon's one log file (``azq daemon``, daemon/proc.py and systemd alike)."""
        return self.log_dir / "daemon.log"

    @property
    def daemon_socket(self) -> Path:
        return self.run_dir / "azqemu.sock"

    @property
    def templates_dir(self) -> Path:
        return self.state_dir / "templates"

    @property
    def sandboxes_dir(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def preload_library(self) -> Path:
        return Path(os.environ.get("AZQ_PRELOAD_LIB", REPO_ROOT / "qemu-patches" / "libazq_uffd.so"))


def load() -> Config:
    env = os.environ.get
    return Config(
        state_dir=Path(env("AZQ_STATE_DIR", "/var/lib/azqemu")),
        run_dir=Path(env("AZQ_RUN_DIR", "/run/azqemu")),
        image_cache_dir=Path(env("AZQ_IMAGE_CACHE", "/var/cache/azqemu/images")),
        libvirt_uri=env("AZQ_LIBVIRT_URI", "qemu:///system"),
        shm_dir=Path(env("AZQ_SHM_DIR", "/dev/shm/azqemu")),
        log_dir=Path(env("AZQ_LOG_DIR", DEFAULT_LOG_DIR)),
    )
