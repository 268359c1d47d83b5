"""Paths and settings shared by every part of azqemu.

Everything configurable comes from the environment (``AZQ_*``) so that the CLI, the daemon
and the tests agree without passing a config file around.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from azqemu.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LOG_DIR = "/var/log/azqemu"
# TCG's translation cache per guest (QEMU's tb-size). QEMU 7.2 lets it grow to 1 GiB: a
# guest that runs a Python build for minutes held 420 MiB of it, more than its own RAM use,
# in every sandbox alike (docs/figures.md). Once full it is flushed and refilled in place,
# so this bounds QEMU's own memory under TCG. 0 leaves QEMU's default. KVM has none.
DEFAULT_TCG_TB_CACHE_MIB = 96
MAX_TCG_TB_CACHE_MIB = 2048
# How long a native fault thread reads its uffd without sleeping after a fault, at most (us;
# restore/_faultloop.c fp_main adapts it below this). A fault taken while it spins skips the
# thread's wake-up: the guest's stall per fault went from 56-78 to 21-30 us median here
# (docs/figures.md, session 38). 0 never spins.
DEFAULT_FAULT_SPIN_US = 50
MAX_FAULT_SPIN_US = 1000


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


def _int_setting(var: str, default: int, top: int, unit: str) -> int:
    """The integer from 0 to ``top`` in environment variable ``var`` (``default`` when unset);
    ConfigError naming the variable if it is not such a number."""
    raw = os.environ.get(var, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= top:
        raise ConfigError(f"{var}={raw!r}: expected {unit} from 0 to {top}")
    return value


def tcg_tb_cache_mib() -> int:
    """``AZQ_TCG_TB_CACHE_MIB``: the TCG translation cache of each new domain (MiB, 0 =
    QEMU's default)."""
    return _int_setting("AZQ_TCG_TB_CACHE_MIB", DEFAULT_TCG_TB_CACHE_MIB, MAX_TCG_TB_CACHE_MIB, "MiB")


def fault_spin_us() -> int:
    """``AZQ_FAULT_SPIN_US``: the native fault threads' longest spin after a fault (us, 0 =
    never)."""
    return _int_setting("AZQ_FAULT_SPIN_US", DEFAULT_FAULT_SPIN_US, MAX_FAULT_SPIN_US, "microseconds")


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
