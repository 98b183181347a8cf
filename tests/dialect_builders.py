"""Agent histories in the four dialects ctxgate must compact, and what the issue-11 tests
check on what was forwarded (pure data, no servers).

One scenario (a seeded, dialect-free list of steps: view a file, run a command, edit,
talk) is rendered in each dialect:

- `tool_calls`: OpenAI `tool_calls` on assistant messages, results in `role: "tool"`
  messages (OpenHands' function-calling format; some steps call two tools at once);
- `openhands_text`: `<function=NAME>\\n<parameter=KEY>VALUE</parameter>\\n</function>` after
  some prose, the observation a user turn opening `EXECUTION RESULT of [NAME]:`;
- `swe_agent_text`: the thought, then the command in a ``` fence or in `<command>` tags (SWE-agent's
  XML parser); the observation a user turn (`OBSERVATION:`, a `[File: …]` window, or `Your
  command ran successfully …`) ending in `(Open file: …)\\n(Current directory: …)\\nbash-$`; some runs open with a
  demonstration of another task before the real one;
- `mini_swe_agent`: `THOUGHT: …` and exactly one ```` ```bash ```` block; the observation
  a user turn `<returncode>N</returncode>\\n<output>…</output>` (a long one with
  mini-swe-agent's `<warning>`/`<output_head>`/`<output_tail>` shape).

Every history is system prompt, task, then `steps` steps; outputs of varied sizes, some of
several thousand tokens, failing commands with a Python traceback ending in
`ValueError: bad config key …`, and some steps of plain talk (an assistant message with
no action, answered by the agent framework's nudge or by the human). The same seed with
more steps extends the same history: `build(d, s, 30).messages[:k] == build(d, s, 40).messages[:k]`
for k up to the 30-step length.

`kinds` labels each message: the ground truth the checks use (never ctxgate's detection).
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.notes import is_compaction_note, is_ctxgate_message
from ctxgate.pipeline.turns import is_valid_sequence
from ctxgate.proxy.engine.turn_budget import Turn

from pipeline_builders import Message, call, calls, counter, filler, system, tool, user

TOOL_CALLS = "tool_calls"
OPENHANDS_TEXT = "openhands_text"
SWE_AGENT_TEXT = "swe_agent_text"
MINI_SWE_AGENT = "mini_swe_agent"
DIALECTS = (TOOL_CALLS, OPENHANDS_TEXT, SWE_AGENT_TEXT, MINI_SWE_AGENT)
"""The names `GET /v1/ctx/sessions/{id}` reports as `dialect` (besides `anthropic_blocks`, `plain`)."""
TEXT_DIALECTS = (OPENHANDS_TEXT, SWE_AGENT_TEXT, MINI_SWE_AGENT)

INSTRUCTIONS = "instructions"
DEMONSTRATION = "demonstration"
TASK = "task"
ACTION = "action"
OBSERVATION = "observation"
TALK = "talk"
"""An assistant message with no action."""
REPLY = "reply"
"""A user message that is not an observation: the framework's nudge after talk, or the human."""

RECENT = 10
"""The issue's recent window: at least the last 10 messages, never fewer than the last two complete steps."""
NOTE_ROOM = 300
"""Room for ctxgate's own notes (restore blocks, a summary): the recent window is owed
verbatim when it fits a budget (or the compaction target) with this much to spare."""

ROOTS = {TOOL_CALLS: "/workspace/repo", OPENHANDS_TEXT: "/workspace/repo", SWE_AGENT_TEXT: "/repo",
         MINI_SWE_AGENT: "/testbed"}
FILES = ("src/app.py", "src/config.py", "src/utils/io.py", "src/cli.py", "tests/test_app.py", "tests/test_config.py",
         "setup.py", "reproduce.py")
BAD_KEY = "retry_after"
ERROR_LINE = f"ValueError: bad config key '{BAD_KEY}'"


# -- the scenario: what the agent does, in no dialect ---------------------------------------

@dataclass(frozen=True)
class Step:
    kind: str
    """`view`, `run`, `edit` or `talk`."""
    thought: str
    path: str = ""
    """Relative to the repository root (view, edit)."""
    also: str = ""
    """A second file viewed in the same step: a parallel tool call (tool_calls only)."""
    start: int = 1
    lines: tuple[str, ...] = ()
    """The file window shown (view) or the lines around an edit."""
    total: int = 0
    """How many lines the file has."""
    command: str = ""
    """The shell command (run)."""
    output: str = ""
    """What it printed (run); may hold `{root}`."""
    exit_code: int = 0
    old: str = ""
    new: str = ""
    reply: str = ""
    """(talk) The human's answer; empty: the framework's nudge."""
    fenced: bool = True
    """(SWE-agent) The command in a ``` fence, else in `<command>` tags after the thought (as in
    SWE-agent's own trajectories: none puts a command bare after a thought)."""


def code_line(path: str, n: int) -> str:
    """Line `n` (1-based) of a made-up Python file: blocks of seven lines, one function each."""
    k, r = divmod(n - 1, 7)
    stem = path.rsplit("/", 1)[-1].removesuffix(".py").replace(".", "_")
    return (f"def {stem}_handler_{k}(value, *, strict=False):",
            f'    """Return the {k}th normalised value of the {stem} settings."""',
            "    if strict and value is None:",
            f'        raise ValueError("bad config key {stem}_{k}")',
            f"    result = normalise(value, scale={k % 9 + 1}) + {k}",
            "    return result",
            "")[r]


def _file_window(rng: random.Random, path: str, long: bool) -> tuple[int, tuple[str, ...], int]:
    total = rng.randint(300, 700) if long else rng.randint(40, 260)
    size = min(total, rng.randint(260, 420) if long else rng.randint(12, 60))
    start = 1 if long or rng.random() < 0.5 else rng.randint(1, total - size + 1)
    return start, tuple(code_line(path, n) for n in range(start, start + size)), total


def _traceback(script: str) -> str:
    return ("Traceback (most recent call last):\n"
            f'  File "{{root}}/{script}", line 4, in <module>\n'
            '    app.main(["--config", "settings.json"])\n'
            '  File "{root}/src/app.py", line 57, in main\n'
            "    cfg = load_config(args.config)\n"
            '  File "{root}/src/config.py", line 23, in load_config\n'
            '    raise ValueError(f"bad config key {key!r}")\n'
            f"{ERROR_LINE}")


def _pytest_output(rng: random.Random, failing: bool, verbose_tokens: int, seed: int) -> str:
    tests = [f"tests/test_config.py::test_option_{i} PASSED" for i in range(rng.randint(4, 14))]
    out = ["============================= test session starts ==============================",
           "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0",
           "rootdir: {root}", f"collected {len(tests) + failing} items", "", *tests]
    if verbose_tokens:
        words = filler(verbose_tokens, seed).split()
        out += [f"DEBUG config.loader: {' '.join(words[i:i + 12])}" for i in range(0, len(words), 12)]
    if failing:
        out += ["tests/test_config.py::test_retry_after FAILED", "",
                "=================================== FAILURES ===================================",
                "______________________________ test_retry_after _______________________________", "",
                "    def test_retry_after():", ">       load_config('tests/data/retry.json')", "",
                "tests/test_config.py:41: ", "_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _",
                _traceback("tests/test_config.py"),
                "=========================== short test summary info ============================",
                f"FAILED tests/test_config.py::test_retry_after - {ERROR_LINE}",
                f"========================= 1 failed, {len(tests)} passed in 0.48s ========================="]
    else:
        out.append(f"============================== {len(tests)} passed in 0.41s ==============================")
    return "\n".join(out)


def _listing(rng: random.Random) -> str:
    names = ["__init__.py", "app.py", "cli.py", "config.py", "utils", "errors.py", "models.py", "db.py"]
    rows = [f"-rw-r--r-- 1 root root {rng.randint(120, 24000):6d} Sep  9 02:49 {n}" for n in names[:rng.randint(3, 8)]]
    return "\n".join([f"total {rng.randint(20, 120)}", "drwxr-xr-x 1 root root   4096 Sep  9 02:49 .",
                      "drwxr-xr-x 1 root root   4096 Sep  9 02:49 ..", *rows])


def _grep(rng: random.Random) -> str:
    return "\n".join(f"src/{rng.choice(['app', 'config', 'cli'])}.py:{rng.randint(3, 200)}:    cfg = "
                     f"load_config(path, strict={rng.choice(['True', 'False'])})" for _ in range(rng.randint(1, 9)))


THOUGHTS = {
    "view": ("Let me look at how the configuration is loaded before changing anything.",
             "The traceback points at load_config, so I will inspect that file next.",
             "I want to double-check the CLI entry point, which also builds a config."),
    "run": ("I should reproduce the failure first so I can confirm the fix later.",
            "Now I will run the tests for the config module to see what fails.",
            "Let me search for other callers of load_config that may pass unknown keys.",
            "The change looks right; running the checks again to be sure."),
    "edit": ("The key is rejected because it is missing from DEFAULTS; I will add it there.",
             "The strict flag must be passed through here as well."),
    "talk": (("the loader validates keys before it merges the defaults, so documented options that are not in "
              "DEFAULTS are refused."), "the CLI and the library share one loader, so one fix covers both."),
}
HUMAN = ("Please also make sure the README mentions the new option.",
         "Note that the config file may also come from the CTX_CONFIG environment variable.",
         "Keep the public API of load_config unchanged, other packages import it.")


def _thought(rng: random.Random, kind: str, i: int) -> str:
    return f"{rng.choice(THOUGHTS[kind])} (step {i + 1})"


def scenario(seed: int, steps: int) -> list[Step]:
    """The steps of one run, the same in every dialect. A prefix of a longer run with the same seed."""
    rng = random.Random(seed)
    out: list[Step] = []
    for i in range(steps):
        roll = rng.random()
        long = rng.random() < 0.12  # several thousand tokens
        if roll < 0.28:
            path = rng.choice(FILES[:6])
            start, lines, total = _file_window(rng, path, long)
            also = rng.choice([f for f in FILES[:6] if f != path]) if rng.random() < 0.25 else ""
            out.append(Step("view", _thought(rng, "view", i), path=path, also=also, start=start, lines=lines,
                            total=total))
        elif roll < 0.48:
            failing = rng.random() < 0.5
            output = _pytest_output(rng, failing, rng.randint(2000, 4500) if long else 0, seed * 1000 + i)
            out.append(Step("run", _thought(rng, "run", i), command="python -m pytest tests/test_config.py -q",
                            output=output, exit_code=1 if failing else 0))
        elif roll < 0.58:
            failing = rng.random() < 0.6
            out.append(Step("run", _thought(rng, "run", i), command="python reproduce.py",
                            output=_traceback("reproduce.py") if failing else "", exit_code=1 if failing else 0))
        elif roll < 0.72:
            if long:
                output = filler(rng.randint(2500, 5000), seed * 1000 + i)
                out.append(Step("run", _thought(rng, "run", i), command="cat logs/server.log", output=output))
            elif rng.random() < 0.5:
                out.append(Step("run", _thought(rng, "run", i), command="ls -la src", output=_listing(rng)))
            else:
                out.append(Step("run", _thought(rng, "run", i), command="grep -rn load_config src", output=_grep(rng)))
        elif roll < 0.88:
            path = rng.choice(FILES[:4])
            at = rng.randint(3, 180)
            old = code_line(path, at)
            new = old.replace("strict=False", "strict=True") if "strict=False" in old else old + "  # checked"
            lines = tuple(code_line(path, n) if n != at else new for n in range(max(1, at - 3), at + 4))
            out.append(Step("edit", _thought(rng, "edit", i), path=path, start=max(1, at - 3), lines=lines,
                            total=rng.randint(200, 400), old=old, new=new))
        else:
            talk = (f"I have narrowed the problem down: {rng.choice(THOUGHTS['talk'])} "
                    + " ".join(rng.choice(THOUGHTS["talk"]).capitalize() for _ in range(rng.randint(1, 4))))
            out.append(Step("talk", talk, reply=rng.choice(HUMAN) if rng.random() < 0.4 else ""))
        out[-1] = replace(out[-1], fenced=rng.random() < 0.7)
    return out


# -- the history in each dialect ------------------------------------------------------------

@dataclass(frozen=True)
class History:
    dialect: str
    seed: int
    messages: list[Message]
    kinds: tuple[str, ...]
    tools: list[dict[str, Any]] | None

    def requests(self) -> list[Request]:
        """What the agent sends, turn by turn: `messages[:i]` before each assistant message
        after the task, then the whole history (the request for its next reply)."""
        first = self.kinds.index(TASK)
        cuts = [i for i, m in enumerate(self.messages) if i > first and m["role"] == "assistant"]
        return [Request(i, self.messages[:i], self.kinds[:i]) for i in cuts] + [
            Request(len(self.messages), self.messages, self.kinds)]


@dataclass(frozen=True)
class Request:
    turn: int
    """How many messages of the history it holds."""
    messages: list[Message]
    kinds: tuple[str, ...]


def _asst(text: str) -> Message:
    return {"role": "assistant", "content": text}


def _numbered_cat(root: str, step: Step) -> str:
    return "\n".join(f"{n:6d}\t{line}" for n, line in enumerate(step.lines, step.start))


def _plain_output(step: Step, root: str) -> str:
    return step.output.replace("{root}", root)


# OpenHands: function calling and text share the tools; text puts them in the prompt.
OPENHANDS_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "execute_bash",
        "description": "Execute a bash command in the terminal within a persistent shell session.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string",
                                                                    "description": "The bash command to execute."}},
                       "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "str_replace_editor",
        "description": "Custom editing tool for viewing, creating and editing files in plain-text format.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
            "path": {"type": "string", "description": "Absolute path to file or directory."},
            "old_str": {"type": "string"}, "new_str": {"type": "string"}},
            "required": ["command", "path"]}}},
    {"type": "function", "function": {
        "name": "finish", "description": "Signals the completion of the current task or conversation.",
        "parameters": {"type": "object", "properties": {}}}},
]
OPENHANDS_SYSTEM = """You are OpenHands agent, a helpful AI assistant that can interact with a computer to solve tasks.

<ROLE>
Your primary role is to assist users by executing commands, modifying code, and solving technical problems effectively.
* If the user asks a question, like "why is X happening", don't try to fix the problem. \
Just give an answer to the question.
</ROLE>

<EFFICIENCY>
* Each action you take is somewhat expensive. Wherever possible, combine multiple actions into a single action.
* When exploring the codebase, use efficient tools like find, grep, and git commands with appropriate filters.
</EFFICIENCY>

<FILE_SYSTEM_GUIDELINES>
* When a user provides a file path, do NOT assume it's relative to the current working directory.
* If asked to edit a file, edit the file directly, rather than creating a new file with a different filename.
</FILE_SYSTEM_GUIDELINES>

<CODE_QUALITY>
* Write clean, efficient code with minimal comments.
* When implementing solutions, focus on making the minimal changes needed to solve the problem.
</CODE_QUALITY>

<PROBLEM_SOLVING_WORKFLOW>
1. EXPLORATION: Thoroughly explore relevant files and understand the context before proposing solutions
2. ANALYSIS: Consider multiple approaches and select the most promising one
3. TESTING: For bug fixes, create tests to verify issues before implementing fixes
4. IMPLEMENTATION: Make focused, minimal changes to address the problem
5. VERIFICATION: Test your implementation thoroughly, including edge cases
</PROBLEM_SOLVING_WORKFLOW>"""
OPENHANDS_TEXT_TOOLS = """

You have access to the following functions:

---- BEGIN FUNCTION #1: execute_bash ----
Description: Execute a bash command in the terminal within a persistent shell session.
Parameters:
  (1) command (string, required): The bash command to execute.
---- END FUNCTION #1 ----

---- BEGIN FUNCTION #2: str_replace_editor ----
Description: Custom editing tool for viewing, creating and editing files in plain-text format
Parameters:
  (1) command (string, required): The commands to run. \
Allowed options are: `view`, `create`, `str_replace`, `insert`, `undo_edit`.
  (2) path (string, required): Absolute path to file or directory, e.g. `/workspace/file.py` or `/workspace`.
  (3) old_str (string, optional): \
Required parameter of `str_replace` command containing the string in `path` to replace.
  (4) new_str (string, optional): Optional parameter of `str_replace` command containing the new string.
---- END FUNCTION #2 ----

---- BEGIN FUNCTION #3: finish ----
Description: Finish the interaction when the task is complete OR if the assistant cannot proceed further with the task.
No parameters are required for this function.
---- END FUNCTION #3 ----

If you choose to call a function ONLY reply in the following format with NO suffix:

<function=example_function_name>
<parameter=example_parameter_1>value_1</parameter>
<parameter=example_parameter_2>
This is the value for the second parameter
that can span
multiple lines
</parameter>
</function>

<IMPORTANT>
Reminder:
- Function calls MUST follow the specified format, start with <function= and end with </function>
- Required parameters MUST be specified
- Only call one function at a time
- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after.
</IMPORTANT>"""
ISSUE = (f"Loading a settings file that sets `{BAD_KEY}` fails with `{ERROR_LINE}` although the option is "
         "documented in the README. Steps: create settings.json with {\"retry_after\": 5} and run "
         "`python -m app --config settings.json`. Expected: the option is accepted and used for back-off.")
OPENHANDS_TASK = ("<uploaded_files>\n/workspace/repo\n</uploaded_files>\nI've uploaded a python code repository "
                  f"in the directory repo. Consider the following issue description:\n\n<issue_description>\n{ISSUE}\n"
                  "</issue_description>\n\nCan you help me implement the necessary changes to the repository so that "
                  "the requirements specified in the <issue_description> are met?\nI've already taken care of all "
                  "changes to any of the test files described in the <issue_description>. This means you DON'T have "
                  "to modify the testing logic or any of the tests in any way!")
OPENHANDS_NUDGE = ("Please continue working on the task on whatever approach you think is suitable.\nIf you think you "
                   "have solved the task, please first send your answer to user through message and then finish the "
                   "interaction.\nIMPORTANT: YOU SHOULD NEVER ASK FOR HUMAN HELP.\n")


def _openhands_args(step: Step, root: str, path: str | None = None) -> tuple[str, dict[str, str]]:
    if step.kind == "view":
        return "str_replace_editor", {"command": "view", "path": f"{root}/{path or step.path}"}
    if step.kind == "edit":
        return "str_replace_editor", {"command": "str_replace", "path": f"{root}/{step.path}", "old_str": step.old,
                                      "new_str": step.new}
    return "execute_bash", {"command": f"cd {root} && {step.command}"}


def _openhands_result(step: Step, root: str, path: str | None = None) -> str:
    if step.kind == "view":
        p = path or step.path
        if path:  # the second file of a parallel view
            return (f"Here's the result of running `cat -n` on {root}/{p}:\n"
                    + "\n".join(f"{n:6d}\t{code_line(p, n)}" for n in range(1, 31)))
        return f"Here's the result of running `cat -n` on {root}/{p}:\n" + _numbered_cat(root, step)
    if step.kind == "edit":
        return (f"The file {root}/{step.path} has been edited. Here's the result of running `cat -n` on a snippet of "
                f"{root}/{step.path}:\n{_numbered_cat(root, step)}\nReview the changes and make sure they are as "
                "expected. Edit the file again if necessary.")
    return (f"{_plain_output(step, root)}\n[The command completed with exit code {step.exit_code}.]\n"
            f"[Current working directory: {root}]\n[Python interpreter: /usr/bin/python]\n"
            f"[Command finished with exit code {step.exit_code}]")


def _function_block(name: str, args: dict[str, str]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<function={name}>\n{params}</function>"


def _tool_calls(steps: list[Step], root: str) -> list[tuple[Message, str]]:
    out: list[tuple[Message, str]] = [(system(OPENHANDS_SYSTEM), INSTRUCTIONS), (user(OPENHANDS_TASK), TASK)]
    for i, step in enumerate(steps):
        if step.kind == "talk":
            out += [({"role": "assistant", "content": step.thought}, TALK),
                    (user(step.reply or OPENHANDS_NUDGE), REPLY)]
            continue
        paths = [step.path, step.also] if step.kind == "view" and step.also else [None]
        ids = [f"toolu_{i:03d}_{k}" for k in range(len(paths))]
        named = [_openhands_args(step, root, p) for p in paths]
        tcs = [call(cid, name, **args) for cid, (name, args) in zip(ids, named, strict=True)]
        out.append((calls(*tcs, text=step.thought), ACTION))
        out += [(tool(cid, _openhands_result(step, root, p if k else None)), OBSERVATION)
                for k, (cid, p) in enumerate(zip(ids, paths))]
    return out


def _openhands_text(steps: list[Step], root: str) -> list[tuple[Message, str]]:
    out: list[tuple[Message, str]] = [(system(OPENHANDS_SYSTEM + OPENHANDS_TEXT_TOOLS), INSTRUCTIONS),
                                      (user(OPENHANDS_TASK), TASK)]
    for step in steps:
        if step.kind == "talk":
            out += [(_asst(step.thought), TALK), (user(step.reply or OPENHANDS_NUDGE), REPLY)]
            continue
        name, args = _openhands_args(step, root)
        out.append((_asst(f"{step.thought}\n\n{_function_block(name, args)}"), ACTION))
        out.append((user(f"EXECUTION RESULT of [{name}]:\n{_openhands_result(step, root)}"), OBSERVATION))
    return out


SWE_SYSTEM = """SETTING: You are an autonomous programmer, \
and you're working directly in the command line with a special interface.

The special interface consists of a file editor that shows you 100 lines of a file at a time.
In addition to typical bash commands, you can also use the following commands to help you navigate and edit files.

COMMANDS:
open:
  docstring: opens the file at the given path in the editor. \
If line_number is provided, the window will be move to include that line
  signature: open <path> [<line_number>]

goto:
  docstring: moves the window to show <line_number>
  signature: goto <line_number>

edit:
  docstring: replaces lines <start_line> through <end_line> (inclusive) with the given text in the open file.
  signature: edit <start_line>:<end_line>
<replacement_text>
end_of_edit

search_dir:
  docstring: searches for search_term in all files in dir. If dir is not provided, searches in the current directory
  signature: search_dir <search_term> [<dir>]

submit:
  docstring: submits your current code and terminates the session
  signature: submit

Please note that THE EDIT COMMAND REQUIRES PROPER INDENTATION.

RESPONSE FORMAT:
Your shell prompt is formatted as follows:
(Open file: <path>) <cwd> $

You need to format your output using two fields; discussion and command.
Your output should always include _one_ discussion and _one_ command field EXACTLY as in the following example:
DISCUSSION
First I'll start by using ls to see what files are in the current directory. \
Then maybe we can look at some relevant files to see what they look like.
```
ls -a
```

You should only include a *SINGLE* command in the command section and then wait for a response from the shell \
before continuing with more discussion and commands."""
SWE_DEMONSTRATION = ("Here is a demonstration of how to correctly accomplish this task.\nIt is included to show you "
                     "how to correctly use the interface.\nYou do not need to follow exactly what is done in the "
                     "demonstration.\n--- DEMONSTRATION ---\nWe're currently solving the following issue within our "
                     "repository. Here's the issue text:\nISSUE:\nTimeDelta serialization precision\n")
SWE_TASK = (f"We're currently solving the following issue within our repository. Here's the issue text:\nISSUE:\n"
            f"{ISSUE}\n\nINSTRUCTIONS:\nNow, you're going to solve this issue on your own. Your terminal session has "
            "started and you're in the repository's root directory. You can use any bash commands or the special "
            "interface to help you. Edit all the files you need to and run any checks or tests that you want.\n"
            "Remember, YOU CAN ONLY ENTER ONE COMMAND AT A TIME. You should always wait for feedback after every "
            "command.\nWhen you're satisfied with all of the changes you've made, you can submit your changes to the "
            "code base by simply running the submit command.\n\n(Open file: n/a)\n(Current directory: /repo)\nbash-$")
SWE_FORMAT_ERROR = ("Your output was not formatted correctly. You must always include one discussion and one command "
                    "as part of your response. Make sure you do not have multiple discussion/command tags.\n"
                    "Please make "
                    "sure your output precisely matches the following format:\nDISCUSSION\nDiscuss here with yourself "
                    "about what your planning and what you're going to do in this step.\n\n```\ncommand(s) that "
                    "you're going to run\n```")


def _swe_agent_text(steps: list[Step], root: str, seed: int) -> list[tuple[Message, str]]:
    out: list[tuple[Message, str]] = [(system(SWE_SYSTEM), INSTRUCTIONS)]
    if seed % 3 == 0:  # SWE-agent's demonstration of another task, before the real one
        out.append((user(SWE_DEMONSTRATION + filler(600, seed + 7)), DEMONSTRATION))
    out.append((user(SWE_TASK), TASK))
    labelled = seed % 2 == 0  # some SWE-agent versions open observations with OBSERVATION:
    open_file = "n/a"
    for step in steps:
        if step.kind == "talk":
            out += [(_asst(step.thought), TALK), (user(step.reply or SWE_FORMAT_ERROR), REPLY)]
            continue
        if step.kind == "view":
            command = f"open {step.path}" + (f" {step.start}" if step.start > 1 else "")
            open_file = f"{root}/{step.path}"
            above = f"({step.start - 1} more lines above)\n" if step.start > 1 else ""
            below = step.total - (step.start + len(step.lines) - 1)
            body = (f"[File: {open_file} ({step.total} lines total)]\n{above}"
                    + "\n".join(f"{n}:{line}" for n, line in enumerate(step.lines, step.start))
                    + (f"\n({below} more lines below)" if below > 0 else ""))
        elif step.kind == "edit":
            at = step.start + 3
            command = f"edit {at}:{at}\n{step.new}\nend_of_edit"
            open_file = f"{root}/{step.path}"
            body = (f"[File: {open_file} ({step.total} lines total)]\n({step.start - 1} more lines above)\n"
                    + "\n".join(f"{n}:{line}" for n, line in enumerate(step.lines, step.start))
                    + "\nFile updated. Please review the changes and make sure they are correct (correct indentation, "
                      "no duplicate lines, etc). Edit the file again if necessary.")
        else:
            command = step.command.replace("grep -rn load_config src", 'search_dir "load_config" src')
            printed = _plain_output(step, root)
            body = printed if printed else "Your command ran successfully and did not produce any output."
            if labelled and printed:
                body = "OBSERVATION:\n" + body
        text = (f"DISCUSSION\n{step.thought}\n\n```\n{command}\n```" if step.fenced
                else f"{step.thought}\n<command>\n{command}\n</command>")
        out.append((_asst(text), ACTION))
        out.append((user(f"{body}\n(Open file: {open_file})\n(Current directory: {root})\nbash-$"), OBSERVATION))
    return out


MINI_SYSTEM = """You are a helpful assistant that can interact multiple times with a computer shell \
to solve programming tasks.
Your response must contain exactly ONE bash code block with ONE command (or commands connected with && or ||).

Include a THOUGHT section before your command where you explain your reasoning process.
Format your response as shown in <example>.

<example>
THOUGHT: Your reasoning and analysis here

```bash
your_command_here
```
</example>

Failure to follow these rules will cause your response to be rejected."""
MINI_TASK = (f"<pr_description>\nConsider the following PR description:\n{ISSUE}\n</pr_description>\n\n<instructions>\n"
             "# Task Instructions\n\n## Overview\nYou're a software engineer interacting continuously with a computer "
             "by submitting commands.\nYou'll be helping implement necessary changes to meet requirements in the PR "
             "description.\nYour task is specifically to make changes to non-test files in the current directory in "
             "order to fix the issue described in the PR description in a way that is general and consistent with "
             "the codebase.\n</instructions>")
MINI_FORMAT_ERROR = ("Please always provide EXACTLY ONE action in triple backticks, found 0 actions.\n\nPlease format "
                     "your action in triple backticks as shown in <response_example>.\n\n<response_example>\nHere are "
                     "some thoughts about why you want to perform the action.\n\n```bash\n<action>\n```\n"
                     "</response_example>")
MINI_LONG_CHARS = 10_000


def _mini_observation(code: int, output: str) -> str:
    if len(output) <= MINI_LONG_CHARS:
        return f"<returncode>{code}</returncode>\n<output>\n{output}{chr(10) if output else ''}</output>"
    head, tail = output[:5000], output[-5000:]
    return (f"<returncode>{code}</returncode>\n<warning>\nThe output of your last command was too long.\nPlease try a "
            "different command that produces less output.\nIf you're looking at a file you can try use head, tail or "
            "sed to view a smaller number of lines selectively.\n</warning><output_head>\n"
            f"{head}\n</output_head>\n<elided_chars>\n{len(output) - 10000} characters elided\n</elided_chars>\n"
            f"<output_tail>\n{tail}\n</output_tail>")


def _mini_swe_agent(steps: list[Step], root: str) -> list[tuple[Message, str]]:
    out: list[tuple[Message, str]] = [(system(MINI_SYSTEM), INSTRUCTIONS), (user(MINI_TASK), TASK)]
    for step in steps:
        if step.kind == "talk":
            out += [(_asst(f"THOUGHT: {step.thought}"), TALK), (user(step.reply or MINI_FORMAT_ERROR), REPLY)]
            continue
        if step.kind == "view":
            end = step.start + len(step.lines) - 1
            command = f"nl -ba {step.path} | sed -n '{step.start},{end}p'"
            code, output = 0, _numbered_cat(root, step)
        elif step.kind == "edit":
            old, new = (s.replace("/", "\\/") for s in (step.old, step.new))
            command = f"sed -i 's/{old}/{new}/' {step.path}"
            code, output = 0, ""
        else:
            command, code, output = step.command, step.exit_code, _plain_output(step, root)
        out.append((_asst(f"THOUGHT: {step.thought}\n\n```bash\n{command}\n```"), ACTION))
        out.append((user(_mini_observation(code, output)), OBSERVATION))
    return out


@lru_cache(maxsize=256)
def _built(dialect: str, seed: int, steps: int) -> History:
    plan, root = scenario(seed, steps), ROOTS[dialect]
    if dialect == TOOL_CALLS:
        pairs = _tool_calls(plan, root)
    elif dialect == OPENHANDS_TEXT:
        pairs = _openhands_text(plan, root)
    elif dialect == SWE_AGENT_TEXT:
        pairs = _swe_agent_text(plan, root, seed)
    elif dialect == MINI_SWE_AGENT:
        pairs = _mini_swe_agent(plan, root)
    else:
        raise ValueError(f"unknown dialect {dialect!r}")
    return History(dialect, seed, [m for m, _ in pairs], tuple(k for _, k in pairs),
                   OPENHANDS_TOOLS if dialect == TOOL_CALLS else None)


def build(dialect: str, seed: int, steps: int) -> History:
    """One history (the same object for the same arguments: do not mutate it)."""
    return _built(dialect, seed, steps)


# -- what the tests check on a forwarded request --------------------------------------------

def same(a: Any, b: Any) -> bool:
    """Byte-identical as JSON: the same values and the same key order."""
    return json.dumps(a, ensure_ascii=False) == json.dumps(b, ensure_ascii=False)


def complete_steps(messages: list[Message], kinds: tuple[str, ...]) -> list[int]:
    """Where each complete step (an action and its whole observation) starts."""
    out = []
    for i, kind in enumerate(kinds):
        if kind != ACTION:
            continue
        wanted = len(messages[i].get("tool_calls") or []) or 1
        j = i + 1
        while j < len(kinds) and kinds[j] == OBSERVATION and j - i <= wanted:
            j += 1
        if j - i - 1 == wanted:
            out.append(i)
    return out


Window = tuple[int, int]
"""A recent window as (messages, complete steps): the issue's is (RECENT, 2); a compaction point
with little room may keep a narrower one (`cost.min_turns`), which its log names."""
WINDOW: Window = (RECENT, 2)
RESTORED_ERROR = "Last error reported"
"""How the restored state names the last failure (pipeline/restore.py)."""
TAIL: Window = (6, 1)
"""The protected tail (pipeline/tail.py): at a point whose window is over its target, the window's
older messages may give way; the newest six messages (and the newest step) are what it holds."""


def window_start(messages: list[Message], kinds: tuple[str, ...], window: Window = WINDOW) -> int:
    """The recent window: the last `window[0]` messages, widened to hold the last `window[1]` complete steps."""
    start = max(0, len(messages) - window[0])
    steps = complete_steps(messages, kinds)
    if len(steps) >= window[1] > 0:
        start = min(start, steps[-window[1]])
    return start


def pinned(messages: list[Message], kinds: tuple[str, ...], window: Window = WINDOW) -> list[Message]:
    """The leading instructions, the task and the recent window."""
    start = window_start(messages, kinds, window)
    return [m for i, (m, k) in enumerate(zip(messages, kinds)) if i >= start or k in (INSTRUCTIONS, TASK)]


def feasible(messages: list[Message], kinds: tuple[str, ...], tools: list[dict[str, Any]] | None,
             effective_budget: int) -> bool:
    """The instructions, the task and the whole recent window fit the effective budget, with
    NOTE_ROOM to spare: a request ctxgate can forward within its budget without touching the window."""
    return tokens_of(pinned(messages, kinds), tools) + NOTE_ROOM <= effective_budget


def core(messages: list[Message], kinds: tuple[str, ...]) -> list[Message]:
    """The system prompt, the task and the last message if it is not an observation: when
    they alone exceed the limit the request is infeasible. A last observation is not part of
    it: ctxgate cuts it head and tail when nothing else makes the request fit."""
    last = len(messages) - 1
    return [m for i, (m, k) in enumerate(zip(messages, kinds))
            if (i == last and k != OBSERVATION) or k in (INSTRUCTIONS, TASK)]


def newest_user(messages: list[Message]) -> int | None:
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)


CUT = re.compile(r"\n\.\.\. \[middle \d+ tokens truncated(?:, ref ctx:[0-9a-f]+)?\] \.\.\.\n")
"""Microcompact's separator (pipeline/microcompact.py SEPARATOR)."""


def is_cut_of(got: Message, sent: Message) -> bool:
    """`got` is `sent` microcompacted: the same role and other fields in the same order, its
    content a start and an end of `sent`'s (its first and last characters kept) around
    Microcompact's separator."""
    text, content = sent.get("content"), got.get("content")
    if not isinstance(text, str) or not isinstance(content, str) or list(got) != list(sent):
        return False
    if any(not same(got[k], sent[k]) for k in sent if k != "content"):
        return False
    parts = CUT.split(content)
    if len(parts) != 2:
        return False
    head, tail = parts
    return (bool(head) and bool(tail) and len(head) + len(tail) < len(text) and text.startswith(head)
            and text.endswith(tail))


def compaction_target(messages: list[Message], tools: list[dict[str, Any]] | None, limit: int,
                      reserved: int = 0, offset: int = 0) -> int:
    """Where a compaction of `messages` lands, in ctxgate's count of the messages:
    `Turn.target(effective budget, target_ratio)` (proxy/compaction.py)."""
    config = PipelineConfig()

    async def never(_: list[Message]) -> str:
        raise AssertionError("not called")

    turn = Turn(messages=messages, fingerprints=[], tools=tools, counter=counter(), config=config,
                max_input_tokens=limit, summarize=never, reserved_tokens=reserved, count_offset=offset)
    return turn.target(config.effective_budget(limit), config.target_ratio)


HEAD_KINDS = (INSTRUCTIONS, DEMONSTRATION, TASK)
CUT_FLOOR = PipelineConfig().microcompact.min_threshold
"""Microcompact cuts no output below this many tokens."""
UNCUTTABLE = CUT_FLOOR + 16
"""An observation of at most this many tokens is too short to cut: cutting oldest first may pass it by."""


def cuttable(messages: list[Message], kinds: tuple[str, ...], window: Window = WINDOW) -> list[int]:
    """The recent window's observations the issue lets a compaction cut: all but the last
    message and the newest user message."""
    last, newest = len(messages) - 1, newest_user(messages)
    return [i for i in range(window_start(messages, kinds, window), len(messages))
            if kinds[i] == OBSERVATION and i not in (last, newest)]


def window_floor(messages: list[Message], kinds: tuple[str, ...], tools: list[dict[str, Any]] | None,
                 cut: dict[int, Message] | None = None, window: Window = WINDOW) -> int:
    """The instructions, the task and the recent window with every cuttable observation cut
    to CUT_FLOOR tokens (or as an earlier compaction point cut it, `cut`: a cut stays as it
    is), tools schema included: the smallest request that holds the whole window. Over the
    limit, no request both holds the window and fits."""
    def size(i: int) -> int:
        return counter().count(str(messages[i].get("content")))

    cut = cut or {}
    spare = sum(size(i) - (counter().count(str(cut[i].get("content"))) if i in cut else min(size(i), CUT_FLOOR))
                for i in cuttable(messages, kinds, window))
    return tokens_of(pinned(messages, kinds, window), tools) - spare


class WindowWatch:
    """The issue's recent-window rules over one session's forwarded turns, in order (what
    a turn may forward depends on the session's last compaction point and what was cut there):

    - the window's messages end the forwarded list in order; when the window reaches back to
      the instructions or the task, those come first and only ctxgate's own (marked) messages
      may sit between them and the rest;
    - every message that arrived after the session's last compaction point is forwarded
      verbatim (outside compaction points: the messages after it, window or not);
    - at a compaction point where the instructions, the task and the window (with NOTE_ROOM
      for ctxgate's notes) fit the compaction target, the window is forwarded verbatim; where
      they do not, a window observation may be cut (head and tail around Microcompact's
      separator), oldest first, never the last message nor the newest user message;
    - a message cut at a compaction point stays cut, the same way, on later turns.

    None of it is owed where no request can hold the whole window within the effective
    budget (its `window_floor`, with the earlier points' notes and NOTE_ROOM, is over it:
    those notes are merged only by a point's one summary, and one already asked for is not
    asked for again): ctxgate then keeps only the turn
    in progress (and cuts the last message head and tail if it is an observation and still
    does not fit). There, and on later turns for the messages that arrived up to then, only
    the limit, the instructions and the task, and the last message bind.

    With a demonstration before the task (SWE-agent), ctxgate's notes may sit between the
    instructions and the task (a known limit): there the placement check ignores notes
    anywhere before the window's rest."""

    def __init__(self, tools: list[dict[str, Any]] | None, limit: int, is_note: Any = is_ctxgate_message) -> None:
        self.tools, self.limit, self.is_note = tools, limit, is_note
        self.budget = PipelineConfig().effective_budget(limit)
        self.since = 0
        """How many messages the request held at the session's last compaction point."""
        self.cuts: dict[int, Message] = {}
        """Window messages cut at a compaction point, by index, as forwarded."""
        self.exempt = 0
        """Messages before this index are owed nothing: a compaction point where the window
        could not fit the limit whole (`window_floor`) removed or cut what it had to."""
        self.notes: list[Message] = []
        """The compaction notes the session's last forwarded request held."""
        self.kept_from = 0
        """Where the window the session's last compaction point kept begins (it may be narrower
        than the issue's when the room is small)."""
        self.held = 0
        """Where the window a point held starts, when its oldest turns gave way to the last error."""
        self.cut_points = 0
        """Compaction points where the window was over the target (and what was cut in it)."""
        self.cut_messages = 0
        self.exempt_points = 0

    def over_target(self, request: Request, reserved: int = 0, offset: int = 0, window: Window = WINDOW,
                    target: int | None = None, notes: int = 0) -> bool:
        """The instructions, the task, the earlier notes (`notes` tokens) and the window (with
        NOTE_ROOM) exceed the compaction target (`target` when the compaction point's log names
        the one it chose)."""
        kept = counter().count_messages(pinned(request.messages, request.kinds, window)) + notes
        if target is None:
            target = compaction_target(request.messages, self.tools, self.limit, reserved, offset)
        return kept + NOTE_ROOM > target

    def beyond(self, request: Request, reserved: int = 0, offset: int = 0, window: Window = WINDOW,
               notes: int = 0) -> bool:
        """No request holding the whole window (its observations cut as far as allowed) and the
        earlier points' notes (`notes` tokens: kept byte-identical, or merged only by a point's
        one summary) fits the effective budget: ctxgate falls back to the turn in progress."""
        floor = window_floor(request.messages, request.kinds, self.tools, self.cuts, window)
        return floor + reserved + offset + notes + NOTE_ROOM > self.budget

    def check(self, request: Request, forwarded: list[Message], point: bool, reserved: int = 0,
              offset: int = 0, chosen: dict[str, Any] | None = None) -> list[str]:
        """What `forwarded` (for `request`, the session's next turn) breaks; records the turn.
        `reserved` and `offset` are the compaction's (`Turn.reserved_tokens`, `Turn.count_offset`);
        `chosen`: at a compaction point, its log entry (`chain`), which names the window and the
        target the cost model chose when it chose them (docs/compaction.md)."""
        window: Window = tuple(chosen["window"]) if chosen and chosen.get("window") else WINDOW  # type: ignore
        target = chosen.get("target") if chosen else None
        sent, kinds, n = request.messages, request.kinds, len(request.messages)
        problems: list[str] = []
        if not point and self.since == 0 and not same(forwarded, sent):
            problems.append("no compaction yet, but the request was not forwarded as sent")
        if not point and self.since and not same(forwarded[-(n - self.since):], sent[self.since:]):
            problems.append(f"the {n - self.since} messages that arrived after the last compaction point (at "
                            f"{self.since} messages) do not end the forwarded list verbatim")
        # The notes earlier points left stay byte-identical (incremental compaction): kept, like
        # the instructions and the task, so they count against the target and the budget too.
        earlier = [m for m in forwarded if is_compaction_note(m) and any(same([m], [e]) for e in self.notes)]
        notes = counter().count_messages(earlier) if earlier else 0
        if point and window[0] > TAIL[0] and self.over_target(request, reserved, offset, window, target, notes):
            window = TAIL
        if point and self.beyond(request, reserved, offset, window, notes):
            self.since = self.exempt = n
            self.exempt_points += 1
            for i in range(window_start(sent, kinds, window), n):  # what it cut stays cut
                got = next((m for m in forwarded if is_cut_of(m, sent[i])), None)
                if got is not None and i not in self.cuts:
                    self.cuts[i] = got
            return problems
        self.notes = [m for m in forwarded if is_compaction_note(m)]
        may_cut = point and self.over_target(request, reserved, offset, window, target, notes)
        self.held = 0
        found, cut = self._window(request, forwarded, point, may_cut, window)
        if point:
            self.since = n
            self.kept_from = max(self.kept_from, window_start(sent, kinds, window), self.held)
            fresh = {i: m for i, m in cut.items() if i not in self.cuts}
            self.cuts.update(fresh)
            if may_cut:
                self.cut_points += 1
                self.cut_messages += len(fresh)
        return problems + found

    def _window(self, request: Request, forwarded: list[Message], point: bool,
                may_cut: bool, window: Window = WINDOW) -> tuple[list[str], dict[int, Message]]:
        """The window's problems, and its messages forwarded cut (by index, as forwarded)."""
        sent, kinds, n = request.messages, request.kinds, len(request.messages)
        # Never before the window the last point kept: what it compacted does not come back.
        start = max(window_start(sent, kinds, window), self.kept_from, self.exempt)
        last, newest = n - 1, newest_user(sent)
        head = [i for i in range(start, n) if kinds[i] in HEAD_KINDS]
        rest = [i for i in range(start, n) if kinds[i] not in HEAD_KINDS]
        if point and any(self.is_note(m) and RESTORED_ERROR in str(m.get("content")) for m in forwarded):
            # The oldest turns of the window may give way to the last failure's line, when the
            # window alone leaves no room for it (pipeline/over_budget.py): gone whole, never changed.
            while rest and not any(same(m, sent[rest[0]]) or is_cut_of(m, sent[rest[0]]) for m in forwarded):
                rest = rest[1:]
            self.held = rest[0] if rest else n
        if len(forwarded) < len(head) + len(rest):
            return [f"only {len(forwarded)} messages forwarded, the recent window holds {len(head) + len(rest)}"], {}
        problems: list[str] = []
        at = len(forwarded) - len(rest)
        before = forwarded[:at]
        if DEMONSTRATION in kinds:  # known limit: a note may sit between the instructions and the task
            before = [m for m in before if not self.is_note(m)]
        while before and self.is_note(before[-1]):
            before = before[:-1]
        if head and not same(before[-len(head):], [sent[i] for i in head]):
            problems.append("the window reaches back to the instructions or the task, and they are not forwarded "
                            "verbatim, in order, before the rest of it (only ctxgate's notes may sit between them "
                            "and the rest)")
        cut: dict[int, Message] = {}
        for i, got in zip(rest, forwarded[at:]):
            want = sent[i]
            if same(got, want):
                continue
            kept_cut = i in self.cuts and same(got, self.cuts[i])  # cut at an earlier compaction point
            new_cut = may_cut and kinds[i] == OBSERVATION and i not in (last, newest) and is_cut_of(got, want)
            if kept_cut or new_cut:
                cut[i] = got
            else:
                why = ("the window fits the compaction target" if point and not may_cut
                       else "only observations may be cut, head and tail kept, never the last nor the newest user "
                            "message" if point
                       else "arrived after the last compaction point" if i >= self.since
                       else "not a compaction point")
                problems.append(f"window message {i} of {n} ({kinds[i]}) is not forwarded verbatim ({why}): "
                                f"{_brief(got)} instead of {_brief(want)}")
        if cut and point:
            passed = [i for i in rest if i < max(cut) and i not in cut and kinds[i] == OBSERVATION
                      and i not in (last, newest) and counter().count(str(sent[i].get("content"))) > UNCUTTABLE]
            if passed:
                problems.append(f"window observations are not cut oldest first: {passed[:3]} kept whole, "
                                f"{max(cut)} (newer) cut")
        return problems, cut


def _brief(m: Message | None, chars: int = 90) -> str:
    if m is None:
        return "nothing"
    content = m.get("content")
    text = content if isinstance(content, str) else json.dumps(content)
    extra = f" +{len(m['tool_calls'])} tool calls" if m.get("tool_calls") else ""
    return f"{m.get('role')}:{text[:chars]!r}{'...' if len(text) > chars else ''}{extra} ({len(text)} chars)"


OBSERVATION_OPENERS = {OPENHANDS_TEXT: ("EXECUTION RESULT of [",), MINI_SWE_AGENT: ("<returncode>",),
                       SWE_AGENT_TEXT: ("OBSERVATION:", "[File: ", "Your command ran successfully")}


def pair_problems(dialect: str, request: list[Message], kinds: tuple[str, ...], forwarded: list[Message],
                  is_note: Any = is_ctxgate_message) -> list[str]:
    """Actions and their observations kept or removed together.

    Tool calls: a sequence a provider accepts, every call with its result and every result
    with its call. Text dialects: an observation forwarded verbatim follows the assistant
    message that preceded it in the client's history (or one ctxgate rewrote: an assistant
    message the client never sent), unless it is the first message after a ctxgate note;
    an action forwarded verbatim is followed by its observation (verbatim, or as ctxgate
    rewrote it: a user message the client never sent)."""
    if dialect == TOOL_CALLS:
        problems = []
        if not is_valid_sequence(forwarded):
            problems.append("not a valid tool-call sequence (a result without its call, or a call without its result)")
        ids = [str(tc["id"]) for m in forwarded for tc in m.get("tool_calls") or []]
        results = [str(m.get("tool_call_id")) for m in forwarded if m.get("role") == "tool"]
        if sorted(ids) != sorted(results):
            problems.append(f"tool calls {sorted(set(ids) ^ set(results))} lack their partner")
        return problems
    keys = [json.dumps(m, ensure_ascii=False) for m in request]
    where: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        where.setdefault(key, []).append(i)
    problems = []
    for k, message in enumerate(forwarded):
        found = where.get(json.dumps(message, ensure_ascii=False), [])
        before = forwarded[k - 1] if k else None
        if message.get("role") == "user":
            observations = [j for j in found if kinds[j] == OBSERVATION]
            rewritten = not found and isinstance(message.get("content"), str) and message["content"].startswith(
                OBSERVATION_OPENERS[dialect])
            if not observations and not rewritten:
                continue
            if before is not None and is_note(before):
                continue
            if before is None or before.get("role") != "assistant":
                problems.append(f"forwarded message {k}, an observation, does not follow an assistant message: "
                                f"{_brief(message)} after {_brief(before) if before else 'nothing'}")
                continue
            before_key = json.dumps(before, ensure_ascii=False)
            if observations and before_key in where and not any(keys[j - 1] == before_key for j in observations):
                problems.append(f"forwarded message {k}, an observation, follows another action than its own: "
                                f"{_brief(message)} after {_brief(before)}")
        elif message.get("role") == "assistant":
            actions = [i for i in found if kinds[i] == ACTION and i + 1 < len(request)]
            if not actions:
                continue
            after = forwarded[k + 1] if k + 1 < len(forwarded) else None
            after_key = json.dumps(after, ensure_ascii=False) if after is not None else ""
            own = after is not None and any(keys[i + 1] == after_key for i in actions)
            rewritten = after is not None and after.get("role") == "user" and after_key not in where
            if not (own or rewritten):
                problems.append(f"forwarded message {k}, an action, is not followed by its observation: "
                                f"{_brief(message)} then {_brief(after) if after else 'nothing'}")
    return problems


def unmarked_additions(request: list[Message], forwarded: list[Message],
                       is_note: Any = is_ctxgate_message) -> list[str]:
    """System messages forwarded that the client did not send and that carry no ctxgate
    marker (pipeline/notes.py): what ctxgate adds must be told apart from the client's own."""
    sent = {json.dumps(m, ensure_ascii=False) for m in request}
    return [f"forwarded message {k}: {_brief(m)}" for k, m in enumerate(forwarded)
            if m.get("role") in ("system", "developer") and json.dumps(m, ensure_ascii=False) not in sent
            and not is_note(m)]


def tokens_of(messages: list[Message], tools: list[dict[str, Any]] | None) -> int:
    """ctxgate's count (messages and tools schema), o200k_base."""
    return counter().count_request(messages, tools)
