"""Memory's capture skips work it can prove useless (memory/capture.py): a manifest's pattern
is tried only on a text holding one of its strings, the person's preferences and corrections
only on an ASCII text whose lower case holds one of theirs, and a text stops being read as a
listing once too many of its lines are not names. Each shortcut must find exactly what the
plain rule finds: checked here against the plain rules, on every recorded agent run's text
and on phrases made for each branch of the patterns."""
from __future__ import annotations

import os
import re

import pytest

from ctxgate.memory import capture as cap
from ctxgate.pipeline.provenance import message_spans
from trajectories import every_dialect

PREFERENCES = ["I prefer", "I always prefer", "I really prefer", "I'd rather", "I would rather", "I'd like you to",
               "I would like you to", "please always", "always use", "always answer", "always write",
               "always reply", "always respond", "never use", "never answer", "never write", "never reply",
               "from now on", "my preferred", "my favourite", "my favorite", "I like my", "I like it when",
               "call me"]
CORRECTIONS = ["no use", "no, use", "no do", "no, do", "no don't", "no, don't", "no not", "no, not", "don't use",
               "do not use", "instead of", "rather than", "that's wrong", "that is wrong", "not what I asked",
               "not what I wanted", "you should have", "you shouldn't have", "you should not have",
               "stop using", "stop doing", "wrong tool", "wrong approach", "wrong file"]


def _texts() -> list[str]:
    texts = []
    for run in every_dialect():
        spans = message_spans(run.messages, set(range(len(run.messages))))
        texts += [span.text for i in spans for span in spans[i] if span.text.strip()]
    return texts


TEXTS = _texts()


def _cases(phrase: str) -> list[str]:
    return [f"{variant} the tabs, thanks." for variant in (phrase, phrase.upper(), phrase.title(), phrase.lower())]


@pytest.mark.parametrize("phrase", PREFERENCES + CORRECTIONS)
def test_each_branch_of_the_person_s_patterns_passes_its_hint(phrase: str) -> None:
    pattern = cap._PREFERENCE if phrase in PREFERENCES else cap._CORRECTION
    hint = cap._PREFERENCE_HINT if phrase in PREFERENCES else cap._CORRECTION_HINT
    for text in _cases(phrase):
        assert pattern.search(text), text  # the phrase is one the pattern takes
        assert hint.search(text.lower()), text


def test_the_person_s_hints_never_hide_a_match_in_recorded_runs() -> None:
    recorded = [t[:4000] for t in TEXTS]
    matched = 0
    for head in recorded + [c for p in PREFERENCES + CORRECTIONS for c in _cases(p)]:
        if not head.isascii():
            continue  # the hints are not asked: the patterns run
        for pattern, hint in ((cap._PREFERENCE, cap._PREFERENCE_HINT), (cap._CORRECTION, cap._CORRECTION_HINT)):
            if pattern.search(head):
                matched += head in recorded
                assert hint.search(head.lower()), head[:200]
    assert matched >= 10  # the recorded runs' own words met the patterns, not only the made phrases


def test_a_person_s_words_outside_ascii_still_meet_the_patterns() -> None:
    # IGNORECASE folds more than `str.lower` outside ASCII (the long s is an s to it): such a
    # text skips the hints.
    messages = [{"role": "assistant", "content": "I used unittest."},
                {"role": "user", "content": "Alwayſ uſe pytest. No, uſe pytest."}]
    assert not cap._PREFERENCE_HINT.search(messages[1]["content"].lower())  # the hints would hide both
    found = cap._from_user(messages, 1, messages[1]["content"], 0.0)
    assert [c.category.value for c in found] == ["user", "feedback"]


def test_manifest_strings_never_hide_a_manifest_in_recorded_runs() -> None:
    samples = [t[:20000] for t in TEXTS] + [text for _, text in MANIFESTS]
    for sample in samples:
        for name, needles, pattern in cap._MANIFESTS:
            if pattern.search(sample):
                assert needles.search(sample), (name, sample[:200])


MANIFESTS = [  # one per string of each manifest's needles, holding no other of them
    ("pyproject.toml", '[project]\nname = "shop"\n'),
    ("pyproject.toml", '[tool.poetry]\nname = "shop"\n'),
    ("pyproject.toml", '[build-system]\nrequires = ["hatchling"]\n'),
    ("package.json", '{"dependencies": {"react": "18"}}'),
    ("package.json", '{"devDependencies": {"jest": "29"}}'),
    ("go.mod", "module example.com/shop\n\ngo 1.22\n"),
    ("Cargo.toml", '[package]\nname = "shop"\nedition = "2021"\n'),
    *[("requirements.txt", "".join(f"pkg{i}{op}1.{i}\n" for i in range(3))) for op in ("==", "<=", ">=", "~=", "!=")],
]


@pytest.mark.parametrize("name,text", MANIFESTS)
def test_each_manifest_string_alone_lets_its_manifest_through(name: str, text: str) -> None:
    """A text whose only needle is this one: dropping it from `_MANIFESTS` hides the manifest."""
    assert [c.data["tech_stack"]["manifest"] for c in cap.project_facts(text, 0.0) if "tech_stack" in c.data] == [name]


def _plain_listing(text: str) -> list[str]:
    """The listing rule as first written: every line read."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not 4 <= len(lines) <= 2000:
        return []
    names = [ln for ln in lines if cap._LISTING_LINE.match(ln)]
    if len(names) < 0.8 * len(lines):
        return []
    root = os.path.commonpath(names) if all(n.startswith("/") for n in names) and len(names) > 1 else ""
    return [n[len(root):].lstrip("/") or n for n in names] if root and root != "/" else names


def _boundary_listings() -> list[str]:
    """Listings around the 80% line and the line counts' bounds, with blank lines among them."""
    out = []
    for names, others, blanks in [(4, 1, 0), (4, 1, 6), (8, 2, 0), (8, 2, 30), (7, 2, 0), (7, 2, 9), (3, 0, 0),
                                  (4, 0, 0), (2000, 0, 0), (1999, 2, 0), (1600, 400, 0), (1599, 401, 0),
                                  (40, 10, 200), (40, 11, 200), (0, 5, 0)]:
        lines = [f"/repo/src/mod_{i}.py" for i in range(names)] + ["a line of prose"] * others + [""] * blanks
        out += ["\n".join(lines), "\n".join(reversed(lines)), "\n".join(lines[::2] + lines[1::2])]
    return out + ["src\n  \ntests\n\t\nREADME.md\nsetup.cfg\n", "a\r\nb\r\nc\x0bd\n", "1\n2\n3\n4\n5\n"]


def test_the_listing_rule_read_early_finds_what_the_plain_rule_finds() -> None:
    recorded = [t[:20000] for t in TEXTS]
    listings = 0
    for sample in recorded + _boundary_listings():
        expected = _plain_listing(sample)
        assert cap._listing(sample) == expected, sample[:200]
        listings += bool(expected) and sample in recorded
    assert listings >= 5  # the recorded runs' listings were compared, not only the made ones


def test_the_hints_are_spelt_as_their_patterns() -> None:
    # A hint names strings of its pattern in lower case: an upper-case letter in one could never
    # be found in a lower-cased text.
    for hint in (cap._PREFERENCE_HINT, cap._CORRECTION_HINT):
        assert hint.pattern == hint.pattern.lower() and not re.search(r"\\[A-Z]", hint.pattern)
