"""The config file: litellm's own `model_list` plus a `ctxgate:` section.

A LiteLLM proxy config works unchanged (its other top-level sections are accepted and
ignored). Everything is validated at start; a bad file is refused with the dotted path
of the bad key, e.g. `ctxgate.tenants.acme.profile: Input should be ...`.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ctxgate.pipeline.config import PROFILE_DEFAULTS, PipelineConfig
from ctxgate.memory.config import MemoryConfig, Shareable
from ctxgate.wal.config import WalConfig
from ctxgate.redis_backend import RedisTarget, is_redis_url
from .ids import validate_id
from .context_settings import NativeContextChoice, NativeContextSettings

log = logging.getLogger("ctxgate.config")

ProfileName = Literal["minimal", "professional", "enterprise"]
Override = Literal["profile", "budget", "expand"]


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file and the bad key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelEntry(BaseModel):
    """One entry of litellm's `model_list`, as litellm's proxy takes it."""
    model_config = ConfigDict(extra="allow")
    model_name: str = Field(min_length=1)
    litellm_params: dict[str, Any]
    model_info: dict[str, Any] = Field(default_factory=dict)

    @field_validator("litellm_params")
    @classmethod
    def _needs_model(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(v.get("model"), str) or not v["model"]:
            raise ValueError("litellm_params.model is required (e.g. openai/gpt-4o)")
        return v


class TokenizerRuleConfig(_Strict):
    pattern: str
    tokenizer: str


class TenantConfig(_Strict):
    api_keys: list[str] = Field(default_factory=list)
    profile: ProfileName | None = None
    budget: int | None = Field(default=None, gt=0)
    """max_input_tokens for this tenant's requests (otherwise the model's own limit)."""
    allow_overrides: list[Override] | None = None
    """Which per-request headers (X-Ctx-Profile, X-Ctx-Budget, X-Ctx-Expand) this tenant may send. Unset: every
    one on a gateway with no tenant keys (whoever reaches it runs it: a laptop, a trusted
    network), none on one with keys, where a small X-Ctx-Budget from any key would force paid
    compaction."""
    pass_through_key: bool = False
    """Send the tenant's own bearer key upstream instead of the configured upstream key."""
    max_body_bytes: int | None = Field(default=None, gt=0)
    """This tenant's request bodies: at most this (a 413 past it); unset: ctxgate.max_body_bytes."""
    max_messages: int = Field(default=100_000, gt=0)
    """Messages (or Responses input items, Gemini contents) in one request: a 400 past it."""
    max_content_parts: int = Field(default=1_000_000, gt=0)
    """Content parts (blocks) of all the messages of one request together: a 400 past it."""
    heavy_concurrency: int = Field(default=1, gt=0)
    """This tenant's large requests whose CPU work (validation, counting, planning) runs at once,
    off the event loop; more wait for their turn behind this tenant's own (proxy/heavy.py)."""
    pipeline: dict[str, Any] = Field(default_factory=dict)
    share_captured: list[Shareable] | None = None
    """Captured memory categories every user of this tenant sees; unset: `ctxgate.memory.share_captured`."""
    native_context: NativeContextChoice | None = None
    """Who applies the providers' context-management APIs for this tenant (context_settings.py)."""


class ProfileOverrides(_Strict):
    pipeline: dict[str, Any] = Field(default_factory=dict)


class ConnectionSettings(_Strict):
    """How long a client may take, and how many connections it may hold (slowloris, idle floods)."""
    header_read_timeout_s: float = Field(default=10.0, gt=0)
    """From a connection's first byte (or its opening) to the end of a request's headers."""
    body_read_timeout_s: float = Field(default=60.0, gt=0)
    """From the end of the headers to the end of the body: a 408 past it, and the connection closes."""
    keepalive_timeout_s: float = Field(default=75.0, gt=0)
    """An idle keep-alive connection is closed after this."""
    max_connections: int | None = Field(default=None, gt=0)
    """Open client connections; past it a new one is answered 503 (but /healthz, /readyz).
    None: 80% of the open-file limit (raised to its hard limit at start)."""
    rejection_log_interval_s: float = Field(default=10.0, ge=0)
    """Malformed HTTP requests are logged at most once per kind per interval, with a count."""


class CtxgateSettings(_Strict):
    data_dir: str = "./.ctxgate"
    state: str = "memory"
    profile: ProfileName = "professional"
    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    forwarding: Literal["auto", "litellm"] = "auto"
    """auto: OpenAI-compatible upstreams go through ctxgate's pooled aiohttp client (reply
    byte-exact, lower overhead), every other provider through litellm.acompletion."""
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    session_idle_ttl_s: float = Field(default=3600.0, gt=0)
    """With `state: memory`, a session idle this long leaves memory (its WAL rebuilds it if it returns)."""
    max_memory_sessions: int = Field(default=10_000, gt=0)
    """With `state: memory`, the sessions held in memory; the least recently used leave first."""
    default_max_input_tokens: int = Field(default=128_000, gt=0)
    tokenizers: list[TokenizerRuleConfig] = Field(default_factory=list)
    pipeline: dict[str, Any] = Field(default_factory=dict)
    profiles: dict[ProfileName, ProfileOverrides] = Field(default_factory=dict)
    """Per-profile overrides of the pipeline settings: `profiles.enterprise.pipeline: {...}`."""
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    wal: WalConfig = Field(default_factory=WalConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    connections: ConnectionSettings = Field(default_factory=ConnectionSettings)
    native_context: NativeContextSettings = Field(default_factory=NativeContextSettings)
    admin_key: str | None = Field(default_factory=lambda: os.environ.get("CTXGATE_ADMIN_KEY") or None, min_length=16)
    """An operator's key (or the CTXGATE_ADMIN_KEY environment variable): reads /metrics and
    every tenant's sessions on /ui (as a bearer token or x-api-key), serves no chat."""
    metrics_auth: Literal["auto", "key", "open"] = "auto"
    """Who reads /metrics (the whole gateway's series): auto: the admin key once any key is
    configured (a tenant key is refused), else anyone; key: always the admin key; open: anyone."""

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        """A setting ctxgate no longer has is dropped with a warning, not refused: a config
        written for an earlier release still starts."""
        if isinstance(data, dict) and "count_workers" in data:
            log.warning("ctxgate.count_workers is ignored: a new conversation is counted in a thread "
                        "(gigatoken counts 107K tokens in ~3 ms); remove it from the config")
            data = {k: v for k, v in data.items() if k != "count_workers"}
        return data

    @model_validator(mode="after")
    def _metrics_readable(self) -> "CtxgateSettings":
        if self.metrics_auth == "key" and self.admin_key is None:
            raise ValueError("metrics_auth: key needs ctxgate.admin_key (/metrics shows the whole gateway's series, "
                             "which a tenant key may not read: else nobody can read it)")
        return self

    @field_validator("state")
    @classmethod
    def _state(cls, v: str) -> str:
        if v != "memory" and not is_redis_url(v):
            raise ValueError("state must be 'memory', a redis:// URL or a redis+cluster:// URL")
        if v != "memory":
            RedisTarget.parse(v)
        return v

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        for name in v:
            validate_id(name, "tenant")
        return v


class Config(BaseModel):
    model_config = ConfigDict(extra="allow")  # litellm_settings, general_settings, router_settings ...
    model_list: list[ModelEntry] = Field(default_factory=list)
    ctxgate: CtxgateSettings = Field(default_factory=CtxgateSettings)
    source: str = "<embedded defaults>"

    def pipeline_config(self, profile: str, tenant: str | None = None) -> PipelineConfig:
        """Profile defaults, then `ctxgate.pipeline`, the profile's overrides, the tenant's."""
        merged: dict[str, Any] = {}
        layers = [PROFILE_DEFAULTS[profile], self.ctxgate.pipeline]
        if profile in self.ctxgate.profiles:
            layers.append(self.ctxgate.profiles[profile].pipeline)
        if tenant and tenant in self.ctxgate.tenants:
            layers.append(self.ctxgate.tenants[tenant].pipeline)
        for layer in layers:
            merged = _deep_merge(merged, layer)
        return PipelineConfig.model_validate(merged)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _format(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        lines.append(f"{where}: {e['msg']}")
    return "; ".join(lines)


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read and validate a config file; `None` gives the embedded defaults."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping with model_list: and ctxgate:")
    try:
        cfg = Config.model_validate({**raw, "source": str(p)})
    except ValidationError as e:
        raise ConfigError(f"{p}: {_format(e)}") from None
    except ValueError as e:
        raise ConfigError(f"{p}: {e}") from None
    _validate_pipeline_layers(cfg, p)
    return cfg


def _validate_pipeline_layers(cfg: Config, p: Path) -> None:
    """Each pipeline override is checked on its own, so an error names where it is."""
    layers = {"ctxgate.pipeline": cfg.ctxgate.pipeline}
    layers.update({f"ctxgate.profiles.{k}.pipeline": v.pipeline for k, v in cfg.ctxgate.profiles.items()})
    layers.update({f"ctxgate.tenants.{k}.pipeline": v.pipeline for k, v in cfg.ctxgate.tenants.items()})
    try:
        for prefix, layer in layers.items():
            try:
                PipelineConfig.model_validate(layer)
            except ValidationError as e:
                raise ConfigError(f"{p}: {_format(e, prefix)}") from None
        for profile in PROFILE_DEFAULTS:
            for tenant in (None, *cfg.ctxgate.tenants):
                cfg.pipeline_config(profile, tenant)
    except ValidationError as e:
        raise ConfigError(f"{p}: {_format(e, 'ctxgate.pipeline')}") from None
    except ValueError as e:
        raise ConfigError(f"{p}: {e}") from None
