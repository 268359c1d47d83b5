"""The daemon's one log: ``Config.daemon_log`` (``$AZQ_LOG_DIR/daemon.log``, by default
/var/log/azqemu/daemon.log), whatever starts the daemon.

``azq daemon`` in a terminal, ``daemon/proc.py`` (the demo and the tests) and the systemd unit
(packaging/azqemu.service) all end here, so an operator looks in one place. The file is
reopened when logrotate moves it (``WatchedFileHandler``). A terminal on stderr gets the lines
too; a non-terminal stderr (systemd's journal, proc.py's redirect into the same file) does not,
so no line is written twice.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys

from azqemu import config as config_mod

LOG_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"


def log_to_daemon_log(cfg: config_mod.Config | None = None) -> str:
    """Send the root logger to the daemon's log (INFO, or DEBUG when ``azq -v`` asked);
    returns the path. Replaces the CLI's own handlers (its debug log)."""
    cfg = cfg or config_mod.load()
    path = cfg.daemon_log
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    level = min(root.level or logging.INFO, logging.INFO)
    handlers: list[logging.Handler] = [logging.handlers.WatchedFileHandler(path)]
    if sys.stderr.isatty():
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=level, handlers=handlers, format=LOG_FORMAT, force=True)
    logging.getLogger(__name__).info("azqemu daemon logging to %s", path)
    return str(path)
