"""The recoverability bench's cut-line probe: a line ctxgate cut, answered only through expansion.

For each case, the probe is one line of the run's observations (a tool's output, or a user
turn of a text dialect) that ctxgate's compressed request no longer holds: of the distinct
lines of 20 characters or more that appear once in the input and whose first and last 12
characters are nowhere in the output, the one whose blake2b hash is smallest (an arbitrary
pick no method is tuned to). A trimming baseline answers it when the line is still in its
output. ctxgate answers it when the line is in its output or when a model that asks the
gateway's expansion tool (`Expansion`, the code the gateway runs: the content store, the
per-turn limit of 3, the room left under the compaction trigger, excerpts of what does not fit) gets it
back within that limit.

The model is simulated as one that knows which part of the history it wants: it asks for the
reference, among those its request names, whose original holds the line (or names a
reference that does), and when the result is an excerpt without it, for the reference the
excerpt names for the missing part; it reads each result in place of the note it expands
(a line a Microcompact cut ran through reads whole again). So the probe measures the mechanism (every cut is
stored, named and reachable within the limits), not how well a real model picks a
reference from a note.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ctxgate.pipeline.config import ExpandConfig
from ctxgate.pipeline.refs import REF_RE
from ctxgate.pipeline.tokens import TokenCounter
from ctxgate.proxy.engine.content_store import MemoryContentStore
from ctxgate.proxy.engine.expansion import Expansion, ToolCall

Message = dict[str, Any]
MIN_LINE = 20
EDGE = 12
"""A line is lost when neither its start nor its end is in the output: a line a cut runs
through is half in view, and the model has that half without asking."""


def _text(m: Message) -> str:
    content = m.get("content")
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or p.get("content") or "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


async def _whole(ref: str, store: MemoryContentStore, config: ExpandConfig, seen: set[str]) -> str | None:
    """`ref`'s original with every reference it names put in its place, as deep as they go:
    everything a model could read through it."""
    original = await store.get("bench", "case", ref, config.store_ttl_s)
    if original is None or ref in seen:
        return None
    seen.add(ref)
    for inner in REF_RE.findall(original):
        if (text := await _whole(inner, store, config, seen)) is not None:
            original = _put_in(original, inner, text)
    return original


def cut_line(observations: list[Message], out: list[Message]) -> str | None:
    """The probe for a case: a line of the observations its output lost, or None."""
    blob = "\n".join(_text(m) for m in out) + "\n".join(json.dumps(m.get("tool_calls") or []) for m in out)
    seen: dict[str, int] = {}
    for m in observations:
        for line in _text(m).splitlines():
            line = line.strip()
            if len(line) >= MIN_LINE:
                seen[line] = seen.get(line, 0) + 1
    lost = [line for line, n in seen.items() if n == 1 and line[:EDGE] not in blob and line[-EDGE:] not in blob]
    return min(lost, key=lambda s: hashlib.blake2b(s.encode(), digest_size=8).digest()) if lost else None


async def expansions_to_reach(line: str, out: list[Message], originals: dict[str, str], room: int,
                              counter: TokenCounter, config: ExpandConfig | None = None) -> int | None:
    """How many expansions bring `line` back to a model reading `out` (None: not within the limit)."""
    config = config or ExpandConfig()
    store = MemoryContentStore()
    await store.put("bench", "case", originals, config.store_max_bytes, config.store_ttl_s)
    expansion = Expansion(config, store, "bench", "case", counter, room=room)
    read = "\n".join(_text(m) for m in out)
    named = REF_RE.findall(read)
    for n in range(1, config.max_per_turn + 1):
        ref = None
        for candidate in dict.fromkeys(named):
            if candidate in expansion.served:
                continue
            whole = await _whole(candidate, store, config, set())
            if whole is not None and line in _put_in(read, candidate, whole):
                ref = candidate
                break
        if ref is None:
            return None
        result = await expansion.answer(ToolCall(f"call_{n}", json.dumps({"ref": ref})))
        read = _put_in(read, ref, result)
        if line in read:
            return n
        named = REF_RE.findall(result)
    return None


def _put_in(read: str, ref: str, result: str) -> str:
    """What the model has read so far with `result` in place of the in-line note naming `ref`
    (a Microcompact separator, an excerpt's gap): a line such a note ran through reads whole
    again. A span's note (Snip, Collapse, Autocompact) stands for whole messages: appended."""
    inline = re.compile(r"\n\.\.\. \[middle \d+ tokens truncated, ref %s\] \.\.\.\n|\[\.\.\. \d+ lines, \d+ tokens: "
                        r"ref %s\]\n|\n\[\.\.\. \d+ more tokens: ref %s\]" % (ref, ref, ref))
    found = inline.search(read)
    return read[:found.start()] + result + read[found.end():] if found else read + "\n" + result
