"""Who is asking (tenant), for which conversation (session), with which settings."""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Mapping

import xxhash

from .config import Config, TenantConfig
from .errors import ErrorKind, GatewayError
from .ids import derived_id, require_id
from .numbers import whole_number

DEFAULT_TENANT = "default"
MAX_BUDGET = 100_000_000
# Conventions agents and gateways already send, after our own header.
_SESSION_HEADERS = ("x-session-id", "x-session-affinity")


@dataclass(frozen=True)
class Caller:
    tenant: str
    tenant_config: TenantConfig
    bearer: str | None
    profile: str
    budget: int | None
    """max_input_tokens override (X-Ctx-Budget or the tenant's), None: the model's own."""
    expand: bool | None = None
    """X-Ctx-Expand: on or off for this request; None: the profile's and tenant's setting."""


def _bearer(headers: Mapping[str, str]) -> str | None:
    """The client's key: `Authorization: Bearer`, or Anthropic's `x-api-key`."""
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key", "").strip() or None


def _tenant_by_key(config: Config, key: str | None) -> str | None:
    """Compare against every configured key in constant time, so timing tells nothing."""
    found = None
    for name, tenant in config.ctxgate.tenants.items():
        for k in tenant.api_keys:
            if key is not None and hmac.compare_digest(k.encode(), key.encode()):
                found = name
    return found


def resolve_caller(config: Config, headers: Mapping[str, str], key: str | None = None) -> Caller:
    """`key`: the client's key as its door found it elsewhere (Google's `x-goog-api-key`), read
    as a bearer key; None: the headers' bearer key."""
    bearer = (key.strip() or None) if key is not None else _bearer(headers)
    keys_configured = any(t.api_keys for t in config.ctxgate.tenants.values())
    if keys_configured:
        tenant = _tenant_by_key(config, bearer)
        if tenant is None:
            raise GatewayError(ErrorKind.AUTHENTICATION,
                               "Incorrect API key provided for this gateway", code="invalid_api_key")
    else:
        tenant = require_id(headers.get("X-Ctx-Tenant") or DEFAULT_TENANT, "tenant", "X-Ctx-Tenant")
    tcfg = config.ctxgate.tenants.get(tenant) or TenantConfig()
    profile: str = tcfg.profile or config.ctxgate.profile
    budget = tcfg.budget
    # A malformed override is a bad request whoever sends it (400); a well-formed one the
    # tenant may not send is refused (403).
    if (raw := headers.get("X-Ctx-Profile")) is not None:
        if raw not in ("minimal", "professional", "enterprise"):
            raise GatewayError(ErrorKind.INVALID_REQUEST, "X-Ctx-Profile must be minimal, professional or enterprise",
                           param="X-Ctx-Profile", code="invalid_header")
        _allowed(tcfg, "profile", tenant, keys_configured)
        profile = raw
    if (raw := headers.get("X-Ctx-Budget")) is not None:
        budget = whole_number(raw, "X-Ctx-Budget", 1, MAX_BUDGET, code="invalid_header")
        _allowed(tcfg, "budget", tenant, keys_configured)
    expand = None
    if (raw := headers.get("X-Ctx-Expand")) is not None:
        if raw.strip().lower() not in ("on", "off"):
            raise GatewayError(ErrorKind.INVALID_REQUEST, "X-Ctx-Expand must be on or off",
                               param="X-Ctx-Expand", code="invalid_header")
        _allowed(tcfg, "expand", tenant, keys_configured)
        expand = raw.strip().lower() == "on"
    return Caller(tenant=tenant, tenant_config=tcfg, bearer=bearer, profile=profile, budget=budget, expand=expand)


def _allowed(tcfg: TenantConfig, what: str, tenant: str, keys_configured: bool) -> None:
    allowed = tcfg.allow_overrides
    if allowed is None:  # unset: all on an open gateway, none on one with tenant keys
        allowed = [] if keys_configured else ["profile", "budget", "expand"]
    if what not in allowed:
        raise GatewayError(ErrorKind.PERMISSION, f"tenant {tenant!r} may not override its {what} (allow_overrides)",
                       code="override_not_allowed")


def _first_text(messages: list[dict[str, Any]], roles: tuple[str, ...]) -> str:
    for m in messages:
        if m.get("role") in roles:
            c = m.get("content")
            return c if isinstance(c, str) else repr(c)
    return ""


def named_session(headers: Mapping[str, str], prompt_cache_key: Any = None) -> str | None:
    """The session the request names: X-Ctx-Session, else the conventions agents send
    (headers, the body's cache key); None when it names none."""
    own = headers.get("X-Ctx-Session")
    if own is not None:
        return require_id(own, "session", "X-Ctx-Session")
    candidates = [headers.get(h) for h in _SESSION_HEADERS]
    if isinstance(prompt_cache_key, str):
        candidates.append(prompt_cache_key)
    for value in candidates:
        if value:
            return derived_id(value)  # other tools' ids are not ours to refuse
    return None


def resolve_session(tenant: str, headers: Mapping[str, str], messages: list[dict[str, Any]],
                    prompt_cache_key: Any = None) -> str:
    """The session the request names (`named_session`), else a fingerprint of the
    conversation's start (`messages` in the neutral model)."""
    named = named_session(headers, prompt_cache_key)
    if named is not None:
        return named
    seed = "\x00".join((tenant, _first_text(messages, ("system", "developer")), _first_text(messages, ("user",))))
    return "fp-" + xxhash.xxh3_128_hexdigest(seed.encode())[:24]
