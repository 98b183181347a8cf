"""Sealed compaction items across replicas (docs/native-context.md): `ctxgate serve` processes
sharing Redis state and `ctxgate.native_context.keys` open each other's items, and a key
rotates by being put first while the old one stays listed."""
from __future__ import annotations

import copy
from typing import Any

import openai
import pytest

from servers import Gateway, RedisServer, main_config, start_gateways, stop_all
from test_native_responses_compaction import client, forwarded, history, session
from upstream import ScriptedUpstream

OLD, NEW = "old-sealing-key-0123456789", "new-sealing-key-9876543210"


def _compacted(gw: Gateway, headers: dict[str, str], secret: str) -> list[dict[str, Any]]:
    """What a client sends after compacting on `gw`: the compacted output, then its next question."""
    compacted = client(gw).responses.compact(model="gpt-4o", input=history(secret), extra_headers=headers)  # type: ignore[arg-type]
    assert compacted.output[-1].type == "compaction"
    return [o.model_dump(exclude_none=True) for o in compacted.output] + [{"role": "user", "content": "secret?"}]


def _continues(gw: Gateway, headers: dict[str, str], follow: list[dict[str, Any]], up: ScriptedUpstream,
               secret: str) -> None:
    start = len(up.log)
    assert client(gw).responses.create(model="gpt-4o", input=follow, extra_headers=headers).output_text  # type: ignore[arg-type]
    sent = forwarded(up, start)
    assert secret in sent and follow[-2]["encrypted_content"] not in sent
    assert "STEP-7" in sent  # the newest step: only in what the item names, read from the shared store


def _refused(gw: Gateway, headers: dict[str, str], follow: list[dict[str, Any]], up: ScriptedUpstream) -> None:
    start = len(up.log)
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).responses.create(model="gpt-4o", input=follow, extra_headers=headers)  # type: ignore[arg-type]
    assert e.value.code == "invalid_encrypted_content" and len(up.log) == start


def test_replicas_open_each_others_items_and_a_key_rotates(upstream: ScriptedUpstream, up: ScriptedUpstream,
                                                           redis_server: RedisServer, tmp_path: Any) -> None:
    base = main_config(upstream.url, "auto", state=redis_server.url)
    keys = {"a": [OLD], "b": [OLD], "rotated": [NEW, OLD], "new-only": [NEW]}
    configs = {}
    for name, listed in keys.items():
        configs[name] = copy.deepcopy(base)
        configs[name]["ctxgate"]["native_context"] = {"keys": listed}
    replicas = start_gateways({name: (tmp_path / name, config) for name, config in configs.items()})
    try:
        a, b, rotated, new_only = (replicas[n] for n in ("a", "b", "rotated", "new-only"))
        headers = session()
        sealed_by_a = _compacted(a, headers, "OSPREY")
        _continues(b, headers, sealed_by_a, up, "OSPREY")  # the same keys, another process
        _continues(rotated, headers, sealed_by_a, up, "OSPREY")  # the old key still listed opens it
        _refused(new_only, headers, sealed_by_a, up)  # once the old key is gone, so are its items
        other = session()
        sealed_new = _compacted(rotated, other, "HERON")
        _continues(new_only, other, sealed_new, up, "HERON")  # sealed under the new key
        _refused(a, other, sealed_new, up)  # which a replica left on the old keys does not have
    finally:
        stop_all(replicas.values())
