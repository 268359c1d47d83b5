"""A standalone fault server: serve one QEMU's faults from a RAM image file.

    python -m tests.support.uffd_serve --socket /run/azqemu/uffd/SANDBOX.sock --image RAM_IMAGE

Connects to the export of a QEMU process (taking over its uffd; a restarted server gets
the same one back), wakes the RAM blocks so that faults whose messages died with a
previous server are raised again, and answers every fault with the page at the same
offset of ``--image`` (holes are zero) until SIGTERM or SIGINT. Prints ``SERVING ...``
once ready and the handler stats as JSON on exit.

It is a tool for bring-up and for the tests (a manager that can be killed with -9);
the daemon runs the same FaultHandler in-process with a store-backed source.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys

from azqemu.restore.export import UffdExport
from azqemu.restore.handler import FaultHandler
from azqemu.restore.source import TemplateSource


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.uffd_serve", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, help="the export socket (AZQ_UFFD_SOCKET of QEMU)")
    parser.add_argument("--image", required=True, help="RAM image, laid out like the RAM file")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the export")
    parser.add_argument("--register", action="store_true", help="register every RAM block first")
    args = parser.parse_args(argv)

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    handle = UffdExport.connect(args.socket, args.timeout)
    source = TemplateSource(args.image)
    if args.register:
        handle.register_all()
    handler = FaultHandler(handle, source)
    handler.start(wake=True)
    print(f"SERVING pid={handle.pid} uffd_created={int(handle.created)} blocks={len(handle.blocks)}",
          flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    handler.close()
    print(json.dumps(dataclasses.asdict(handler.stats())), flush=True)
    source.close()
    handle.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
