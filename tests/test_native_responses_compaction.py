"""OpenAI's compaction on the Responses door, on routes whose provider has none (docs/native-context.md):
the official `openai` SDK against a real `ctxgate serve` in front of the scripted upstream."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from servers import KEYS, Gateway, launch, main_config, stop_all
from upstream import ScriptedUpstream

BIG = "".join(f"line {k}: build output that fills the context with words\n" for k in range(40))


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto")
    config["model_list"].append({"model_name": "claude-n", "litellm_params": {
        "model": "anthropic/claude-n", "api_base": upstream.url, "api_key": "sk-up"}})
    gateway = launch("native-responses", tmp_path_factory.mktemp("native-responses"), config).wait_ready()
    yield gateway
    stop_all([gateway])


def client(gw: Gateway, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url, api_key=KEYS[tenant], max_retries=0)


def session() -> dict[str, str]:
    return {"X-Ctx-Session": f"native-{uuid.uuid4().hex[:12]}"}


def history(secret: str = "PELICAN") -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"role": "user", "content": f"Fix the failing build. The secret word is {secret}."}]
    for i in range(8):
        items.append({"type": "function_call", "call_id": f"f{i}", "name": "bash",
                      "arguments": json.dumps({"command": f"make step{i}"})})
        items.append({"type": "function_call_output", "call_id": f"f{i}", "output": f"STEP-{i}\n" + BIG})
    return items


def forwarded(up: ScriptedUpstream, start: int) -> str:
    return json.dumps([r.body for r in up.log[start:] if r.body.get("model") != "summarizer"])


@pytest.mark.parametrize("model", ["claude-n", "gpt-4o"])
def test_compact_endpoint_then_the_item_is_expanded_upstream(gw: Gateway, up: ScriptedUpstream, model: str) -> None:
    cli, headers = client(gw), session()
    compacted = cli.responses.compact(model=model, input=history(), instructions="You are a coding agent.",  # type: ignore[arg-type]
                                      extra_headers=headers)
    assert compacted.object == "response.compaction"
    *users, item = compacted.output
    assert item.type == "compaction" and item.encrypted_content.startswith("ctxs1.")  # type: ignore[union-attr]
    assert [u.role for u in users] == ["user"]  # type: ignore[union-attr]
    assert compacted.usage.output_tokens >= 0
    start = len(up.log)
    follow = [o.model_dump(exclude_none=True) for o in compacted.output] + [{"role": "user", "content": "secret?"}]
    reply = cli.responses.create(model=model, input=follow, extra_headers=headers)  # type: ignore[arg-type]
    assert reply.output_text
    sent = forwarded(up, start)
    assert item.encrypted_content not in sent and "PELICAN" in sent and "secret?" in sent  # type: ignore[union-attr]
    assert "STEP-7" in sent  # the newest step stays as it was


def test_a_tampered_or_foreign_item_is_refused_and_nothing_forwarded(gw: Gateway, up: ScriptedUpstream) -> None:
    cli = client(gw)
    item = cli.responses.compact(model="gpt-4o", input=history(), extra_headers=session()).output[-1]
    blob: str = item.encrypted_content  # type: ignore[union-attr]
    tampered = blob[:-4] + ("AAAA" if not blob.endswith("AAAA") else "BBBB")
    start = len(up.log)
    for key, content in (("acme", tampered), ("relay", blob), ("acme", "gAAAA-not-ours")):
        with pytest.raises(openai.BadRequestError) as e:
            client(gw, key).responses.create(model="gpt-4o", extra_headers=session(), input=[  # type: ignore[arg-type]
                {"type": "compaction", "encrypted_content": content}, {"role": "user", "content": "go on"}])
        assert e.value.code == "invalid_encrypted_content" and "encrypted_content" in str(e.value.param)
    assert len(up.log) == start


def test_context_management_under_and_over_the_threshold(gw: Gateway, up: ScriptedUpstream) -> None:
    cli = client(gw)
    start = len(up.log)
    small = cli.responses.create(model="claude-n", input="hi", extra_headers=session(),
                                 extra_body={"context_management": [{"type": "compaction", "compact_threshold": 5000}]})
    assert [o.type for o in small.output] == ["message"]
    [entry] = up.log[start:]
    assert "context_management" not in entry.body and "extra_body" not in json.dumps(entry.body)
    headers = session()
    big = cli.responses.create(model="gpt-4o", input=history(), extra_headers=headers,  # type: ignore[arg-type]
                               extra_body={"context_management": [{"type": "compaction", "compact_threshold": 1000}]})
    assert [o.type for o in big.output] == ["compaction", "message"]
    assert big.usage is not None and big.usage.model_extra and "compaction" in big.usage.model_extra
    status, summary = gw.get(f"/v1/ctx/sessions/{headers['X-Ctx-Session']}",
                             {"Authorization": f"Bearer {KEYS['acme']}"})
    assert status == 200 and any(e.get("reason") == "client" for e in summary["compactions"])


def test_streamed_compaction_item_comes_first(gw: Gateway, up: ScriptedUpstream) -> None:
    events = list(client(gw).responses.create(
        model="gpt-4o", input=history(), stream=True, extra_headers=session(),  # type: ignore[arg-type]
        extra_body={"context_management": [{"type": "compaction", "compact_threshold": 1000}]}))
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]  # type: ignore[union-attr]
    assert added[0] == (0, "compaction") and added[1][0] == 1
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    final = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in final.output] == ["compaction", "message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_compaction_trigger_is_answered_by_the_gateway(gw: Gateway, up: ScriptedUpstream, stream: bool) -> None:
    start = len(up.log)
    got = client(gw).responses.create(model="claude-n", input=[*history(), {"type": "compaction_trigger"}],  # type: ignore[list-item]
                                      stream=stream, extra_headers=session())
    response = list(got)[-1].response if stream else got  # type: ignore[union-attr, call-overload]
    assert [o.type for o in response.output] == ["compaction"]
    assert all(r.body.get("model") == "summarizer" for r in up.log[start:])  # no model turn, only a summary


@pytest.mark.parametrize("body, param", [
    ({"context_management": [{"type": "compaction", "compact_threshold": 10}]},
     "context_management.0.compact_threshold"),
    ({"context_management": [{"type": "forget_everything"}]}, "context_management.0.type"),
    ({"context_management": {"type": "compaction"}}, "context_management"),
])
def test_bad_context_management_is_a_400_naming_the_field(gw: Gateway, up: ScriptedUpstream, body: dict[str, Any],
                                                        param: str) -> None:
    start = len(up.log)
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).responses.create(model="gpt-4o", input="hi", extra_headers=session(), extra_body=body)
    assert e.value.param == param and len(up.log) == start


def test_a_trigger_not_last_is_a_400(gw: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).responses.create(model="gpt-4o", extra_headers=session(), input=[  # type: ignore[list-item]
            {"type": "compaction_trigger"}, {"role": "user", "content": "hi"}])
    assert e.value.param == "input.0"


def test_keys_rotate(tmp_path: Path) -> None:
    from ctxgate.proxy.engine.sealed import Reference, SealError, Sealer
    old, new = "old-key-0123456789abcdef", "new-key-0123456789abcdef"
    token = Sealer([old]).seal("acme", Reference("s", "cmp-1", 1e12))
    assert Sealer([new, old]).open("acme", token).ref == "cmp-1"  # the new key first, the old one still opens
    with pytest.raises(SealError):
        Sealer([new]).open("acme", token)
    with pytest.raises(SealError):
        Sealer([old]).open("other", token)
    with pytest.raises(SealError, match="expired"):
        Sealer([old]).open("acme", Sealer([old]).seal("acme", Reference("s", "cmp-1", 1.0)))


def test_native_routes_pass_the_fields_through_unless_the_tenant_says_emulate(
        upstream: ScriptedUpstream, up: ScriptedUpstream, tmp_path: Path) -> None:
    config = main_config(upstream.url, "auto", native_context={"routes": {"gpt-4o": "native"}})
    config["ctxgate"]["tenants"]["relay"]["native_context"] = {"routes": {"gpt-4o": "emulate"}}
    gateway = launch("native-mode", tmp_path, config).wait_ready()
    field = {"context_management": [{"type": "compaction", "compact_threshold": 1000}]}
    try:
        start = len(up.log)
        native = client(gateway).responses.create(model="gpt-4o", input=history(), extra_headers=session(),  # type: ignore[arg-type]
                                                  extra_body=field)
        [entry] = up.log[start:]
        assert entry.body["context_management"] == field["context_management"]  # the vendor's to apply
        assert [o.type for o in native.output] == ["message"]
        emulated = client(gateway, "relay").responses.create(model="gpt-4o", input=history(),  # type: ignore[arg-type]
                                                             extra_headers=session(), extra_body=field)
        assert [o.type for o in emulated.output] == ["compaction", "message"]
    finally:
        stop_all([gateway])


def test_on_a_native_route_the_compact_endpoint_is_still_ctxgates(
        upstream: ScriptedUpstream, up: ScriptedUpstream, tmp_path: Path) -> None:
    """docs/native-context.md, what is not done: `/responses/compact` never reaches the vendor,
    so there an item the vendor made (which its `/responses` reads) is refused."""
    config = main_config(upstream.url, "auto", native_context={"routes": {"gpt-4o": "native"}})
    gateway = launch("native-compact", tmp_path, config).wait_ready()
    vendors = {"type": "compaction", "encrypted_content": "gAAAA-made-by-the-vendor"}
    try:
        cli, start = client(gateway), len(up.log)
        item = cli.responses.compact(model="gpt-4o", input=history(), extra_headers=session()).output[-1]
        assert item.encrypted_content.startswith("ctxs1.")  # type: ignore[union-attr]
        assert not [r for r in up.log[start:] if r.door != "chat" or r.body.get("model") != "summarizer"]
        with pytest.raises(openai.BadRequestError) as e:
            cli.responses.compact(model="gpt-4o", input=[vendors, *history()], extra_headers=session())  # type: ignore[list-item]
        assert e.value.code == "invalid_encrypted_content" and e.value.param == "input.0.encrypted_content"
        start = len(up.log)
        cli.responses.create(model="gpt-4o", input=[vendors, *history()], extra_headers=session())  # type: ignore[list-item]
        assert [r.body["input"][0] for r in up.log[start:]] == [vendors]  # the vendor's to read
    finally:
        stop_all([gateway])


def test_auto_is_native_only_at_the_vendors_own_host() -> None:
    from ctxgate.proxy.context_settings import NativeContextChoice, NativeContextSettings, mode_for, vendor_applies
    assert vendor_applies("auto", "openai_compaction", "openai", None)
    assert vendor_applies("auto", "openai_compaction", "azure", "https://x.openai.azure.com/")
    assert not vendor_applies("auto", "openai_compaction", "openai", "http://127.0.0.1:8000/v1")
    assert not vendor_applies("auto", "openai_compaction", "anthropic", None)
    assert vendor_applies("auto", "anthropic_edits", "anthropic", "https://api.anthropic.com")
    assert not vendor_applies("auto", "anthropic_edits", "openai", None)
    settings = NativeContextSettings(mode="native", routes={"m": "emulate"})
    assert mode_for(settings, None, "m") == "emulate" and mode_for(settings, None, "other") == "native"
    assert mode_for(settings, NativeContextChoice(routes={"m": "native"}), "m") == "native"


def test_the_launcher_asks_codex_for_remote_compaction() -> None:
    from ctxgate.proxy.agent_wiring import wire
    local = wire(["codex", "exec", "hi"], {}, "http://127.0.0.1:1", "s-1").added_args
    remote = wire(["codex", "exec", "hi"], {}, "http://127.0.0.1:1", "s-1", remote_compaction=True).added_args
    assert 'model_providers.ctxgate.name="ctxgate"' in local
    assert 'model_providers.ctxgate.name="OpenAI"' in remote  # the name Codex's remote compaction requires


def test_a_chain_continues_from_the_compaction_it_stored(gw: Gateway, up: ScriptedUpstream) -> None:
    """The compaction item is in the stored reply: the next turn by previous_response_id is sent
    the compacted conversation and the reply after it, not the history before it."""
    cli, headers = client(gw), session()
    first = cli.responses.create(model="gpt-4o", input=history("OSPREY"), extra_headers=headers,  # type: ignore[arg-type]
                                 extra_body={"context_management": [{"type": "compaction", "compact_threshold": 1000}]})
    assert first.output[0].type == "compaction"
    start = len(up.log)
    cli.responses.create(model="gpt-4o", previous_response_id=first.id, input="and now?", extra_headers=headers)
    sent = forwarded(up, start)
    assert "OSPREY" in sent and "and now?" in sent and "ctxs1." not in sent
    assert sent.count("line 39: build output") < 8  # the old outputs stay compacted


def test_a_fallback_is_sent_the_expanded_conversation(upstream: ScriptedUpstream, up: ScriptedUpstream,
                                                      tmp_path: Path) -> None:
    from test_upstream_fallbacks import fallback_config
    gateway = launch("native-fallback", tmp_path, fallback_config(upstream.url)).wait_ready()
    try:
        cli, headers = client(gateway), session()
        item = cli.responses.compact(model="backup", input=history("HERON"), extra_headers=headers).output[-1]
        start = len(up.log)
        reply = cli.responses.create(model="primary", extra_headers=headers, input=[  # type: ignore[arg-type]
            item.model_dump(exclude_none=True), {"role": "user", "content": "the word?"}])
        assert reply.output_text
        backup = [r for r in up.log[start:] if r.body.get("model") == "gpt-4o"]
        assert backup and "HERON" in json.dumps(backup[-1].body) and "ctxs1." not in forwarded(up, start)
    finally:
        stop_all([gateway])


def test_a_gateway_without_keys_makes_one_and_keeps_it(tmp_path: Path) -> None:
    from ctxgate.proxy.engine.sealed import KEY_FILE, Reference, Sealer
    token = Sealer.from_config([], tmp_path).seal("acme", Reference("s", "cmp-1", 1e12))
    assert Sealer.from_config([], tmp_path).open("acme", token).ref == "cmp-1"  # a restart (or another worker)
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o077 == 0 and len(list(tmp_path.iterdir())) == 1
