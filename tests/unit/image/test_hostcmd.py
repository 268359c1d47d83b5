"""Unit tests of running host tools (azqemu.image.hostcmd): one-line errors, clean removal."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from azqemu.errors import ImageError
from azqemu.image.hostcmd import remove_tree, run, sigterm_raises


def test_run_returns_the_output() -> None:
    assert run(["sh", "-c", "echo out; echo err >&2"], "echo").stdout == "out\n"


def test_failure_is_one_line_with_the_last_output_line() -> None:
    with pytest.raises(ImageError) as err:
        run(["sh", "-c", "echo first >&2; echo 'the reason' >&2; exit 3"], "the step")
    assert str(err.value) == "the step failed (exit 3): the reason"


def test_missing_tool_names_its_package() -> None:
    with pytest.raises(ImageError, match=r"mkfs: /nonexistent/mkfs.ext4 not found \(apt-get install e2fsprogs\)"):
        run(["/nonexistent/mkfs.ext4"], "mkfs")


def test_sigterm_raises_only_while_building() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_raises():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    seen: list[object] = []

    def in_a_thread() -> None:              # signal.signal only works in the main thread
        with sigterm_raises():
            seen.append(signal.getsignal(signal.SIGTERM))

    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join()
    assert seen == [before]


def test_remove_tree(tmp_path: Path) -> None:
    tree = tmp_path / "build"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("x")
    remove_tree(tree)
    assert not tree.exists()
    remove_tree(tree)                       # already gone: fine
