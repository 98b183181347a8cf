"""Client-side helpers of the integration tests: the official SDK, raw HTTP, references."""
from __future__ import annotations

import json
import math
import re
from typing import Any, Iterator

import httpx
import openai

from servers import KEYS, METRICS_HEADERS, Gateway
from upstream import encode, prompt_tokens

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello in three languages, please. " * 20},
    {"role": "assistant", "content": "Hello, hola, bonjour."},
    {"role": "user", "name": "carol", "content": "Now in two."},
]
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
CTX_HEADERS = ("x-ctx-session", "x-ctx-tokens-in", "x-ctx-tokens-out", "x-ctx-levels", "x-ctx-overhead-ms",
               "x-ctx-tokenizer")


def counted_beside(gw: Gateway) -> float:
    """`ctxgate_counts_beside_upstream_total`: the turns forwarded before they were counted."""
    status, text = gw.get("/metrics", METRICS_HEADERS)
    assert status == 200
    found = re.search(r"^ctxgate_counts_beside_upstream_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def client(gw: Gateway, key: str = KEYS["acme"]) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url, api_key=key, max_retries=0, timeout=30)


def async_client(gw: Gateway, key: str = KEYS["acme"]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url, api_key=key, max_retries=0, timeout=30)


def post(gw: Gateway, body: Any = None, *, raw: bytes | None = None, headers: dict[str, str] | None = None,
         key: str | None = KEYS["acme"], path: str = "/v1/chat/completions") -> httpx.Response:
    """POST a body (JSON-encoded, or `raw` bytes as they are) and read the whole answer."""
    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    return httpx.post(gw.base + path, content=raw if raw is not None else json.dumps(body).encode(), headers=sent,
                      timeout=30)


def reference_tokens(messages: list[dict[str, Any]]) -> int:
    """OpenAI's formula over tiktoken's o200k_base, independently of ctxgate."""
    return prompt_tokens(messages, lambda s: len(encode(s)))


def estimate_tokens(messages: list[dict[str, Any]]) -> int:
    """The estimate ctxgate documents for a model with no known tokenizer: UTF-8 bytes / 3, in the same formula."""
    return prompt_tokens(messages, lambda s: math.ceil(len(s.encode()) / 3))


def assert_error_shape(resp: httpx.Response, status: int | tuple[int, ...], code: str | None = None) -> dict[str, Any]:
    """An OpenAI error object with the expected status (and code); returns the `error` dict."""
    wanted = (status,) if isinstance(status, int) else status
    assert resp.status_code in wanted, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert isinstance(err, dict) and isinstance(err["message"], str) and err["message"], err
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["type"], str) and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def ctx_headers(headers: Any) -> dict[str, str]:
    return {k: headers[k] for k in CTX_HEADERS if k in headers}


def agent_turns(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The request a recorded agent sent before each of its replies."""
    return [messages[:i] for i, m in enumerate(messages) if i >= 2 and m["role"] == "assistant"]


def feasible_turns(turns: list[list[dict[str, Any]]], limit: int) -> list[list[dict[str, Any]]]:
    """The turns a gateway can serve under `limit`: no compaction changes the instructions,
    the task or the last message, so a turn where they alone are over the limit (with a
    tenth to spare for ctxgate's notes) is refused with CONTEXT_EXHAUSTED, by design."""
    def pinned(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        return messages[:first_user + 1] + messages[-1:]
    return [t for t in turns if prompt_tokens(pinned(t)) <= 0.9 * limit]


def strings(value: Any) -> Iterator[str]:
    """Every string a JSON value holds, keys aside."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)
