"""The line of an observation that says what failed.

The conversation model judges every observation with it (`protocols.base.observation`):
Collapse never folds a failed observation, and activeRestore brings the key line of the
latest one back when a compaction took it out of view: what went wrong last is what the
agent acts on next, so a line that merely names an error is not one. A failure line
reports a failure: an exception line (`ValueError: …`, the tail of a traceback), pytest's
`E   …` and `FAILED`, a tool's `error:` / `fatal:`, a shell's "No such file or directory",
a non-zero exit's message ("Process exited with code 1", "[Command finished with exit code
1]"), a count of failures ("1 failed"). Never a line marked as passing (✓, PASSED, `... ok`,
"0 failed", "no errors"), a warning, nor code that names an exception (`raise ValueError(`,
`except TypeError:`, a numbered file view, an indented docstring's `ValueError: if …`):
failure reports start at the line's first column, code is indented or starts with a keyword.

Which output failed is judged from its structure, not from any line that looks like an error:
a non-zero exit status (or a result flagged as an error), a failure line among its first or
last `EDGE_LINES` lines (where a tool, a test runner or a compiler reports how it ended), or a
Python traceback (whose tail is the exception line, whatever the exception's name). An
error-looking line in the middle of an output that reports no failure (a build log that went
on and ended well) is not what failed last.
"""
from __future__ import annotations

import re
from functools import lru_cache
from itertools import islice

from .boundaries import head_at_boundary

KEY_LINE_CHARS = 300
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_LISTING_LINE = re.compile(r"^\s*\d+(?::|\t|\s{2,}|\|)")
"""A numbered line of a file view (`317:    raise ValueError(`, `cat -n` output, OpenHands'
`12|`): code, not a failure."""
EXIT_LINE = re.compile(r"(?:exit(?:ed)?(?: with)? (?:code|status)|Exit code|<returncode>)[:\s]*(-?\d+)", re.I)
"""A command's exit status as agents' tools report it: Codex ("Process exited with code 1",
"Exit code: 1"), OpenHands ("[Command finished with exit code 1]"), mini-swe-agent
(`<returncode>1</returncode>`), Python's "returned non-zero exit status 1"."""
_COUNTS = re.compile(r"\b(\d+) (?:failed|failures?|errors?)\b", re.I)
"""A test runner's or checker's tally: "1 failed, 3 passed", "Found 2 errors in 1 file"."""
_PASSING = re.compile(r"^\s*[✓✔√]|\.\.\.\s*ok\s*$|^(?:ok|OK)\b|^Success\b"
                      r"|\b(?:no|zero|without) (?:errors?|failures?|problems)\b|\bAll checks passed\b", re.I)
_PASSING_UPPER = re.compile(r"\bPASS(?:ED)?\b")
"""pytest's `PASSED`, Go's and Jest's `PASS`: upper case only ("cannot pass x" passes nothing)."""
_FAIL_MARK = re.compile(r"^\s*(?:[✗✘✕×]|--- FAIL\b)")
"""A failed test's mark, indented or not (Jest's `  ✕ …`, Go's subtests `    --- FAIL: …`)."""
_WARNING = re.compile(r"^(?:\S+:\s*)?warning\b", re.I)
_PREFIX = re.compile(r"^(?:[-*•]\s+|[A-Z]\d{3,4}\s+|(?:[\w.\-/\\~]+\.\w+|<[\w\-]+>)(?::\d+)+:?\s*)+")
"""What stands before a failure on its line: a bullet, a lint code (`- E999 `), a location
(`app.py:14: error: …`, pytest's `tests/t.py:12: ValueError`)."""
_STRONG = re.compile(
    r"^(?:Traceback\b"
    r"|(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*)?(?:Error|Exception|Failure|Interrupt)(?::\s.*|:)?$"
    r"|Exception in thread\b"
    r"|(?:\S+\s)?(?:error|fatal|panic)(?:\[[\w\-]+\])?(?::|!|\s|$)"
    r"|(?:\S+\s)?failed\b|failure\b|not ok\b"
    r"|\S+: \*\*\* .*\bError \d+)", re.I)
"""A failure report at the start of the (prefix-stripped) line."""
_STRONG_ANYWHERE = re.compile(r"\bFAIL(?:ED)?\b|\bERROR\b|command not found|No such file or directory"
                              r"|Permission denied|Segmentation fault|core dumped")
_PYTEST_E = re.compile(r"^E\s{2,}\S")
_CODE = re.compile(r"^(?:raise|except|def|class|import|from|return|assert|throw|catch|if|elif|with|try|yield|await)\b")
WEAK, STRONG = 1, 2
JUDGED_CHARS = 2000
"""How much of a line is judged: a report of a failure says so early, and the patterns cost
time with a line's length (a minified or hostile output may be one line of megabytes)."""


def strength(line: str) -> int:
    """0 for a line that reports no failure; WEAK for a non-zero exit's message or a tally of
    failures (they say that something failed, not what); STRONG for one that says what."""
    return _judged_strength(line[:JUDGED_CHARS])


@lru_cache(maxsize=2048)
def _judged_strength(judged: str) -> int:
    """`strength` of a line's judged part, kept: tool outputs repeat their lines (OpenHands'
    "[Command finished with exit code 0]", a tool's "Error:"), and the patterns cost ~15 us a
    line where a lookup costs a hash. At most 2048 x JUDGED_CHARS characters kept."""
    raw = _ANSI.sub("", judged).rstrip()
    if not raw.strip() or _LISTING_LINE.match(raw):
        return 0
    tally = [int(n) for n in _COUNTS.findall(raw)]
    if tally and not _STRONG_ANYWHERE.search(raw):
        return WEAK if any(tally) else 0
    code = EXIT_LINE.search(raw)
    if code is not None and int(code.group(1)) == 0:
        return 0
    # A non-zero exit's message says that something failed; it may say what, too
    # (Python's "CalledProcessError: … returned non-zero exit status 1").
    floor = WEAK if code is not None else 0
    if _PYTEST_E.match(raw) or _FAIL_MARK.match(raw):
        return STRONG
    if is_passing_line(raw) or _WARNING.match(raw):
        return floor
    if raw[0].isspace():
        return floor  # indented: code, a docstring, a frame of a traceback
    body = _PREFIX.sub("", raw)
    if _CODE.match(body):
        return floor
    return STRONG if _STRONG.match(body) or _STRONG_ANYWHERE.search(raw) else floor


def is_error_line(line: str) -> bool:
    """The line reports a failure (see the module's docstring)."""
    return strength(line) > 0


def is_passing_line(line: str) -> bool:
    raw = _ANSI.sub("", line).strip()
    return bool(_PASSING_UPPER.search(raw) or _PASSING.search(raw))


_EXIT_REPORT = re.compile(r"^\W*[\w ]*?(?:exit(?:ed)?(?: with)? (?:code|status)|Exit code|returncode>)[:\s]*(-?\d+)"
                          r"(?:</returncode>)?\W*$", re.I | re.M)
"""A line that is an exit-status report and nothing else: the tool's own, not a program's
output that mentions one ("child exited with code 2 after 3s")."""


def exit_status_of(text: str) -> int | None:
    """The exit status `text` reports: its first line that is an exit-status report (Codex's
    header, OpenHands' footer, mini-swe-agent's `<returncode>`), if it has one."""
    if not text.isascii():
        found = _EXIT_REPORT.search(text)
        return int(found.group(1)) if found else None
    # The pattern tries every line: on ASCII text (where its case-folding is lowering) only the
    # lines that write an exit at all are tried, in order; the first report among them is the
    # text's first (a report is one line: `^` and `$` are a line's ends).
    low = text.lower()
    starts = sorted({text.rfind("\n", 0, at) + 1 for marker in ("exit", "returncode>") for at in _finds(low, marker)})
    for start in starts:
        end = text.find("\n", start)
        found = _EXIT_REPORT.search(text, start, len(text) if end < 0 else end)
        if found:
            return int(found.group(1))
    return None


def _finds(text: str, literal: str) -> list[int]:
    found, at = [], text.find(literal)
    while at >= 0:
        found.append(at)
        at = text.find(literal, at + 1)
    return found


EDGE_LINES = 5
"""How many non-blank lines at each end of an output say how it ended."""
_TRACEBACK = "Traceback (most recent call last)"


def traceback_tails(lines: list[str]) -> set[int]:
    """The indices of the exception lines that end Python tracebacks: the first line at the
    first column after a traceback's header and its indented frames."""
    tails: set[int] = set()
    inside = False
    for i, line in enumerate(lines):
        raw = _ANSI.sub("", line).rstrip()
        if raw.strip().startswith(_TRACEBACK):
            inside = True
        elif inside and raw.strip() and not raw[0].isspace():
            tails.add(i)
            inside = False
    return tails


SCAN_LINES = 2000
"""How many lines at each end of a long output are searched for its key line: a report of how
it ended stands near an end, and a hostile output of a million lines costs no more than this."""


def key_error_line(text: str, exit_status: int | None = None, flagged: bool = False) -> str:
    """The line of `text` that says what failed, when the output reports a failure by its
    structure (see the module's docstring; `exit_status`, `flagged`: what its wrapper says): the
    last one that says what (a traceback's tail, not its header), else the last that says that
    something failed (an exit status, a tally); a line too short to say anything ("Error:")
    comes with the line after it. Empty if none. The line as the output has it (colour codes
    too): activeRestore looks for it in what is still in view."""
    # The structure first, from a few lines: most outputs report no failure, and judging every
    # line of each is what reading a long conversation (and logging a new one) would cost.
    stated = flagged or exit_status not in (None, 0)
    if not (stated or _TRACEBACK in text or "\x1b" in text or _fails(_ends(text, True) + _ends(text, False))):
        return ""
    lines = text.splitlines()
    if len(lines) > 2 * SCAN_LINES:
        lines = lines[:SCAN_LINES] + lines[-SCAN_LINES:]
    strengths = [strength(line) if _may_report(line) else 0 for line in lines]
    tails = traceback_tails(lines) if _TRACEBACK in text or "\x1b" in text else set()
    for i in tails:
        strengths[i] = STRONG
    if not (stated or tails or _edge_strength(lines, strengths, True) or _edge_strength(lines, strengths, False)):
        return ""
    return strongest_line(lines, strengths)


def strongest_line(lines: list[str], strengths: list[int]) -> str:
    """The last of the strongest failure lines (with the line after it when it is too short to
    say anything), cut at a boundary; empty when no line reports a failure."""
    best = max(strengths, default=0)
    if not best:
        return ""
    at = max(i for i, s in enumerate(strengths) if s == best)
    key = lines[at].strip()
    if len(key) < 12:
        following = next((line.strip() for line in lines[at + 1:] if line.strip()), "")
        key = f"{key}\n{following}" if following else key
    return head_at_boundary(key, KEY_LINE_CHARS)


def _edge_strength(lines: list[str], strengths: list[int], head: bool) -> bool:
    """A failure among the first (`head`) or the last `EDGE_LINES` non-blank lines."""
    order = range(len(lines)) if head else range(len(lines) - 1, -1, -1)
    shown = islice((i for i in order if _ANSI.sub("", lines[i]).strip()), EDGE_LINES)
    return any(strengths[i] for i in shown)


def _ends(text: str, head: bool) -> list[str]:
    """The first (or last) `EDGE_LINES` non-blank lines of `text` (which holds no colour
    codes), read from a window at that end that grows until it holds them, not from the whole
    text split into lines."""
    window = 512
    while True:
        whole = window >= len(text)
        piece = text if whole else text[:window] if head else text[-window:]
        lines = piece.splitlines()
        if not whole:  # the line the window's edge falls in may be cut
            lines = lines[:-1] if head else lines[1:]
        shown = list(islice((line for line in (lines if head else reversed(lines)) if line.strip()), EDGE_LINES))
        if whole or len(shown) == EDGE_LINES:
            return shown
        window *= 4


_MARKERS = ("error", "exception", "fail", "interrupt", "traceback", "fatal", "panic", "not ok", "exit", "returncode",
            "command not found", "no such file or directory", "permission denied", "segmentation fault",
            "core dumped")
"""What every line `strength` finds a failure in holds (lowered), unless it starts with `E`
(pytest's `E   …`) or holds a non-ASCII mark."""


def _may_report(line: str) -> bool:
    """Whether `strength` could find a failure in `line`: a few literal checks, not its patterns."""
    if not line.isascii() or "\x1b" in line or line.startswith("E"):
        return True
    low = line.lower()
    return any(marker in low for marker in _MARKERS)


def _fails(lines: list[str]) -> bool:
    # Most ends hold no marker at all: one look at them joined answers for every line (a
    # marker cannot span the newline that joins two lines), not fifteen looks at each.
    block = "\n".join(lines)
    if block.isascii() and "\x1b" not in block and not any(line.startswith("E") for line in lines):
        low = block.lower()
        if not any(marker in low for marker in _MARKERS):
            return False
    return any(strength(line) for line in lines if _may_report(line))


def failure_line(text: str, exit_status: int | None = None, flagged: bool = False) -> str:
    """What an output's failure is named by (the conversation model's observations, the WAL's
    TOOL_RESULT): its key line (`key_error_line`), else, for a non-zero exit status or a result
    flagged as an error, its last line not marked as passing. Empty: it did not fail."""
    line = key_error_line(text, exit_status, flagged)
    if line or not (flagged or exit_status not in (None, 0)):
        return line
    said = last_said_line(text)
    if said:
        return head_at_boundary(said, KEY_LINE_CHARS)
    return f"exit status {exit_status}" if exit_status not in (None, 0) else "the tool reported an error"


def last_said_line(text: str) -> str:
    """The last line of an output that failed without saying so, passing lines left out: what
    the command printed last is the best account there is of what went wrong."""
    return next((line.strip() for line in reversed(text.splitlines())
                 if line.strip() and not is_passing_line(line)), "")
