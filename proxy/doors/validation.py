"""Reading and checking a chat-completions body.

Only what ctxgate relies on is checked (model, messages, their roles and tool-call
shapes, stream flags); every other field passes through untouched, and the forwarded
body is the parsed dict itself, never a re-validated copy.
"""
from __future__ import annotations

from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import NotRequired, TypedDict

from ctxgate.pipeline.notes import TAG
from ..errors import ErrorKind, GatewayError
from ..large_json import BodyNotJson, JsonParser
from ..resent import Resent, ResentBodies
from .nesting import nests_deeper, shallow

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
CONTENT_REQUIRED = ("system", "developer", "user", "tool", "function")
"""OpenAI requires `content` for these (an assistant message may carry tool calls instead)."""


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


# The messages' shapes as typed dicts: checked without a model instance made of each (a new
# 107K conversation's 337 messages: 0.16 ms against 0.39), with the same errors.
_OPEN = ConfigDict(extra="allow", strict=True)


@with_config(_OPEN)
class _Function(TypedDict):
    name: str
    arguments: str


@with_config(_OPEN)
class _ToolCall(TypedDict):
    id: str
    type: NotRequired[str]
    function: _Function


@with_config(_OPEN)
class _Message(TypedDict):
    role: Role
    content: NotRequired[str | list[dict[str, Any]] | None]
    name: NotRequired[str | None]
    tool_calls: NotRequired[list[_ToolCall] | None]
    tool_call_id: NotRequired[str | None]


class _StreamOptions(_Open):
    include_usage: bool | None = None


class _ChatRequest(_Open):
    """The body but its messages' contents, which `validate_chat_messages` checks."""
    model: str = Field(min_length=1)
    messages: list[Any] = Field(min_length=1)
    """Each an object (`validate_chat_request`); their contents: `validate_chat_messages`."""
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None


_MESSAGES = TypeAdapter(list[_Message])
VALIDATION_SLICE = 2_000
"""Messages checked by one pydantic call (a few milliseconds): between calls the GIL may change hands."""
MAX_NESTING = 200
"""Objects and arrays inside one another in a request body, the body itself the first."""


async def read_json_body(request: web.Request, parser: JsonParser, limit: int | None = None,
                         history: str = "messages") -> dict[str, Any]:
    """The body as a JSON object (a large one parsed off the event loop, `JsonParser`);
    `limit`: the caller's own body limit (a tenant's), below the gateway's; `history`: the
    field holding the conversation, whose nesting the door checks itself, only in what is new."""
    return (await read_resent_body(request, parser, None, (), limit, history))[0]


async def read_resent_body(request: web.Request, parser: JsonParser, resent: ResentBodies | None,
                           key: tuple[str, ...], limit: int | None = None, history: str = "messages"
                           ) -> tuple[dict[str, Any], Resent | None]:
    """`read_json_body`, where a body that resends the bytes of one kept under `key` has only its
    tail parsed (`ResentBodies`): the body, and what was known of it (None: parsed whole).
    The door keeps the body for the next once it has checked it (`ResentBodies.keep`)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise GatewayError(ErrorKind.TOO_LARGE,
                           f"request body is larger than the limit of {request.client_max_size} bytes",
                       code="request_too_large") from None
    if limit is not None and len(raw) > limit:
        raise GatewayError(ErrorKind.TOO_LARGE, f"request body is larger than this tenant's limit of {limit} bytes",
                           code="request_too_large")
    if not raw:
        raise GatewayError(ErrorKind.INVALID_REQUEST,
                           "request body is empty; expected a JSON object", code="invalid_json")
    known = resent.parse(key, raw, history) if resent is not None else None
    if known is not None:
        body = known.body
    else:
        try:
            body = await parser.loads(raw)
        except BodyNotJson as e:
            raise GatewayError(ErrorKind.INVALID_REQUEST,
                               f"request body is not valid JSON (UTF-8): {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "request body must be a JSON object", code="invalid_json")
    if not shallow(raw, MAX_NESTING):
        check_nesting({k: v for k, v in body.items() if k != history})
    return body, known


def check_nesting(value: Any, level: int = 1) -> None:
    """`value`, found `level` containers deep in a body, nests no deeper than MAX_NESTING:
    a body ctxgate parsed but could not re-encode (orjson's own limit is 254 levels) would
    fail after the turn was logged; the same limit is checked before anything happens."""
    if nests_deeper(value, level, MAX_NESTING):
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"the request body nests objects and arrays more than "
                           f"{MAX_NESTING} levels deep", code="nesting_too_deep")


def validate_chat_request(body: dict[str, Any]) -> None:
    """Everything but the contents of the messages (see `validate_chat_messages`)."""
    try:
        _ChatRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e, 0) from None
    require_objects(body["messages"], "messages")


def require_objects(items: list[Any], where: str) -> None:
    """Every item of a list is an object: checked apart from their contents, which a steady
    turn checks only for its new items (a model of `list[dict]` would copy every one)."""
    if set(map(type, items)) <= {dict}:  # a loop in C: a steady turn's whole history passes through here
        return
    for i, item in enumerate(items):
        if type(item) is not dict:
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"{where}.{i}: Input should be a valid dictionary",
                               param=f"{where}.{i}", code="invalid_request")


def refuse_reserved(messages: list[dict[str, Any]], start: int = 0, where: str = "messages") -> None:
    """ctxgate knows its own notes by a field only it sets (`pipeline/notes.py`): a client
    message carrying it is refused, so nothing a client sends passes for ctxgate's."""
    for i in range(start, len(messages)):
        if TAG in messages[i]:
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"{where}.{i}.{TAG}: a field ctxgate reserves for its own "
                               "notes", param=f"{where}.{i}.{TAG}", code="invalid_request")


def validate_chat_messages(messages: list[dict[str, Any]], start: int = 0) -> None:
    """The messages from `start` on: those before it were checked when they arrived (a steady
    turn pays only for what is new in it, see `HistoryCache`)."""
    new = messages[start:]
    check_nesting(new, 2)
    refuse_reserved(messages, start)
    validate_slices(_MESSAGES, new, start, "messages")
    for i, m in enumerate(new, start):
        for j, part in enumerate(m["content"] if isinstance(m.get("content"), list) else []):
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                # Every provider refuses it: answered here, before any state or upstream call.
                raise GatewayError(ErrorKind.INVALID_REQUEST, f"messages.{i}.content.{j}.text: a text part's text "
                                   "must be a string", param=f"messages.{i}.content.{j}.text", code="invalid_request")
        if m["role"] in CONTENT_REQUIRED and m.get("content") is None:
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"messages.{i}.content: required for a {m['role']} message",
                           param=f"messages.{i}.content", code="invalid_request")
        if m["role"] == "tool" and not m.get("tool_call_id"):
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"messages.{i}.tool_call_id: required for a tool message",
                           param=f"messages.{i}.tool_call_id", code="invalid_request")


def validate_slices(adapter: TypeAdapter[Any], items: list[Any], offset: int, prefix: str) -> None:
    """`items` (the list `prefix` from index `offset` on) checked by `adapter` a slice at a time:
    pydantic holds the GIL for a whole call, so a list of 400,000 messages in one call would
    hold the event loop for seconds even from a thread (`proxy/heavy.py`)."""
    for at in range(0, len(items), VALIDATION_SLICE):
        try:
            adapter.validate_python(items[at:at + VALIDATION_SLICE])
        except ValidationError as e:
            raise validation_error(e, offset + at, prefix) from None


def validation_error(e: ValidationError, offset: int, prefix: str = "") -> GatewayError:
    """The first error of a check of the body (`prefix` empty) or of its list `prefix` from
    index `offset` on, as a 400 that says where in the body it is."""
    loc = list(e.errors()[0]["loc"])
    if prefix:
        loc = [prefix, int(loc[0]) + offset, *loc[1:]] if loc else [prefix]
    where = ".".join(str(p) for p in loc)
    return GatewayError(ErrorKind.INVALID_REQUEST, f"{where}: {e.errors()[0]['msg']}", param=where,
                        code="invalid_request")
