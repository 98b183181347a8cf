"""Gemini generateContent bodies: checked on the way in, read into the neutral model.

The pipeline reads chat-completions messages, so `conversation_of` turns Gemini's `contents`
into them, each message keeping under `ORIGIN` what it came from (rendering gives back what
the pipeline left alone byte for byte, `gemini_render.py`):

- `systemInstruction` -> a leading system message (its text);
- a `model` turn -> ONE assistant message: its text, a tool call per `functionCall` part, and
  the whole turn as sent (a turn with a `thoughtSignature` is kept whole or dropped whole);
- a `user` turn -> a tool message per `functionResponse` part (the part as sent), then a user
  message of its other parts, if any (their list as sent).

A call without an `id` is named by where it stands (`gc<turn>_<k>`), so the same history
reads the same every turn; a response takes the id of the call it answers (its own `id`,
else the first call of its name in the turn before not answered yet).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import Annotated, Required, TypedDict

from ctxgate.memory.capture import ROOT_MESSAGES, workspace_root
from ctxgate.pipeline.tokens import TOKENS_PER_TOOL, json_bound
from .validation import check_nesting, validate_slices, validation_error
from ..errors import ErrorKind, GatewayError

Message = dict[str, Any]
Part = dict[str, Any]
ORIGIN = "gemini"
"""The key under which a neutral message keeps the Gemini content or parts it came from."""
_RESULT_KEYS = ("output", "result", "content")
DECLARATION_ALLOWANCE = TOKENS_PER_TOOL + 64
"""Tokens a function declaration may count beyond its JSON's bytes: the per-tool tokens, and
`"description":""` and `"parameters":{"type":"object","properties":{}}` where it has neither."""


# TypedDicts, not models: pydantic checks a dict against one ~30x faster than it builds a
# model instance, and only the check is wanted (the body itself is what is read on).
_STRICT = with_config(ConfigDict(strict=True))
Name = Annotated[str, Field(min_length=1)]


@_STRICT
class _Call(TypedDict, total=False):
    name: Required[Name]
    args: dict[str, Any] | None
    id: str | None


@_STRICT
class _Response(TypedDict, total=False):
    name: Required[Name]
    response: Required[dict[str, Any]]
    id: str | None


@_STRICT
class _Part(TypedDict, total=False):
    text: str | None
    thought: bool | None
    thoughtSignature: str | None
    functionCall: _Call | None
    functionResponse: _Response | None
    inlineData: dict[str, Any] | None
    fileData: dict[str, Any] | None


@_STRICT
class _Content(TypedDict, total=False):
    role: Literal["user", "model"] | None
    parts: Required[Annotated[list[_Part], Field(min_length=1)]]


@_STRICT
class _System(TypedDict, total=False):
    role: str | None
    parts: Required[list[_Part]]


@_STRICT
class _Declaration(TypedDict, total=False):
    name: Required[Name]


@_STRICT
class _Tool(TypedDict, total=False):
    functionDeclarations: list[_Declaration] | None


@_STRICT
class _Request(TypedDict, total=False):
    contents: Required[Annotated[list[Any], Field(min_length=1)]]
    """Each a `_Content`, checked from the first new one on (`validate_request`)."""
    systemInstruction: _System | None
    tools: list[_Tool] | None
    toolConfig: dict[str, Any] | None
    generationConfig: dict[str, Any] | None
    safetySettings: list[dict[str, Any]] | None
    cachedContent: str | None


_REQUEST = TypeAdapter(_Request)
_CONTENTS = TypeAdapter(list[_Content])
_UNSEEN = object()
"""A field the last request did not have (`validate_request`): never the object a body holds."""


@dataclass
class ReadContents:
    """A request's system instruction and `contents` (checked) and the neutral messages they
    became: kept with the session's history, so that its next request, which starts with the
    same turns, is checked and read from its first new turn on (`known_turns`, `read_contents`)."""
    system: Any
    contents: list[Any]
    """The objects the messages' `ORIGIN`s are: the earlier requests' for the turns they had."""
    messages: list[Message]
    known: int = 0
    """How many leading turns were the session's last request's, their messages reused."""
    chat: Any = None
    """The messages' JSON as a chat route is sent them, once asked (`gemini_chat.ChatJson`):
    made for the new messages only, the earlier ones' taken from the last request's."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The request's other fields (`tools`, `generationConfig`, ...), checked: a next request
    that resends them as they were has the same objects (`ResentBodies`), not checked again."""
    tools: list[dict[str, Any]] | None = None
    """`fields["tools"]` as chat tools, once made (`gemini.GeminiDoor`)."""
    root: str | None = None
    """The workspace root its leading messages name, once looked for (`rooted`, `workspace_root`)."""
    rooted: bool = False

    def workspace_root(self, messages: list[Message]) -> str | None:
        """`capture.workspace_root` of `messages` (these messages), looked for once: a next
        request that keeps the leading messages it is looked for in keeps it (`read_contents`)."""
        if not self.rooted:
            self.root, self.rooted = workspace_root(messages), True
        return self.root


def known_turns(last: Any, contents: Any) -> int:
    """How many leading turns of `contents` the session's last request had (0: it is not its
    continuation: another conversation, an earlier turn edited, a retry of an earlier turn)."""
    if not isinstance(last, ReadContents) or not isinstance(contents, list):
        return 0
    n = len(last.contents)
    return n if len(contents) >= n and contents[:n] == last.contents else 0


def validate_request(body: dict[str, Any], start: int = 0, checked: dict[str, Any] | None = None,
                     nested: bool = True) -> None:
    """A clear 400 naming the field for a body the door cannot read; other fields pass as they are
    (how deep they nest was checked as the body was read: `read_json_body`). Turns before
    `start` were checked when they arrived, and so were the fields that are the very objects
    (`is`) `checked` holds: the session's last request's, resent as they were. `nested`: False
    when the body is known not to nest too deep (`nesting.shallow`)."""
    if checked:
        body = {k: v for k, v in body.items() if k == "contents" or checked.get(k, _UNSEEN) is not v}
    try:
        _REQUEST.validate_python(body)
    except ValidationError as e:
        raise validation_error(e, 0) from None
    if nested:
        check_nesting(body["contents"][start:], 2)
    validate_slices(_CONTENTS, body["contents"][start:], start, "contents")
    for i, content in enumerate(body["contents"][start:], start):
        if content.get("role") == "user" and any("functionCall" in p for p in content["parts"]):
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"contents.{i}.parts: a functionCall part belongs in a "
                               "model turn", param=f"contents.{i}.parts", code="invalid_request")
        if content.get("role") == "model" and any("functionResponse" in p for p in content["parts"]):
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"contents.{i}.parts: a functionResponse part belongs in "
                               "a user turn", param=f"contents.{i}.parts", code="invalid_request")


def count_bound(raw: bytes, body: dict[str, Any]) -> int:
    """At least what a byte-bounded counter counts for the conversation and tools read from this
    body. `tokens.json_bound`'s reasoning holds for Gemini's JSON: every string counted is in it
    (a call's `args` re-serialised compact), and the keys and braces around each turn, part and
    call outweigh the fixed tokens counted for the message, call or made-up id read from it. A
    declaration's chat form may add what its JSON lacks: an empty description and schema."""
    tools = body.get("tools")
    declarations = sum(len(t.get("functionDeclarations") or []) for t in tools if isinstance(t, dict)) \
        if isinstance(tools, list) else 0
    return json_bound(raw) + DECLARATION_ALLOWANCE * declarations


def counted_body(body: dict[str, Any]) -> dict[str, Any]:
    """countTokens takes `contents` (and tools, systemInstruction) or a whole `generateContentRequest`."""
    inner = body.get("generateContentRequest")
    if inner is None:
        return body
    if not isinstance(inner, dict):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "generateContentRequest: must be an object",
                           param="generateContentRequest", code="invalid_request")
    return inner


def system_text(system: dict[str, Any]) -> str:
    return "\n".join(p["text"] for p in system.get("parts") or [] if isinstance(p.get("text"), str))


def conversation_of(body: dict[str, Any]) -> list[Message]:
    """The body's system instruction and contents in the neutral model."""
    return read_contents(body).messages


def read_contents(body: dict[str, Any], last: ReadContents | None = None, known: int = 0) -> ReadContents:
    """`conversation_of`, and what a next turn reads on from. `known`: how many leading turns
    `last` had (`known_turns`); their messages are `last`'s own, when the system instruction is
    the same too (a turn reads the same whatever follows it)."""
    system = body.get("systemInstruction")
    contents = body["contents"]
    if last is not None and known and known == len(last.contents) and system == last.system:
        out = list(last.messages)
        before = last.contents[known - 1]
        # The answers of the first new turn name the calls of the last known one.
        calls = [(c["id"], c["function"]["name"]) for c in out[-1].get("tool_calls", [])] \
            if before.get("role") == "model" else []
        rooted = last.rooted and len(last.messages) >= ROOT_MESSAGES  # its leading messages are last's
        return ReadContents(last.system, last.contents + contents[known:], _read(contents, known, calls, out),
                            known, last.chat, _fields(body), root=last.root, rooted=rooted)
    out = []
    if system and system_text(system):
        out.append({"role": "system", "content": system_text(system), ORIGIN: system})
    return ReadContents(system, contents, _read(contents, 0, [], out), fields=_fields(body))


def _fields(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "contents"}


def _read(contents: list[Any], start: int, calls: list[tuple[str, str]], out: list[Message]) -> list[Message]:
    """`out` with the messages of `contents[start:]`; `calls`: the turn before's calls not answered yet: (id, name)."""
    for i in range(start, len(contents)):
        content = contents[i]
        if content.get("role") == "model":
            message = assistant_message(content, i)
            calls = [(c["id"], c["function"]["name"]) for c in message.get("tool_calls", [])]
            out.append(message)
            continue
        rest = []
        for k, part in enumerate(content["parts"]):
            if "functionResponse" not in part:
                rest.append(part)
                continue
            response = part["functionResponse"]
            call_id = _answered(calls, response.get("id"), response["name"]) or f"gr{i}_{k}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": result_text(response["response"]),
                        ORIGIN: part})
        calls = []
        if rest:
            out.append({"role": "user", "content": user_content(rest), ORIGIN: rest})
    return out


def _answered(calls: list[tuple[str, str]], own_id: Any, name: str) -> str | None:
    for j, (call_id, call_name) in enumerate(calls):
        if (own_id is not None and call_id == own_id) or (own_id is None and call_name == name):
            del calls[j]
            return call_id
    return None


def assistant_message(content: dict[str, Any], i: int) -> Message:
    text, calls = assistant_view(content, i)
    message: Message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    message[ORIGIN] = content
    return message


def assistant_view(content: dict[str, Any], i: int) -> tuple[str | None, list[dict[str, Any]]]:
    """A model turn's visible text (its thoughts left out) and its calls, as chat has them."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in content["parts"]:  # one pass: every turn of a new conversation is read this way
        text = part.get("text")
        if isinstance(text, str) and not part.get("thought"):
            texts.append(text)
        if "functionCall" in part:
            call = part["functionCall"]
            calls.append({"id": call.get("id") or f"gc{i}_{len(calls)}", "type": "function", "function": {
                "name": call["name"], "arguments": orjson.dumps(call.get("args") or {}).decode()}})
    return "".join(texts) or None, calls


def result_text(response: dict[str, Any]) -> str:
    """A functionResponse's result as the pipeline reads an observation: the text of the usual
    `{"output": "..."}`, else the JSON."""
    if len(response) == 1 and isinstance(value := next(iter(response.values())), str) \
            and next(iter(response)) in _RESULT_KEYS:
        return value
    return orjson.dumps(response).decode()


def user_content(parts: list[Part]) -> str | list[dict[str, Any]]:
    """A user turn's parts as chat content: its text, images as data URLs, other media named."""
    if all(isinstance(p.get("text"), str) for p in parts):
        return "".join(p["text"] for p in parts)
    out: list[dict[str, Any]] = []
    for p in parts:
        if isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif isinstance(blob := p.get("inlineData"), dict) and str(blob.get("mimeType", "")).startswith("image/"):
            url = f"data:{blob['mimeType']};base64,{blob.get('data')}"
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            media = p.get("fileData") or p.get("inlineData") or {}
            named = media.get("fileUri") or media.get("mimeType") or "part"
            out.append({"type": "text", "text": f"[{next(iter(p), 'part')} {named}]"})
    return out


def signed(content: dict[str, Any]) -> bool:
    """A model turn one of whose parts carries a thought signature: never edited."""
    return any("thoughtSignature" in p or "thought_signature" in p for p in content.get("parts") or [])
