"""``azq bench clone``: N sandboxes cloned from one template at once, timed per clone (start
to the guest agent answering) and in total."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from azqemu.client import Client
from azqemu.errors import AzqemuError

log = logging.getLogger(__name__)


def run_clone(c: Client, template: str, count: int, ram_mode: str,
              name_prefix: str = "azq-bench-clone-") -> dict[str, Any]:
    """N clones at once: {clones, per_clone_s: {median, p95}, total_s, ram_mode}. The clones
    are destroyed before it returns."""
    t0 = time.monotonic()
    rows = c.clone(template, count=count, name_prefix=name_prefix,
                   ram_mode=None if ram_mode == "auto" else ram_mode)
    total_s = time.monotonic() - t0
    try:
        per = np.array([r.as_json()["clone_s"] for r in rows])
        return {"clones": len(rows), "per_clone_s": {"median": float(np.median(per)),
                                                     "p95": float(np.percentile(per, 95))},
                "total_s": total_s, "ram_mode": rows[0].as_json()["ram_mode"] if rows else ram_mode}
    finally:
        for r in rows:
            try:
                c.destroy(r.name)
            except AzqemuError as exc:
                log.warning("destroy %s: %s", r.name, exc)
