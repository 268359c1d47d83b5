"""Names of things azqemu makes (sandboxes, templates, sharing domains), checked at the door.

A name becomes a libvirt domain name, a directory under the state and run directories and
part of unix socket paths (at most 108 bytes with the directory), so it is restricted to
``[A-Za-z0-9._-]``, 1-64 characters, not starting with '-' or '.': no path separator, no
``..``, no Unicode look-alikes, and every derived path stays inside its directory.
"""

from __future__ import annotations

import re

from azqemu.errors import ConfigError

MAX_NAME_CHARS = 64
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,%d}" % (MAX_NAME_CHARS - 1))


def is_valid_name(name: object) -> bool:
    return isinstance(name, str) and _NAME_RE.fullmatch(name) is not None


def validate_name(name: object, what: str = "name") -> str:
    """Return ``name`` if it is valid, else raise ConfigError (one line, naming ``what``)."""
    if not is_valid_name(name):
        shown = name if isinstance(name, str) and len(name) <= 80 else f"{str(name)[:80]}..."
        raise ConfigError(f"invalid {what} {shown!r}: use 1-{MAX_NAME_CHARS} characters "
                          "from A-Z a-z 0-9 '.', '_', '-', not starting with '-' or '.'")
    return name  # type: ignore[return-value]
