"""Anthropic Messages bodies: checked on the way in, rendered back from the neutral model.

In the neutral model (what the pipeline reads) the request is the `system` as one leading
system message followed by the client's messages, the same dict objects (a system turn the
client sends among its messages, as Claude Code does, is a system message in its place).
Compaction may drop or edit messages and add ctxgate's notes (quoted data, user-role, tagged:
`pipeline/notes.py`); the memory block is such a note after the leading system messages, and
ctxgate's fixed notice a system message among them. Rendering puts the leading system
messages back into `system`, leaves the client's own system turns where they are, delivers
each note as text blocks of a user turn (`_placed`: appended to the user turn before it, or a
turn of its own, never merged into the newest user turn, an assistant turn of ctxgate's fixed
wording keeping the roles alternating where needed), and repairs what the Messages API
refuses: turns that do not alternate or start with an assistant, `tool_use` / `tool_result`
blocks without their partner, more than 4 cache breakpoints. A record made before notes were
quoted still has system-role notes: they go into `system`, as they did.
An assistant turn with `thinking` blocks is never edited (their signatures cover it): it is
kept byte for byte or dropped whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

from ctxgate.pipeline.notes import TAG, is_ctxgate_message
from .validation import check_nesting, refuse_reserved, require_objects, validate_slices, validation_error

Message = dict[str, Any]
Block = dict[str, Any]
MAX_BREAKPOINTS = 4
COMPACTED_OPENING = "[ctxgate: the earlier conversation was compacted.]"
CONTEXT_ACK = "[ctxgate: the quoted context above is noted as data.]"
"""The assistant turn between a user turn of ctxgate's quoted context and a user turn of the
client's, so the roles alternate without merging the two."""
_THINKING = ("thinking", "redacted_thinking")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


@with_config(ConfigDict(extra="allow", strict=True))
class _Message(TypedDict):
    """A typed dict, as the chat door's: checked without a model instance made of each."""
    role: Literal["user", "assistant", "system"]
    """`system`: a system turn in the conversation (Claude Code sends them), kept in its place."""
    content: str | list[dict[str, Any]]


class _CountRequest(_Open):
    """The body but its messages' contents, which `validate_messages` checks."""
    model: str = Field(min_length=1)
    messages: list[Any] = Field(min_length=1)
    """Each an object (`validate_messages_request`); their contents: `validate_messages`."""
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


class _MessagesRequest(_CountRequest):
    max_tokens: int = Field(gt=0)
    stream: bool | None = None


_MESSAGES = TypeAdapter(list[_Message])


def validate_messages_request(body: dict[str, Any], *, counting: bool = False) -> None:
    """A clear 400 for a body the door cannot read; every field it does not read passes as is."""
    try:
        (_CountRequest if counting else _MessagesRequest).model_validate(body)
    except ValidationError as e:
        raise validation_error(e, 0) from None
    require_objects(body["messages"], "messages")


def validate_messages(messages: list[dict[str, Any]], start: int = 0) -> None:
    """The messages from `start` on: those before it were checked when they arrived (see `HistoryCache`)."""
    check_nesting(messages[start:], 2)
    refuse_reserved(messages, start)
    validate_slices(_MESSAGES, messages[start:], start, "messages")


@dataclass
class Conversation:
    """A Messages body and its conversation in the neutral model."""
    body: dict[str, Any]
    neutral: list[Message]
    """The system first, then the messages as sent: the same objects, but for `marked`."""
    marked: dict[int, Message]
    """For each message sent with cache breakpoints: the id of its copy without them (in
    `neutral`) → the client's message. An agent moves its breakpoint to the newest message
    every turn; were the marker in the neutral model, the message it left would differ from
    turn to turn, and no stored compaction would ever match the history again."""


def conversation_of(body: dict[str, Any]) -> Conversation:
    system = body.get("system")
    neutral: list[Message] = [{"role": "system", "content": system}] if system else []
    marked: dict[int, Message] = {}
    for message in body["messages"]:
        plain = unmarked(message)
        if plain is not message:
            marked[id(plain)] = message
        neutral.append(plain)
    return Conversation(body, neutral, marked)


def unmarked(message: Message) -> Message:
    content = message.get("content")
    if not isinstance(content, list) or not any(isinstance(b, dict) and "cache_control" in b for b in content):
        return message
    return {**message, "content": [{k: v for k, v in b.items() if k != "cache_control"} if isinstance(b, dict) else b
                                   for b in content]}


def render(conversation: Conversation, neutral: list[Message]) -> tuple[Any, list[Message]]:
    """`system` and `messages` for the forwarded body, from the (compacted) neutral list."""
    body = conversation.body
    if neutral is conversation.neutral:  # nothing compacted or added: the client's own, as sent
        return body.get("system"), body["messages"]
    leading = _leading(neutral)
    systems = [m for m in neutral if _to_system(m, leading)]
    # The client's breakpoints go back on the messages that reach the upstream as it sent them.
    turns = [conversation.marked.get(id(m), m) for m in neutral if not _to_system(m, leading)]
    compacted = any(is_ctxgate_message(m) for m in systems) or turns != body["messages"]
    turns = _valid_turns(_placed(turns), _signed_turns(body["messages"]))
    client_system = body.get("system")
    if [m.get("content") for m in systems] == ([client_system] if client_system else []):
        system: Any = client_system
    else:
        system = [b for m in systems for b in _as_blocks(m.get("content"))]
    quoted = [i for i, m in enumerate(turns) if TAG in m]
    if compacted and _breakpoints(system if isinstance(system, list) else [], turns, body.get("tools")) \
            < MAX_BREAKPOINTS:
        # The compacted prefix (summary, notes, restored state) is the same from turn to turn
        # until the next compaction: one breakpoint at its end lets the provider cache it.
        if quoted:
            at = quoted[-1]
            blocks = turns[at]["content"]
            turns[at] = {**turns[at], "content": [*blocks[:-1], {**blocks[-1], "cache_control": {"type": "ephemeral"}}]}
        elif isinstance(system, list) and system and "cache_control" not in system[-1]:
            system = [*system[:-1], {**system[-1], "cache_control": {"type": "ephemeral"}}]
    return system, [{k: v for k, v in m.items() if k != TAG} if TAG in m else m for m in turns]


def _placed(turns: list[Message]) -> list[Message]:
    """ctxgate's notes (user-role, tagged) as text blocks of user turns: appended to the user
    turn right before them unless that is the client's newest user turn (kept verbatim), else
    a user turn of their own; an assistant turn of fixed wording (`CONTEXT_ACK`) stands between
    such a turn and a user turn of the client's, so nothing is merged into the client's turn."""
    if not any(TAG in m and m.get("role") == "user" for m in turns):
        return turns
    newest = next((id(m) for m in reversed(turns) if m.get("role") == "user" and TAG not in m), None)
    out: list[Message] = []
    for m in turns:
        note = TAG in m and m.get("role") == "user"
        prev = out[-1] if out else None
        if not note:
            if prev is not None and TAG in prev and m.get("role") == "user":
                out.append({"role": "assistant", "content": CONTEXT_ACK})
            out.append(m)
            continue
        block = {"type": "text", "text": str(m.get("content"))}
        if prev is not None and prev.get("role") == "user" and (TAG in prev or id(prev) != newest):
            out[-1] = {**prev, "content": [*_as_blocks(prev.get("content")), block], TAG: m[TAG]}
            continue
        if prev is not None and prev.get("role") == "user":
            out.append({"role": "assistant", "content": CONTEXT_ACK})
        out.append({"role": "user", "content": [block], TAG: m[TAG]})
    return out


def _leading(neutral: list[Message]) -> set[int]:
    """The ids of the system messages before the first turn."""
    first_turn = next((i for i, m in enumerate(neutral) if m.get("role") != "system"), len(neutral))
    return {id(m) for m in neutral[:first_turn]}


def _to_system(message: Message, leading: set[int]) -> bool:
    """Whether a neutral message goes into `system`: the leading system messages (the client's
    `system`, the memory block) and ctxgate's notes wherever they are. A system turn the client
    sent among its messages stays a turn, where it was."""
    return message.get("role") == "system" and (id(message) in leading or is_ctxgate_message(message))


def _as_blocks(content: Any) -> list[Block]:
    if isinstance(content, list):
        return [b for b in content if isinstance(b, dict)]
    return [{"type": "text", "text": content}] if isinstance(content, str) and content else []


def _signed_turns(messages: list[Message]) -> set[bytes]:
    """The client's assistant turns that carry thinking blocks, as bytes."""
    signed = [m for m in messages if m.get("role") == "assistant" and _has_thinking(m)]
    return {orjson.dumps(v) for m in signed for v in (m, unmarked(m))}


def _has_thinking(message: Message) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in _THINKING for b in content)


def _valid_turns(turns: list[Message], signed: set[bytes]) -> list[Message]:
    """Alternating turns that start with the user, every tool block with its partner."""
    # A signed turn the pipeline edited would be refused: it goes whole.
    turns = [m for m in turns if not _has_thinking(m) or orjson.dumps(m) in signed]
    while True:
        repaired = _pair_tools(_merge_same_roles(turns))
        if repaired == turns:
            break
        turns = repaired
    if turns and turns[0].get("role") == "assistant":
        turns = [{"role": "user", "content": COMPACTED_OPENING}, *turns]
    return turns


def _merge_same_roles(turns: list[Message]) -> list[Message]:
    out: list[Message] = []
    for m in turns:
        if out and out[-1].get("role") == m.get("role"):
            if m.get("role") == "assistant" and (_has_thinking(out[-1]) or _has_thinking(m)):
                out[-1] = m  # a signed turn cannot take another's blocks: the later turn stands
            else:
                out[-1] = {**out[-1], "content": [*_as_blocks(out[-1].get("content")),
                                                  *_as_blocks(m.get("content"))]}
        else:
            out.append(m)
    return out


def _pair_tools(turns: list[Message]) -> list[Message]:
    """A `tool_result` without its `tool_use` in the turn before, and a `tool_use` (not in the
    last turn) without its result in the turn after, become text; a signed assistant turn
    with an unanswered call is dropped, never edited."""
    out: list[Message] = []
    for i, m in enumerate(turns):
        before, after = _neighbour(turns, i, -1), _neighbour(turns, i, 1)
        if m.get("role") == "user":
            asked = _ids(before, "tool_use", "id") if before and before.get("role") == "assistant" else set()
            m = _textify(m, "tool_result", lambda b: b.get("tool_use_id") not in asked)
        elif m.get("role") == "assistant" and after is not None:
            answered = _ids(after, "tool_result", "tool_use_id") if after.get("role") == "user" else set()
            if _ids(m, "tool_use", "id") - answered:
                if _has_thinking(m):
                    continue
                m = _textify(m, "tool_use", lambda b: b.get("id") not in answered)
        out.append(m)
    return out


def _neighbour(turns: list[Message], i: int, step: int) -> Message | None:
    """The nearest turn before (step -1) or after (+1) turn i that is not a system turn."""
    j = i + step
    while 0 <= j < len(turns) and turns[j].get("role") == "system":
        j += step
    return turns[j] if 0 <= j < len(turns) else None


def _ids(message: Message, kind: str, key: str) -> set[Any]:
    content = message.get("content")
    return {b.get(key) for b in content if isinstance(b, dict) and b.get("type") == kind} \
        if isinstance(content, list) else set()


def _textify(message: Message, kind: str, orphan: Any) -> Message:
    """The message with its orphan `kind` blocks as text; the same object when there are none."""
    content = message.get("content")
    if not isinstance(content, list) or not any(isinstance(b, dict) and b.get("type") == kind and orphan(b)
                                                for b in content):
        return message
    blocks = [_as_text(b) if isinstance(b, dict) and b.get("type") == kind and orphan(b) else b for b in content]
    return {**message, "content": blocks}


def _as_text(block: Block) -> Block:
    if block.get("type") == "tool_use":
        text = f"[tool call {block.get('name')} {orjson.dumps(block.get('input', {})).decode()}]"
    else:
        text = f"[tool result{' (error)' if block.get('is_error') else ''}]\n{_result_text(block.get('content'))}"
    return {"type": "text", "text": text}


def _result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b["text"] if b.get("type") == "text" and isinstance(b.get("text"), str)
                         else f"[{b.get('type')}]" for b in content if isinstance(b, dict))
    return ""


def _breakpoints(system: list[Block], turns: list[Message], tools: Any) -> int:
    blocks = [*system, *(tools if isinstance(tools, list) else [])]
    for m in turns:
        blocks += _as_blocks(m.get("content"))
    return sum(1 for b in blocks if isinstance(b, dict) and "cache_control" in b)
