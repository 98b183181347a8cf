"""mini-swe-agent: a `THOUGHT:` then exactly one fenced command block; the observation is the
next user turn, `<returncode>N</returncode>` and `<output>…</output>` (an `<exception>` line
may come first; a long output comes as `<output_head>` and `<output_tail>`).

Which fence holds the command is the agent's configuration, and its system prompt shows it:
1.x writes ```` ```bash ````, 2.x ```` ```mswea_bash_command ````, and a user's config may name
another. The reader learns the fence from the instructions (`learn`): a fenced block there
whose language names a shell or a command; a turn's command is its last block in a learnt
language, else in a known one (bash, sh, shell, none), else in any whose language names a
command (instructions that only describe the format: the agent's turns show it).
"""
from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache

from .base import Action, Observation, observation, shell_action

KNOWN_FENCES = ("bash", "sh", "shell", "")
_FENCE = re.compile(r"```([\w.+\-]*)[ \t]*\n(.*?)```", re.DOTALL)
_COMMAND_WORDS = frozenset({"bash", "sh", "shell", "zsh", "command", "cmd", "console", "action"})
_RETURN_CODE = re.compile(r"<returncode>\s*(-?\d+)\s*</returncode>")
_LEADING_EXCEPTION = re.compile(r"\A\s*<exception>(.*?)</exception>\s*", re.DOTALL)
_OUTPUT = re.compile(r"<output>\n?(.*?)(?:</output>|\Z)", re.DOTALL)
_HEAD_TAIL = re.compile(r"<output_head>\n?(.*?)</output_head>.*?<output_tail>\n?(.*?)(?:</output_tail>|\Z)", re.DOTALL)


@lru_cache(maxsize=64)
def command_fences(instructions: str) -> tuple[str, ...]:
    """The fence languages `instructions` show for commands, the most shown first: those whose
    name has a shell's or a command's word in it (`mswea_bash_command`, `console`), the known
    ones left out (they are read anyway)."""
    shown = Counter(lang for lang, _ in _FENCE.findall(instructions)
                    if lang not in KNOWN_FENCES and _names_command(lang))
    return tuple(lang for lang, _ in shown.most_common())


def _names_command(lang: str) -> bool:
    """Whether a fence's language names a shell or a command (`mswea_bash_command`, `console`)."""
    return bool(_COMMAND_WORDS & set(re.split(r"[_.+\-]", lang.lower())))


class MiniSweAgentReader:
    name = "mini_swe_agent"

    def __init__(self, fences: tuple[str, ...] = ()) -> None:
        self.fences = fences
        """The fences learnt from the instructions, preferred to the known ones."""

    def learn(self, instructions: str) -> "MiniSweAgentReader":
        fences = command_fences(instructions)
        return MiniSweAgentReader(fences) if fences != self.fences else self

    def command(self, text: str) -> str | None:
        """The command a turn's text gives: its last block in a learnt fence, else in a known one,
        else in one whose language names a command (instructions that describe the format in
        words and show no block: the agent's own turns show it)."""
        found = _FENCE.findall(text)
        for blocks in ([body for lang, body in found if lang in self.fences],
                       [body for lang, body in found if lang in KNOWN_FENCES],
                       [body for lang, body in found if _names_command(lang)]):
            if blocks:
                return blocks[-1]
        return None

    def actions(self, text: str) -> list[Action]:
        found = self.command(text)
        return [shell_action(found, "bash")] if found and found.strip() else []

    def signals(self, text: str, role: str) -> bool:
        if role == "assistant":
            return any(f"```{fence}\n" in text for fence in self.fences) or (
                "THOUGHT:" in text and any(_names_command(lang) for lang, _ in _FENCE.findall(text)))
        return _RETURN_CODE.match(_LEADING_EXCEPTION.sub("", text.lstrip())) is not None

    def observation(self, text: str, tool: str | None) -> Observation:
        code = _RETURN_CODE.search(text)
        split = _HEAD_TAIL.search(text)
        output = _OUTPUT.search(text)
        body = (f"{split.group(1)}\n{split.group(2)}" if split else output.group(1) if output else text)
        raised = _LEADING_EXCEPTION.match(text)  # what stopped the command (a timeout): part of what it reported
        return observation(tool, f"{raised.group(1).strip()}\n{body}" if raised else body,
                           int(code.group(1)) if code else None)
