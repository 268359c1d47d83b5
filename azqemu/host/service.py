"""The systemd unit of the manager daemon (packaging/azqemu.service) and its installation.

``azq host install-service`` renders the unit for the interpreter azqemu runs in (its
``@PYTHON@``), writes it to /etc/systemd/system/azqemu.service and reloads systemd. It does
not enable or start it: that is the operator's decision (docs/operations.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from azqemu.config import REPO_ROOT
from azqemu.errors import ConfigError

UNIT_NAME = "azqemu.service"
UNIT_TEMPLATE = REPO_ROOT / "packaging" / UNIT_NAME
UNIT_DIR = Path("/etc/systemd/system")


def render(python: str | None = None) -> str:
    """The unit text with ``@PYTHON@`` replaced by ``python`` (this interpreter by default)."""
    python = python or sys.executable
    if not os.path.isabs(python):
        raise ConfigError(f"the daemon's interpreter must be an absolute path: {python!r}")
    return UNIT_TEMPLATE.read_text().replace("@PYTHON@", python)


def install(dest_dir: Path = UNIT_DIR, *, python: str | None = None, reload: bool = True) -> Path:
    """Write the unit into ``dest_dir`` (atomically) and ``systemctl daemon-reload``."""
    dest = dest_dir / UNIT_NAME
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(render(python))
    tmp.chmod(0o644)
    os.replace(tmp, dest)
    if reload:
        r = subprocess.run(["systemctl", "daemon-reload"], capture_output=True, text=True)
        if r.returncode != 0:
            raise ConfigError(f"systemctl daemon-reload failed: {r.stderr.strip() or r.returncode}")
    return dest
