"""Unit tests of the image recipe (azqemu.image.recipe) and of the recipe's own files in images/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from azqemu.errors import ImageError
from azqemu.image.recipe import load_recipe

from .conftest import RECIPE


def test_recipe_cmdline_and_modules() -> None:
    recipe = load_recipe(RECIPE)
    words = recipe.cmdline.split()
    assert {"console=ttyS0", "root=/dev/vda", "ro"} <= set(words)
    assert recipe.kernel_package.startswith("linux-image-")
    mods = list(recipe.modules)
    for before, after in [("virtio_ring", "virtio"), ("virtio", "virtio_pci"), ("virtio_pci", "virtio_blk"),
                          ("crc32c_generic", "ext4"), ("jbd2", "ext4")]:
        assert mods.index(before) < mods.index(after)


def test_bad_recipe_is_one_clear_error(recipe_copy: tuple[Path, Path]) -> None:
    toml = recipe_copy[0] / "recipe.toml"
    toml.write_text(toml.read_text().replace("console=ttyS0 ", ""))
    with pytest.raises(ImageError, match="kernel cmdline lacks 'console=ttyS0'"):
        load_recipe(recipe_copy[0])
    toml.write_text("[kernel]\n")
    with pytest.raises(ImageError, match="bad image recipe"):
        load_recipe(recipe_copy[0])
    with pytest.raises(ImageError, match="image recipe not found"):
        load_recipe(recipe_copy[0] / "nowhere")


# ------------------------------------------------------------------ recipe contents

@pytest.mark.parametrize("script", ["initramfs/init", "rootfs/usr/sbin/azq-init",
                                    "rootfs/usr/local/sbin/azq-respawn", "rootfs/usr/sbin/shutdown"])
def test_shell_scripts_parse_and_are_executable(script: str) -> None:
    path = RECIPE / script
    assert path.stat().st_mode & 0o111, f"{script} must be executable"
    shell = shutil.which("busybox") or shutil.which("dash") or "/bin/sh"
    argv = [shell, "sh", "-n", str(path)] if shell.endswith("busybox") else [shell, "-n", str(path)]
    result = subprocess.run(argv, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_guest_init_starts_the_agents() -> None:
    init = (RECIPE / "rootfs" / "usr" / "sbin" / "azq-init").read_text()
    assert "qemu-ga -m virtio-serial -p $QGA_PORT" in init
    assert "QGA_PORT=/dev/virtio-ports/org.qemu.guest_agent.0" in init
    assert "AGENT=/usr/local/lib/azq-agent/azq_guest_agent.py" in init
    assert "AGENT_PORT=/dev/virtio-ports/org.azqemu.agent.0" in init
    assert 'say "ready' in init


def test_workspace_suite_passes_on_the_host() -> None:
    project = RECIPE / "workspace" / "tally"
    result = subprocess.run([sys.executable, "-B", "-m", "unittest", "-q"], cwd=project,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = sum(len(p.read_text().splitlines()) for p in project.rglob("*.py"))
    assert 300 <= lines <= 800
