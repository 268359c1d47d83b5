"""The daemon's versioned HTTP API (``/v1``): models, error mapping, the app and its jobs.

``models`` and ``errors`` need only pydantic and are shared with the typed client
(``azqemu.client``); ``app``, ``jobs``, ``guard`` and ``streams`` are the daemon's side
(FastAPI, served by uvicorn from ``azqemu.daemon.server``). See docs/api.md.
"""

API_VERSION = "v1"
PREFIX = f"/{API_VERSION}"
