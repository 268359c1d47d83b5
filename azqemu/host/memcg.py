"""A memory cgroup of our own: a hard limit on a set of processes, their usage and OOM kills.

The fill check of ``azq bench fill`` puts the manager and every sandbox's QEMU in one
memory cgroup and fills it. cgroup v2 where the unified hierarchy has the memory controller
(``memory.max``, ``memory.current``, ``memory.events``), else v1 (``memory.limit_in_bytes``,
``memory.usage_in_bytes``, ``memory.oom_control``): hosts with a hybrid hierarchy, as this
project's machines, have the memory controller in v1 only.

A process keeps the charges it made before it was moved in (neither version moves them by
default); what it allocates afterwards is charged here. The cgroup is removed on close, every
process still in it moved back to the cgroup it came from (their charges go to the parent).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

from azqemu.errors import HostError

CGROUP_ROOT = Path("/sys/fs/cgroup")
RMDIR_TIMEOUT_S = 10.0


def _v2_root(root: Path) -> Path | None:
    """The v2 hierarchy that offers the memory controller (pure v2, or hybrid's unified/)."""
    for cand in (root, root / "unified"):
        try:
            if "memory" in (cand / "cgroup.controllers").read_text().split():
                return cand
        except OSError:
            continue
    return None


def _own_cgroup(pid: int, version: int) -> str:
    """The cgroup path (relative to its hierarchy's root) that ``pid`` is in."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            hid, controllers, path = line.rstrip("\n").split(":", 2)
            if version == 2 and hid == "0":
                return path
            if version == 1 and "memory" in controllers.split(","):
                return path
    raise HostError(f"process {pid} is in no memory cgroup")


class MemoryCgroup:
    """``MemoryCgroup(name, limit_bytes)``: created at once (a new leaf at the hierarchy's
    root), removed by ``close`` (also as a context manager)."""

    def __init__(self, name: str, limit_bytes: int, root: Path = CGROUP_ROOT) -> None:
        if limit_bytes <= 0:
            raise HostError(f"a memory limit must be positive, not {limit_bytes}")
        v2 = _v2_root(root)
        if v2 is not None:
            self.version, self.hierarchy = 2, v2
        elif (root / "memory" / "memory.limit_in_bytes").exists():
            self.version, self.hierarchy = 1, root / "memory"
        else:
            raise HostError(f"no memory cgroup controller under {root} (neither v2 nor v1)")
        self.path = self.hierarchy / name
        self._origin: dict[int, str] = {}
        try:
            if self.version == 2:
                self._enable_memory_controller()
            self.path.mkdir()
        except OSError as exc:
            raise HostError(f"cannot create the memory cgroup {self.path}: {exc.strerror}") from exc
        try:
            self.set_limit(limit_bytes)
            if self.version == 1:
                # Charges in v1 are hierarchical only with use_hierarchy (the default since 6.x).
                with contextlib.suppress(OSError):
                    (self.path / "memory.use_hierarchy").write_text("1")
        except BaseException:
            self.close()
            raise

    def _enable_memory_controller(self) -> None:
        ctl = self.hierarchy / "cgroup.subtree_control"
        if "memory" not in ctl.read_text().split():
            ctl.write_text("+memory")

    # -- limit and figures ---------------------------------------------------------------
    def set_limit(self, limit_bytes: int) -> bool:
        """Set the hard limit; False when the kernel cannot reclaim the usage below it
        (v1 answers EBUSY; v2 takes the limit and reclaims or OOM-kills instead)."""
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        try:
            (self.path / name).write_text(str(int(limit_bytes)))
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False
            raise HostError(f"cannot set {self.path / name}: {exc.strerror}") from exc
        self.limit_bytes = int(limit_bytes)
        return True

    def lift_limit(self) -> None:
        """No limit any more (before tearing down: a process stuck at the limit is let go)."""
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        with contextlib.suppress(OSError):
            (self.path / name).write_text("max" if self.version == 2 else "-1")
            self.limit_bytes = 0

    def usage_bytes(self) -> int:
        return int((self.path / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")).read_text())

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer killed in this cgroup (v2: memory.events;
        v1: memory.oom_control's oom_kill, or the limit's fail count as a sign)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def pids(self) -> list[int]:
        return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]

    # -- membership ----------------------------------------------------------------------
    def add(self, pid: int) -> None:
        """Move process ``pid`` (every thread of it) into this cgroup."""
        try:
            origin = _own_cgroup(pid, self.version)
            (self.path / "cgroup.procs").write_text(str(pid))
        except (OSError, HostError) as exc:
            raise HostError(f"cannot move process {pid} into {self.path}: {exc}") from exc
        self._origin.setdefault(pid, origin)

    def close(self) -> None:
        """Move every process left back where it came from (its parent's root if unknown)
        and remove the cgroup."""
        if not self.path.exists():
            return
        with contextlib.suppress(OSError):
            for pid in self.pids():
                back = self.hierarchy / self._origin.get(pid, "/").lstrip("/")
                with contextlib.suppress(OSError):
                    (back / "cgroup.procs").write_text(str(pid))
        deadline = time.monotonic() + RMDIR_TIMEOUT_S
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                # EBUSY while a killed process's exit is still being reaped.
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise HostError(f"cannot remove the memory cgroup {self.path}: {exc.strerror}") from exc
                time.sleep(0.1)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
