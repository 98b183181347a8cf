"""Who writes a replay's Autocompact summaries: the configured model when it can be reached,
else a deterministic offline summariser; the report says which did.

The model is asked once per summary through the gateway's own call (`Gateway.summarize`);
the first failure of any kind (no network, a refused key, a timeout) switches the rest of
the run to the offline summariser, so a replay without network still finishes in seconds.

The offline summariser reads the transcript Autocompact sends (`[role] text` paragraphs)
and fills the six fields of `SUMMARY_PROMPT` from it, with no model: the task, the actions
in order, the tools used, the last error lines, the file paths mentioned. It is what a
summary can be without understanding, enough to see what the compaction keeps.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...pipeline.tokens import TokenCounter

if TYPE_CHECKING:
    from ..gateway import Gateway

Message = dict[str, Any]
_PARAGRAPH = re.compile(r"^\[(system|developer|user|assistant|tool)\] ", re.M)
_PATH = re.compile(r"(?<![\w/.])((?:/|\./)?(?:[\w.-]+/)+[\w.-]+\.\w{1,6}|[\w-]+\.(?:py|js|ts|go|rs|java|c|h|cpp|"
                   r"md|json|yaml|yml|toml|txt|cfg|ini|sh|html|css))\b")
_ERROR = re.compile(r"(Traceback|Error|error:|FAILED|Exception|not found|No such file)", re.I)
_ACTION = re.compile(r"(?:\bcalls? |<function=|```(?:bash|sh)?\n|\"name\": ?\")([\w./-]+)")
MAX_STEPS, MAX_FILES, LINE_CHARS = 12, 15, 160


def _paragraphs(prompt: list[Message]) -> list[tuple[str, str]]:
    """(role, text) of each message of the transcript in the prompt's last message."""
    text = str(prompt[-1].get("content") or "") if prompt else ""
    text = text.split("\n\n", 1)[1] if text.startswith("Conversation history:") and "\n\n" in text else text
    marks = list(_PARAGRAPH.finditer(text))
    return [(m.group(1), text[m.end():marks[k + 1].start() if k + 1 < len(marks) else len(text)].strip())
            for k, m in enumerate(marks)]


def _line(text: str) -> str:
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first if len(first) <= LINE_CHARS else first[:LINE_CHARS - 1] + "…"


def offline_summary(prompt: list[Message]) -> str:
    """The six fields from the transcript alone (see the module's docstring)."""
    paragraphs = _paragraphs(prompt)
    users = [t for r, t in paragraphs if r == "user" and t]
    agent = [t for r, t in paragraphs if r == "assistant" and t]
    observations = [t for r, t in paragraphs if r in ("tool", "user")]
    tools = list(dict.fromkeys(m.group(1) for t in agent for m in _ACTION.finditer(t)))
    files = list(dict.fromkeys(m.group(1) for _, t in paragraphs for m in _PATH.finditer(t)))[-MAX_FILES:]
    errors = [_line(line) for t in observations[-5:] for line in t.splitlines() if _ERROR.search(line)][-3:]
    steps = [_line(t) for t in agent][-MAX_STEPS:]
    skipped = len(agent) - len(steps)
    lines = ["1. User goal: " + (_line(users[0]) if users else "not stated in the summarised part"),
             "2. Completed steps:" + (f" ({skipped} earlier steps not listed)" if skipped > 0 else "")]
    lines += [f"   - {s}" for s in steps] or ["   - none recorded"]
    lines.append("3. Key decisions: tools called: " + (", ".join(tools[:10]) or "none named"))
    lines.append("4. Open problems: " + ("; ".join(errors) if errors else "no error in the last observations"))
    lines.append("5. Current files: " + (", ".join(files) or "none named"))
    lines.append(f"6. Skill/tool context: {len(agent)} agent messages and {len(observations)} observations "
                 "summarised offline (no model)")
    return "\n".join(lines)


@dataclass
class Summarizer:
    """The replay's summarize callable: the model while it answers, then the offline summariser."""
    counter: TokenCounter
    gateway: "Gateway | None" = None
    model: str = ""
    """The `model_name` that writes summaries, when a gateway is there to ask."""
    model_calls: int = 0
    offline_calls: int = 0
    failure: str = ""
    """Why the model was given up on (empty: it never failed, or was never tried)."""
    prompt_tokens: list[int] = field(default_factory=list)
    """Each call's prompt, in the session's count: what the summaries cost."""
    summary_tokens: list[int] = field(default_factory=list)

    async def __call__(self, prompt: list[Message]) -> str:
        self.prompt_tokens.append(self.counter.count_messages(prompt))
        text = await self._write(prompt)
        self.summary_tokens.append(self.counter.count(text))
        return text

    async def _write(self, prompt: list[Message]) -> str:
        if self.gateway is not None and not self.failure:
            try:
                text = await self.gateway.summarize(self.model, prompt)
                self.model_calls += 1
                return text
            except Exception as e:  # any failure: the offline summariser takes over for the run
                self.failure = f"{type(e).__name__}: {str(e)[:200]}"
        self.offline_calls += 1
        return offline_summary(prompt)

    def described(self) -> str:
        """Who wrote the summaries, as the report says it."""
        if self.gateway is None:
            return "offline summariser (no model configured with a key)"
        if self.failure and self.model_calls:
            return (f"model {self.model} ({self.model_calls} summaries), then the offline summariser after a "
                    f"failure: {self.failure}")
        if self.failure:
            return f"offline summariser: model {self.model} failed ({self.failure})"
        return f"model {self.model}"
