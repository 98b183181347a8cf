"""The scripted upstream's Gemini door: `POST /v1beta/models/{model}:generateContent` and
`:streamGenerateContent` (SSE with `alt=sse`, else one JSON array), as Google answers them.

`ScriptedUpstream` (tests/upstream.py) mounts it through `GeminiUpstream(upstream).add_routes(app)`.
The model name chooses the behaviour as on the other doors: any name answers "ok"; `tools`
calls the first declared function with `{"path": "a.py"}`, its part carrying a
`thoughtSignature` as Gemini 2.5 sends one; `error-<status>` answers that status; `overflow`
(limit: half the input) or an input over the instance's `limit` answers 400 INVALID_ARGUMENT
"The input token count (N) exceeds the maximum number of tokens allowed (LIMIT)." Errors are
`{"error": {"code", "message", "status"}}`.

Every request is checked as the Gemini API checks it, and refused 400 INVALID_ARGUMENT when
it breaks a rule: roles `user` / `model`, the first turn the user's, a turn of
`functionResponse` parts right after a model turn with as many `functionCall` parts of the
same names. Logged as a `Received` with `door` "gemini" and `prompt_tokens`:

    gemini_input_tokens = 3 + c(systemInstruction texts) + sum over contents of (4 + sum over
        parts: text -> c(text); functionCall -> c(name) + c(J(args)); functionResponse ->
        c(name) + c(J(response)); anything else -> 85)
"""
from __future__ import annotations

import json
import re
from collections import Counter
from typing import TYPE_CHECKING, Any

from aiohttp import web

from upstream import REPLY, Received, _json, encode

if TYPE_CHECKING:
    from upstream import ScriptedUpstream

STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
          429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
SIGNATURE = "c2NyaXB0ZWQtc2lnbmF0dXJl"


def gemini_input_tokens(body: dict[str, Any]) -> int:
    def c(s: str) -> int:
        return len(encode(s))

    system = body.get("systemInstruction") or {}
    used = 3 + sum(c(p.get("text", "")) for p in system.get("parts") or [])
    for content in body.get("contents") or []:
        used += 4
        for p in content.get("parts") or []:
            if "text" in p:
                used += c(p["text"])
            elif "functionCall" in p:
                used += c(p["functionCall"]["name"]) + c(json.dumps(p["functionCall"].get("args") or {}))
            elif "functionResponse" in p:
                used += c(p["functionResponse"]["name"]) + c(json.dumps(p["functionResponse"].get("response")))
            else:
                used += 85
    return used


def invalid(body: Any) -> str | None:
    """Why the Gemini API would refuse the body; None when it would not."""
    contents = body.get("contents") if isinstance(body, dict) else None
    if not isinstance(contents, list) or not contents:
        return "contents is required"
    if contents[0].get("role") != "user":
        return "the first turn must be the user's"
    for i, content in enumerate(contents):
        if content.get("role") not in ("user", "model"):
            return f"contents[{i}].role must be user or model"
        answers = Counter(p["functionResponse"]["name"] for p in content["parts"] if "functionResponse" in p)
        if answers:
            before = contents[i - 1] if i else {}
            asked = Counter(p["functionCall"]["name"] for p in before.get("parts", []) if "functionCall" in p)
            if before.get("role") != "model" or asked != answers:
                return (f"Please ensure that the number of function response parts is equal to the number of "
                        f"function call parts of the function call turn (contents[{i}])")
    return None


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_json({"error": {"code": status, "message": message,
                                                             "status": STATUS.get(status, "UNKNOWN")}}),
                        content_type="application/json")


class GeminiUpstream:
    def __init__(self, upstream: "ScriptedUpstream") -> None:
        self.up = upstream

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1beta/models/{target}", self.generate)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        entry = Received(request.path_qs, raw, {k.lower(): v for k, v in request.headers.items()}, door="gemini")
        self.up.log.append(entry)
        try:
            return await self._answer(request, entry)
        finally:
            entry.done = True

    async def _answer(self, request: web.Request, entry: Received) -> web.StreamResponse:
        model, _, method = request.match_info["target"].rpartition(":")
        body = entry.body
        problem = invalid(body)
        if problem is not None:
            return _error(400, problem)
        entry.prompt_tokens = used = gemini_input_tokens(body)
        if found := re.fullmatch(r"error-(\d{3})", model):
            return _error(int(found.group(1)), f"scripted upstream error {found.group(1)}")
        limit = max(1, used // 2) if "overflow" in model else self.up.limit
        if limit and used > limit:
            return _error(400, f"The input token count ({used}) exceeds the maximum number of tokens allowed "
                               f"({limit}).")
        declared = [fn for t in body.get("tools") or [] for fn in t.get("functionDeclarations") or []]
        if "tools" in model and declared:
            parts: list[dict[str, Any]] = [{"functionCall": {"name": declared[0]["name"], "args": {"path": "a.py"}},
                                            "thoughtSignature": SIGNATURE}]
        else:
            parts = [{"text": REPLY}]
        usage = {"promptTokenCount": used, "candidatesTokenCount": 1, "totalTokenCount": used + 1}
        final = {"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}],
                 "usageMetadata": usage, "modelVersion": model, "responseId": f"gem-up-{len(self.up.log)}"}
        if method == "generateContent":
            entry.response = _json(final)
            return web.Response(body=entry.response, content_type="application/json")
        chunks = [{"candidates": [{"content": {"role": "model", "parts": [{"text": ""}]}, "index": 0}],
                   "modelVersion": model}, final]
        sse = request.query.get("alt") == "sse"
        frames = [b"data: " + _json(c) + b"\r\n\r\n" for c in chunks] if sse else \
            [b"[" + _json(chunks[0]), b",\r\n" + _json(chunks[1]), b"]"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream" if sse else "application/json"})
        await response.prepare(request)
        for frame in frames:
            entry.response += frame
            await response.write(frame)
        await response.write_eof()
        return response
