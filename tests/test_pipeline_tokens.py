"""The tokenCounter against tiktoken used directly, its cache, and head()/tail()."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.tokens import TokenCounter, TokenizerRegistry

import tiktoken  # after ctxgate.pipeline.tokens: it points tiktoken at the BPE files bundled offline

from pipeline_builders import call, calls, counter, system, tool, user
from trajectories import all_trajectories

ENC = tiktoken.get_encoding("o200k_base")


def ref_text(text: str) -> int:
    return len(ENC.encode(text, disallowed_special=()))


def ref_message(m: dict) -> int:
    """OpenAI's formula, computed independently of ctxgate."""
    n = 3
    for key, value in m.items():
        if isinstance(value, str):
            n += ref_text(value)
    if "name" in m:
        n += 1
    for tc in m.get("tool_calls") or []:
        n += 3 + ref_text(tc["function"]["name"]) + ref_text(tc["function"]["arguments"])
    return n


def ref_messages(messages: list[dict]) -> int:
    return sum(ref_message(m) for m in messages) + 3


def test_gpt4o_uses_o200k_exactly() -> None:
    c = counter()
    assert c.exact and c.name == "tiktoken:o200k_base"
    assert TokenizerRegistry().for_model("gpt-4o") .name == c.name


@pytest.mark.parametrize("text", ["", "hello", "Hello, world!", "def f(x):\n    return x * 2\n",
                                  "中文字符 and emoji 🙂🙂", "<|endoftext|> is not special here", "a" * 5000])
def test_count_text_equals_tiktoken(text: str) -> None:
    assert counter().count(text) == ref_text(text)


def test_plain_message_formula() -> None:
    c = counter()
    m = user("What is the capital of France?")
    assert c.count_structured(m) == 3 + ref_text("user") + ref_text("What is the capital of France?")
    named = {**m, "name": "alice"}
    assert c.count_structured(named) == c.count_structured(m) + ref_text("alice") + 1
    assert c.count_messages([m]) == c.count_structured(m) + 3
    assert c.count_messages([]) == 3


def test_tool_calls_are_counted() -> None:
    c = counter()
    bare = {"role": "assistant", "content": ""}
    one = calls(call("call_1", "read_file", path="/src/app.py"))
    two = calls(call("call_1", "read_file", path="/src/app.py"), call("call_2", "execute_bash", command="pytest -x"))
    args1 = one["tool_calls"][0]["function"]["arguments"]
    assert c.count_structured(one) == c.count_structured(bare) + 3 + ref_text("read_file") + ref_text(args1)
    assert c.count_structured(two) > c.count_structured(one) > c.count_structured(bare)
    assert c.count_structured(two) == ref_message(two)
    result = tool("call_1", "print('hi')")
    assert c.count_structured(result) == 3 + ref_text("tool") + ref_text("call_1") + ref_text("print('hi')")


def test_real_histories_equal_reference() -> None:
    c = counter()
    checked = 0
    for traj in all_trajectories():
        assert c.count_messages(traj.messages) == ref_messages(traj.messages), traj.name
        checked += len(traj.messages)
    assert checked > 1000


def test_fingerprint_cache_hits_on_second_count() -> None:
    c = TokenCounter("test", TokenizerRegistry().counter("tiktoken:o200k_base")._encoder)
    messages = [system(), user("count me"), *[user(f"message {i}") for i in range(10)]]
    fps = [message_fingerprint(m) for m in messages]
    first = c.count_messages(messages, fps)
    assert (c.hits, c.misses) == (0, len(messages))
    second = c.count_messages(messages, fps)
    assert second == first == ref_messages(messages)
    assert (c.hits, c.misses) == (len(messages), len(messages))
    # one new message at the end costs one miss; the rest are hits
    more = messages + [user("new")]
    c.count_messages(more, fps + [message_fingerprint(more[-1])])
    assert (c.hits, c.misses) == (2 * len(messages), len(messages) + 1)
    # without fingerprints the counter computes them: the same messages still hit
    c.count_messages(messages)
    assert (c.hits, c.misses) == (3 * len(messages), len(messages) + 1)


def test_head_and_tail_on_code() -> None:
    c = counter()
    text = "\n".join(f"    result_{i} = compute(value_{i}, factor={i})" for i in range(400))
    total = c.count(text)
    for n in (0, 1, 7, 100, 1500, total, total + 10):
        head, tail = c.head(text, n), c.tail(text, n)
        assert c.count(head) <= n and c.count(tail) <= n
        assert text.startswith(head) and text.endswith(tail)
    assert c.head(text, total) == text and c.tail(text, total) == text
    head, tail = c.head(text, 1500), c.tail(text, 1500)
    line = c.count("\n    result_399 = compute(value_399, factor=399)")
    assert 1500 - line <= c.count(head) <= 1500 and text[len(head)] == "\n", "whole lines, as many as fit"
    assert 1500 - line <= c.count(tail) <= 1500 and text[-len(tail) - 1] == "\n"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet=st.sampled_from(list("ab c\n\t{}é中文字🙂👍🏽")), max_size=80), n=st.integers(0, 40))
def test_head_tail_at_most_n_tokens_and_real_slices(text: str, n: int) -> None:
    """head() is a start of the text and tail() an end, each of at most n tokens, even when
    a token boundary falls inside a multi-byte character."""
    c = counter()
    head, tail = c.head(text, n), c.tail(text, n)
    assert c.count(head) <= n and c.count(tail) <= n
    assert text.startswith(head), (text, n, head)
    assert text.endswith(tail), (text, n, tail)


def test_estimate_counter_is_conservative() -> None:
    reg = TokenizerRegistry()
    est = reg.for_model("some-unknown-model")
    assert not est.exact and est.name == "estimate"
    text = "def main():\n    print('hello world')\n" * 20
    assert est.count(text) >= counter().count(text)
    assert est.count(est.head(text, 10)) <= 10 and est.count(est.tail(text, 10)) <= 10


@pytest.mark.parametrize("text", ["plain ascii text " * 50, "héllo wörld ✓ 日本語のテキスト " * 40, "x"])
@pytest.mark.parametrize("head,tail", [(0, 0), (1, 1), (7, 3), (100, 40), (10_000, 10_000)])
def test_head_and_tail_from_one_encoding_match_head_and_tail(text: str, head: int, tail: int) -> None:
    c = counter()
    assert c.head_and_tail(text, head, tail) == (c.head(text, head), c.tail(text, tail))


def test_count_cached_matches_count_and_hits_the_cache() -> None:
    c = TokenizerRegistry().for_model("gpt-4o")
    text = "some long tool output " * 100
    hits = c.hits
    assert c.count_cached(text) == c.count(text)
    assert c.count_cached(text) == c.count(text)
    assert c.hits == hits + 1


def test_anthropic_tool_blocks_count_what_the_model_reads() -> None:
    """A tool_result counts as its output, a tool_use as its name and input: not their JSON."""
    counter = TokenizerRegistry().for_model("gpt-4o")
    output = 'line with "quotes" and \\ slashes\n' * 40
    as_text = counter.count_structured({"role": "tool", "tool_call_id": "c", "content": output})
    as_block = counter.count_structured({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_0123456789", "content": output}]})
    assert abs(as_block - as_text) <= 3
    use = {"type": "tool_use", "id": "toolu_0123456789", "name": "bash", "input": {"command": "ls -la"}}
    assert counter.count_structured({"role": "assistant", "content": [use]}) == (
        3 + counter.count("assistant") + 3 + counter.count("bash") + counter.count('{"command":"ls -la"}'))
