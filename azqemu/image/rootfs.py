"""Guest root filesystem: a debootstrap minbase tree made into a read-only ext4 image.

The tree is debootstrapped, pruned, overlaid with images/rootfs, given the guest agent and
the workspace projects, then packed with ``mkfs.ext4 -d`` (no loop mount, no journal).
Every path written into the tree goes through ``_inside`` so that the tree's absolute
symlinks can never lead a write onto the host.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from azqemu.errors import ImageError
from azqemu.image.cache import BUILDER_VERSION
from azqemu.image.hostcmd import Progress, run, unmount_under
from azqemu.image.recipe import Recipe, recipe_files

ROOTFS_NAME = "rootfs.ext4"
GUEST_AGENT_TARGET = "usr/local/lib/azq-agent"   # where guest-agent/ goes in the rootfs
WORKSPACE_TARGET = "opt/azq-workspace"           # copied to a tmpfs /workspace at boot
READONLY_TARGET = "usr/lib/azq-readonly"


def _inside(root: Path, rel: str) -> Path:
    """root/rel, refusing a path that a symlink in the tree would lead outside root
    (debootstrap's tree has absolute links such as var/run -> /run: followed on the host,
    they would write into the host's own directories)."""
    target = Path(os.path.realpath(root / rel))
    real_root = Path(os.path.realpath(root))
    if target != real_root and real_root not in target.parents:
        raise ImageError(f"recipe path {rel} leads outside the rootfs ({target})")
    return target


def copy_tree(src: Path, root: Path, rel_dest: str) -> int:
    """Copy the recipe files under src to root/rel_dest, keeping modes; returns the count."""
    count = 0
    for path in recipe_files(src):
        rel = path.relative_to(src)
        dest = _inside(root, f"{rel_dest}/{rel.as_posix()}" if rel_dest else rel.as_posix())
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink() or dest.exists():
            dest.unlink()
        if path.is_symlink():
            dest.symlink_to(os.readlink(path))
        else:
            shutil.copy2(path, dest)
            dest.chmod(0o755 if path.stat().st_mode & 0o111 else 0o644)
        count += 1
    return count


def _prune(root: Path, recipe: Recipe) -> None:
    """Empty the recipe's prune directories; of /usr/share/doc keep only copyright files."""
    for rel in recipe.prune:
        directory = _inside(root, rel)
        if directory.is_dir() and not directory.is_symlink():
            for child in directory.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    doc = _inside(root, "usr/share/doc")
    for dirpath, dirnames, filenames in os.walk(doc, topdown=False):
        for name in filenames:
            if name != "copyright":
                (Path(dirpath) / name).unlink()
        for name in dirnames:
            sub = Path(dirpath) / name
            if sub.is_symlink():
                sub.unlink()
            elif not any(sub.iterdir()):
                sub.rmdir()
    for rel in ("etc/resolv.conf",):        # the host's, copied by debootstrap: no network here
        leftover = root / rel
        if leftover.is_symlink() or leftover.is_file():
            leftover.unlink()


def _relocate_readonly(root: Path, recipe: Recipe) -> None:
    """Move the recipe's read-only data out of /var (copied to tmpfs at boot) into /usr."""
    for rel in recipe.readonly:
        src = _inside(root, rel)
        if not src.is_dir() or src.is_symlink():
            continue
        dest = _inside(root, f"{READONLY_TARGET}/{rel}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(src, dest)
        src.symlink_to(f"/{READONLY_TARGET}/{rel}")


def _link(root: Path, rel: str, target: str) -> None:
    path = _inside(root, rel)
    if path.is_symlink() or path.exists():
        path.unlink()
    path.symlink_to(target)


def _install_guest_agent(root: Path, agent_dir: Path) -> int:
    """Copy guest-agent/ into the rootfs and link azq-phase onto PATH; 0 files is fine."""
    count = copy_tree(agent_dir, root, GUEST_AGENT_TARGET) if agent_dir.is_dir() else 0
    phase = _inside(root, f"{GUEST_AGENT_TARGET}/azq-phase")
    if phase.is_file():
        phase.chmod(0o755)
        _link(root, "usr/local/bin/azq-phase", f"/{GUEST_AGENT_TARGET}/azq-phase")
    return count


def _install_workspace(root: Path, recipe_dir: Path) -> list[str]:
    """Bake images/workspace/ into /opt/azq-workspace as git repositories, tests checked.

    Each project is committed once so that an agent's `git diff` shows only its own edits,
    and its unittest suite must pass in the guest's Python before the image is accepted.
    """
    projects: list[str] = []
    src = recipe_dir / "workspace"
    _inside(root, "workspace").mkdir(exist_ok=True)     # tmpfs mount point
    if not src.is_dir():
        return projects
    copy_tree(src, root, WORKSPACE_TARGET)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}
    for project in sorted(p for p in _inside(root, WORKSPACE_TARGET).iterdir() if p.is_dir()):
        guest_path = f"/{WORKSPACE_TARGET}/{project.name}"
        if (project / "tests").is_dir():
            # -B: no __pycache__ baked into the image (the guest makes its own on tmpfs).
            run(["chroot", str(root), "/bin/sh", "-c", f"cd {guest_path} && python3 -B -m unittest -q"],
                f"workspace tests of {project.name} in the guest's python3", env=env)
        if (root / "usr/bin/git").exists():
            script = (f"cd {guest_path} && git init -q && git add -A && "
                      "git commit -q -m 'workspace as baked into the guest image'")
            run(["chroot", str(root), "/bin/sh", "-c", script], f"git init of {project.name}", env=env)
        projects.append(project.name)
    return projects


def build_rootfs_tree(recipe: Recipe, recipe_dir: Path, agent_dir: Path, root: Path, key: str,
                      progress: Progress) -> dict:
    """debootstrap, prune, overlay images/rootfs, install the agent and the workspace."""
    started = time.monotonic()
    progress(f"debootstrap {recipe.suite} ({recipe.variant} + {', '.join(recipe.include)})")
    run(["debootstrap", f"--variant={recipe.variant}", f"--include={','.join(recipe.include)}",
         recipe.suite, str(root), recipe.mirror], "debootstrap")
    unmount_under(root)
    debootstrap_s = time.monotonic() - started
    _prune(root, recipe)
    overlay_files = copy_tree(recipe_dir / "rootfs", root, "")
    _relocate_readonly(root, recipe)
    _link(root, "etc/inittab", "/run/azq/inittab")      # written by azq-init at every boot
    # hwclock -w (which qemu-ga's guest-set-time runs: libvirt's virDomainSetTime, `virsh
    # domtime --time`) writes /etc/adjtime; the root is read-only, so it lives in /run.
    _link(root, "etc/adjtime", "/run/azq/adjtime")
    _link(root, "etc/mtab", "../proc/self/mounts")
    if not _inside(root, "usr/sbin/init").exists():
        _link(root, "usr/sbin/init", "azq-init")
    agent_files = _install_guest_agent(root, agent_dir)
    progress(f"guest agent: {agent_files} file(s) from guest-agent/"
             + ("" if agent_files else " (none yet: the slot stays empty)"))
    projects = _install_workspace(root, recipe_dir)
    progress(f"workspace: {', '.join(projects) or 'none'} (tests pass in the guest's python3)")
    _inside(root, "etc/azq-image").write_text(f"key={key}\nbuilder={BUILDER_VERSION}\n"
                                              f"kernel={recipe.kernel_abi}\n")
    packages = run(["chroot", str(root), "dpkg-query", "-W", "-f", "${Package}\n"],
                   "listing the rootfs packages").stdout.split()
    return {"debootstrap_s": round(debootstrap_s, 1), "overlay_files": overlay_files,
            "guest_agent_files": agent_files, "workspace_projects": projects,
            "package_count": len(packages)}


def _tree_footprint(root: Path) -> tuple[int, int]:
    """(bytes of 4 KiB blocks the files need, inode count) of a tree, hard links once."""
    seen: set[int] = set()
    blocks_bytes, inodes = 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            inodes += 1
            blocks_bytes += -(-max(st.st_size, 1) // 4096) * 4096
    return blocks_bytes, inodes


def make_ext4(root: Path, image: Path, slack_mib: int) -> None:
    """Pack the tree into an ext4 image file with mkfs.ext4 -d (no mount, no loop device).

    No journal (the root is only ever mounted read-only, by many VMs at once), no reserved
    blocks, inodes sized to the tree. Checked with e2fsck -fn afterwards.
    """
    data_bytes, inodes = _tree_footprint(root)
    inode_count = inodes + inodes // 10 + 1024
    # ext4 metadata beyond inode tables (bitmaps, group descriptors, directories' extra
    # blocks) stays well under 5% of the data for trees like this one.
    size_bytes = int(data_bytes * 1.05) + inode_count * 256 + (slack_mib << 20) + (8 << 20)
    size_bytes = -(-size_bytes // (1 << 20)) << 20
    if image.exists():
        image.unlink()
    run(["mkfs.ext4", "-q", "-F", "-t", "ext4", "-b", "4096", "-N", str(inode_count), "-m", "0",
         "-O", "^has_journal", "-L", "azq-root", "-E", "root_owner=0:0", "-d", str(root),
         str(image), f"{size_bytes >> 10}k"], "mkfs.ext4 -d")
    run(["e2fsck", "-fn", str(image)], "e2fsck of the new rootfs")
