"""Copy-on-write clones under libvirt: a qemu hook that maps the template's RAM image.

libvirt 9.0 cannot point a domain's RAM at an arbitrary file (``<qemu:override>`` cannot set
mem-path and a commandline override of the backend breaks the "pc.ram" ramblock id). With
``memory_backing_dir`` set and ``<source type='file'/><access mode='private'/>``, libvirt maps
``<memory_backing_dir>/libvirt/qemu/<id>-<short name>/pc.ram`` with share=off; this hook,
run by libvirtd at "start begin", makes that path a symlink to the template's RAM image. QEMU
then maps the template privately: pages the clone only reads stay shared in the page cache,
pages it writes become its own anonymous copies (which KSM can merge). That is the
``none-cow`` and ``linux`` policies' clone, and what snapshot-restore sandboxes do.

The hook is POSIX sh (libvirtd's environment has no guarantee of our Python) and acts only on
domains carrying azqemu's metadata with a ``cow-ram`` attribute. libvirtd must be restarted
to notice a new hook; ``azq host setup`` does that.
"""

from __future__ import annotations

from pathlib import Path

from azqemu.host.files import write_atomic

HOOK_PATH = Path("/etc/libvirt/hooks/qemu")
HOOK_MARK = "# azqemu copy-on-write clone hook"
MEMORY_BACKING_DIR = "/dev/shm/azqemu-libvirt-ram"
# libvirt's virDomainDefGetShortName: "<id>-<first 20 characters of the name>".
SHORT_NAME_CHARS = 20

HOOK_SCRIPT = r"""#!/bin/sh
@MARK@ (installed by 'azq host setup'; see azqemu/virt/cowhook.py)
# $1 domain name, $2 operation, $3 sub-operation; the domain XML is on stdin, and it must
# be read whole every time: libvirtd fails the operation with EPIPE otherwise.
xml=$(cat)
case "$2/$3" in start/begin|release/end) ;; *) exit 0 ;; esac
case "$xml" in *azqemu.dev/xmlns/sandbox*cow-ram=*) ;; *) exit 0 ;; esac
ram=$(printf '%s\n' "$xml" | sed -n 's/.*cow-ram="\([^"]*\)".*/\1/p' | head -n 1)
short=$(printf '%s' "$1" | cut -c1-@SHORT@)
if [ "$2" = "release" ]; then
    # The domain is gone (its XML no longer carries an id): remove its links only; the
    # template image they point to is never touched. No other domain has this name now.
    for dir in "@MEMDIR@"/libvirt/qemu/*-"$short"; do
        [ -L "$dir/pc.ram" ] && rm -f "$dir/pc.ram" && rmdir "$dir" 2>/dev/null
    done
    exit 0
fi
id=$(printf '%s\n' "$xml" | sed -n "s/^<domain [^>]*id=[\"']\([0-9]*\)[\"'].*/\1/p" | head -n 1)
[ -n "$ram" ] && [ -n "$id" ] || { echo "azqemu hook: no RAM image or id for $1" >&2; exit 1; }
dir="@MEMDIR@/libvirt/qemu/$id-$short"
[ -f "$ram" ] || { echo "azqemu hook: template RAM image $ram is missing" >&2; exit 1; }
mkdir -p "$dir" && ln -sfn "$ram" "$dir/pc.ram"
""".replace("@MARK@", HOOK_MARK).replace("@SHORT@", str(SHORT_NAME_CHARS)).replace("@MEMDIR@", MEMORY_BACKING_DIR)


def install_hook() -> bool:
    """Write the hook; True if it changed (libvirtd must restart). Refuses a foreign hook."""
    if HOOK_PATH.exists():
        current = HOOK_PATH.read_text()
        if HOOK_MARK not in current:
            from azqemu.errors import HostError

            raise HostError(f"{HOOK_PATH} exists and is not azqemu's; merge {__name__}.HOOK_SCRIPT into it")
        if current == HOOK_SCRIPT:
            return False
    HOOK_PATH.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(HOOK_PATH, HOOK_SCRIPT, 0o755)
    return True


def remove_hook() -> bool:
    """Remove the hook if it is azqemu's; True if it was there (libvirtd must restart)."""
    try:
        current = HOOK_PATH.read_text()
    except FileNotFoundError:
        return False
    if HOOK_MARK not in current:
        return False
    HOOK_PATH.unlink()
    return True
