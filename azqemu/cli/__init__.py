"""The ``azq`` command line: a virsh-style front end for templates, sandboxes and benchmarks.

Sub-commands live in their own modules and are imported only when used, so ``azq --help``
and one-shot commands stay quick. Every command reports a bad input or a failure as one line
on stderr and a non-zero exit (under ``--json``: the error as JSON on stdout, same exit code;
README.md has the table); the traceback goes to the debug log (``AZQ_DEBUG_LOG``, default
/tmp/azqemu-debug.log).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from typing import Any

import click

from azqemu import __version__
from azqemu.cli import output
from azqemu.daemon.logsetup import LOG_FORMAT
from azqemu.errors import AzqemuError

# command name -> "module:attribute"; each module owns its commands.
COMMANDS: dict[str, str] = {
    "doctor": "azqemu.cli.host_cmds:doctor",
    "host": "azqemu.cli.host_cmds:host",
    "image": "azqemu.cli.image_cmds:image",
    "template": "azqemu.cli.sandbox_cmds:template",
    "clone": "azqemu.cli.sandbox_cmds:clone",
    "exec": "azqemu.cli.sandbox_cmds:exec_",
    "pause": "azqemu.cli.sandbox_cmds:pause",
    "resume": "azqemu.cli.sandbox_cmds:resume",
    "compress": "azqemu.cli.sandbox_cmds:compress",
    "destroy": "azqemu.cli.sandbox_cmds:destroy",
    "phase": "azqemu.cli.sandbox_cmds:phase",
    "list": "azqemu.cli.sandbox_cmds:list_",
    "dominfo": "azqemu.cli.sandbox_cmds:dominfo",
    "domstats": "azqemu.cli.sandbox_cmds:domstats",
    "daemon": "azqemu.cli.daemon_cmds:daemon",
    "job": "azqemu.cli.sandbox_cmds:job",
    "tag": "azqemu.cli.sandbox_cmds:tag",
    "cp": "azqemu.cli.files_cmds:cp",
    "mem": "azqemu.cli.mem_cmds:mem",
    "store": "azqemu.cli.store_cmds:store",
    "bench": "azqemu.cli.bench_cmds:bench",
    "demo": "azqemu.cli.demo_cmds:demo",
    "capacity": "azqemu.cli.capacity_cmds:capacity",
    "placement": "azqemu.cli.capacity_cmds:placement",
    "events": "azqemu.cli.events_cmds:events",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in COMMANDS:
            raise click.UsageError(f"unknown command {name!r} (see 'azq --help')")
        return super().resolve_command(ctx, args)


def _setup_logging(verbose: bool) -> None:
    log_path = os.environ.get("AZQ_DEBUG_LOG", "/tmp/azqemu-debug.log")
    handlers: list[logging.Handler] = []
    try:
        handlers.append(logging.FileHandler(log_path))
    except OSError:
        pass
    if verbose:
        handlers.append(logging.StreamHandler(sys.stderr))
    # force: whatever a library (or an earlier call) attached to the root logger must not
    # make basicConfig a silent no-op (it was: the daemon's INFO lines went nowhere).
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=handlers,
                        format=LOG_FORMAT, force=True)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="azq", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="Log to stderr as well as the debug log.")
def cli(verbose: bool) -> None:
    """azqemu: dense AI-agent sandbox VMs through guest-memory compression."""
    _setup_logging(verbose)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning every failure into one line and an exit code."""
    try:
        cli.main(args=argv, prog_name="azq", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("azq: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        _fail(exc.format_message(), "UsageError", exc.exit_code)
    except AzqemuError as exc:
        logging.getLogger("azqemu").debug("command failed", exc_info=True)
        if output.state.json:
            from azqemu.api.errors import error_info

            output.emit({"error": error_info(exc).model_dump(mode="json")})
            sys.exit(exc.exit_code)
        _fail(str(exc), type(exc).__name__, exc.exit_code)
    except KeyboardInterrupt:
        click.echo("azq: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - last line of defence: one line, trace to the log
        logging.getLogger("azqemu").error("unexpected failure\n%s", traceback.format_exc())
        _fail(f"internal error: {type(exc).__name__}: {exc} "
              f"(traceback in {os.environ.get('AZQ_DEBUG_LOG', '/tmp/azqemu-debug.log')})", "InternalError", 70)


def _fail(message: str, error_type: str, exit_code: int) -> None:
    """One line on stderr, or under --json the error object on stdout; then exit."""
    if output.state.json:
        output.emit({"error": {"type": error_type, "message": message, "exit_code": exit_code,
                               "fields": {}, "module": ""}})
    else:
        click.echo(f"azq: {message}", err=True)
    sys.exit(exit_code)
