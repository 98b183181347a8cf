"""What a note shows of a message it cut, whatever kind of block holds it: text, a chat tool
call, an Anthropic `tool_use` / `tool_result` (with its nested content), a Responses
`function_call` / `function_call_output`, Codex's exec output (its output, not the header
"Exit code: … Wall time: … Output:") and a text protocol's observation (the output, not the
protocol's wrapper). Cutting is `refs.clip`'s: at a boundary, never inside a reference."""
from __future__ import annotations

import re
from typing import Any

import orjson

from .protocols.base import Action, text_of
from .protocols.tool_calls import action_of, calls_of
from .refs import clip
from .types import Message

KEY_ARGUMENTS = ("command", "cmd", "path", "file_path", "filepath", "filename", "file", "target_file", "query",
                 "pattern", "url", "code", "script")
"""Arguments that say what a call did, in the order they are looked for."""
_EXEC_HEADER = re.compile(r"\A(?:(?:Chunk ID|Wall time|Process exited with code|Exit code|Original token count|"
                          r"Process running with session ID)\b[^\n]*\n)+Output:\n?")
_EXIT = re.compile(r"(?:Process exited with code|Exit code:)\s*(-?\d+)")
_WRAPPERS = (re.compile(r"\AEXECUTION RESULT of \[[^\]\n]+\]:\n?"), re.compile(r"\AOBSERVATION:\n"))
_RETURN_CODE = re.compile(r"\A\s*<returncode>\s*(-?\d+)\s*</returncode>\s*(?:<output>\n?)?")
_OUTPUT_CLOSE = re.compile(r"</output>\s*\Z")


def output_body(text: str) -> tuple[int | None, str]:
    """An observation's exit status, when its wrapper says one, and its output without the
    wrapper: Codex's exec header, OpenHands' `EXECUTION RESULT of [...]`, SWE-agent's
    `OBSERVATION:`, mini-swe-agent's `<returncode>`/`<output>`. A JSON exec result
    (`{"output": ..., "metadata": {"exit_code": ...}}`) is read the same way."""
    if text.startswith('{"output"'):
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("output"), str):
            meta = data.get("metadata")
            code = meta.get("exit_code") if isinstance(meta, dict) else None
            return (code if isinstance(code, int) else None), data["output"]
    if found := _EXEC_HEADER.match(text):
        code = _EXIT.search(found.group(0))
        return (int(code.group(1)) if code else None), text[found.end():]
    if found := _RETURN_CODE.match(text):
        return int(found.group(1)), _OUTPUT_CLOSE.sub("", text[found.end():])
    for wrapper in _WRAPPERS:
        if found := wrapper.match(text):
            return None, text[found.end():]
    return None, text


def key_argument(action: Action) -> str:
    """The argument that says what a call did: its command, else its path, else its query,
    else its first string argument; one line of words."""
    value: Any = action.command or next((action.arguments[k] for k in KEY_ARGUMENTS if k in action.arguments), None)
    if value is None:
        value = next((v for v in action.arguments.values() if isinstance(v, (str, list))), "")
    if isinstance(value, list):  # Codex's `shell`: ["bash", "-lc", "the command"]
        words = [str(v) for v in value]
        value = words[-1] if words[:2] in (["bash", "-lc"], ["bash", "-c"], ["sh", "-c"]) else " ".join(words)
    return " ".join(str(value).split())


def call_text(action: Action, chars: int) -> str:
    """`tool(key argument)`, the argument cut to fit `chars` characters in all."""
    what = key_argument(action)
    if not what:
        return action.tool or "?"
    return f"{action.tool or '?'}({clip(what, max(8, chars - len(action.tool) - 2))})"


def _flat(text: str, chars: int) -> str:
    """The start of `text` with its whitespace collapsed, enough of it for `chars` characters
    (a prefix collapsed is a prefix of the whole collapsed: a long output is not split whole)."""
    shown = " ".join(text[:4 * chars + 64].split())
    if len(shown) < chars + 1 and len(text) > 4 * chars + 64:
        shown = " ".join(text.split())
    return shown


def output_text(text: str) -> str:
    """An observation's output as a preview shows it: the body, after `exit N:` when non-zero."""
    code, body = output_body(text)
    return (f"exit {code}: " if code not in (None, 0) else "") + body


def _block_text(block: dict[str, Any], chars: int) -> str:
    kind = block.get("type")
    if kind == "tool_result":
        return "result: " + output_text(text_of(block) or (block["content"] if isinstance(block.get("content"), str)
                                                             else ""))
    if kind == "tool_use":
        args = block.get("input")
        return "called " + call_text(action_of(str(block.get("name") or ""), args if isinstance(args, dict) else {},
                                               None), chars)
    if kind in ("function_call", "custom_tool_call"):
        raw = block.get("arguments") or block.get("input") or ""
        call = {"function": {"name": block.get("name"), "arguments": raw if isinstance(raw, (str, dict)) else ""}}
        return "called " + call_text(calls_of({"tool_calls": [call]})[0], chars)
    if kind is not None and str(kind).endswith("_output"):
        output = block.get("output")
        return "result: " + output_text(output if isinstance(output, str) else text_of(block, "output"))
    text = block.get("text")
    return text if isinstance(text, str) else ""


def preview(message: Message, chars: int) -> str:
    """What a note shows of `message` in `chars` characters: its text and every block's, a
    tool output by its body, a call by its tool and key argument."""
    content = message.get("content")
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(output_text(content) if message.get("role") in ("tool", "user") else content)
    elif isinstance(content, list):
        parts += [_block_text(b, chars) for b in content if isinstance(b, dict)]
    elif isinstance(message.get("type"), str):  # a Responses item as it came
        parts.append(_block_text(message, chars))
    if isinstance(message.get("tool_calls"), list):
        parts.append("called " + ", ".join(call_text(a, chars) for a in calls_of(message)))
    return clip(_flat("\n".join(p for p in parts if p), chars), chars)
