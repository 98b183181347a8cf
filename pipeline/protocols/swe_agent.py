"""SWE-agent: a thought, then the command in a fenced block (or `<command>…</command>`,
or alone on its line); the observation is the next user turn, often a file window
`[File: PATH (N lines total)]`, closed by its `(Open file: …)` status lines."""
from __future__ import annotations

import re

from .base import Action, Observation, observation, shell_action
from .openhands import function_actions

_FENCE = re.compile(r"```[\w+\-]*[ \t]*\n(.*?)```", re.DOTALL)
_COMMAND_TAG = re.compile(r"<command>\n?(.*?)</command>", re.DOTALL)
_BARE = re.compile(r"^[a-z_][\w\-]*(?: [^\n]*)?$")
_BARE_WORDS = 8
"""A bare command is one short line: prose is longer, or ends like a sentence."""
_STATUS = re.compile(r"\n*(?:\(Open file: [^)\n]*\)\n?|\(Current directory: [^)\n]*\)\n?|bash-\$\s*)+\Z")
_OBSERVATION_HEADER = "OBSERVATION:\n"
_SIGNS = ("(Open file: ", "[File: ", "Your command ran successfully and did not produce any output")


def command_of(text: str) -> str | None:
    """The command an assistant turn gives: its last fenced block or `<command>` tag, or the
    whole turn when it is a single bare command line."""
    found = _COMMAND_TAG.findall(text) or _FENCE.findall(text)
    if found:
        return found[-1].strip()
    stripped = text.strip()
    if _BARE.match(stripped) and len(stripped.split()) < _BARE_WORDS and not stripped.endswith((".", "?", "!", ":")):
        return stripped
    return None


class SweAgentReader:
    name = "swe_agent_text"

    def learn(self, instructions: str) -> "SweAgentReader":
        return self

    def actions(self, text: str) -> list[Action]:
        command = command_of(text)
        if command is not None and command:
            return [shell_action(command, "")]
        return function_actions(text)

    def signals(self, text: str, role: str) -> bool:
        if role == "assistant":
            return "<command>" in text or (text.rstrip().endswith("```") and "```bash" not in text)
        return text.startswith(_OBSERVATION_HEADER) or any(sign in text for sign in _SIGNS)

    def observation(self, text: str, tool: str | None) -> Observation:
        output = text[len(_OBSERVATION_HEADER):] if text.startswith(_OBSERVATION_HEADER) else text
        return observation(tool, _STATUS.sub("", output))
