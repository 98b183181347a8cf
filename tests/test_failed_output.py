"""A tool output reads as failed (the WAL's TOOL_RESULT `success`) exactly when the pattern says
so: the `str.find` path for ASCII text against the regular expression itself."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ctxgate.proxy.engine.failed_output import FAILURE, SCAN_CHARS, failed, first_failure_line

FRAGMENTS = ["error", "Error", "ERRORS", "_error", "error_", "errors", "9error", "exception", "EXCEPTIONAL",
             "exit code ", "Exit Code 1", "exit code 0", "exit code", "Traceback (most recent call last)",
             "traceback (most recent call", "command not found", "Command Not Found", "no such file or directory",
             "No such file or", " ", "-", "x", "7", "_", "\n", ":", "é", "ſ", "\u212a", "ı", "İ", "\u0307", "东"]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14))
def test_failed_is_the_patterns_answer(parts: list[str]) -> None:
    text = "".join(parts)
    assert failed(text) == (FAILURE.search(text[:SCAN_CHARS]) is not None)


@given(st.text(alphabet=st.sampled_from(list("erorxcptionEXITcd 19_\nmandfu(")), max_size=60))
def test_failed_on_letters_of_the_phrases(text: str) -> None:
    assert failed(text) == (FAILURE.search(text) is not None)


def test_only_the_scanned_start_counts_and_the_first_failing_line_is_named() -> None:
    late = "ok\n" * (SCAN_CHARS // 3) + "error"
    assert not failed(late) and FAILURE.search(late) is not None
    assert failed("fine\n  Error: disk full  \nerror again") and not failed("terrors, errorless")
    assert first_failure_line("fine\n  Error: disk full  \nerror again") == "Error: disk full"
    assert first_failure_line("all good") == ""
