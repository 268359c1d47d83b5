"""OpenStack Placement: this host as a resource provider with a MEMORY_MB inventory.

The one module that talks to Placement (its REST API, microversion 1.26, stdlib urllib);
what it answers becomes ``PlacementError`` (one line, the HTTP status kept).

``sync`` makes sure the provider exists (named after the host; its UUID is kept in
``$AZQ_STATE_DIR/placement.json`` so a renamed host stays the same provider, and a provider
of that name made elsewhere is adopted) and PUTs the MEMORY_MB inventory with the provider's
generation; a generation that moved meanwhile (409) is read again and the PUT retried.

Authentication, first found of: ``AZQ_PLACEMENT_TOKEN`` (sent as ``X-Auth-Token``: for
``noauth2`` deployments ``admin``); a Keystone v3 password login from the usual ``OS_AUTH_URL``,
``OS_USERNAME``, ``OS_PASSWORD``, ``OS_PROJECT_NAME``, ``OS_USER_DOMAIN_NAME``,
``OS_PROJECT_DOMAIN_NAME`` (whose catalog also gives Placement's URL when none is given);
otherwise ``admin`` (noauth2). The URL: ``--url``, ``AZQ_PLACEMENT_URL``, or the catalog.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
import uuid as uuid_mod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from azqemu.errors import ConfigError, PlacementError

MICROVERSION = "placement 1.26"
RESOURCE_CLASS = "MEMORY_MB"
TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Auth:
    token: str
    url: str | None = None        # Placement's endpoint from the Keystone catalog


def keystone_login(env: dict[str, str] | None = None, timeout_s: float = TIMEOUT_S) -> Auth | None:
    """A Keystone v3 password token (and Placement's public endpoint) if OS_AUTH_URL is set."""
    env = dict(os.environ) if env is None else env
    auth_url = env.get("OS_AUTH_URL", "").rstrip("/")
    if not auth_url:
        return None
    missing = [k for k in ("OS_USERNAME", "OS_PASSWORD", "OS_PROJECT_NAME") if not env.get(k)]
    if missing:
        raise ConfigError(f"OS_AUTH_URL is set but {', '.join(missing)} is not")
    body = {"auth": {
        "identity": {"methods": ["password"], "password": {"user": {
            "name": env["OS_USERNAME"], "password": env["OS_PASSWORD"],
            "domain": {"name": env.get("OS_USER_DOMAIN_NAME", "Default")}}}},
        "scope": {"project": {"name": env["OS_PROJECT_NAME"],
                              "domain": {"name": env.get("OS_PROJECT_DOMAIN_NAME", "Default")}}}}}
    if not auth_url.endswith("/v3"):
        auth_url += "/v3"
    req = urllib.request.Request(f"{auth_url}/auth/tokens", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            token = r.headers.get("X-Subject-Token", "")
            catalog = json.load(r).get("token", {}).get("catalog", [])
    except urllib.error.HTTPError as exc:
        raise PlacementError(f"Keystone at {auth_url} refused the login: HTTP {exc.code}", exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        raise PlacementError(f"cannot reach Keystone at {auth_url}: {_reason(exc)}") from None
    endpoint = next((e["url"] for s in catalog if s.get("type") == "placement"
                     for e in s.get("endpoints", []) if e.get("interface") == "public"), None)
    return Auth(token, endpoint)


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc
    return str(getattr(reason, "strerror", None) or reason)


class Placement:
    """A small Placement client: resource providers and their inventories."""

    def __init__(self, url: str, token: str = "admin", timeout_s: float = TIMEOUT_S) -> None:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"Placement URL {url!r} is not http(s)://HOST[:PORT][/PATH]")
        self.url = url
        self.token = token
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """(status, decoded body); PlacementError for anything but 2xx, 404 and 409."""
        headers = {"X-Auth-Token": self.token, "OpenStack-API-Version": MICROVERSION,
                   "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            if exc.code in (404, 409):
                return exc.code, _json_or_text(raw)
            raise PlacementError(f"Placement {method} {path}: HTTP {exc.code}: {_detail(raw)}", exc.code) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PlacementError(f"cannot reach Placement at {self.url}: {_reason(exc)}") from None

    def provider(self, rp_uuid: str) -> dict[str, Any] | None:
        status, body = self.request("GET", f"/resource_providers/{rp_uuid}")
        return body if status == 200 else None

    def provider_named(self, name: str) -> dict[str, Any] | None:
        _, body = self.request("GET", "/resource_providers?" + urllib.parse.urlencode({"name": name}))
        found = (body or {}).get("resource_providers", [])
        return found[0] if found else None

    def create_provider(self, name: str, rp_uuid: str) -> dict[str, Any]:
        status, body = self.request("POST", "/resource_providers", {"name": name, "uuid": rp_uuid})
        if status == 409:
            raise PlacementError(f"Placement refused provider {name!r} ({rp_uuid}): {_detail(body)}", 409)
        return dict(body)

    def inventories(self, rp_uuid: str) -> dict[str, Any]:
        status, body = self.request("GET", f"/resource_providers/{rp_uuid}/inventories")
        if status != 200:
            raise PlacementError(f"Placement has no resource provider {rp_uuid}", status)
        return dict(body)

    def set_inventory(self, rp_uuid: str, generation: int, resource_class: str,
                      inventory: dict[str, Any], *, exists: bool) -> tuple[int, Any]:
        """PUT one class's inventory (POST the first time: Placement has no upsert)."""
        body = {"resource_provider_generation": generation, **inventory}
        if exists:
            return self.request("PUT", f"/resource_providers/{rp_uuid}/inventories/{resource_class}", body)
        return self.request("POST", f"/resource_providers/{rp_uuid}/inventories",
                            {"resource_class": resource_class, **body})


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _detail(body: Any) -> str:
    """The first error's detail of a Placement error body, on one line."""
    if isinstance(body, bytes):
        body = _json_or_text(body)
    if isinstance(body, dict) and body.get("errors"):
        e = body["errors"][0]
        body = e.get("detail") or e.get("title") or e
    return " ".join(str(body).split())[:300]


def memory_inventory(total_mib: int, reserved_mib: int, allocation_ratio: float) -> dict[str, Any]:
    total_mib = max(1, int(total_mib))
    return {"total": total_mib, "reserved": max(0, min(int(reserved_mib), total_mib)), "min_unit": 1,
            "max_unit": total_mib, "step_size": 1, "allocation_ratio": float(allocation_ratio)}


def provider_identity(state_dir: Path, name: str | None = None) -> tuple[str, str]:
    """(name, uuid) of this host's provider: the UUID kept under the state dir, made once."""
    path = state_dir / "placement.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    name = name or saved.get("name") or socket.gethostname()
    rp_uuid = saved.get("uuid") or str(uuid_mod.uuid4())
    save_identity(state_dir, name, rp_uuid)
    return name, rp_uuid


def save_identity(state_dir: Path, name: str, rp_uuid: str) -> None:
    path = state_dir / "placement.json"
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"name": name, "uuid": rp_uuid}) + "\n")
    os.replace(tmp, path)


def sync(client: Placement, state_dir: Path, inventory: dict[str, Any], name: str | None = None,
         resource_class: str = RESOURCE_CLASS) -> dict[str, Any]:
    """Create the provider if needed and set its inventory; returns what was before and after."""
    name, rp_uuid = provider_identity(state_dir, name)
    created = False
    rp = client.provider(rp_uuid)
    if rp is None:
        rp = client.provider_named(name)
        if rp is not None:  # made by an earlier sync whose state dir is gone: adopt it
            rp_uuid = rp["uuid"]
            save_identity(state_dir, name, rp_uuid)
        else:
            rp = client.create_provider(name, rp_uuid)
            created = True
    before = client.inventories(rp_uuid)
    for _attempt in range(3):
        status, body = client.set_inventory(rp_uuid, int(before["resource_provider_generation"]),
                                            resource_class, inventory,
                                            exists=resource_class in before["inventories"])
        if status in (200, 201):
            return {"provider": {"uuid": rp_uuid, "name": name, "created": created,
                                 "generation": body["resource_provider_generation"]},
                    "before": before["inventories"].get(resource_class), "inventory": inventory,
                    "after": {k: v for k, v in body.items()
                              if k not in ("resource_provider_generation", "resource_class")}}
        if status != 409:
            break
        before = client.inventories(rp_uuid)  # someone else moved the generation: read it again
    raise PlacementError(f"Placement did not take the {resource_class} inventory of {name}: {_detail(body)}",
                         status)
