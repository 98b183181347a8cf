"""Who may look at the dashboard, and at which tenants.

The admin key sees every tenant; a tenant key sees its own tenant only. A gateway with no
admin key and no tenant keys has nobody to ask for a key: it shows the dashboard to its
own machine only (a loopback client) and refuses everyone else with 403.
"""
from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Mapping

from multidict import CIMultiDict

from ..config import Config
from ..errors import ErrorKind, GatewayError
from ..tenancy import resolve_caller
from .metrics import presented_key


@dataclass(frozen=True)
class Viewer:
    role: str
    """`admin` (the admin key), `tenant` (a tenant key) or `local` (an open gateway, asked from loopback)."""
    tenant: str | None
    """The one tenant a tenant key sees; None: every tenant."""

    def sees(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant


def is_loopback(remote: str | None) -> bool:
    try:
        address = ipaddress.ip_address(remote or "")
    except ValueError:  # a Unix socket or no peer address: not known to be this machine
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def is_open(config: Config) -> bool:
    """No admin key and no tenant key: nobody can present a key."""
    settings = config.ctxgate
    return settings.admin_key is None and not any(t.api_keys for t in settings.tenants.values())


def _local_host(host: str) -> bool:
    """The Host header names this machine: a page of another site whose name was made to point
    at 127.0.0.1 (DNS rebinding) sends its own name, and is refused."""
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.split("]")[0].lstrip("[") if name.startswith("[") else name
    return name.lower() == "localhost" or is_loopback(name)


def loopback_only(config: Config, remote: str | None, host: str) -> None:
    """On an open gateway, the dashboard is for this machine only, asked for by a loopback name."""
    if is_open(config) and not (is_loopback(remote) and _local_host(host)):
        raise GatewayError(ErrorKind.PERMISSION, "this gateway has no admin key and no tenant keys, so its dashboard "
                           "answers loopback clients only, at localhost, 127.0.0.1 or [::1] (set ctxgate.admin_key "
                           "to open it to others)", code="dashboard_loopback_only")


def viewer_of(config: Config, headers: Mapping[str, str], remote: str | None, host: str) -> Viewer:
    """The caller of a dashboard JSON endpoint: 401 without a valid key, 403 from afar on an open gateway."""
    if is_open(config):
        loopback_only(config, remote, host)
        return Viewer("local", None)
    settings = config.ctxgate
    key = presented_key(headers)
    if key is not None and settings.admin_key is not None and hmac.compare_digest(key.encode(),
                                                                                  settings.admin_key.encode()):
        return Viewer("admin", None)
    if key is not None and any(t.api_keys for t in settings.tenants.values()):
        # Only the key: the tenant is who the key belongs to, whatever else the request says.
        caller = resolve_caller(config, CIMultiDict((k, v) for k, v in headers.items()
                                                    if k.lower() in ("authorization", "x-api-key")))
        return Viewer("tenant", caller.tenant)
    raise GatewayError(ErrorKind.AUTHENTICATION, "the dashboard needs the admin key or a tenant key "
                       "(Authorization: Bearer or x-api-key)", code="invalid_api_key")
