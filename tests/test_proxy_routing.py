"""Wildcard model names: an agent that chooses its own model names reaches the route that matches."""
from typing import Iterator

import openai
import pytest

from servers import UPSTREAM_KEY, Gateway, launch, stop_all
from upstream import ScriptedUpstream


@pytest.fixture(scope="module")
def wildcard_gateway(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = f"{upstream.url}/v1"
    config = {"model_list": [
        {"model_name": "gpt-4o", "litellm_params": {"model": "openai/gpt-4o", "api_base": base,
                                                    "api_key": UPSTREAM_KEY}},
        {"model_name": "team-*", "litellm_params": {"model": "openai/up-*", "api_base": base,
                                                    "api_key": UPSTREAM_KEY}, "model_info": {"max_input_tokens": 5000}},
    ]}
    gw = launch("wildcard", tmp_path_factory.mktemp("wildcard"), config).wait_ready()
    yield gw
    stop_all([gw])


def test_a_wildcard_entry_serves_the_names_it_matches(wildcard_gateway: Gateway, up: ScriptedUpstream) -> None:
    client = openai.OpenAI(base_url=wildcard_gateway.url, api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="team-alpha", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "ok"
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert [c.body["model"] for c in up.chats()] == ["up-alpha", "gpt-4o"]  # the exact entry wins over `*`
    models = [m.id for m in client.models.list().data]
    assert models == ["gpt-4o", "team-*"]


def test_a_name_no_entry_matches_is_404(wildcard_gateway: Gateway, up: ScriptedUpstream) -> None:
    client = openai.OpenAI(base_url=wildcard_gateway.url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="team-"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    assert up.chats() == []


def test_the_wildcard_entrys_limit_applies(wildcard_gateway: Gateway, up: ScriptedUpstream) -> None:
    client = openai.OpenAI(base_url=wildcard_gateway.url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context limit of 5000"):
        client.chat.completions.create(model="team-beta", messages=[{"role": "user", "content": "word " * 6000}])
    assert up.chats() == []


def test_an_anthropic_route_without_a_key_takes_the_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Messages door calls Anthropic itself: a model_list entry written for litellm
    (the key in ANTHROPIC_API_KEY) must reach it with that key."""
    from ctxgate.proxy.config import Config
    from ctxgate.proxy.upstream.routing import Router

    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-from-env")
    config = Config.model_validate({"model_list": [{"model_name": "claude-*",
                                                    "litellm_params": {"model": "anthropic/claude-*"}}]})
    route = Router(config).resolve("claude-sonnet-4-5")
    assert route.provider == "anthropic" and route.api_key == "sk-ant-from-env"
