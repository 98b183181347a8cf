"""OpenAI Responses requests: validation, and the conversion to and from the neutral model.

The pipeline reads chat-completions messages, so `to_messages` turns Responses input
items into them and `to_items` turns the (possibly compacted) messages back. Each
message keeps the item(s) it came from, so what the pipeline left alone goes back
byte-identical, and the conversion is deterministic (stable message fingerprints):

- a user/system/developer message item -> `{"role", "content", "item"}`;
- a run of assistant-side items (reasoning, assistant messages, tool calls, web searches
  ...) -> ONE assistant message `{"role": "assistant", "content": text, "tool_calls",
  "items"}`: an assistant turn is kept or dropped whole, so `reasoning.encrypted_content`
  is never edited;
- a tool output (`function_call_output`, `custom_tool_call_output`, any `*_output` with a
  `call_id`) -> `{"role": "tool", "tool_call_id", "content", "item"}`;
- `instructions` -> a leading system message marked `"instructions": True`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ErrorKind, GatewayError
from .validation import check_nesting

INPUT_ROLES = ("user", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _ResponsesRequest(_Open):
    model: str = Field(min_length=1)
    input: Any = None
    """Checked below: pydantic's message for a union names its members, not the rule."""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool | None = None
    store: bool | None = None
    user: str | None = None
    prompt_cache_key: str | None = None


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(ErrorKind.INVALID_REQUEST, message, param=param, code="invalid_request")


def validate_responses_request(body: dict[str, Any], *, input_required: bool = True, start: int = 0) -> None:
    """The shapes ctxgate relies on; every other field passes through untouched. Input items
    before `start` were checked when they arrived (a steady turn checks only what is new)."""
    try:
        _ResponsesRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"][:2])
        raise _bad(f"{where}: {first['msg']}", where) from None
    raw = body.get("input")
    if raw is None:
        if input_required:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "Missing required parameter: 'input'.", param="input",
                           code="missing_required_parameter")
    elif not isinstance(raw, (str, list)):
        raise _bad("input: must be a string or a list of input items", "input")
    else:
        if isinstance(raw, list):  # the door's body check leaves its input to this one (`read_resent_body`)
            check_nesting(raw[start:], 2)
        for i, item in enumerate(raw[start:] if isinstance(raw, list) else [], start):
            if not isinstance(item, dict):
                raise _bad(f"input.{i}: an input item must be an object", f"input.{i}")
            _validate_item(item, f"input.{i}")


def _validate_item(item: dict[str, Any], where: str) -> None:
    kind = item.get("type")
    if kind is not None and not isinstance(kind, str):
        raise _bad(f"{where}.type: must be a string", f"{where}.type")
    if kind in (None, "message"):
        role = item.get("role")
        if role not in (*INPUT_ROLES, "assistant"):
            raise _bad(f"{where}: an item needs a `type`, or a message `role` (user, system, developer, "
                       "assistant)", where)
        content = item.get("content")
        if not isinstance(content, (str, list)) or (
                isinstance(content, list) and not all(isinstance(p, dict) and isinstance(p.get("type"), str)
                                                      for p in content)):
            raise _bad(f"{where}.content: a string or a list of typed content parts", f"{where}.content")
        return
    if _is_output(item) and not isinstance(item.get("call_id"), str):
        raise _bad(f"{where}.call_id: required for a {kind} item", f"{where}.call_id")
    if kind in ("function_call", "custom_tool_call") and not isinstance(item.get("call_id"), str):
        raise _bad(f"{where}.call_id: required for a {kind} item", f"{where}.call_id")


def _is_output(item: dict[str, Any]) -> bool:
    kind = item.get("type")
    return isinstance(kind, str) and kind.endswith("_output")


def _is_input_message(item: dict[str, Any]) -> bool:
    return item.get("type") in (None, "message") and item.get("role") in INPUT_ROLES


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's own input as items: a string is one user message."""
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    return list(raw or [])


def to_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input (the whole conversation) -> chat-completions messages."""
    return convert(instructions, items).messages


@dataclass(frozen=True)
class Converted:
    """A conversation's items and the chat-completions messages they became."""
    instructions: str | None
    items: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    starts: list[int]
    """`[j]`: the index in `items` of message j's first item (-1: the instructions)."""
    checked: int = 0
    """How many leading items were checked as a request's own input (not a chain's history)."""


def known_items(previous: Converted | None, instructions: Any, raw_input: Any) -> int:
    """How many leading items of a request's own input `previous` had (0 if it is not its continuation)."""
    if previous is None or previous.instructions != instructions or not isinstance(raw_input, list):
        return 0
    known = len(previous.items)
    return known if len(raw_input) >= known and raw_input[:known] == previous.items else 0


def checked_items(previous: Converted | None, instructions: Any, raw_input: Any) -> int:
    """How many leading items of a request's own input were checked already, as `previous`'s own input."""
    return min(known_items(previous, instructions, raw_input), previous.checked) if previous is not None else 0


def convert(instructions: str | None, items: list[dict[str, Any]], previous: Converted | None = None) -> Converted:
    """`to_messages`, reusing what `previous` converted when `items` starts with its items:
    every message but its last is closed (an item followed it), so only the last is made
    again, with what came since (a run of calls and reasoning may have grown)."""
    messages: list[dict[str, Any]] = []
    starts: list[int] = []
    first = 0
    if instructions:
        messages.append({"role": "system", "content": instructions, "instructions": True})
        starts.append(-1)
    if previous is not None and len(previous.messages) >= 2 and previous.starts[-1] >= 0 \
            and known_items(previous, instructions, items):
        last = len(previous.messages) - 1
        messages, starts, first = previous.messages[:last], previous.starts[:last], previous.starts[last]
    run: list[dict[str, Any]] = []
    for i in range(first, len(items)):
        item = items[i]
        if _is_input_message(item) or _is_output(item):
            if run:
                messages.append(_assistant_turn(run))
                starts.append(i - len(run))
                run = []
            messages.append(_tool_message(item) if _is_output(item) else
                            {"role": item["role"], "content": _content(item["content"]), "item": item})
            starts.append(i)
        else:
            run.append(item)
    if run:
        messages.append(_assistant_turn(run))
        starts.append(len(items) - len(run))
    return Converted(instructions, list(items), messages, starts)


def _content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Message content as chat completions has it: text parts, images as image_url parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for p in content:
        if p.get("type") in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(p.get("text") or p.get("refusal") or "")})
        elif p.get("type") == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": str(p.get("image_url") or p.get("file_id"))}})
        else:  # input_file and the like: named, not inlined, for reading and counting
            parts.append({"type": "text", "text": f"[{p.get('type')} {p.get('filename') or p.get('file_id') or ''}]"})
    return parts


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or p.get("refusal") or "") for p in content
                       if isinstance(p, dict) and p.get("type") in _TEXT_PARTS)
    return ""


def _tool_message(item: dict[str, Any]) -> dict[str, Any]:
    output = item.get("output")
    return {"role": "tool", "tool_call_id": item["call_id"],
            "content": output if isinstance(output, str) else _text(output), "item": item}


def _call_of(item: dict[str, Any]) -> dict[str, Any] | None:
    """An assistant-side item that expects an output, as a chat tool call."""
    call_id, kind = item.get("call_id"), item.get("type")
    if not isinstance(call_id, str) or not isinstance(kind, str) or _is_output(item):
        return None
    if kind == "function_call":
        name, arguments = item.get("name"), item.get("arguments")
    elif kind == "custom_tool_call":
        name, arguments = item.get("name"), item.get("input")
    else:  # computer_call, local_shell_call ...: named by their type
        name, arguments = kind, item.get("action")
    if not isinstance(arguments, str):
        arguments = "" if arguments is None else str(arguments)
    return {"id": call_id, "type": "function", "function": {"name": str(name or kind), "arguments": arguments}}


def _assistant_view(items: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    text = "".join(_text(i.get("content")) for i in items if i.get("type") in (None, "message"))
    calls = [c for c in map(_call_of, items) if c is not None]
    return text or None, calls


def _assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    text, calls = _assistant_view(items)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    message["items"] = items
    return message


def to_request(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """Chat-completions messages (compacted, memory in) -> (instructions, input items)."""
    instructions: str | None = None
    if messages and messages[0].get("instructions") is True:
        instructions = _text(messages[0].get("content")) or None
        messages = messages[1:]
    rendered: list[dict[str, Any]] = []
    for m in messages:
        rendered += _items_of(m)
    return instructions, _paired(rendered)


def _items_of(m: dict[str, Any]) -> list[dict[str, Any]]:
    role = m.get("role")
    if role == "assistant" and isinstance(m.get("items"), list):
        items: list[dict[str, Any]] = m["items"]
        text, calls = _assistant_view(items)
        if (m.get("content") or None, m.get("tool_calls") or []) == (text, calls):
            return items
        return _edited_turn(m, items)
    if role == "assistant":
        return [{"role": "assistant", "content": _text(m.get("content"))}]
    item = m.get("item")
    if role == "tool":
        if isinstance(item, dict) and m.get("content") == _tool_message(item)["content"]:
            return [item]
        base = item if isinstance(item, dict) else {"type": "function_call_output"}
        return [{**base, "call_id": m.get("tool_call_id"), "output": _text(m.get("content"))}]
    if isinstance(item, dict):
        if m.get("content") == _content(item["content"]):
            return [item]
        return [{**item, "content": _back(m.get("content"))}]
    # ctxgate's own notes (restore blocks, the memory block, summaries) have no item
    return [{"role": "developer" if role == "system" else str(role), "content": _text(m.get("content"))}]


def _back(content: Any) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for p in content or []:
        if p.get("type") == "image_url":
            parts.append({"type": "input_image", "image_url": p["image_url"]["url"], "detail": "auto"})
        else:
            parts.append({"type": "input_text", "text": str(p.get("text") or "")})
    return parts


def _edited_turn(m: dict[str, Any], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant turn the pipeline edited: its calls carry the new arguments and its text
    the new content. Reasoning goes (encrypted reasoning is never edited, and the API
    accepts a turn without it); calls the pipeline dropped go too."""
    calls = {c["id"]: c for c in m.get("tool_calls") or []}
    out: list[dict[str, Any]] = []
    text_done = False
    for item in items:
        kind = item.get("type")
        if kind == "reasoning":
            continue
        if kind in (None, "message"):
            if not text_done and m.get("content"):
                out.append({**item, "content": [{"type": "output_text", "text": _text(m["content"]),
                                                 "annotations": []}]})
            text_done = True
            continue
        call = _call_of(item)
        if call is None:
            out.append(item)
        elif call["id"] in calls:
            arguments = calls[call["id"]]["function"]["arguments"]
            field = {"function_call": "arguments", "custom_tool_call": "input"}.get(str(kind))
            out.append({**item, field: arguments} if field else item)
    if not text_done and m.get("content"):
        out.append({"role": "assistant", "content": _text(m["content"])})
    if any(item.get("type") == "reasoning" for item in items):
        # An item id names the stored turn it came from, whose reasoning is gone: the API
        # refuses a call given by id without its reasoning item, and accepts it without the id.
        out = [{k: v for k, v in item.items() if k != "id"} for item in out]
    return out


def _paired(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The API refuses an output whose call is not in the input, and a call with no output:
    either one left alone (its partner compacted away) becomes text."""
    calls = {i["call_id"] for i in items if _call_of(i) is not None}
    outputs = {i.get("call_id") for i in items if _is_output(i)}
    out: list[dict[str, Any]] = []
    for item in items:
        call = _call_of(item)
        if _is_output(item) and item.get("call_id") not in calls:
            output = item.get("output")
            out.append({"role": "user", "content": f"[output of an earlier tool call {item.get('call_id')}]\n"
                                                   f"{output if isinstance(output, str) else _text(output)}"})
        elif call is not None and call["id"] not in outputs:
            while out and out[-1].get("type") == "reasoning":
                out.pop()  # a reasoning item must be followed by the item it led to, which is now text
            fn = call["function"]
            note = f"[called {fn['name']}({fn['arguments']}); no output recorded]"
            out.append({"role": "assistant", "content": note})
        else:
            out.append(item)
    return out
