"""A scripted model for real agents: its next step depends on what reaches it.

Model `agent-steps-N` runs N steps of one tool (the first tool the request offers, whose
first string parameter takes a shell command), then finishes. Step k's command prints the
marker `STEP-k-OK` and a bulk of output that fills the context. The model reads its progress
from the request's newest observation only (the last message, a tool result or a user
turn): a gateway that lost or cut the newest step verbatim makes it finish with `LOST`
instead of carrying on, so the agent's final answer says whether every step arrived whole.

The finishing command is mini-swe-agent's (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`
then the answer on the next line); an agent with its own tool (the Agents SDK test's) runs
it as any other command and answers with its output.
"""
from __future__ import annotations

import json
import re
from typing import Any

FINISH = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
BULK_LINES = 2500
"""`seq 1 2500`: about 12K characters, 5K tokens, per step."""


def is_steps_model(model: str) -> bool:
    return re.fullmatch(r"agent-steps-\d+", model) is not None


def steps_of(model: str) -> int:
    return int(model.rsplit("-", 1)[1])


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") or p.get("output", "") for p in content if isinstance(p, dict))
    return ""


def newest_step(observation: str | None, answered_before: bool) -> int | None:
    """The step the newest observation reports; 0 before any step; None when the newest
    observation reports none although steps were taken (it was lost or cut)."""
    if not answered_before:
        return 0
    found = re.findall(r"STEP-(\d+)-OK", observation or "")
    return int(found[-1]) if found else None


def command_after(step: int | None, total: int) -> str:
    if step is None:
        return f"echo {FINISH} && echo LOST"
    if step >= total:
        return f"echo {FINISH} && echo DONE-{total}"
    return f"echo STEP-{step + 1}-OK && seq 1 {BULK_LINES}"


def _command_parameter(parameters: Any) -> str:
    properties = parameters.get("properties", {}) if isinstance(parameters, dict) else {}
    return next((name for name, spec in properties.items() if isinstance(spec, dict)
                 and spec.get("type") == "string"), "command")


def chat_choice(body: dict[str, Any], model: str, i: int) -> dict[str, Any]:
    """A Chat Completions choice: a call of the request's first tool."""
    messages = body.get("messages") or []
    answered = any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    step = newest_step(_text(last.get("content")) if last.get("role") != "assistant" else None, answered)
    function = (body.get("tools") or [{}])[0].get("function") or {}
    arguments = {_command_parameter(function.get("parameters")): command_after(step, steps_of(model))}
    call = {"id": f"call_step_{len(messages)}_{i}", "type": "function",
            "function": {"name": function.get("name", "bash"), "arguments": json.dumps(arguments)}}
    return {"index": i, "message": {"role": "assistant", "content": f"Step {step}: carrying on.", "tool_calls": [call]},
            "logprobs": None, "finish_reason": "tool_calls"}


def responses_output(body: dict[str, Any], model: str, suffix: str) -> list[dict[str, Any]]:
    """A Responses output: a function call of the request's first tool, or, once the
    finishing command's output is back, a message with the answer."""
    items = body.get("input") if isinstance(body.get("input"), list) else []
    answered = any(isinstance(it, dict) and it.get("type") == "function_call" for it in items)
    last = items[-1] if items and isinstance(items[-1], dict) else {}
    observed = _text(last.get("output")) if last.get("type") == "function_call_output" else _text(last.get("content"))
    if FINISH in observed:
        answer = observed.split(FINISH, 1)[1].strip().splitlines()
        return [{"type": "message", "id": f"msg_{suffix}", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": answer[0] if answer else "", "annotations": []}]}]
    tool = next((t for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"), {})
    arguments = {_command_parameter(tool.get("parameters")): command_after(newest_step(observed, answered),
                                                                            steps_of(model))}
    return [{"type": "function_call", "id": f"fc_{suffix}", "call_id": f"call_{suffix}", "status": "completed",
             "name": tool.get("name", "bash"), "arguments": json.dumps(arguments)}]
