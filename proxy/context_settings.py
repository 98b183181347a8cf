"""Who applies the providers' own context-management APIs on a route (docs/native-context.md):
the vendor (the fields pass through byte for byte) or ctxgate (the fields are read and
emulated, whatever the route). `auto`, the default, leaves them to the vendor only on its
own API at its own host: OpenAI or Azure for Responses compaction, Anthropic for context
editing and compaction.
"""
from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field

Mode = Literal["auto", "native", "emulate"]
Feature = Literal["openai_compaction", "anthropic_edits"]
_OWN_HOSTS: dict[Feature, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # (providers, hosts a base URL may name; a suffix starting with "." matches subdomains)
    "openai_compaction": (("openai", "azure"), ("api.openai.com", ".openai.azure.com")),
    "anthropic_edits": (("anthropic",), ("api.anthropic.com",)),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NativeContextChoice(_Strict):
    """`native_context` of a tenant: its own choice, overall and per `model_name`."""
    mode: Mode | None = None
    routes: dict[str, Mode] = Field(default_factory=dict)


class NativeContextSettings(NativeContextChoice):
    """`ctxgate.native_context`: the gateway's choice, and the keys compaction items are sealed with."""
    keys: list[str] = Field(default_factory=list)
    """Secrets (any string, 16 characters or more; random bytes in base64 are best) for the
    compaction items' `encrypted_content`: the first seals, every one opens, so a key
    rotates by being put first and the old one kept until its items expire. Unset: one key
    made and kept in the data directory (one gateway only: replicas need the same keys)."""
    seal_ttl_s: float | None = Field(default=None, gt=0)
    """How long a compaction item is honoured; unset: as long as expansion originals are kept."""

    def model_post_init(self, _context: object) -> None:
        if any(len(k) < 16 for k in self.keys):
            raise ValueError("native_context.keys: every key needs 16 characters or more")


def mode_for(gateway: NativeContextSettings, tenant: NativeContextChoice | None, model_name: str) -> Mode:
    """The most specific choice: the tenant's for the route, the gateway's for the route, the
    tenant's overall, the gateway's overall."""
    for choice in ((tenant.routes.get(model_name) if tenant else None), gateway.routes.get(model_name),
                   (tenant.mode if tenant else None), gateway.mode):
        if choice is not None:
            return choice
    return "auto"


def vendor_applies(mode: Mode, feature: Feature, provider: str, api_base: str | None) -> bool:
    """Whether the route's vendor applies the feature itself (the fields pass through)."""
    if mode != "auto":
        return mode == "native"
    providers, hosts = _OWN_HOSTS[feature]
    if provider not in providers:
        return False
    if not api_base:
        return provider != "azure"  # litellm's default base is the vendor's own; Azure always names one
    host = (urlparse(api_base).hostname or "").lower()
    return any(host == h or (h.startswith(".") and host.endswith(h)) for h in hosts)
