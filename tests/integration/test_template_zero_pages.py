"""A template's tmpfs working copy under copy-on-write clones: each write of a clone to a hole
allocates a zero page in the file (the copy is made from it), and the template used to keep
those pages for good. Once its last copy-on-write clone is destroyed, the daemon punches them
back to holes (Lifecycle._give_back_template_zeros): the file holds what it held before, byte
for byte."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from azqemu.client import Client
from tests.support.guest import sh

pytestmark = [pytest.mark.vm, pytest.mark.root]


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def _digest(path: Path) -> str:
    # read(2) of a tmpfs hole returns zeros without allocating it (a mapping's read would).
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def test_zero_pages_copy_on_write_clones_made_the_template_hold_go_back(template: str) -> None:
    c = Client()
    img = Path(os.environ["AZQ_SHM_DIR"]) / "templates" / template / "ram.img"
    before, digest = _allocated(img), _digest(img)
    (rec,) = c.clone(template, count=1, name_prefix="tzp-", policy="none-cow")
    try:
        assert c.dominfo(rec.name).ram_mode == "cow"
        code, out = sh(rec.name, "python3 -c 'b = bytearray(96 << 20); b[::4096] = b\"x\" * len(b[::4096]); print(len(b))'")
        assert code == 0, out
        grown = _allocated(img)
    finally:
        c.destroy(rec.name)
    assert grown >= before + (16 << 20)          # the clone's writes to holes grew the image
    assert _allocated(img) <= before             # and the zero pages went back with the clone
    assert _digest(img) == digest                # not a byte of the template changed
