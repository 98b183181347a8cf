"""The (compacted) neutral conversation back into Gemini's `systemInstruction` and `contents`.

What the pipeline left alone goes back as the client sent it (`gemini_model.ORIGIN`). Every
system message (the client's instruction, ctxgate's fixed notice) goes into
`systemInstruction`; ctxgate's notes, restored state and memory (user-role, tagged: quoted
data) become text parts of user turns, never merged into the client's newest user turn.
Then what the Gemini API refuses is repaired: roles that do not alternate (same-role turns
merged; a signed model turn takes no other turn's parts), a `functionCall` whose
`functionResponse` is not in the next turn or a response whose call is not in the turn
before (made text; a signed turn with an unanswered call is dropped whole), a first turn
that is the model's. A model turn carrying a `thoughtSignature` that the pipeline edited is
dropped whole: its signature covers it as sent.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import orjson

from ctxgate.pipeline.notes import TAG
from .gemini_model import ORIGIN, Message, Part, assistant_view, result_text, signed, system_text, user_content

Content = dict[str, Any]
COMPACTED_OPENING = "[ctxgate: the earlier conversation was compacted.]"
CONTEXT_ACK = "[ctxgate: the quoted context above is noted as data.]"
_NOTE = "ctxgate_note"
"""Marks, while rendering, a user turn that is ctxgate's own (notes may merge into it)."""


def render(body: dict[str, Any], neutral: list[Message], sent: list[Content] | None = None
           ) -> tuple[dict[str, Any] | None, list[Content]]:
    """`systemInstruction` and `contents` for the forwarded body. `sent`: the contents the
    messages were read from (`ReadContents.contents`: an earlier request's objects for the
    turns it had), else the body's."""
    systems = [m for m in neutral if m.get("role") == "system"]
    original = body.get("systemInstruction")
    if [m.get(ORIGIN) for m in systems] == ([original] if original and system_text(original) else []) \
            and all(m.get("content") == system_text(m[ORIGIN]) for m in systems):
        system = original
    else:
        system = {"parts": [{"text": str(m.get("content"))} for m in systems]} if systems else None
    turns: list[Content] = []
    for m in neutral:
        if m.get("role") != "system" and (content := _content_of(m, len(turns))) is not None:
            turns.append(content)
    newest = next((id(t) for t in reversed(turns) if t["role"] == "user" and _NOTE not in t), None)
    return system, _as_sent(body["contents"] if sent is None else sent, _valid(turns, newest))


def _as_sent(sent: list[Content], turns: list[Content]) -> list[Content]:
    """Each rendered turn that holds exactly the parts of one of the client's turns, as that
    turn (a user turn was read as several messages, and is put together again)."""
    owner = {id(p): c for c in sent for p in c["parts"]}
    out = []
    for t in turns:
        found = owner.get(id(t["parts"][0])) if t["parts"] else None
        if found is not None and len(found["parts"]) == len(t["parts"]) \
                and all(a is b for a, b in zip(found["parts"], t["parts"])):
            out.append(found)
        else:
            out.append({k: v for k, v in t.items() if k != _NOTE} if _NOTE in t else t)
    return out


def _content_of(m: Message, at: int) -> Content | None:
    role, origin = m.get("role"), m.get(ORIGIN)
    if role == "assistant":
        return _model_turn(m, origin if isinstance(origin, dict) else None, at)
    if role == "tool":
        return {"role": "user", "parts": [_response_part(m, origin if isinstance(origin, dict) else None)]}
    if isinstance(origin, list) and m.get("content") == user_content(origin):
        return {"role": "user", "parts": origin}
    turn: Content = {"role": "user", "parts": _text_parts(m.get("content"))}
    if TAG in m:
        turn[_NOTE] = True
    return turn


def _model_turn(m: Message, origin: Content | None, at: int) -> Content | None:
    if origin is not None:
        # The index a call's id was made from is the client's; compare with the turn's own view.
        text, calls = assistant_view(origin, _index_of(origin, m))
        if (m.get("content") or None, m.get("tool_calls") or []) == (text, calls):
            return origin
        if signed(origin):
            return None
    parts: list[Part] = [{"text": str(m["content"])}] if m.get("content") else []
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        try:
            args = orjson.loads(fn.get("arguments") or "{}")
        except orjson.JSONDecodeError:
            args = {"arguments": fn.get("arguments")}
        part: Part = {"functionCall": {"name": fn.get("name"), "args": args if isinstance(args, dict) else {}}}
        if not str(call.get("id", "")).startswith("gc"):
            part["functionCall"]["id"] = call.get("id")
        parts.append(part)
    return {"role": "model", "parts": parts or [{"text": ""}]}


def _index_of(origin: Content, m: Message) -> int:
    """The turn index its synthetic call ids were made with (`gc<i>_<k>`)."""
    for call in m.get("tool_calls") or []:
        found = str(call.get("id", ""))
        if found.startswith("gc") and "_" in found:
            head = found[2:].split("_", 1)[0]
            if head.isdigit():
                return int(head)
    return -1


def _response_part(m: Message, origin: Part | None) -> Part:
    if origin is not None and m.get("content") == result_text(origin["functionResponse"]["response"]):
        return origin
    response: dict[str, Any] = dict(origin["functionResponse"]) if origin is not None \
        else {"name": str(m.get("name") or "tool")}  # ctxgate's own (the expansion's answers) are named
    response["response"] = {"output": _plain(m.get("content"))}
    if origin is None and not str(m.get("tool_call_id", "")).startswith(("gc", "gr")):
        response["id"] = m.get("tool_call_id")
    return {"functionResponse": response}


def _plain(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _text_parts(content: Any) -> list[Part]:
    if isinstance(content, list):
        parts = [{"text": str(p.get("text") or "")} for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return parts or [{"text": ""}]
    return [{"text": _plain(content)}]


def _valid(turns: list[Content], newest: int | None) -> list[Content]:
    while True:
        repaired = _paired(_alternating(turns, newest))
        if repaired == turns:
            break
        turns = repaired
    if turns and turns[0]["role"] == "model":
        turns = [{"role": "user", "parts": [{"text": COMPACTED_OPENING}]}, *turns]
    return turns


def _alternating(turns: list[Content], newest: int | None) -> list[Content]:
    out: list[Content] = []
    for t in turns:
        prev = out[-1] if out else None
        if prev is None or prev["role"] != t["role"]:
            out.append(t)
        elif t["role"] == "user" and id(t) == newest and _NOTE in prev and not _responses(t):
            out += [{"role": "model", "parts": [{"text": CONTEXT_ACK}]}, t]  # the newest turn takes no note
        elif t["role"] == "user":
            merged: Content = {"role": "user", "parts": [*prev["parts"], *t["parts"]]}
            if _NOTE in prev and _NOTE in t:
                merged[_NOTE] = True
            out[-1] = merged
            if id(t) == newest or id(prev) == newest:
                newest = id(merged)
        elif signed(prev) or signed(t):
            out[-1] = t  # a signed turn cannot take another's parts: the later turn stands
        else:
            out[-1] = {"role": "model", "parts": [*prev["parts"], *t["parts"]]}
    return out


def _names(turn: Content | None, kind: str) -> Counter[str]:
    """How many calls (or responses) of each name a turn holds: Gemini pairs them by name and order."""
    return Counter(str(p[kind].get("name")) for p in (turn or {}).get("parts", []) if kind in p)


def _responses(turn: Content) -> bool:
    return any("functionResponse" in p for p in turn["parts"])


def _paired(turns: list[Content]) -> list[Content]:
    out: list[Content] = []
    for i, t in enumerate(turns):
        before = turns[i - 1] if i > 0 else None
        after = turns[i + 1] if i + 1 < len(turns) else None
        if t["role"] == "user" and _responses(t):
            asked = _names(before, "functionCall") if before and before["role"] == "model" else Counter()
            t = _textified(t, "functionResponse", asked)
        elif t["role"] == "model" and after is not None:
            answered = _names(after, "functionResponse") if after["role"] == "user" else Counter()
            if _names(t, "functionCall") - answered:
                if signed(t):
                    continue
                t = _textified(t, "functionCall", answered)
        out.append(t)
    return out


def _textified(turn: Content, kind: str, partners: Counter[str]) -> Content:
    """The turn with its `kind` parts that have no partner left (in order) as text; the same
    object when every one has."""
    left, parts, changed = Counter(partners), [], False
    for p in turn["parts"]:
        if kind in p and left[name := str(p[kind].get("name"))] > 0:
            left[name] -= 1
        elif kind in p:
            p, changed = _as_text(p, kind), True
        parts.append(p)
    return {**turn, "parts": parts} if changed else turn


def _as_text(part: Part, kind: str) -> Part:
    inner = part[kind]
    if kind == "functionCall":
        return {"text": f"[tool call {inner.get('name')} {orjson.dumps(inner.get('args') or {}).decode()}]"}
    return {"text": f"[tool result {inner.get('name')}]\n{result_text(inner.get('response') or {})}"}
