"""Consolidation through a real gateway against an upstream that enforces a small context
limit: every call fits the dream model's limit (batches counted with the route's counter),
so a session that fetched many documents is consolidated, not refused and stored raw."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from clients import client, post
from servers import KEYS, _model, main_config, start_gateways
from upstream import ScriptedUpstream

LIMIT = 1500


def _fetches(n: int) -> list[dict[str, Any]]:
    """A conversation in which the agent fetched `n` documents of about 450 tokens each."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You research."},
                                      {"role": "user", "content": "Read the docs."}]
    for i in range(n):
        url = f"https://docs.example.com/page-{i}"
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "web_fetch",
                                                              "arguments": json.dumps({"url": url})}}]},
                     {"role": "tool", "tool_call_id": f"c{i}",
                      "content": f"# Page {i}\n" + " ".join(f"fact{i}-{j} holds" for j in range(220))}]
    return messages


def test_a_session_of_many_documents_is_consolidated_in_calls_that_fit_the_limit(tmp_path: Path) -> None:
    upstream = ScriptedUpstream(limit=LIMIT).start()
    config = main_config(upstream.url, "auto", memory={"dream_model": "small-summarizer", "end_timeout_s": 30})
    config["model_list"].append(_model("small-summarizer", f"{upstream.url}/v1", max_input_tokens=LIMIT))
    # Counted as the scripted upstream counts (o200k), as for a provider whose tokenizer ctxgate knows.
    config["ctxgate"]["tokenizers"] = [{"pattern": "small-summarizer", "tokenizer": "tiktoken:o200k_base"}]
    gw = start_gateways({"batches": (tmp_path, config)})["batches"]
    try:
        messages = _fetches(12)
        sdk = client(gw, KEYS["acme"])
        # The upstream refuses what is over its limit: the turn goes in slices that each fit,
        # and the session's buffer sees every document once.
        for end in range(4, len(messages) + 1, 2):
            window = messages[:2] + messages[max(2, end - 2):end]
            sdk.chat.completions.create(model="gpt-4o", messages=window, user="u1",
                                        extra_headers={"X-Ctx-Session": "docs"})
        ended = post(gw, {}, path="/v1/ctx/sessions/docs/end")
        assert ended.status_code == 200, ended.text
        event = ended.json()["auto_dream"]
        assert event["consolidated"] is True, event
        calls = [r for r in upstream.log if isinstance(r.body, dict) and r.body.get("model") == "small-summarizer"]
        assert len(calls) > 1  # one call would have held ~5,400 tokens of entries
        assert all(r.prompt_tokens is not None and r.prompt_tokens <= LIMIT for r in calls), \
            [r.prompt_tokens for r in calls]
        sent = " ".join(json.dumps(r.body["messages"]) for r in calls)
        assert all(f"Page {i}" in sent for i in range(12))
        listed = httpx.get(gw.base + "/v1/ctx/memory?category=reference", timeout=30,
                           headers={"Authorization": f"Bearer {KEYS['acme']}"}).json()["data"]
        assert listed and all(e["quarantine"] is None for e in listed)
        assert all(p["source"] == "document" and p["session"] == "docs" for e in listed for p in e["provenance"])
    finally:
        gw.stop()
        upstream.stop()
