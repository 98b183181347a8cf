"""Recoverability probes: what a continuing agent needs at one turn, read from the request
its agent sent, and whether the request ctxgate forwarded still holds it.

The scorer's own reading of the transcript, independent of ctxgate's (pipeline/restore.py
reads the same things to restore them; a probe that used it would only check itself):
- task: the task statement (the first user message, or the one after a SWE-agent
  demonstration) is in a forwarded message, or 90% of its first 500 characters are;
- files: the share of the paths the agent named so far (tool-call arguments, text-protocol
  `<function=…>` parameters and command blocks, `[File: …]` / `(Open file: …)` headers)
  found anywhere in the forwarded request; n/a before the first. Not a path: a URL's, one in
  the text a command writes into a file (a heredoc's body, an `edit` body), one in code outside
  its string literals (`self.lock`, `process.env`);
- error: the last failure line the agent saw is present: the key line of the newest
  observation that reports a failure by its structure (`last_error_line`); n/a while there is none;
- latest: the share of the request's last `LATEST` messages forwarded verbatim;
- valid: tool calls and their results still paired.
A refused turn scores 0 on every probe: the agent got no reply.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from ctxgate.pipeline.turns import first_user_index, is_valid_sequence
from .driver import Forwarded, agent_turns

Message = dict[str, Any]
LATEST = 6
"""The last messages of the request that should arrive verbatim."""
PROBES = ("task", "files", "error", "latest", "valid")
_EXT = ("py|pyi|pyx|js|mjs|ts|tsx|jsx|json|yaml|yml|toml|cfg|ini|txt|md|rst|c|h|cc|cpp|hpp|go|rs|java|rb|php|sh|"
        "html|css|sql|xml|csv|lock|patch|diff|ipynb|conf|env")
PATH_RE = re.compile(r"(?<![\w/.\-])((?:~|\.{1,2})?/?(?:[\w.\-]+/)*[\w\-][\w.\-]*\.(?:" + _EXT + r"))(?![\w/\-])")
ERROR_MARKERS = ("Error", "Traceback", "error:")
"""What the stand-in summariser (bench/dialects.py) quotes as an error: any line naming one."""
_PATH_KEYS = ("path", "file_path", "filepath", "filename", "file", "target_file", "file_name")
_HEADER_RE = re.compile(r"\[File: ([^\s\]]+)|\(Open file: ([^)\n]+)\)")
_FUNCTION_RE = re.compile(r"<function=[\w.\-]+>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER_RE = re.compile(r"<parameter=([\w\-]+)>(.*?)</parameter>", re.S)
_LISTING_RE = re.compile(r"^\s*\d+(?::|\t|\s{2,})")
"""A numbered line of a file view (`317:    raise ValueError(`, `cat -n` output): code, not an error."""


def text_of(m: Message) -> str:
    content = m.get("content")
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    parts = [content if isinstance(content, str) else ""]
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        parts.append(f"{fn.get('name', '')}({fn.get('arguments', '')})")
    return "\n".join(parts)


def squash(text: str) -> str:
    return " ".join(text.split())


def _canon_args(args: Any) -> str:
    if isinstance(args, str):
        try:
            return json.dumps(json.loads(args), sort_keys=True)
        except (ValueError, TypeError):
            return args
    return json.dumps(args, sort_keys=True)


def norm(m: Message) -> tuple[Any, ...]:
    """A message as a provider sees it, so equal messages compare equal however they were built."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = tuple(sorted((tc.get("id"), (tc.get("function") or {}).get("name"),
                          _canon_args((tc.get("function") or {}).get("arguments")))
                         for tc in m.get("tool_calls") or []))
    return (m.get("role"), content or "", calls, m.get("tool_call_id"))


def observations(messages: list[Message], text_mode: bool) -> list[Message]:
    """Tool results; for a text dialect (observations in user turns), the user turns after the task."""
    if not text_mode:
        return [m for m in messages if m.get("role") == "tool"]
    first = first_user_index(messages)
    return [m for i, m in enumerate(messages) if m.get("role") == "user" and i != first]


_URL_RE = re.compile(r"\b[A-Za-z][\w+.\-]*://\S*")
"""A URL: its path (`localhost:3333/index.html`) is a page, not a file the agent works on."""
_HEREDOC_RE = re.compile(r"<<-?\s*(['\"]?)(\w+)\1[^\n]*\n.*?^\s*\2\s*$", re.S | re.M)
_EDIT_RE = re.compile(r"^(edit\b[^\n]*)\n.*?^end_of_edit\s*$", re.S | re.M)
"""A heredoc's body and SWE-agent's `edit` body: the text written into a file (code, where
`self.lock` and `process.env` are not files), not files named."""
_LITERAL_RE = re.compile(r"""(['"])((?:(?!\1)[^\\\n]|\\.)*)\1""")
"""A string literal in code: where code names a file (`open('src/a.py')`)."""


def command_paths(command: str) -> list[str]:
    """The paths a command names: not in a URL, nor in the text it writes into a file."""
    command = _EDIT_RE.sub(r"\1", _HEREDOC_RE.sub("", command))
    return [p for p in PATH_RE.findall(_URL_RE.sub(" ", command)) if p != "/dev/null"]


def code_paths(code: str) -> list[str]:
    """The paths code names: in its string literals (elsewhere `self.lock` is an attribute)."""
    return [p for _, text in _LITERAL_RE.findall(code) for p in command_paths(text)]


def touched_files(messages: list[Message], text_mode: bool) -> list[str]:
    found: dict[str, None] = {}

    def add_from(text: str) -> None:
        for p in command_paths(text):
            found.setdefault(p, None)

    def add_args(args: dict[str, Any]) -> None:
        for k, v in args.items():
            if isinstance(v, str) and k in _PATH_KEYS and v.strip():
                found.setdefault(v.strip(), None)
            elif isinstance(v, str) and k in ("command", "cmd"):
                add_from(v)
            elif isinstance(v, str) and k == "code":
                for p in code_paths(v):
                    found.setdefault(p, None)

    for m in messages:
        for tc in m.get("tool_calls") or []:
            raw = (tc.get("function") or {}).get("arguments") or ""
            try:
                args = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError:
                args = None
            if isinstance(args, dict):
                add_args(args)
            else:
                add_from(str(raw))
        if text_mode and m.get("role") == "assistant":
            text = text_of(m)
            calls = _FUNCTION_RE.findall(text)
            for body in calls:  # OpenHands text protocol: the same arguments as its tool calls
                add_args({k: v.strip("\n") for k, v in _PARAMETER_RE.findall(body)})
            blocks = [] if calls else re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
            if blocks:
                add_from(blocks[-1])
    for m in observations(messages, text_mode):
        for a, b in _HEADER_RE.findall(text_of(m)):
            path = (a or b).strip()
            if path and path != "n/a" and "." in path.rsplit("/", 1)[-1]:
                found.setdefault(path, None)
    return list(found)


_EXIT_RE = re.compile(r"(?:exit(?:ed)?(?: with)? (?:code|status)|Exit code|<returncode>)[:\s]*(-?\d+)", re.I)
_PASS_RE = re.compile(r"^[✓✔√]|\bPASS(?:ED)?\b|\.\.\.\s*ok$|^ok\b|^OK\b|^Success\b|\ball checks passed\b"
                      r"|\b(?:no|zero|0) (?:errors?|failures?|failed|problems)\b", re.I | re.M)
_FAILS_RE = re.compile(r"^(?:E {2,}\S|\s*[✗✘✕×]|\s*--- FAIL\b|not ok\b)")
_TALLY_RE = re.compile(r"\b([1-9]\d*) (?:failed|failures?|errors?)\b", re.I)
_SAYS_RE = re.compile(
    r"^(?:[-*•] +)?(?:[A-Z]\d{3,4} +)?(?:[\w./\\~-]+\.\w+(?::\d+)+:? *)?"
    r"(?:Traceback\b|(?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception|Failure|Interrupt)(?::\s.*|:)?$|Exception in thread"
    r"|(?:\S+ )?(?:error|fatal|panic)(?:\[[\w-]+\])?(?::|!|\s|$)|(?:\S+ )?failed\b|failure\b"
    r"|\S+: \*\*\* .*\bError \d+)", re.I)
_SHELL_RE = re.compile(r"\bFAIL(?:ED)?\b|\bERROR\b|command not found|No such file or directory|Permission denied"
                       r"|Segmentation fault|core dumped")
_NOT_SAYING_RE = re.compile(r"^(?:\S+: *)?warning\b|^(?:[\w./-]+:\d+:)?\s*(?:raise|except|def|class|import|from|return"
                            r"|assert|throw|catch|if|elif|with|try)\b", re.I)


def failure_rank(line: str) -> int:
    """2: the line says what failed (an exception line or a traceback's header, pytest's
    `E   ` and `FAILED`, `error:` / `fatal:`, a shell's failure); 1: it says only that
    something failed (a non-zero exit's message, a tally of failures); 0: neither, which
    includes a line marked as passing (✓, PASSED, `... ok`, "0 failed", "no errors"), a
    warning, a numbered file-view line, and code naming an exception (`raise ValueError(`,
    `except TypeError:`, an indented docstring): failure reports start at the first column."""
    line = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line).rstrip()
    if not line.strip() or _LISTING_RE.match(line):
        return 0
    code = _EXIT_RE.search(line)
    if code and int(code.group(1)) == 0:
        return 0
    says = bool(_FAILS_RE.match(line)) or not (line[0].isspace() or _PASS_RE.search(line.strip())
                                                or _NOT_SAYING_RE.match(line)) and bool(
        _SAYS_RE.match(line) or _SHELL_RE.search(line))
    if says and not (_TALLY_RE.search(line) and not _SHELL_RE.search(line)):
        return 2
    return 1 if code or _TALLY_RE.search(line) else 0


def _outcome(m: Message) -> tuple[str, int | None]:
    """An observation's output and the exit status its wrapper gives (mini-swe-agent's
    `<returncode>`), the wrapper taken off."""
    text = text_of(m)
    wrapped = re.match(r"\s*<returncode>\s*(-?\d+)\s*</returncode>\s*(?:<output>\n?)?(.*?)(?:</output>\s*)?\Z",
                       text, re.S)
    return (wrapped.group(2), int(wrapped.group(1))) if wrapped else (text, None)


ENDS = 5
"""An output says how it ended in its first and last this many non-blank lines."""
_TRACEBACK_RE = re.compile(r"^\s*Traceback \(most recent call last\)")


_FRAME_RE = re.compile(r"^(?:EXECUTION RESULT of \[[^\]]*\]:|OBSERVATION:|\((?:Open file|Current directory): .*\)"
                       r"|bash-\$)$")
"""The lines an agent frames every output with (OpenHands' header, SWE-agent's status lines): not the output's."""


def _exception_lines(lines: list[str]) -> list[int]:
    """Where Python tracebacks end: after the header and the indented frames, the first line
    that starts at the first column is the exception, whatever its class is called."""
    found, open_ = [], False
    for i, line in enumerate(lines):
        plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line)
        if _TRACEBACK_RE.match(plain):
            open_ = True
        elif open_ and plain.strip() and not plain[:1].isspace():
            found.append(i)
            open_ = False
    return found


def last_error_line(messages: list[Message], text_mode: bool) -> str | None:
    """The last failure line the agent saw: in the newest observation that reports a failure,
    its last line that says what failed (a traceback's tail), else its last line that says
    that something did (an exit status, a tally); a line under 12 characters ("Error:") gets
    the next line too. An output whose wrapper gives a non-zero exit status and that has no
    such line: its last line not marked as passing. An output reports a failure by how it is
    built, not by any line in it: a non-zero exit status from its wrapper, a failure line among
    its first or last `ENDS` non-blank lines (an exit status, a tally, a tool's or a runner's
    last word) or a Python traceback; an error-looking line inside an output that began and
    ended well (a build log that went on) is not a failure of the command. Only observations
    after the task statement count: a SWE-agent demonstration before it shows another task's work."""
    task = task_statement_index(messages)
    after = messages[task + 1:] if task is not None else messages
    for m in reversed([m for m in after if m.get("role") == ("user" if text_mode else "tool")]):
        text, status = _outcome(m)
        lines = [ln.strip() for ln in text.splitlines()]
        ranks = [failure_rank(ln) for ln in text.splitlines()]
        exceptions = _exception_lines(text.splitlines())
        for i in exceptions:
            ranks[i] = 2
        ends = [r for r, ln in zip(ranks, lines) if re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", ln).strip()
                and not _FRAME_RE.match(ln)]
        if not (status or exceptions or any(ends[:ENDS]) or any(ends[-ENDS:])):
            ranks = [0] * len(ranks)
        best = max(ranks, default=0)
        if not best:
            said = [ln for ln in lines if ln and not _PASS_RE.search(ln)]
            if status and said:
                return said[-1][:300]
            continue
        at = max(i for i, r in enumerate(ranks) if r == best)
        key = lines[at]
        if len(key) < 12:
            nxt = next((ln for ln in lines[at + 1:] if ln), "")
            key = (key + "\n" + nxt) if nxt else key
        return key[:300]
    return None


def task_statement_index(messages: list[Message]) -> int | None:
    fu = first_user_index(messages)
    if fu is not None and text_of(messages[fu]).startswith("Here is a demonstration"):
        return next((i for i in range(fu + 1, len(messages)) if messages[i].get("role") == "user"), fu)
    return fu


def task_present(task: str, out: list[Message]) -> bool:
    if not task.strip():
        return True
    texts = [text_of(m) for m in out]
    if any(task in t for t in texts):
        return True
    head = squash(task)[:500]
    pieces = [head[i:i + 25] for i in range(0, len(head), 25) if len(head[i:i + 25]) >= 5]
    return any(pieces and sum(p in squash(t) for p in pieces) / len(pieces) >= 0.9 for t in texts)


@dataclass
class Need:
    """What the agent needs at one turn, read from that turn's whole request."""
    task: str
    files: list[str]
    error: str | None
    latest: list[tuple[Any, ...]]
    tokens: int


def needs_of(messages: list[Message], text_mode: bool, count: Callable[[list[Message]], int]) -> dict[int, Need]:
    """Per agent turn i (the request messages[:i]); `count`: the provider's count of a request."""
    out = {}
    for i in agent_turns(messages):
        request = messages[:i]
        task = task_statement_index(request)
        out[i] = Need(text_of(request[task]) if task is not None else "", touched_files(request, text_mode),
                      last_error_line(request, text_mode), [norm(m) for m in request[-LATEST:]], count(request))
    return out


def probe(turn: Forwarded, need: Need) -> dict[str, float | None]:
    files = 0.0 if need.files else None
    error = 0.0 if need.error else None
    if turn.refused:
        return {"task": 0.0, "files": files, "error": error, "latest": 0.0, "valid": 0.0}
    out = turn.messages
    blob = "\n\x00\n".join(text_of(m) for m in out)
    kept = {norm(m) for m in out}
    return {"task": 1.0 if task_present(need.task, out) else 0.0,
            "files": sum(p in blob for p in need.files) / len(need.files) if need.files else None,
            "error": (1.0 if need.error in blob else 0.0) if need.error else None,
            "latest": sum(n in kept for n in need.latest) / len(need.latest),
            "valid": 1.0 if is_valid_sequence(out) else 0.0}


def floor_of(messages: list[Message], count: Callable[[list[Message]], int]) -> int:
    """The least any request of the run needs: the leading system message, the task
    statement and the tools schema. A run whose floor is over the limit cannot be served."""
    task = task_statement_index(messages)
    return count([m for i, m in enumerate(messages) if i == task or (i == 0 and m.get("role") == "system")])
