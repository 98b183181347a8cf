"""No cut inside a word (issue 36, item 3): every function that shortens text keeps a start or
an end that stops at a line, else a word, else (text with no spaces) a character boundary,
never inside a combining sequence or a `ref ctx:HEX`, within its limit, with the exact counter
and the estimate alike. The oracle here is written apart from pipeline/boundaries.py."""
from __future__ import annotations

import asyncio
import base64
import json
import re
import string
import unicodedata
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxgate.memory.config import MemoryConfig
from ctxgate.memory.dream import CLASSIFY_TOKENS, Consolidator, Dream, auto_dream
from ctxgate.memory.file_store import FileMemoryStore
from ctxgate.memory.short_term import Candidate, SessionBuffer
from ctxgate.pipeline.autocompact import shorten
from ctxgate.pipeline.boundaries import LINE_KEEP, WORD_REACH, head_at_boundary, tail_at_boundary
from ctxgate.pipeline.config import MicrocompactConfig
from ctxgate.pipeline.excerpt import excerpt
from ctxgate.pipeline.microcompact import MicrocompactStrategy
from ctxgate.pipeline.refs import CutLog, clip
from ctxgate.pipeline.tokens import TiktokenEncoder, TokenCounter, TokenizerRegistry

EXACT = TokenizerRegistry().for_model("gpt-4o")
ESTIMATE = TokenizerRegistry().counter("estimate")
COUNTERS = [EXACT, ESTIMATE]
RAW = TiktokenEncoder("o200k_base")
REF = re.compile(r"ref ctx:[0-9a-f]{12}")
CJK_MARKS = "\u3001\u3002\uff0c\uff1b\uff1a\uff01\uff1f"

# --- texts of each kind -------------------------------------------------------------------------

_word = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=12)
prose = st.lists(st.tuples(_word, st.sampled_from([" ", " ", " ", ", ", ". ", "\n"])), min_size=1, max_size=120).map(
    lambda pairs: "".join(w + sep for w, sep in pairs).rstrip())
_code_line = st.builds(lambda indent, name, arg, n: f"{'    ' * indent}{name}_{n} = compute({arg}, factor={n})",
                       st.integers(0, 3), _word, _word, st.integers(0, 999))
code = st.lists(_code_line, min_size=1, max_size=40).map("\n".join)
cjk = st.text(alphabet=st.sampled_from([chr(c) for c in range(0x4E00, 0x4E60)] + list(CJK_MARKS) + ["\n"]),
              min_size=1, max_size=400)
_scalar = st.one_of(st.integers(), st.booleans(), st.none(), st.text(string.ascii_letters, max_size=20))
_json_value = st.recursive(_scalar,
                           lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                   st.dictionaries(st.text(string.ascii_letters, min_size=1,
                                                                           max_size=8), inner, max_size=6)),
                           max_leaves=60)
minified_json = _json_value.map(lambda v: json.dumps(v, separators=(",", ":")))
b64 = st.binary(min_size=1, max_size=400).map(lambda b: base64.b64encode(b).decode())
_ref = st.binary(min_size=6, max_size=6).map(lambda b: f"(the originals: ref ctx:{b.hex()})")
_graphemes = st.sampled_from(["e\u0301", "👍🏽", "👩\u200d💻", "🇫🇷", "✔\ufe0f", "日本語"])
mixed = st.lists(st.one_of(prose, code, cjk, b64, _ref, _graphemes, minified_json), min_size=1, max_size=6).map(
    lambda parts: " ".join(parts))

KINDS = {"prose": prose, "code": code, "cjk": cjk, "json": minified_json, "base64": b64, "mixed": mixed}
SPACED = ("prose", "code")
"""Kinds whose words are all shorter than WORD_REACH: a cut there always falls between words."""

# --- the oracle -----------------------------------------------------------------------------------


def _joins(text: str, k: int) -> bool:
    """Cutting before text[k] would split a character from its combining mark, joiner or modifier."""
    after = text[k]
    return (unicodedata.combining(after) > 0 or after in "\u200d\ufe0f" or text[k - 1] == "\u200d"
            or 0x1F3FB <= ord(after) <= 0x1F3FF or (0x1F1E6 <= ord(text[k - 1]) <= 0x1F1FF
                                                    and 0x1F1E6 <= ord(after) <= 0x1F1FF))


def _between_words(text: str, k: int) -> bool:
    before, after = text[k - 1], text[k]
    wide = any(unicodedata.east_asian_width(c) in "WF" for c in (before, after))
    return before.isspace() or after.isspace() or before in ",;" + CJK_MARKS or wide


def assert_cut(text: str, kept: str, kind: str, side: str) -> None:
    """`kept` is a start (side "head") or an end ("tail") of `text` that stops at a boundary."""
    assert (text.startswith(kept) if side == "head" else text.endswith(kept)), (side, text, kept)
    if kept == text or not kept:
        return
    k = len(kept) if side == "head" else len(text) - len(kept)
    assert not _joins(text, k), (side, text, kept)
    assert not any(m.start() < k < m.end() for m in REF.finditer(text)), f"a reference cut: {kept!r}"
    if kind in SPACED:
        assert _between_words(text, k), f"a word cut: {kept[-30:]!r}|{text[k:k + 20]!r}"


def assert_keeps_room(text: str, kept: str, room: int) -> None:
    """A cut gives up at most half the room for a line, or a word's length for a word."""
    if room >= len(text):
        assert kept == text
        return
    spaces = max((len(s) for s in re.findall(r"[ \t\r]+", text)), default=0)
    assert len(kept) >= min(room * LINE_KEEP, room - WORD_REACH - spaces) - 1, (room, text, kept)


def raw_chars(counter: TokenCounter, text: str, tokens: int, side: str) -> int:
    """How many characters a plain token cut (not at a boundary) would keep."""
    if not counter.exact:
        raw = text.encode()
        cut = raw[:tokens * 3] if side == "head" else raw[max(0, len(raw) - tokens * 3):]
        return len(cut.decode(errors="ignore"))
    ids = RAW.encode(text)
    part = ids[:tokens] if side == "head" else ids[-tokens:]
    return len(RAW.decode(part).strip("\ufffd")) if tokens > 0 else 0


# --- properties -------------------------------------------------------------------------------------

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(data=st.data())
def test_character_cuts_stop_at_a_boundary(kind: str, data: st.DataObject) -> None:
    text = data.draw(KINDS[kind])
    room = data.draw(st.integers(0, len(text) + 5))
    for side, kept in (("head", head_at_boundary(text, room)), ("head", clip(text, room)),
                       ("tail", tail_at_boundary(text, room))):
        assert len(kept) <= max(room, 0)
        assert_cut(text, kept, kind, side)
        assert_keeps_room(text, kept, room)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("counter", COUNTERS, ids=["exact", "estimate"])
@SETTINGS
@given(data=st.data())
def test_token_cuts_stop_at_a_boundary_within_the_limit(kind: str, counter: TokenCounter, data: st.DataObject) -> None:
    text = data.draw(KINDS[kind])
    head_n, tail_n = data.draw(st.integers(0, 150)), data.draw(st.integers(0, 150))
    head, tail = counter.head(text, head_n), counter.tail(text, tail_n)
    assert counter.head_and_tail(text, head_n, tail_n) == (head, tail)
    for side, kept, n in (("head", head, head_n), ("tail", tail, tail_n)):
        assert counter.count(kept) <= n
        assert_cut(text, kept, kind, side)
        room = raw_chars(counter, text, n, side)
        if room < len(text):
            assert_keeps_room(text, kept, room - 1)  # the exact counter may back off a token at the edge


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("counter", COUNTERS, ids=["exact", "estimate"])
@SETTINGS
@given(data=st.data())
def test_microcompact_keeps_a_head_and_a_tail_at_boundaries(kind: str, counter: TokenCounter,
                                                            data: st.DataObject) -> None:
    text = data.draw(KINDS[kind])
    head_n, tail_n = data.draw(st.integers(8, 60)), data.draw(st.integers(4, 30))
    strategy = MicrocompactStrategy(MicrocompactConfig(head_tokens=head_n, tail_tokens=tail_n))
    cut = strategy.truncate(text, head_n + tail_n, counter, CutLog())
    if cut is None:
        return
    found = re.search(r"\n\.\.\. \[middle (\d+) tokens truncated, ref ctx:[0-9a-f]{12}\] \.\.\.\n", cut)
    assert found is not None
    head, tail = cut[:found.start()], cut[found.end():]
    assert_cut(text, head, kind, "head")
    assert_cut(text, tail, kind, "tail")
    assert counter.count(head) <= head_n and counter.count(tail) <= tail_n
    assert int(found.group(1)) == counter.count(text) - counter.count(head) - counter.count(tail)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("counter", COUNTERS, ids=["exact", "estimate"])
@SETTINGS
@given(data=st.data())
def test_a_one_line_excerpt_keeps_a_head_at_a_boundary(kind: str, counter: TokenCounter, data: st.DataObject) -> None:
    text = data.draw(KINDS[kind]).replace("\n", " ")
    limit = data.draw(st.integers(30, 120))
    out = excerpt(text, limit, counter, CutLog())
    if out == text:
        return
    head = out[:out.rindex("\n[... ")]
    assert_cut(text, head, kind, "head")


@pytest.mark.parametrize("counter", COUNTERS, ids=["exact", "estimate"])
@SETTINGS
@given(data=st.data())
def test_a_shortened_summary_cuts_each_field_at_a_word_and_a_list_at_an_item(counter: TokenCounter,
                                                                              data: st.DataObject) -> None:
    words = st.lists(_word, min_size=1, max_size=20).map(" ".join)
    items = st.lists(st.text(string.ascii_lowercase + "0123456789", min_size=1, max_size=10), min_size=2, max_size=30)
    goal, problems = data.draw(words), data.draw(words)
    steps = data.draw(items)
    fields = [f"1. User goal: {goal}", f"2. Completed steps: {', '.join(steps)}", "3. Key decisions: none",
              f"4. Unresolved problems: {problems}", "5. Files: src/app.py", "6. Tools: bash"]
    tokens = data.draw(st.integers(24, 120))
    for line in shorten("\n".join(fields), tokens, counter).splitlines():
        field = next(f for f in fields if f.startswith(line))
        if field.startswith("2.") and line != field:  # whole items: the cut is at a separator
            assert field[len(line):].startswith(", ") or "," not in line, (line, field)
        if not field[len(line):].startswith(", "):
            assert_cut(field, line, "prose", "head")


# --- the cases issue 36 quotes ------------------------------------------------------------------------


def test_a_summary_field_is_cut_at_a_word_with_the_estimate_counter() -> None:
    summary = ("1. User goal: refactor the parser module into smaller functions and keep tests green\n"
               "2. Completed steps: catstep1, catstep2, uatstep3, uatstep4, uatstep5, ran pytest, fixed lint\n"
               "3. Key decisions: none\n4. Open: ValueError in parse\n5. Files: src/a.py\n6. Tools: bash")
    for counter in COUNTERS:
        short = shorten(summary, 40, counter)
        assert counter.count(short) <= 40
        lines = short.splitlines()
        assert [line[:2] for line in lines] == ["1.", "2.", "3.", "4.", "5.", "6."]
        assert lines[0] in ("1. User goal: refactor", "1. User goal: refactor the"), lines[0]
        assert not lines[1].endswith(",") and not re.search(r"\bcats?$|step$", lines[1]), lines[1]


def test_a_completed_steps_list_keeps_whole_items() -> None:
    steps = ", ".join(f"uatstep{i}" for i in range(1, 40))
    summary = f"1. Goal: ship it\n2. Completed steps: {steps}\n4. Open: none\n5. Files: a.py"
    for counter in COUNTERS:
        line = shorten(summary, 30, counter).splitlines()[1]
        assert line.startswith("2. Completed steps: uatstep1") and re.fullmatch(r"2\. Completed steps: (uatstep\d+, )*"
                                                                                r"uatstep\d+", line), line
        assert f"2. Completed steps: {steps}".startswith(line + ",")


def test_microcompact_head_and_tail_keep_whole_lines() -> None:
    log = "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(400))
    for counter in COUNTERS:
        strategy = MicrocompactStrategy(MicrocompactConfig(head_tokens=150, tail_tokens=50))
        cut = strategy.truncate(log, 1000, counter)
        assert cut is not None
        head, tail = re.split(r"\n\.\.\. \[middle \d+ tokens truncated\] \.\.\.\n", cut)
        assert head.endswith("the lazy dog") and log[len(head)] == "\n"
        assert tail.startswith("line ") and log[-len(tail) - 1] == "\n" and tail.endswith("lazy dog")


def test_a_preview_is_not_cut_inside_a_word() -> None:
    text = "some words that take room in them and more after"
    assert clip(text, 32) == "some words that take room in"
    assert clip(text, 33) == "some words that take room in them"
    assert clip("a " + "x" * 200, 40) == "a " + "x" * 38, "a run longer than a word is cut by characters"
    assert clip("日本語のテキストです。続きます", 9) == "日本語のテキストで"


def test_a_reference_is_never_cut_short() -> None:
    text = "Earlier steps were removed (the originals: ref ctx:0123456789ab) and more text follows here"
    ref_at = text.index("ref ctx:")
    for room in range(len(text)):
        kept = clip(text, room)
        assert "ref" not in kept or "ref ctx:0123456789ab" in kept, kept
        end = tail_at_boundary(text, room)
        assert "ctx:" not in end or end.startswith("ref ctx:0123456789ab") or len(end) > len(text) - ref_at, end


def test_memory_cuts_an_entry_too_large_for_one_call_at_a_word() -> None:
    words = " ".join(f"word{i}" for i in range(3000))
    model = Consolidator(None, EXACT.count, 400, EXACT.head)
    cut = model._cut(words, 200)
    assert EXACT.count(orjson.dumps(cut).decode()) + 2 <= 200 and words.startswith(cut)
    assert words[len(cut)] == " " and len(cut) > 200


def test_the_memory_classifier_reads_each_candidate_cut_at_a_word(tmp_path: Path) -> None:
    said: list[str] = []

    async def classify(messages: list[dict[str, Any]]) -> str:
        said.append(messages[1]["content"])
        return '["drop"]'

    content = " ".join(f"note{i} about the deploy script" for i in range(200))
    dream = Dream(SessionBuffer("t1", "u1", "p1"), "s1", Consolidator(None, EXACT.count, None, EXACT.head),
                  MemoryConfig().feedback_ttl_s())
    asyncio.run(auto_dream(dream, [Candidate(None, content)], FileMemoryStore(tmp_path), None, classify, now=1.0))
    [listing] = said
    shown = listing.removeprefix("1. ")
    assert content.startswith(shown) and content[len(shown)] == " "
    assert CLASSIFY_TOKENS - 8 <= EXACT.count(shown) <= CLASSIFY_TOKENS
