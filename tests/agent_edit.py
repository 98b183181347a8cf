"""A scripted model that edits a file through aider's SEARCH/REPLACE blocks (issue 36, item 6).

Model `agent-edit-N`, on a chat request that offers no tools (aider's): N steps of shell
commands, each printing its marker and a bulk of output that takes the session past its
limit (the text protocol of tests/agent_steps.py, a smaller bulk), then one edit of calc.py:
a SEARCH/REPLACE block whose SEARCH is the line holding `return 0` as aider's files-in-chat
message shows calc.py in this very request. aider applies the block only if it matches the
file on disk byte for byte; when the message did not reach the model verbatim there is no
such line to copy, and the reply is `LOST`, with no edit.
"""
from __future__ import annotations

import re
from typing import Any

from agent_steps import text_step
from ctxgate.pipeline.protocols.base import text_of

_NAME = re.compile(r"agent-edit-(\d+)(-touch)?")
"""`-touch`: each step's command also appends a comment line to calc.py, so aider's files-in-chat
message, which it rebuilds from the file every turn, has changed at the next turn."""
BULK_LINES = 120
"""`seq 1 120`: about 250 tokens a step."""
FILES_IN_CHAT = "I have *added these files to the chat*"
EDITED_FILE = "calc.py"
OLD, NEW = "return 0", "return sum(args)"
_FENCED = re.compile(r"^" + re.escape(EDITED_FILE) + r"\n```[^\n]*\n(.*?)^```", re.M | re.S)


def is_edit_model(model: str) -> bool:
    return _NAME.fullmatch(model) is not None


def edit_reply(messages: list[Any], model: str) -> str:
    """The next step's ```bash block, the edit once every step's output arrived, or `LOST`."""
    found = _NAME.fullmatch(model)
    assert found is not None, model
    total = int(found.group(1))
    step = text_step(messages)
    if step is None:
        return "LOST"
    if step < total:
        touch = f" && echo '# step {step + 1}' >> {EDITED_FILE}" if found.group(2) else ""
        return f"Running step {step + 1}.\n\n```bash\necho STEP-{step + 1}-OK && seq 1 {BULK_LINES}{touch}\n```\n"
    said = [text_of(m) for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    files = next((text for text in reversed(said) if text.lstrip().startswith(FILES_IN_CHAT)), "")
    shown = _FENCED.search(files)
    line = next((x for x in shown.group(1).splitlines() if OLD in x), None) if shown else None
    if line is None:
        return "LOST"
    return (f"{EDITED_FILE}\n```python\n<<<<<<< SEARCH\n{line}\n=======\n{line.replace(OLD, NEW)}\n"
            ">>>>>>> REPLACE\n```\n")


def edit_choice(body: dict[str, Any], model: str, i: int) -> dict[str, Any]:
    """A Chat Completions choice of `edit_reply`."""
    return {"index": i, "message": {"role": "assistant", "content": edit_reply(body.get("messages") or [], model)},
            "logprobs": None, "finish_reason": "stop"}
