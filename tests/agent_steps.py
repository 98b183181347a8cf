"""A scripted model for real agents: its next step depends on what reaches it.

Model `agent-steps-N` (or `agent-steps-N-thinking`) runs N steps of one tool (a shell tool of
SHELL_TOOLS, else the first tool the request offers, whose `command` or first string parameter
takes a shell command), then finishes. Step k's command prints the
marker `STEP-k-OK` and a bulk of output that fills the context. The model reads its progress
from the request's newest observation only (the last message, a tool result or a user
turn): a gateway that lost or cut the newest step verbatim makes it finish with `LOST`
instead of carrying on, so the agent's final answer says whether every step arrived whole.

The finishing command is mini-swe-agent's (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`
then the answer on the next line); an agent with its own tool (the Agents SDK test's) runs
it as any other command and answers with its output.

A chat request that offers no tools (aider's: it runs the ```bash blocks of a reply, when
the user agrees, and adds their output to the chat as a user turn) gets a text reply
(`text_reply`): the next step as a ```bash block, then the answer itself as plain text.

An agent's own summary request (its local compaction: no tools offered, its prompt a user
turn after the tool results it summarises) gets a summary naming the newest step those
results report (`summary_of`), in either API: the agent carries it into its compacted
history, and the next turn resumes from the step it names.
"""
from __future__ import annotations

import itertools
import json
import re
from typing import Any

FINISH = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_CALLS = itertools.count(1)
"""Call ids: unique in the process (a compacted request is shorter, so its length would repeat one)."""
BULK_LINES = 2500
"""`seq 1 2500`: about 12K characters, 5K tokens, per step."""


_NAME = re.compile(r"agent-steps-(\d+)(-thinking)?")
"""`-thinking`: each reply also carries the door's reasoning (Responses) or thinking (Messages)."""


def is_steps_model(model: str) -> bool:
    return _NAME.fullmatch(model) is not None


def steps_of(model: str) -> int:
    found = _NAME.fullmatch(model)
    assert found is not None, model
    return int(found.group(1))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") or p.get("output", "") for p in content if isinstance(p, dict))
    return ""


def newest_step(observation: str | None, answered_before: bool) -> int | None:
    """The step the newest observation reports; 0 before any step; None when the newest
    observation reports none although steps were taken (it was lost or cut)."""
    found = re.findall(r"STEP-(\d+)-OK", observation or "")
    if found:  # also with no call left before it: an agent's own compaction summary names its progress
        return int(found[-1])
    return None if answered_before else 0


def command_after(step: int | None, total: int) -> str:
    if step is None:
        return f"echo {FINISH} && echo LOST"
    if step >= total:
        return f"echo {FINISH} && echo DONE-{total}"
    return f"echo STEP-{step + 1}-OK && seq 1 {BULK_LINES}"


SHELL_TOOLS = ("bash", "Bash", "exec_command", "shell", "run_shell_command", "terminal")
"""Names of a shell tool, taken before the first tool offered (Claude Code offers a dozen)."""


def _command_parameter(properties: dict[str, Any]) -> str:
    """`command` when it is a string parameter (OpenHands' comes after two others), else the first string one."""
    strings = [name for name, spec in properties.items() if isinstance(spec, dict) and spec.get("type") == "string"]
    return "command" if "command" in strings else next(iter(strings), "command")


def _shell_call(tools: list[tuple[str, Any]], command: str) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of a call running `command` with the shell tool among (name, JSON schema)
    pairs. A required parameter with fixed choices (OpenHands' `security_risk`) gets its first."""
    name, schema = next((t for t in tools if t[0] in SHELL_TOOLS), tools[0] if tools else ("bash", None))
    properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
    required = schema.get("required", []) if isinstance(schema, dict) else []
    chosen = {p: spec["enum"][0] for p, spec in properties.items()
              if p in required and isinstance(spec, dict) and spec.get("enum")}
    return name, {**chosen, _command_parameter(properties): command}


def _answer(observed: str) -> str | None:
    """The answer once the finishing command's output is back (agents that end by answering):
    the line after the marker's own line, not the marker quoted in instructions or a command."""
    found = re.search(FINISH + r"[ \t]*(?:\n|\\n)([^\n\\]*)", observed)
    return found.group(1).strip() if found else None


def chat_choice(body: dict[str, Any], model: str, i: int) -> dict[str, Any]:
    """A Chat Completions choice: a call of the shell tool, or the answer."""
    messages = body.get("messages") or []
    answered = any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    observed = _text(last.get("content")) if last.get("role") != "assistant" else ""
    if (answer := _answer(observed)) is not None:
        return {"index": i, "message": {"role": "assistant", "content": answer}, "logprobs": None,
                "finish_reason": "stop"}
    offered = [((t.get("function") or {}).get("name", ""), (t.get("function") or {}).get("parameters"))
               for t in body.get("tools") or [] if isinstance(t, dict)]
    name, arguments = _shell_call(offered, command_after(newest_step(observed, answered), steps_of(model)))
    call = {"id": f"call_step_{next(_CALLS)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {"index": i, "message": {"role": "assistant", "content": "Carrying on.", "tool_calls": [call]},
            "logprobs": None, "finish_reason": "tool_calls"}


def summary_of(outputs: list[str]) -> str:
    """The reply to an agent's own summary request: the newest step the tool outputs before
    its prompt report."""
    found = re.findall(r"STEP-(\d+)-OK", "\n".join(outputs))
    return f"Summary: steps run so far, the newest STEP-{found[-1]}-OK." if found else "Summary: no step run yet."


def summary_request(outputs: list[str], last: dict[str, Any]) -> bool:
    """Whether a request that offers no tools asks for the agent's own summary: it ends with a
    user turn after tool results (`outputs`). A step's request offers the tool to take it; the
    text protocol's (no tools) has no tool results."""
    return last.get("role") == "user" and bool(outputs)


def responses_output(body: dict[str, Any], model: str, suffix: str) -> list[dict[str, Any]]:
    """A Responses output: a function call of the shell tool, or, once the finishing
    command's output is back, a message with the answer."""
    given = body.get("input")
    items: list[Any] = given if isinstance(given, list) else []
    answered = any(isinstance(it, dict) and it.get("type") == "function_call" for it in items)
    last = items[-1] if items and isinstance(items[-1], dict) else {}
    observed = _text(last.get("output")) if last.get("type") == "function_call_output" else _text(last.get("content"))
    if (answer := _answer(observed)) is not None:
        return [{"type": "message", "id": f"msg_{suffix}", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": answer, "annotations": []}]}]
    outputs = [_text(it.get("output")) for it in items
               if isinstance(it, dict) and it.get("type") == "function_call_output"]
    if not body.get("tools") and summary_request(outputs, last):
        return [{"type": "message", "id": f"msg_{suffix}", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": summary_of(outputs), "annotations": []}]}]
    offered = [(t.get("name", ""), t.get("parameters")) for t in body.get("tools") or []
               if isinstance(t, dict) and t.get("type") == "function"]
    name, arguments = _shell_call(offered, command_after(newest_step(observed, answered), steps_of(model)))
    return [{"type": "function_call", "id": f"fc_{suffix}", "call_id": f"call_{suffix}", "status": "completed",
             "name": name, "arguments": json.dumps(arguments)}]


def anthropic_content(body: dict[str, Any], model: str, suffix: str) -> tuple[list[dict[str, Any]], str]:
    """Messages content and stop reason: a `tool_use` of the shell tool, or the answer."""
    messages = body.get("messages") or []
    answered = any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    observed = ""
    if last.get("role") == "user":
        content = last.get("content")
        blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
        observed = "".join(_text(b.get("content")) if b.get("type") == "tool_result" else _text([b])
                           for b in blocks if isinstance(b, dict))
    if (answer := _answer(observed)) is not None:
        return [{"type": "text", "text": answer}], "end_turn"
    offered = [(t.get("name", ""), t.get("input_schema")) for t in body.get("tools") or [] if isinstance(t, dict)]
    name, arguments = _shell_call(offered, command_after(newest_step(observed, answered), steps_of(model)))
    return [{"type": "tool_use", "id": f"toolu_{suffix}", "name": name, "input": arguments}], "tool_use"


_ASKED = re.compile(r"^echo STEP-(\d+)-OK ", re.M)
"""The step a reply of the text protocol asked for: its ```bash block's command."""
_REPORTED = re.compile(r"^STEP-(\d+)-OK\s*$", re.M)
"""A step's marker as its command printed it, on a line of its own (not the command echoed)."""


def asked_step(reply: str) -> int | None:
    """The step a text-protocol reply asked the agent to run; None for an answer."""
    found = _ASKED.findall(reply)
    return int(found[-1]) if found else None


def text_step(messages: list[Any]) -> int | None:
    """The step the text protocol has reached: the one its newest reply in `messages` asked for,
    when the turns after that reply carry its output; 0 before any step (no step named
    anywhere); None when the newest step did not arrive (its reply or its output was lost).

    The agent adds turns of its own after a reply (aider: "Ok" after the output, the user's
    next message, a system reminder), so the model's replies are told apart by their command."""
    said = [(m.get("role"), _text(m.get("content"))) for m in messages if isinstance(m, dict)]
    replies = [i for i, (role, text) in enumerate(said) if role == "assistant" and asked_step(text) is not None]
    if not replies:
        return 0 if not any("STEP-" in text for _, text in said) else None
    asked = asked_step(said[replies[-1]][1])
    after = "\n".join(text for _, text in said[replies[-1] + 1:])
    return asked if str(asked) in _REPORTED.findall(after) else None


_FENCE = re.compile(r"^```([\w\-]+)[ \t]*$", re.M)
_SHELL_WORDS = {"bash", "sh", "shell", "command"}


def text_fence(messages: list[Any]) -> str:
    """The fence the agent's system prompt shows for commands (mini-swe-agent 2.x's text mode:
    `mswea_bash_command`; not aider's ```python examples), else `bash`."""
    system = "\n".join(_text(m.get("content")) for m in messages if isinstance(m, dict) and m.get("role") == "system")
    found = [lang for lang in _FENCE.findall(system) if _SHELL_WORDS & set(re.split(r"[_\-]", lang))]
    return found[0] if found else "bash"


def text_reply(messages: list[Any], total: int) -> str:
    """The text protocol's reply: the next step's command in a block of the agent's fence, or
    the answer (`DONE-N` once every step arrived, `LOST` when the newest one did not): as the
    finishing command when the agent's prompt names one (mini-swe-agent), else as text."""
    step = text_step(messages)
    answer = "LOST" if step is None else f"DONE-{total}" if step >= total else None
    fence = text_fence(messages)
    if answer is not None:
        finish = any(FINISH in _text(m.get("content")) for m in messages if isinstance(m, dict))
        return f"Finishing.\n\n```{fence}\necho {FINISH} && echo {answer}\n```\n" if finish else answer
    command = f"echo STEP-{(step or 0) + 1}-OK && seq 1 {BULK_LINES}"
    return f"Running step {(step or 0) + 1}.\n\n```{fence}\n{command}\n```\n"


def text_choice(body: dict[str, Any], model: str, i: int) -> dict[str, Any]:
    """A Chat Completions choice for a request that offers no tools (but the gateway's): the
    agent's own summary when it asks for one, else the text protocol's reply."""
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    outputs = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
    if summary_request(outputs, messages[-1] if messages else {}):
        content = summary_of(outputs)
    else:
        content = text_reply(messages, steps_of(model))
    return {"index": i, "message": {"role": "assistant", "content": content}, "logprobs": None,
            "finish_reason": "stop"}
