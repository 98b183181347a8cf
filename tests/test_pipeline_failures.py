"""What counts as the last failure (issue 36, item 4): a line that reports a failure, never a
passing line nor code that names an exception; the newest failing command's line is the one
activeRestore names; and the bench's probe (its own reading) agrees with it line for line and
on every turn of the recorded runs."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxgate.pipeline.config import RestoreConfig
from ctxgate.pipeline.boundaries import head_at_boundary
from ctxgate.pipeline.failures import (_ANSI, _EXIT_REPORT, EDGE_LINES, JUDGED_CHARS, KEY_LINE_CHARS, STRONG, WEAK,
                                       exit_status_of, failure_line, key_error_line, strength, strongest_line,
                                       traceback_tails)
from ctxgate.pipeline.restore import ActiveRestore, extract_working_state
from ctxgate.proxy.replay.driver import agent_turns
from ctxgate.proxy.replay.probes import failure_rank, last_error_line

from pipeline_builders import assistant, call, calls, counter, system, tool, user
from trajectories import TOOL_CALLS, dialect_of, mini_swe_agent, openhands, openhands_text, swe_agent, tau_bench

CFG = RestoreConfig()
FAILURES = [
    # Python, from the recorded OpenHands and SWE-agent runs
    ("ValueError: chr() arg not in range(0x110000)", STRONG),
    ("TypeError: __init__() got an unexpected keyword argument 'network'[Python Interpreter: /opt/miniconda3/"
     "envs/testbed/bin/python]", STRONG),
    ("botocore.exceptions.ClientError: An error occurred (InvalidAccessKeyId) when calling the CreateBucket "
     "operation", STRONG),
    ("Traceback (most recent call last):", STRONG),
    ("- E999 IndentationError: unexpected indent", STRONG),
    ("/workspace/python__mypy__1.6/reproduce_error.py:14: error: Trying to assign name \"__traceback__\"", STRONG),
    ("Error occurred: stack expects each tensor to be equal size", STRONG),
    ("rosetta error: failed to open elf at /lib64/ld-linux-x86-64.so.2", STRONG),
    ("\x1b[1mnpm\x1b[22m \x1b[31merror\x1b[39m command failed", STRONG),
    ("ERROR:", STRONG),
    # tau-bench's tool errors
    ("Error: flight HAT030 not available on date 2024-05-13", STRONG),
    # pytest, unittest, Go, Jest, TAP, make, a shell
    ("FAILED tests/test_cpu.py::test_overflow - ValueError: Address 16 exceeds maximum address 15", STRONG),
    ("tests/test_cpu.py::test_overflow FAILED                                 [100%]", STRONG),
    ("E       ValueError: Address 16 exceeds maximum address 15", STRONG),
    ("E       assert 'PASSED' == 'FAILED'", STRONG),
    ("tests/test_cpu.py:41: ValueError", STRONG),
    ("FAIL: test_overflow (tests.test_cpu.CpuTest)", STRONG),
    ("    --- FAIL: TestCPU/overflow (0.00s)", STRONG),
    ("  ✕ rejects an address past 15 (3 ms)", STRONG),
    ("not ok 3 - overflow", STRONG),
    ("make: *** [all] Error 2", STRONG),
    ("cat: cpu.py: No such file or directory", STRONG),
    ("bash: pytets: command not found", STRONG),
    ("fatal: not a git repository (or any of the parent directories): .git", STRONG),
    ("subprocess.CalledProcessError: Command '['make']' returned non-zero exit status 2.", STRONG),
    # a non-zero exit's message, a tally: that something failed, not what
    ("Process exited with code 1", WEAK),
    ("Exit code: 1", WEAK),
    ("[Command finished with exit code 1]", WEAK),
    ("<returncode>2</returncode>", WEAK),
    ("========================= 1 failed, 3 passed in 0.12s =========================", WEAK),
    ("Found 2 errors in 1 file (checked 1 source file)", WEAK),
]
LOOK_ALIKES = [
    # passing lines that name an error
    "✓ Non-integer increment raises TypeError",
    "  ✓ rejects a negative address with ValueError (2 ms)",
    "tests/test_cpu.py::test_raises_value_error PASSED                       [ 50%]",
    "test_value_error (tests.test_cpu.CpuTest) ... ok",
    "--- PASS: TestErrors (0.00s)",
    "ok 2 - throws TypeError on a string",
    "========================= 3 passed, 0 failed in 0.12s =========================",
    "Found 0 errors in 1 file",
    "Success: no issues found in 1 source file",
    "Script completed successfully, no errors.",
    "Process exited with code 0",
    "[Command finished with exit code 0]",
    "<returncode>0</returncode>",
    # source code that names an exception (a file shown, a grep hit, a numbered view)
    "    raise ValueError(f\"Address {address} exceeds maximum address {LIMIT}\")",
    "raise ValueError(msg)",
    "except TypeError:",
    "def test_raises_error():",
    "class AddressError(Exception):",
    "from fastapi.exceptions import RequestValidationError",
    "src/cpu.py:12:    raise ValueError(f\"Address {address} exceeds\")",
    "src/cpu.py:12:raise ValueError(msg)",
    "317:    raise ValueError(",
    "628|            logger.error(f'Error processing command: {str(e)}')",
    "        ValueError: If the address is past the last one.",
    "    ErrorObservation,",
    # warnings and prose
    "Warning: truncated output (original token count: 2851)",
    "Warning: _curses.error: setupterm: could not find terminfo database",
    "/opt/ignite/handlers/checkpoint.py:17: DeprecationWarning: `TorchScript` support is deprecated",
    "but I get the following error:",
    "DO NOT re-run the same failed edit command. Running it again will lead to the same error.",
    "link '[Bug]: Error when running AgentBench evaluation with CodeActAgent', browsergym_id='1535'",
]


@pytest.mark.parametrize("line,expected", FAILURES)
def test_a_line_that_reports_a_failure(line: str, expected: int) -> None:
    assert strength(line) == expected
    assert failure_rank(line) == expected, "the bench's probe reads the same line the same way"


@pytest.mark.parametrize("line", LOOK_ALIKES)
def test_a_line_that_only_looks_like_one(line: str) -> None:
    assert strength(line) == 0
    assert failure_rank(line) == 0


PYTEST_RUN = """============================= test session starts ==============================
collected 4 items

tests/test_cpu.py::test_increment PASSED                                 [ 25%]
tests/test_cpu.py::test_non_integer_raises_type_error PASSED             [ 50%]
tests/test_cpu.py::test_overflow FAILED                                  [ 75%]
tests/test_cpu.py::test_reset PASSED                                     [100%]

=================================== FAILURES ===================================
________________________________ test_overflow _________________________________

    def test_overflow():
        cpu = Cpu()
>       cpu.store(16, 1)

tests/test_cpu.py:22:
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _
    def store(self, address, value):
        if address > LIMIT:
>           raise ValueError(f"Address {address} exceeds maximum address {LIMIT}")
E           ValueError: Address 16 exceeds maximum address 15

cpu.py:9: ValueError
=========================== short test summary info ============================
FAILED tests/test_cpu.py::test_overflow - ValueError: Address 16 exceeds maximum address 15
========================= 1 failed, 3 passed in 0.05s ==========================
"""
CODEX_FAILED = ("Chunk ID: 5b1e0c\nWall time: 0.4120 seconds\nProcess exited with code 1\nOriginal token count: 96\n"
                "Output:\nTraceback (most recent call last):\n  File \"/w/run.py\", line 4, in <module>\n"
                "    cpu.store(16, 1)\n  File \"/w/cpu.py\", line 9, in store\n"
                "    raise ValueError(f\"Address {address} exceeds maximum address {LIMIT}\")\n"
                "ValueError: Address 16 exceeds maximum address 15\n")
NODE_PASSED = ("Chunk ID: 77a0f2\nWall time: 0.2210 seconds\nProcess exited with code 0\nOriginal token count: 40\n"
               "Output:\n  cpu\n    ✓ Increment adds one\n    ✓ Non-integer increment raises TypeError\n"
               "✓ Non-integer increment raises TypeError\n\n2 passing (4ms)\n")
GREP_SOURCE = ("Chunk ID: 0c9e11\nWall time: 0.0100 seconds\nProcess exited with code 0\nOriginal token count: 30\n"
               "Output:\nsrc/cpu.py:9:            raise ValueError(f\"Address {address} exceeds maximum address\")\n"
               "src/cpu.py:14:        except TypeError:\n")


@pytest.mark.parametrize("output,key", [
    (PYTEST_RUN, "FAILED tests/test_cpu.py::test_overflow - ValueError: Address 16 exceeds maximum address 15"),
    (CODEX_FAILED, "ValueError: Address 16 exceeds maximum address 15"),
    ("EXECUTION RESULT of [execute_bash]:\npython reproduce.py\nTraceback (most recent call last):\n"
     "  File \"/workspace/reproduce.py\", line 13, in <module>\n    evaluator = Evaluator(\n"
     "TypeError: __init__() got an unexpected keyword argument 'network'\n"
     "root@openhands-workspace:/workspace # \n[Command finished with exit code 1]",
     "TypeError: __init__() got an unexpected keyword argument 'network'"),
    ("Your proposed edit has introduced new syntax error(s). Please understand the fixes and retry your edit "
     "commmand.\n\nERRORS:\n- E999 IndentationError: unexpected indent\n\nThis is how your edit would have looked"
     "\n1475:return int(round(value))\n1480:        except (TypeError, ValueError) as error:\n-----\n"
     "DO NOT re-run the same failed edit command. Running it again will lead to the same error.",
     "- E999 IndentationError: unexpected indent"),
    ("OBSERVATION:\nERROR:\nThe `view_range` parameter is not allowed when `path` points to a directory.",
     "ERROR:\nThe `view_range` parameter is not allowed when `path` points to a directory."),
    ("grep: src/: Is a directory\n[Command finished with exit code 1]", "[Command finished with exit code 1]"),
    (NODE_PASSED, ""),
    (GREP_SOURCE, ""),
])
def test_the_key_line_of_an_output(output: str, key: str) -> None:
    assert key_error_line(output) == key


def test_exit_statuses_in_each_agents_words() -> None:
    assert [exit_status_of(t) for t in (CODEX_FAILED, NODE_PASSED, "<returncode>2</returncode>\n<output>\n",
                                        "[The command completed with exit code 0.]", "Exit code 1\nno such module",
                                        "plain output")] == [1, 0, 2, 0, 1, None]
    # A program's output that mentions an exit status is not the tool's report of the command's.
    assert exit_status_of(NODE_PASSED + "worker 3 exited with code 2 after 3s\n") == 0


def codex_step(cid: str, command: str, output: str) -> list[dict]:
    return [calls(call(cid, "exec_command", cmd=command)), tool(cid, output)]


def test_the_newest_failing_commands_line_is_named_not_a_passing_line_after_it() -> None:
    """The issue's case: the failing command's ValueError (exit code 1), then a passing run whose
    lines name TypeError, then a grep of the source naming ValueError: the restored last error
    is the failure, and it is the line the bench's probe looks for."""
    h = [system(), user("Make the CPU reject addresses past 15 and fix the failing test."),
         *codex_step("c1", "python run.py", CODEX_FAILED),
         *codex_step("c2", "node --test", NODE_PASSED),
         *codex_step("c3", "grep -rn 'raise ValueError\\|except TypeError' src/", GREP_SOURCE),
         assistant("The overflow check raises; the test expects it."), user("go on")]
    state = extract_working_state(h, CFG)
    assert state.last_error == "ValueError: Address 16 exceeds maximum address 15"
    assert last_error_line(h, text_mode=False) == state.last_error
    # Out of view (the failing output cut away), the block names it.
    out_of_view = [m for m in h if CODEX_FAILED not in str(m.get("content"))]
    blocks = ActiveRestore(CFG, state).blocks(counter(), 10_000, visible=out_of_view)
    assert any(state.last_error in b["content"] and "✓" not in b["content"] for b in blocks)


def test_a_passing_run_after_a_fix_leaves_the_failure_it_fixed_as_the_last_one() -> None:
    """A passing run reports no failure: it does not hide the last one, nor is it named."""
    h = [system(), user("fix it"), *codex_step("c1", "pytest", PYTEST_RUN),
         *codex_step("c2", "node --test", NODE_PASSED)]
    assert extract_working_state(h, CFG).last_error.startswith("FAILED tests/test_cpu.py::test_overflow")


def test_a_command_that_failed_without_saying_how_is_named_by_its_last_line_not_a_passing_one() -> None:
    h = [system(), user("Run the checks."),
         assistant("THOUGHT: run them.\n\n```bash\n./check.sh\n```"),
         user("<returncode>3</returncode>\n<output>\nlint: 12 files\n✓ formatting\n</output>")]
    state = extract_working_state(h, CFG)
    assert state.last_error == "lint: 12 files"
    assert last_error_line(h, text_mode=True) == state.last_error


def test_a_demonstrations_failures_are_not_the_agents() -> None:
    demo = ("Here is a demonstration of how to correctly accomplish this task.\n--- DEMONSTRATION ---\n"
            "```\nedit 3:3\n```\nERRORS:\n- E999 IndentationError: unexpected indent\n(Open file: /r/a.py)\n"
            "--- END OF DEMONSTRATION ---\n")
    h = [system(), user(demo), user("We're currently solving the following issue within our repository."),
         assistant("```\nls\n```"), user("a.py\n(Open file: n/a)\n(Current directory: /r)\nbash-$")]
    assert extract_working_state(h, CFG).last_error == ""
    assert last_error_line(h, text_mode=True) is None


def test_the_probe_and_restore_name_the_same_failure_on_every_recorded_turn() -> None:
    """Two readings written apart (the bench's must not check ctxgate against itself) agree on
    each turn of the recorded runs in every dialect."""
    runs = [*openhands(), *swe_agent(), *openhands_text(), *mini_swe_agent(), *tau_bench(20)]
    named = 0
    for run in runs:
        text_mode = dialect_of(run) != TOOL_CALLS
        for i in agent_turns(run.messages):
            request = run.messages[:i]
            probe = last_error_line(request, text_mode) or ""
            assert extract_working_state(request, CFG).last_error == probe, (run.source, i)
            named += bool(probe)
    assert named > 100


BUILD = "\n".join("error: MIDDLE-MARKER undefined reference to frobnicate" if i == 60 else
                  f"build step {i}: compiling module_{i}.c ok" for i in range(120))
UNNAMED_EXCEPTION = ("Traceback (most recent call last):\n  File \"/w/repro.py\", line 12, in <module>\n"
                     "    client.create_invalidation(\n"
                     "botocore.errorfactory.NoSuchDistribution: An error occurred (NoSuchDistribution) when calling "
                     "the CreateInvalidation operation\nroot@openhands-workspace:/w # \n")
PIPED_PYTEST = ("Chunk ID: 1a\nWall time: 0.9 seconds\nProcess exited with code 0\nOriginal token count: 80\nOutput:\n"
                + PYTEST_RUN)


@pytest.mark.parametrize("output,key", [
    (BUILD, ""),
    (CODEX_FAILED.replace("Output:\n", "Output:\n" + BUILD + "\n"),
     "ValueError: Address 16 exceeds maximum address 15"),
    (UNNAMED_EXCEPTION, UNNAMED_EXCEPTION.splitlines()[3]),
    (PIPED_PYTEST, "FAILED tests/test_cpu.py::test_overflow - ValueError: Address 16 exceeds maximum address 15"),
])
def test_which_output_failed_is_judged_by_its_structure(output: str, key: str) -> None:
    """An error-looking line inside an output that began and ended well is no failure (the
    build log of check_expand); a non-zero exit status, a failure at an output's ends (pytest
    piped through `tail`, whose exit status is 0) or a traceback is, and a traceback's tail is
    its exception line whatever the exception is called. The probe reads each the same way."""
    assert key_error_line(output, exit_status_of(output)) == key
    h = [system(), user("go"), *codex_step("c1", "run", output)]
    assert (last_error_line(h, text_mode=False) or "") == key
    assert extract_working_state(h, CFG).last_error == key


def test_the_middle_of_an_output_that_reports_no_failure_does_not_hide_the_failure_before_it() -> None:
    h = [system(), user("go"), *codex_step("c1", "python run.py", CODEX_FAILED), *codex_step("c2", "make", BUILD)]
    assert extract_working_state(h, CFG).last_error == "ValueError: Address 16 exceeds maximum address 15"
    assert last_error_line(h, text_mode=False) == "ValueError: Address 16 exceeds maximum address 15"
    # With a failing exit status the build's own line is the last failure.
    failed = [*h[:-1], tool("c2", BUILD + "\nProcess exited with code 2")]
    assert extract_working_state(failed, CFG).last_error == "error: MIDDLE-MARKER undefined reference to frobnicate"
    assert last_error_line(failed, text_mode=False) == extract_working_state(failed, CFG).last_error


LINES = ["ok", "", "   ", "collected 3 items", "PASSED tests/t.py::a", "✓ adds", "ValueError: bad value 3",
         "Traceback (most recent call last):", '  File "x.py", line 2, in <module>', "    raise KeyError(k)",
         "KeyError: 'k'", "error: cannot open x", "1 failed, 2 passed", "warning: unused", "\x1b[31mFAILED\x1b[0m t",
         "Exit code: 1", "Process exited with code 0", "def f(): raise ValueError(x)", "some words",
         "E   assert 1 == 2"]


def _judged_line_by_line(text: str, exit_status: int | None, flagged: bool) -> str:
    """`key_error_line` as written before its structure check took the shortcut: every line judged
    first, the failure decided from all their judgements (the line then chosen the same way)."""
    lines = text.splitlines()
    strengths = [strength(line) for line in lines]
    for i in traceback_tails(lines):
        strengths[i] = STRONG
    edges = [s for line, s in zip(lines, strengths) if _ANSI.sub("", line).strip()]
    if not (flagged or exit_status not in (None, 0) or traceback_tails(lines)
            or any(edges[:EDGE_LINES]) or any(edges[-EDGE_LINES:])):
        return ""
    return strongest_line(lines, strengths)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(LINES), max_size=30), st.sampled_from([None, 0, 1, 2]), st.booleans())
def test_the_structure_shortcut_names_what_judging_every_line_names(lines: list[str], exit_status: int | None,
                                                                    flagged: bool) -> None:
    text = "\n".join(lines)
    assert key_error_line(text, exit_status, flagged) == _judged_line_by_line(text, exit_status, flagged)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([*LINES, "EXIT CODE 3", "<returncode>4</returncode>", "exited with status 5",
                                 "the child exited with code 2 after 3s", "exit", "Ret 1"]), max_size=12))
def test_the_exit_status_shortcut_reads_what_the_pattern_reads(lines: list[str]) -> None:
    text = "\n".join(lines)
    found = _EXIT_REPORT.search(text)
    assert exit_status_of(text) == (int(found.group(1)) if found else None)


def test_a_long_output_is_judged_by_its_ends() -> None:
    """A million lines cost what `2 * SCAN_LINES` do: the failure at its end is named, an
    error line in its unread middle is not."""
    middle = ["fine"] * 500_000 + ["ValueError: in the middle"] + ["fine"] * 500_000
    assert key_error_line("\n".join(["start", *middle, "KeyError: 'end'"])) == "KeyError: 'end'"
    assert key_error_line("\n".join(["start", *middle, "done"]), exit_status=1) == ""
    assert failure_line("\n".join(["start", *middle, "done"]), exit_status=1) == "done"


def test_a_failure_is_named_however_little_the_output_says() -> None:
    assert failure_line("", exit_status=2) == "exit status 2"
    assert failure_line("", flagged=True) == "the tool reported an error"
    assert failure_line("all good\n✓ passes", exit_status=1) == "all good"
    assert failure_line("step\n" * 6 + "error: in the middle\n" + "step\n" * 6 + "done") == ""
    long_line = "ValueError: " + "word " * 100
    assert failure_line(long_line) == head_at_boundary(long_line.strip(), KEY_LINE_CHARS)
    assert not failure_line(long_line).endswith(("wor", "wo", " "))


def test_a_line_is_judged_by_its_start() -> None:
    """A one-line output of megabytes costs what its first `JUDGED_CHARS` do: a failure it
    reports at its start is one, a word far into it is not read."""
    assert strength("error: " + "a/b.c:1:" * 200_000) == STRONG
    assert strength("x" * JUDGED_CHARS + " FAILED") == 0
    assert key_error_line("ok\n" + "a/b.c:1:" * 200_000 + " FAILED") == ""
