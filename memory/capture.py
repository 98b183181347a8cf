"""Capture: rules that turn the traffic into short-term memory candidates.

Each message arrives split into spans by what produced them (the person, the agent's
scaffolding, a tool: `pipeline/provenance.py`, passed in by the proxy):

- the person's own words: stated preferences (User) and corrections of what the agent did
  (Feedback, with its `data` fields and the three turns before it); nothing else becomes one;
- any span: manifests such as `pyproject.toml`, `package.json`, `go.mod`, `Cargo.toml`, and
  directory listings (Project);
- results of fetch/browse tools: documents (Reference, summarised to at most 500 tokens).

Every candidate keeps its source and the verbatim span it came from (its provenance).
"""
from __future__ import annotations

import os
import re
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

import orjson

from ctxgate.pipeline.boundaries import head_at_boundary
from ctxgate.wal.paths import safe_name
from .entries import REFERENCE_SUMMARY_TOKENS, Category
from .short_term import Candidate

Truncate = Callable[[str, int], str]

_PREFERENCE = re.compile(
    r"(?i)\b(i (?:always |really )?prefer|i(?:'d| would) (?:rather|like you to)|please always|"
    r"always (?:use|answer|write|reply|respond)|"
    r"never (?:use|answer|write|reply)|from now on|my (?:preferred|favourite|favorite)|i like (?:my|it when)|"
    r"call me)\b[^.\n!?]*[.!?]?")
_CORRECTION = re.compile(
    r"(?i)\b(no,? (?:use|do|don't|not)|don't use|do not use|instead of|rather than|that's wrong|that is wrong|"
    r"not what i (?:asked|wanted)|you should(?:n't| not)? have|stop (?:using|doing)|"
    r"wrong (?:tool|approach|file))\b[^\n]*")
_PREFERENCE_HINT = re.compile(r"prefer|rather|like you to|always|never|from now on|favo|i like|call me")
_CORRECTION_HINT = re.compile(r"no,? (?:use|do|not)|don't use|do not use|instead of|rather than|that's wrong|"
                              r"that is wrong|not what i|you should|stop (?:using|doing)|wrong (?:tool|approach|file)")
"""Strings every match of `_PREFERENCE` (`_CORRECTION`) holds, lower-cased: searched for first in
the lower-cased text when it is ASCII (there the patterns' IGNORECASE is exactly `str.lower`), a
scan in C that most texts fail, where the patterns cost ~35 us a text."""
_CODE_STYLE = re.compile(r"(?i)\b(style|format|indent|naming|pep ?8|camel|snake|type hints?|docstring|lint|black|"
                         r"prettier|quotes?)\b")
_APPROACH = re.compile(r"(?i)\b(approach|instead|async|sync|design|architecture|pattern|algorithm)\b")
_FETCH_TOOL = re.compile(r"(?i)fetch|browse|browser|web|http|curl|wget|url|read_url|search_docs")
_URL = re.compile(r"https?://[^\s\"'<>)]+")
def _needles(*strings: str) -> re.Pattern[str]:
    return re.compile("|".join(map(re.escape, strings)))


_MANIFESTS: tuple[tuple[str, re.Pattern[str], re.Pattern[str]], ...] = (
    ("pyproject.toml", _needles("[project]", "[tool.poetry]", "[build-system]"),
     re.compile(r"(?m)^\[(?:project|tool\.poetry|build-system)\]")),
    ("package.json", _needles('ependencies"'), re.compile(r'"(?:dependencies|devDependencies)"\s*:\s*\{')),
    ("go.mod", _needles("module "), re.compile(r"(?m)^module [\w./-]+\s*$[\s\S]*^go \d")),
    ("Cargo.toml", _needles("[package]"), re.compile(r"(?m)^\[package\][\s\S]*^edition\s*=")),
    ("requirements.txt", _needles("==", "<=", ">=", "~=", "!="),
     re.compile(r"(?m)^(?:[A-Za-z0-9_.-]+(?:\[[^\]]+\])?\s*[=<>~!]=\s*[\w.*]+\s*\n){3,}")),
)
"""Each manifest's name, the strings one of which its pattern's every match holds, and the
pattern: a text is searched for the strings first (a scan in C; most texts hold none, and the
pattern is not tried). The patterns were ~10 of the ~26 ms of a new 200K-token
conversation's capture; the strings take ~2.5."""
MANIFEST_LANGUAGE = {"pyproject.toml": "python", "requirements.txt": "python", "package.json": "javascript",
             "go.mod": "go", "Cargo.toml": "rust"}
_FRAMEWORKS = ("django", "flask", "fastapi", "pytest", "react", "vue", "next", "express", "gin", "tokio",
               "numpy", "pandas", "sqlalchemy", "aiohttp", "spring", "rails")
_LISTING_LINE = re.compile(r"^(?=.*[A-Za-z])/?[\w.@+-][\w./@+-]*/?$")
"""A name in a listing: path characters only, and a letter among them (a column of numbers,
`seq`'s or a count's, is not a listing)."""


class SourcedText(Protocol):
    """A span of a message and what produced it (`pipeline.provenance.Span` is one)."""

    @property
    def source(self) -> str: ...

    @property
    def text(self) -> str: ...


Spans = Mapping[int, Sequence[SourcedText]]
SPAN_CHARS = 2000


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def capture(messages: list[dict[str, Any]], spans: Spans, truncate: Truncate,
            now: float | None = None, pause: Callable[[], None] | None = None) -> list[tuple[int, Candidate]]:
    """Candidates found in `messages[i]` for each i in `spans` (the messages not seen before,
    split by source). Preferences and corrections come only from the person's own words
    (`human` spans); any span may show project facts; a fetch tool's result is a document.
    `pause`: called before each message when read in a thread (a long new history), to give
    the GIL back (the event loop, answering a request, takes it then rather than after a
    switch interval) and to wait while the gateway counts a turn."""
    at = time.time() if now is None else now
    found: list[tuple[int, Candidate]] = []
    for i in sorted(spans):
        if pause is not None:
            pause()
        tool, args = _call_of(messages, i) if messages[i].get("role") == "tool" else (None, {})
        for span in spans[i]:
            text = span.text
            if not text.strip():
                continue
            if span.source == "human":
                found += [(i, c) for c in _from_user(messages, i, text, at)]
            if tool is not None and _FETCH_TOOL.search(tool):
                found.append((i, _reference(text, args, truncate, at)))
            else:
                found += [(i, _sourced(c, span.source, text)) for c in project_facts(text, at)]
    return found


def _sourced(candidate: Candidate, source: str, span: str) -> Candidate:
    candidate.source, candidate.span = source, head_at_boundary(span, SPAN_CHARS)
    return candidate


def _from_user(messages: list[dict[str, Any]], i: int, text: str, at: float) -> list[Candidate]:
    """What the person said: stated preferences and corrections, each with its sentence as the span."""
    out = []
    head = text[:4000]
    lowered = head.lower() if head.isascii() else None
    preference = lowered is None or _PREFERENCE_HINT.search(lowered) is not None
    for match in _PREFERENCE.finditer(head) if preference else ():
        sentence = match.group(0).strip()
        out.append(Candidate(Category.USER, sentence,
                             {"preferences": {"statement": sentence}, "source": "user message"},
                             at, "human", sentence))
    correction = _CORRECTION.search(head) if lowered is None or _CORRECTION_HINT.search(lowered) else None
    if correction and i > 0:
        previous = _previous_action(messages, i)
        said = head_at_boundary(correction.group(0).strip(), 300)
        kind = ("code_style" if _CODE_STYLE.search(said) else
                "tool_choice" if _mentions_tool(said, messages, i) else
                "approach" if _APPROACH.search(said) else "other")
        snippet = [{"role": m.get("role"), "content": head_at_boundary(text_of(m.get("content")), 300)}
                   for m in messages[max(0, i - 6):i + 1]]
        out.append(Candidate(Category.FEEDBACK, f"Correction ({kind}): {said}", {
            "correction_type": kind, "original_action": previous, "corrected_action": said,
            "context_snippet": snippet}, at, "human", said))
    return out


def _previous_action(messages: list[dict[str, Any]], i: int) -> str:
    for m in reversed(messages[:i]):
        if m.get("role") == "assistant":
            calls = [c.get("function", {}).get("name", "") for c in m.get("tool_calls") or [] if isinstance(c, dict)]
            return ("called " + ", ".join(calls)) if calls else head_at_boundary(text_of(m.get("content")), 300)
    return ""


def _mentions_tool(said: str, messages: list[dict[str, Any]], i: int) -> bool:
    names = {c.get("function", {}).get("name", "") for m in messages[:i] for c in m.get("tool_calls") or []
             if isinstance(c, dict)}
    lowered = said.lower()
    return any(n and n.lower() in lowered for n in names) or bool(re.search(r"(?i)\btool\b|\bcommand\b", said))


def _call_of(messages: list[dict[str, Any]], i: int) -> tuple[str | None, dict[str, Any]]:
    call_id = messages[i].get("tool_call_id")
    for k in range(i - 1, -1, -1):  # not a copy of the history for each tool result
        m = messages[k]
        if m.get("role") != "assistant":
            continue
        for call in m.get("tool_calls") or []:
            if isinstance(call, dict) and call.get("id") == call_id:
                fn = call.get("function") or {}
                try:
                    args = orjson.loads(fn.get("arguments") or "{}")
                except orjson.JSONDecodeError:
                    args = {}
                return fn.get("name"), args if isinstance(args, dict) else {}
        break
    return messages[i].get("name"), {}


def _reference(text: str, args: dict[str, Any], truncate: Truncate, at: float) -> Candidate:
    source = next((v for v in args.values() if isinstance(v, str) and _URL.match(v)), None)
    if source is None:
        found = _URL.search(text)
        source = found.group(0) if found else "inline"
    topic = head_at_boundary(next((ln.strip("# ").strip() for ln in text.splitlines() if ln.strip()), ""), 120)
    summary = truncate(text, REFERENCE_SUMMARY_TOKENS)
    return Candidate(Category.REFERENCE, f"{topic}: {summary}", {
        "source": source, "topic": topic, "summary": summary, "original_length": len(text)}, at, "document",
        head_at_boundary(text, SPAN_CHARS))


def project_facts(text: str, at: float) -> list[Candidate]:
    out = []
    sample = text[:20000]
    for name, needles, pattern in _MANIFESTS:
        if needles.search(sample) and pattern.search(sample):
            lowered = sample.lower()
            frameworks = sorted({f for f in _FRAMEWORKS if re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", lowered)})
            stack = {"language": MANIFEST_LANGUAGE[name], "manifest": name, "frameworks": frameworks}
            if name == "pyproject.toml" and "poetry" in lowered:
                stack["package_manager"] = "poetry"
            elif name == "package.json":
                stack["package_manager"] = "npm"
            out.append(Candidate(Category.PROJECT, f"Tech stack from {name}: {MANIFEST_LANGUAGE[name]}"
                                 + (f" ({', '.join(frameworks)})" if frameworks else ""), {"tech_stack": stack}, at))
            break
    listing = _listing(sample)
    if listing:
        out.append(Candidate(Category.PROJECT, f"Files seen: {', '.join(listing[:30])}",
                             {"file_index": {p: {} for p in listing}}, at))
    return out


def _listing(text: str) -> list[str]:
    """A directory listing: most lines are single path-like names (ls, find, tree-less): 4 to
    2,000 lines that are not blank, at least 80% of them names."""
    split = text.splitlines()
    # Once more than a fifth of all its lines (blank ones counted) are not names, fewer than 80%
    # of its non-blank lines can be: a text that is no listing is given up early, mostly unread.
    most_others = len(split) // 5
    names: list[str] = []
    others = 0
    for line in split:
        line = line.strip()
        if not line:
            continue
        if _LISTING_LINE.match(line):
            names.append(line)
        else:
            others += 1
            if others > most_others:
                return []
    lines = len(names) + others
    if not 4 <= lines <= 2000 or len(names) < 0.8 * lines:
        return []
    root = os.path.commonpath(names) if all(n.startswith("/") for n in names) and len(names) > 1 else ""
    return [n[len(root):].lstrip("/") or n for n in names] if root and root != "/" else names


_WORKSPACE = re.compile(r"(?<![\w.])(/(?:workspace|testbed|repo|repos|project|projects|src|app|code)(?:/[\w.@+-]+)?)"
                        r"(?=[/\s'\"`.,:;)]|$)")


def project_id(root: str) -> str:
    """A workspace path as a project id under the proxy's id rule: `/workspace/shop` is
    `workspace:shop`, hashed when it still breaks the rule."""
    return safe_name(root.strip("/").replace("/", ":"))


ROOT_MESSAGES = 4
"""The leading messages a workspace root is looked for in (`workspace_root`)."""


def workspace_root(messages: list[dict[str, Any]]) -> str | None:
    """The workspace root an agent names in its system prompt or task (OpenHands
    `/workspace/<repo>`, SWE-agent `/testbed` or `/<repo>`), as the project's id."""
    for m in messages[:ROOT_MESSAGES]:
        if m.get("role") in ("system", "developer", "user"):
            found = _WORKSPACE.search(text_of(m.get("content"))[:20000])
            if found:
                return found.group(1).rstrip(".")
    return None
