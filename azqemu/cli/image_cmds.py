"""`azq image`: build the guest image from images/ and show where it is.

`azq image build` is a no-op when the cache already holds the image for the current recipe
(images/ and guest-agent/ hashed); `--force` rebuilds it anyway. Building needs root.
"""

from __future__ import annotations

import json
import time

import click

from azqemu.cli.output import emit, json_option
from azqemu.errors import ImageError
from azqemu.units import fmt_mib


@click.group()
def image() -> None:
    """Build and inspect the guest image (kernel, initramfs, read-only rootfs)."""


@image.command()
@click.option("--force", is_flag=True, help="Rebuild even if the image is up to date.")
@json_option
def build(force: bool, as_json: bool) -> None:
    """Build the guest image for the current recipe into the image cache."""
    from azqemu import image as guest_image

    started = time.monotonic()
    if not force:
        try:
            img = guest_image.find_image()
        except ImageError:
            pass
        else:
            if as_json:
                emit({"key": img.key, "built": False, "path": str(img.kernel.parent)})
            else:
                click.echo(f"image up to date: {img.key}")
            return
    img = guest_image.build_image(force=force, progress=lambda m: click.echo(m, err=as_json))
    manifest = guest_image.read_manifest(img)
    if as_json:
        emit({"key": img.key, "built": True, "path": str(img.kernel.parent), "build_s": time.monotonic() - started,
              "files": manifest["files"]})
        return
    sizes = ", ".join(f"{role} {fmt_mib(info['size_bytes'])}" for role, info in manifest["files"].items())
    click.echo(f"built image {img.key} in {time.monotonic() - started:.1f} s: {sizes}")
    click.echo(f"  {img.kernel.parent}")


@image.command()
@json_option
@click.option("--verify", is_flag=True, help="Also check every file's sha256.")
def info(as_json: bool, verify: bool) -> None:
    """Paths, key and size of the image for the current recipe."""
    from azqemu import image as guest_image

    img = guest_image.find_image()
    if verify:
        img = guest_image.image_by_key(img.key, verify=True)
    manifest = guest_image.read_manifest(img)
    if as_json:
        record: dict[str, object] = dict(img.to_dict())
        record.update({k: manifest.get(k) for k in ("kernel_abi", "kernel_package_version", "kernel_boot", "built_at",
                                                    "build_s", "package_count")})
        record["files"] = {role: {"size_bytes": f["size_bytes"], "allocated_bytes": f["allocated_bytes"],
                                  "sha256": f["sha256"]} for role, f in manifest["files"].items()}
        click.echo(json.dumps(record, indent=2))
        return
    rows = [("key", img.key), ("kernel", f"{img.kernel}  ({manifest['kernel_abi']}, "
                                          f"{manifest['kernel_package_version']}, "
                                          f"{manifest.get('kernel_boot', 'bzimage')} boot)"),
            ("initrd", str(img.initrd)), ("rootfs", str(img.rootfs)), ("cmdline", img.cmdline)]
    rows += [(f"{role} size", fmt_mib(f["size_bytes"]) + (f" ({fmt_mib(f['allocated_bytes'])} allocated)"
                                                       if role == "rootfs" else ""))
             for role, f in manifest["files"].items()]
    rows += [("total", fmt_mib(img.size_bytes)), ("built", f"{manifest['built_at']} in {manifest['build_s']} s"),
             ("packages", str(manifest.get("package_count", "?")))]
    for name, value in rows:
        click.echo(f"{name + ':':15}{value}")
    if verify:
        click.echo("sha256:        all files match")


@image.command()
@json_option
def key(as_json: bool) -> None:
    """Print the cache key of the current recipe (built or not)."""
    from azqemu import image as guest_image

    k = guest_image.recipe_key()
    if as_json:
        emit({"key": k})
    else:
        click.echo(k)


@image.command()
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@json_option
def prune(dry_run: bool, as_json: bool) -> None:
    """Remove cached images that neither the current recipe nor any template uses."""
    from azqemu import image as guest_image

    removed = guest_image.prune_images(dry_run=dry_run)
    if as_json:
        emit({"removed": [str(p) for p in removed], "dry_run": dry_run})
        return
    for path in removed:
        click.echo(f"{'would remove' if dry_run else 'removed'} {path}")
    if not removed:
        click.echo("nothing to prune")
