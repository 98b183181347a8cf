"""Who writes a replay's Autocompact summaries: the configured model when it can be reached,
else a deterministic offline summariser; the report says which did.

The model is asked once per summary through the gateway's own call (`Summarizer.complete`);
the first failure of any kind (no network, a refused key, a timeout) switches the rest of
the run to the offline summariser, so a replay without network still finishes in seconds.

The offline summariser reads the transcript Autocompact sends (`[role] text` paragraphs)
and fills the six fields of `SUMMARY_PROMPT` from it, with no model: the task, the actions
in order, the tools used, the last error lines, the file paths mentioned. It is what a
summary can be without understanding, enough to see what the compaction keeps.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ctxgate.pipeline.notes import AUTOCOMPACT_MARKER, OPEN, SNIP_MARKER
from ctxgate.pipeline.tokens import TokenCounter

if TYPE_CHECKING:
    from ..gateway import Gateway

Message = dict[str, Any]
_PARAGRAPH = re.compile(r"^\[(system|developer|user|assistant|tool|ctxgate)\] ", re.M)
"""`[ctxgate]`: one of ctxgate's notes (`pipeline.autocompact.serialise`)."""
_PATH = re.compile(r"(?<![\w/.])((?:/|\./)?(?:[\w.-]+/)+[\w.-]+\.\w{1,6}|[\w-]+\.(?:py|js|ts|go|rs|java|c|h|cpp|"
                   r"md|json|yaml|yml|toml|txt|cfg|ini|sh|html|css))\b")
_ERROR = re.compile(r"(Traceback|Error|error:|FAILED|Exception|not found|No such file)", re.I)
_ACTION = re.compile(r"(?:\[called |<function=|```(?:bash|sh)?\n)([\w./-]+)")
"""An action in the transcript: a tool call as Autocompact writes it (`[called NAME(ARGS)]`),
an OpenHands `<function=NAME>`, or the first word of a fenced shell command."""
_EARLIER_STEPS = re.compile(r"^2\. Completed steps:(?: \(\d+ earlier not listed\))? (.*)$", re.M)
_EARLIER_TOOLS = re.compile(r"^3\. Key decisions: tools called: (.*)$", re.M)
_EARLIER_FILES = re.compile(r"^5\. Current files: (.*)$", re.M)
_SNIPPED_STEP = re.compile(r"^- assistant: (.+)$", re.M)
_SEPARATOR = {_EARLIER_STEPS: "; ", _EARLIER_TOOLS: ", ", _EARLIER_FILES: ", "}
_NONE = ("none recorded", "none named")
MAX_STEPS, MAX_FILES, LINE_CHARS, STEP_CHARS = 8, 15, 160, 70


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


def _step(text: str) -> str:
    """An agent message as one line: what it said first, and the action it took."""
    said = _line(re.sub(r"\[called [^\n]*", "", text))
    action = _ACTION.search(text)
    done = _line(text[action.start():].lstrip("[`")) if action else ""
    step = " → ".join(p for p in (said, done) if p)
    return step if len(step) <= STEP_CHARS else step[:STEP_CHARS - 1] + "…"


def _unquoted(note: str) -> str:
    """A note's text without the line opening its quote block."""
    return note.split("\n", 1)[1] if note.startswith(OPEN) and "\n" in note else note


def _carried(notes: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(steps, tools, files) an earlier compaction left in ctxgate's notes: a summary's step
    list and fields 3 and 5, a Snip note's previews of the agent's messages. Summarising a
    summary keeps what it said."""
    steps: list[str] = []
    tools: list[str] = []
    files: list[str] = []
    for note in notes:
        if note.startswith(AUTOCOMPACT_MARKER):
            for heading, into in ((_EARLIER_STEPS, steps), (_EARLIER_TOOLS, tools), (_EARLIER_FILES, files)):
                found = heading.search(note)
                into += [x for x in found.group(1).split(_SEPARATOR[heading]) if x and x not in _NONE] if found else []
        elif note.startswith(SNIP_MARKER):
            steps += _SNIPPED_STEP.findall(note)
    return steps, tools, files


def offline_summary(prompt: list[Message]) -> str:
    """The six fields from the transcript alone (see the module's docstring)."""
    paragraphs = _paragraphs(prompt)
    users = [t for r, t in paragraphs if r == "user" and t]
    agent = [t for r, t in paragraphs if r == "assistant" and t]
    observations = [t for r, t in paragraphs if r in ("tool", "user")]
    earlier_steps, earlier_tools, earlier_files = _carried([_unquoted(t) for r, t in paragraphs
                                                            if r in ("system", "ctxgate")])
    tools = list(dict.fromkeys(earlier_tools + [m.group(1) for t in agent for m in _ACTION.finditer(t)]))
    files = list(dict.fromkeys(earlier_files + [m.group(1) for r, t in paragraphs if r != "system"
                                                for m in _PATH.finditer(t) if r != "ctxgate"]))[-MAX_FILES:]
    errors = [_line(line) for t in observations[-5:] for line in t.splitlines() if _ERROR.search(line)][-3:]
    every_step = earlier_steps + [_step(t) for t in agent]
    steps = every_step[-MAX_STEPS:]
    skipped = len(every_step) - len(steps)
    # One line per field: when the budget leaves a summary little room, `shorten` cuts every
    # line to a share of it, so fewer lines keep more of each.
    lines = ["1. User goal: " + (_line(users[0]) if users else "the task statement, kept verbatim above"),
             "2. Completed steps:" + (f" ({skipped} earlier not listed)" if skipped > 0 else "") + " "
             + ("; ".join(steps) or "none recorded")]
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
    timeout_s: float = 60.0
    """Autocompact's deadline for one summary (`autocompact.timeout_s`)."""
    model_calls: int = 0
    failure: str = ""
    """Why the model was given up on (empty: it never failed, or was never tried)."""
    prompt_tokens: list[int] = field(default_factory=list)
    """Each call's prompt, in the session's count: what the summaries cost."""
    summary_tokens: list[int] = field(default_factory=list)

    async def __call__(self, prompt: list[Message]) -> str:
        prompt_tokens = self.counter.count_messages(prompt)
        text = await self._write(prompt)
        # Kept only once the call is done: a background summary cancelled at the end of a
        # session was never paid for.
        self.prompt_tokens.append(prompt_tokens)
        self.summary_tokens.append(self.counter.count(text))
        return text

    async def _write(self, prompt: list[Message]) -> str:
        if self.gateway is not None and not self.failure:
            try:
                # Half of Autocompact's own deadline: a model that hangs is given up on while
                # the offline summary can still answer in time.
                text = await asyncio.wait_for(self.gateway.summarizer.complete(self.model, prompt), self.timeout_s / 2)
                self.model_calls += 1
                return text
            except Exception as e:  # any failure: the offline summariser takes over for the run
                timed_out = isinstance(e, asyncio.TimeoutError)
                self.failure = "timed out" if timed_out else f"{type(e).__name__}: {str(e)[:200]}"
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
