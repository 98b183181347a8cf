"""mini-swe-agent 2.x's text protocol (issue 36, item 7): its commands come in the fence its
system prompt shows (```` ```mswea_bash_command ```` in 2.4.6's `mini_textbased.yaml`), which
the reader learns from the instructions rather than knowing it; and its turns are evidence of
mini-swe-agent over SWE-agent's reader (which takes any fenced block), not a tie that
precedence breaks."""
from __future__ import annotations

from ctxgate.pipeline.config import RestoreConfig
from ctxgate.pipeline.conversation import Kind, read_conversation
from ctxgate.pipeline.protocols import detect_dialect
from ctxgate.pipeline.protocols.detect import dialect_votes
from ctxgate.pipeline.protocols.mini_swe_agent import command_fences
from ctxgate.pipeline.restore import extract_working_state

from pipeline_builders import assistant, system, user

MINI_2_SYSTEM = """You are a helpful assistant that can interact with a computer.

Your response must contain exactly ONE bash code block with ONE command (or commands connected with && or ||).
Include a THOUGHT section before your command where you explain your reasoning process.
Format your response as shown in <format_example>.

<format_example>
Your reasoning and analysis here. Explain why you want to perform the action.

```mswea_bash_command
your_command_here
```
</format_example>

Failure to follow these rules will cause your response to be rejected.
"""
"""mini-swe-agent 2.4.6's `mini_textbased.yaml` system template, as it reaches ctxgate."""
MINI_2_TASK = """Please solve this issue: The CPU accepts addresses past 15.

You can execute bash commands and edit files to implement the necessary changes.

## Formatting your response

Here is an example of a correct response:

<example_response>
THOUGHT: I need to understand the structure of the repository first.

```mswea_bash_command
ls -la
```
</example_response>

### Create a new file:

```mswea_bash_command
cat <<'EOF' > newfile.py
import numpy as np
EOF
```
"""
FORMAT_ERROR = """Format error:

<error>
Expected exactly 1 action, found 0.
</error>

Please format your action in triple backticks as shown in <response_example>.

<response_example>
Here are some thoughts about why you want to perform the action.

```mswea_bash_command
<action>
```
</response_example>"""
LONG = "\n".join(str(i) for i in range(2500))


def step(thought: str, command: str) -> dict:
    return assistant(f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```")


def observed(code: int, output: str) -> dict:
    return user(f"<returncode>{code}</returncode>\n<output>\n{output}</output>")


def conversation_2x() -> list[dict]:
    return [system(MINI_2_SYSTEM), user(MINI_2_TASK),
            step("Find the CPU code.", "grep -rn 'def store' src/cpu.py"),
            observed(0, "src/cpu.py:9:    def store(self, address, value):\n"),
            step("Reproduce it.", "python -m pytest tests/test_cpu.py -q"),
            observed(1, "E       ValueError: Address 16 exceeds maximum address 15\n"
                        "FAILED tests/test_cpu.py::test_overflow - ValueError: Address 16 exceeds maximum address 15\n"
                        "1 failed, 3 passed in 0.05s\n"),
            assistant("THOUGHT: I think the check is off by one."),
            user(FORMAT_ERROR),
            step("Print the whole log.", "seq 1 2500"),
            user(f"<returncode>0</returncode>\n<warning>\nThe output of your last command was too long.\n</warning>"
                 f"<output_head>\n{LONG[:5000]}\n</output_head>\n<elided_chars>\n{len(LONG) - 10000} characters "
                 f"elided\n</elided_chars>\n<output_tail>\n{LONG[-5000:]}\n</output_tail>"),
            step("Wait for the slow test.", "sleep 100 && python -m pytest"),
            user("<exception>An error occurred while executing the command: Command 'sleep 100' timed out after 60 "
                 "seconds</exception>\n<returncode>-1</returncode>\n<output>\n</output>")]


def test_the_fence_is_learnt_from_the_system_prompt() -> None:
    assert command_fences(MINI_2_SYSTEM) == ("mswea_bash_command",)
    assert command_fences("Answer in a ```run_command block:\n```run_command\nls\n```\n```python\nx = 1\n```") == (
        "run_command",), "a language that names a command, not the code examples"
    assert command_fences("```bash\nls\n```") == (), "a known fence is read anyway"


def test_a_2x_conversation_is_read_as_mini_swe_agent_with_its_commands() -> None:
    h = conversation_2x()
    c = read_conversation(h)
    assert c.dialect == "mini_swe_agent"
    commands = [(i, c.infos[i].actions[0].command) for i in range(len(h)) if c.infos[i].actions]
    assert commands == [(2, "grep -rn 'def store' src/cpu.py"), (4, "python -m pytest tests/test_cpu.py -q"),
                        (8, "seq 1 2500"), (10, "sleep 100 && python -m pytest")]
    assert c.infos[2].actions[0].paths == ("src/cpu.py",)
    assert [c.kind(i) for i in (3, 5, 9, 11)] == [Kind.OBSERVATION] * 4
    assert c.kind(6) is Kind.TALK and c.kind(7) is Kind.TALK, "a turn with no command, and the format error after it"
    failed = c.infos[5].observations[0]
    assert failed.exit_status == 1
    assert failed.error_line == "FAILED tests/test_cpu.py::test_overflow - ValueError: Address 16 exceeds maximum " \
                                "address 15"
    long = c.infos[9].observations[0]
    assert long.exit_status == 0 and not long.failed and long.output.startswith("0\n1\n") and "2499" in long.output
    timed_out = c.infos[11].observations[0]
    assert timed_out.exit_status == -1 and "timed out after 60 seconds" in timed_out.error_line
    assert all(c.is_complete_step(u) for u in c.units if c.infos[u.start].actions)


def test_its_turns_are_evidence_for_mini_swe_agent_not_a_tie() -> None:
    h = conversation_2x()
    votes = dialect_votes(h, 1)
    # Four commands in its fence and four observations; SWE-agent's reader takes a turn that
    # ends with any fenced block, so the four commands signal it too: 8 to 4, not 4 to 4.
    assert (votes["mini_swe_agent"], votes["swe_agent_text"]) == (8, 4), votes
    for end in range(4, len(h) + 1):
        assert detect_dialect(h[:end], 1) == "mini_swe_agent", end


def test_without_the_system_prompt_showing_it_the_fence_is_learnt_from_the_agents_turns() -> None:
    """Instructions that describe the format in words ("one bash block") and show no block:
    the agent's own turns show its fence. A block whose language names a command is its
    command; one in a language that names none (a code example) is not."""
    h = [system("Reply with a THOUGHT and exactly one bash block in triple backticks."), *conversation_2x()[1:4],
         assistant("THOUGHT: the fix.\n\n```python\nlimit = 15\n```"),
         user("<returncode>0</returncode>\n<output>\n</output>")]
    assert detect_dialect(h, 1) == "mini_swe_agent"
    c = read_conversation(h, "mini_swe_agent")
    assert [a.command for a in c.infos[2].actions] == ["grep -rn 'def store' src/cpu.py"]
    assert not c.infos[4].actions


def test_the_command_is_the_block_in_its_fence_not_a_code_block_after_it() -> None:
    h = [system(MINI_2_SYSTEM), user(MINI_2_TASK),
         assistant("THOUGHT: write the fix.\n\n```mswea_bash_command\nsed -i 's/> 15/>= 16/' src/cpu.py\n```\n\n"
                   "which makes it read:\n```python\nif address >= 16:\n```")]
    c = read_conversation(h)
    assert [a.command for a in c.infos[2].actions] == ["sed -i 's/> 15/>= 16/' src/cpu.py"]


def test_1x_bash_blocks_still_read() -> None:
    h = [system("Your response must contain exactly ONE bash code block."), user("Fix it."),
         assistant("THOUGHT: look.\n\n```bash\nls src\n```"),
         user("<returncode>0</returncode>\n<output>\ncpu.py\n</output>")]
    c = read_conversation(h)
    assert c.dialect == "mini_swe_agent" and c.infos[2].actions[0].command == "ls src"


def test_restore_names_the_failing_command_of_a_2x_run() -> None:
    h = [*conversation_2x()[:6], user("continue")]
    assert extract_working_state(h, RestoreConfig()).last_error.startswith("FAILED tests/test_cpu.py::test_overflow")
