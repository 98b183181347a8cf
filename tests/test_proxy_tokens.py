"""Token counts: X-Ctx-Tokens-In against references computed here with the tokenizers
themselves, and the TokenCounter of pipeline/tokens.py as a unit."""
from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from tokenizers import Tokenizer

from clients import MESSAGES, TOOLS, client, estimate_tokens, reference_tokens
from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.tokens import TiktokenEncoder, TokenCounter, TokenizerRegistry
from servers import METRICS_HEADERS, Gateway
from upstream import ScriptedUpstream, prompt_tokens

O200K = tiktoken.get_encoding("o200k_base")
TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'}}


def _deepseek_tokenizer() -> Path:
    spec = importlib.util.find_spec("litellm")
    assert spec is not None and spec.origin
    path = Path(spec.origin).parent / "litellm_core_utils" / "tokenizers" / "deepseek_tokenizer.json"
    assert path.is_file(), path
    return path


def _tokens_in(gw: Gateway, model: str, messages: list[dict[str, Any]], **params: Any) -> tuple[int, str]:
    raw = client(gw).chat.completions.with_raw_response.create(model=model, messages=messages, **params)
    raw.parse()
    return int(raw.headers["x-ctx-tokens-in"]), raw.headers["x-ctx-tokenizer"]


def _metric(text: str, name: str, model: str) -> float:
    found = re.search(rf'^{name}_total\{{model="{re.escape(model)}"\}} ([0-9.e+]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


# -- through the gateway --------------------------------------------------------------

def test_tokens_in_matches_tiktoken_reference(gateway: Gateway, up: ScriptedUpstream) -> None:
    tokens, tokenizer = _tokens_in(gateway, "gpt-4o", MESSAGES)
    assert tokenizer == "tiktoken:o200k_base"
    assert tokens == reference_tokens(MESSAGES)
    assert tokens == up.chats()[-1].prompt_tokens  # and the upstream's own usage agrees


@pytest.mark.parametrize("text", ["", "x", "naïve café 東京 🚀", "def f(x):\n    return x * 2\n" * 50,
                                  "<|endoftext|> is only text here"])
def test_tokens_in_for_varied_text(gateway: Gateway, up: ScriptedUpstream, text: str) -> None:
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": text or "-"},
                {"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    assert _tokens_in(gateway, "gpt-4o", messages)[0] == reference_tokens(messages)


def test_tools_add_their_schema(gateway: Gateway, up: ScriptedUpstream) -> None:
    plain, _ = _tokens_in(gateway, "gpt-4o", MESSAGES)
    with_tools, _ = _tokens_in(gateway, "gpt-4o", MESSAGES, tools=TOOLS)
    schema = TokenizerRegistry().for_model("gpt-4o").count_tools(TOOLS)
    assert schema > len(O200K.encode(TOOLS[0]["function"]["description"]))
    assert with_tools == plain + schema


def test_tool_calls_are_counted(gateway: Gateway, up: ScriptedUpstream) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"}]
    tokens, _ = _tokens_in(gateway, "gpt-4o", messages, tools=TOOLS)
    fn = TOOL_CALL["function"]
    call_tokens = 3 + len(O200K.encode(fn["name"])) + len(O200K.encode(fn["arguments"]))
    schema = TokenizerRegistry().for_model("gpt-4o").count_tools(TOOLS)
    assert tokens == reference_tokens(messages) + call_tokens + schema


def test_deepseek_uses_its_own_tokenizer(gateway: Gateway, up: ScriptedUpstream) -> None:
    path = _deepseek_tokenizer()
    tok = Tokenizer.from_file(str(path))
    tokens, tokenizer = _tokens_in(gateway, "deepseek-chat", MESSAGES)
    assert tokenizer.startswith("hf:") and tokenizer.endswith("deepseek_tokenizer.json")
    expected = prompt_tokens(MESSAGES, lambda s: len(tok.encode(s, add_special_tokens=False).ids))
    assert tokens == expected != reference_tokens(MESSAGES)
    assert up.chats()[-1].body["model"] == "deepseek-chat"
    assert up.chats()[-1].body["messages"] == MESSAGES


def test_unknown_model_is_estimated_and_counted(gateway: Gateway, up: ScriptedUpstream) -> None:
    _, before = gateway.get("/metrics", METRICS_HEADERS)
    tokens, tokenizer = _tokens_in(gateway, "mystery-model", MESSAGES)
    assert tokenizer == "estimate"
    assert tokens == estimate_tokens(MESSAGES) >= reference_tokens(MESSAGES)
    _, after = gateway.get("/metrics", METRICS_HEADERS)
    assert _metric(after, "ctxgate_token_estimates", "mystery-model") == \
        _metric(before, "ctxgate_token_estimates", "mystery-model") + 1


def test_calibration_sees_no_difference_for_exact_counts(gateway: Gateway, up: ScriptedUpstream) -> None:
    def figures() -> list[float]:
        """How many diffs were < 0, <= 0, and in all (the histogram has no _sum: its buckets go negative)."""
        status, text = gateway.get("/metrics", METRICS_HEADERS)
        assert status == 200
        names = ('bucket{le="-1.0",model="gpt-4o"}', 'bucket{le="0.0",model="gpt-4o"}', 'count{model="gpt-4o"}')
        got = [re.search(rf"^ctxgate_calibration_diff_tokens_{re.escape(n)} ([0-9.e+]+)$", text, re.M) for n in names]
        return [float(g.group(1)) if g else 0.0 for g in got]

    below, at_most, count = figures()
    _tokens_in(gateway, "gpt-4o", MESSAGES)  # upstream prompt_tokens - ours == 0
    assert figures() == [below, at_most + 1, count + 1]


# -- TokenCounter as a unit -------------------------------------------------------------

@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter("tiktoken:o200k_base", TiktokenEncoder("o200k_base"))


def test_count_is_tiktoken(counter: TokenCounter) -> None:
    for text in ("", "hello world", "東京 🚀", "<|endoftext|>", "x" * 5000):
        assert counter.count(text) == len(O200K.encode(text, disallowed_special=()))


def test_count_messages_is_openais_formula(counter: TokenCounter) -> None:
    assert counter.count_messages(MESSAGES) == reference_tokens(MESSAGES)
    assert counter.count_messages([]) == 3


def test_count_structured_with_tool_calls(counter: TokenCounter) -> None:
    message = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL, TOOL_CALL]}
    fn = TOOL_CALL["function"]
    per_call = 3 + len(O200K.encode(fn["name"])) + len(O200K.encode(fn["arguments"]))
    assert counter.count_structured(message) == 3 + len(O200K.encode("assistant")) + 2 * per_call
    named = {"role": "user", "name": "bob", "content": "hi"}
    assert counter.count_structured(named) == 3 + 1 + sum(len(O200K.encode(v)) for v in named.values())


def test_cache_hits_per_fingerprint() -> None:
    fresh = TokenCounter("tiktoken:o200k_base", TiktokenEncoder("o200k_base"))
    fps = [message_fingerprint(m) for m in MESSAGES]
    first = fresh.count_messages(MESSAGES, fps)
    assert (fresh.hits, fresh.misses) == (0, len(MESSAGES))
    assert fresh.count_messages(MESSAGES, fps) == first
    assert (fresh.hits, fresh.misses) == (len(MESSAGES), len(MESSAGES))
    longer = [*MESSAGES, {"role": "user", "content": "one more"}]
    fresh.count_messages(longer, [message_fingerprint(m) for m in longer])
    assert (fresh.hits, fresh.misses) == (2 * len(MESSAGES), len(MESSAGES) + 1)


def test_registry_chooses_tokenizers() -> None:
    seen: list[str] = []
    registry = TokenizerRegistry(on_estimate=seen.append)
    assert registry.for_model("gpt-4o").name == "tiktoken:o200k_base"
    assert registry.for_model("gpt-4", "openai/gpt-4").name == "tiktoken:cl100k_base"
    assert registry.for_model("deepseek-chat").name == f"hf:{_deepseek_tokenizer()}"
    unknown = registry.for_model("mystery-model")
    assert unknown.name == "estimate" and not unknown.exact and seen == ["mystery-model"]
    assert unknown.count("abcd") == math.ceil(4 / 3)
    assert registry.for_model("gpt-4o") is registry.for_model("gpt-4o")


def test_head_and_tail_stay_within_budget(counter: TokenCounter) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 40
    head, tail = counter.head(text, 25), counter.tail(text, 25)
    assert text.startswith(head) and text.endswith(tail)
    assert counter.count(head) <= 25 and counter.count(tail) <= 25 and len(head) > 50
