"""An original given back within a token limit (`pipeline/excerpt.py`): whole when it fits;
otherwise head, tail and failure lines, every part left out named by a reference whose
original puts the text back together."""
from __future__ import annotations

import re

from ctxgate.pipeline.excerpt import excerpt
from ctxgate.pipeline.refs import CutLog, render_span

from pipeline_builders import counter

GAP = re.compile(r"\[\.\.\. \d+ lines, \d+ tokens: ref (ctx:[0-9a-f]{12})\]\n")


def build_log(n: int = 1500, errors: dict[int, str] | None = None) -> str:
    lines = [f"build step {i}: compiling module_{i}.c ok" for i in range(n)]
    for at, text in (errors or {}).items():
        lines[at] = text
    return "\n".join(lines) + "\n"


def put_back(text: str, cuts: CutLog) -> str:
    return GAP.sub(lambda m: cuts.originals[m.group(1)], text)


def test_a_text_that_fits_is_given_whole() -> None:
    cuts = CutLog()
    text = build_log(20)
    assert excerpt(text, 1000, counter(), cuts) == text and not cuts.originals


def test_a_long_log_keeps_head_tail_and_its_failure_within_the_limit() -> None:
    tc, cuts = counter(), CutLog()
    text = build_log(errors={750: "error: MIDDLE-MARKER undefined reference to frobnicate"})
    out = excerpt(text, 2000, tc, cuts)
    assert tc.count(out) <= 2000
    assert out.startswith("build step 0:") and out.rstrip().endswith("module_1499.c ok")
    assert "build step 749:" in out and "MIDDLE-MARKER" in out and "build step 751:" in out
    assert len(GAP.findall(out)) == 2
    assert put_back(out, cuts) == text  # nothing is lost: each gap's original is kept under its ref


def test_the_newest_failures_come_first_when_not_all_fit() -> None:
    tc, cuts = counter(), CutLog()
    errors = {i: f"error: failure number {i} " + "x " * 80 for i in range(100, 1400, 20)}
    out = excerpt(build_log(errors=errors), 1500, tc, cuts)
    assert tc.count(out) <= 1500
    assert "failure number 1380" in out and "failure number 100 " not in out
    assert put_back(out, cuts) == build_log(errors=errors)


def test_one_long_line_gives_its_head_and_the_rest_by_reference() -> None:
    tc, cuts = counter(), CutLog()
    text = "token " * 5000
    out = excerpt(text, 500, tc, cuts)
    assert tc.count(out) <= 500
    [ref] = re.findall(r"more tokens: ref (ctx:[0-9a-f]{12})\]$", out)
    assert out[:out.index("\n[...")] + cuts.originals[ref] == text


def test_a_span_of_messages_becomes_an_index_of_them() -> None:
    tc, cuts = counter(), CutLog()
    messages = [{"role": "user", "content": "TASK: fix it"}]
    for i in range(30):
        messages.append({"role": "assistant", "content": f"step {i}: reading module_{i}.py"})
        messages.append({"role": "tool", "content": "\n".join(f"module_{i} line {k}" for k in range(40))
                         + ("\nTraceback: boom in module_17" if i == 17 else "")})
    span = render_span(messages)
    out = excerpt(span, 1500, tc, cuts)
    assert tc.count(out) <= 1500 and out.startswith("61 messages")
    entries = out.splitlines()[1:]
    assert len(entries) == 61 and entries[1] == "[assistant] step 0: reading module_0.py"  # short: whole
    [ref] = re.findall(r"ref (ctx:[0-9a-f]{12})", entries[36])
    assert cuts.originals[ref] == render_span([messages[36]]) and "Traceback: boom in module_17" in entries[36]
    # An index that does not fit either: the span's lines, as for any text.
    small = CutLog()
    assert not excerpt(span, 300, tc, small).startswith("61 messages") and put_back(excerpt(span, 300, tc, small),
                                                                                    small) == span + "\n"


def test_an_index_entry_never_ends_in_a_reference_cut_short() -> None:
    """An expanded note's first line names its own reference; an index entry cut at that
    reference would name one that does not exist (a model asks for it and is told so)."""
    tc, cuts = counter(), CutLog()
    note = ("[ctxgate: context snipped] 6 earlier messages were removed to fit the context budget "
            "(the originals: ref ctx:9662046ef26b). A short preview of each:\n" + "- tool: output line\n" * 40)
    messages = [{"role": "system", "content": note}, {"role": "tool", "content": "x\n" * 200}]
    out = excerpt(render_span(messages), 200, tc, cuts)
    assert out.startswith("2 messages")
    for entry in out.splitlines()[1:]:
        for found in re.findall(r"ref ctx:[0-9a-f]*", entry):
            assert len(found) == len("ref ctx:") + 12, entry
