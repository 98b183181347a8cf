"""mini-swe-agent: `THOUGHT:` then exactly one fenced bash block; the observation is the
next user turn, `<returncode>N</returncode>` and `<output>…</output>`."""
from __future__ import annotations

import re

from .base import Action, Observation, observation, shell_action

_BASH_FENCE = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)```", re.DOTALL)
_RETURN_CODE = re.compile(r"<returncode>\s*(-?\d+)\s*</returncode>")
_OUTPUT = re.compile(r"<output>\n?(.*?)(?:</output>|\Z)", re.DOTALL)


class MiniSweAgentReader:
    name = "mini_swe_agent"

    def actions(self, text: str) -> list[Action]:
        found = _BASH_FENCE.findall(text)
        return [shell_action(found[-1], "bash")] if found and found[-1].strip() else []

    def signals(self, text: str, role: str) -> bool:
        if role == "assistant":
            return "THOUGHT:" in text and "```bash" in text
        return _RETURN_CODE.match(text.lstrip()) is not None

    def observation(self, text: str, tool: str | None) -> Observation:
        code = _RETURN_CODE.search(text)
        output = _OUTPUT.search(text)
        return observation(tool, output.group(1) if output else text, int(code.group(1)) if code else None)
