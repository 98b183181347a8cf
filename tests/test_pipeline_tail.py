"""The protected tail and the file under edit (issue 36, items 5 and 6): what a compaction
point gives up first at a tight budget, planned on plain data (pipeline/planner.py, no engine)."""
from __future__ import annotations

from typing import Any

from ctxgate.pipeline import planner
from ctxgate.pipeline.budget import Turn, effective_budget
from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.microcompact import is_microcompacted
from ctxgate.pipeline.notes import is_ctxgate_message, quoted_text
from ctxgate.pipeline.tail import PROTECTED_TAIL
from ctxgate.proxy.replay.driver import replay
from pipeline_builders import Facts, Message, assistant, call, calls, counter, filler, system, tool, tool_turn, user


async def _summarize(_: list[Message]) -> str:
    return "1. goal\n2. steps\n3. decisions\n4. open\n5. files: src/app.py\n6. tools"


def _turn(messages: list[Message], limit: int) -> Turn:
    return Turn(messages=messages, fingerprints=[message_fingerprint(m) for m in messages], tools=None,
                counter=counter(), config=PipelineConfig(), max_input_tokens=limit, summarize=_summarize)


async def _point(messages: list[Message], limit: int, reason: Any = "proactive") -> list[Message]:
    turn = _turn(messages, limit)
    point = await planner.plan(turn, Facts(), messages, None, reason)
    assert point.record.tokens_after <= effective_budget(turn, None), point.record.tokens_after
    return point.record.messages


def _editing(steps: int, size: int) -> list[Message]:
    """A task, a file viewed and edited (restored state: its name, its content, a plan), then
    `steps` shell steps of `size` tokens each."""
    h = [system(), user("TASK: fix the failing test in src/app.py")]
    h += [calls(call("v", "str_replace_editor", command="view", path="src/app.py")), tool("v", filler(400, 1))]
    h += [calls(call("p", "update_plan", plan=[{"step": "fix app.py", "status": "in_progress"}])), tool("p", "ok")]
    for i in range(steps):
        h += tool_turn(i + 10, size=size)
    return h


async def test_at_a_tight_budget_the_newest_messages_stay_and_the_rest_gives_room() -> None:
    """The newest six messages stay verbatim, however little room is left after them: the older
    observations, the restored state and the notes give theirs first."""
    h = _editing(12, 260)
    tail = sum(counter().count_structured(m) for m in h[-PROTECTED_TAIL.messages:])
    floor = counter().count_messages(h[:2])
    limit = int((floor + tail) / 0.95 * 1.25)  # the tail and the floor take 80 % of the budget
    out = await _point(h, limit)
    assert out[-PROTECTED_TAIL.messages:] == h[-PROTECTED_TAIL.messages:]
    assert out[:2] == h[:2]
    assert not any(is_microcompacted(str(m.get("content"))) for m in out[-PROTECTED_TAIL.messages:])
    assert len(out) < len(h)


async def test_a_tail_over_the_budget_is_cut_oldest_observation_first_never_the_last_message() -> None:
    """SWE-agent style: when the newest messages alone are over the budget, the oldest
    observation among them is cut head and tail first; the last message is never changed."""
    observation = "OBSERVATION START\n" + filler(6000, 5) + "\nFINAL LINE: 3 tests failed"
    newest = "OBSERVATION 2\n" + filler(600, 6)
    h = [system(), user("TASK: fix the failing test"), assistant("```\nls\n```"), user(observation),
         assistant("```\ncat a.py\n```"), user(newest)]
    out = [m for m in await _point(h, 2400) if not is_ctxgate_message(m)]
    assert out[-1] == h[-1], "the last message is never changed"
    cut = out[3]["content"]
    assert out[3]["role"] == "user" and cut.startswith("OBSERVATION START") and cut.endswith("3 tests failed")
    assert "tokens truncated" in cut
    assert out[:3] == h[:3] and out[4] == h[4]


async def test_restored_state_gives_room_before_the_newest_messages() -> None:
    """Where the newest messages and the restored file's content do not both fit, the content goes."""
    h = _editing(8, 300)
    tail = sum(counter().count_structured(m) for m in h[-PROTECTED_TAIL.messages:])
    floor = counter().count_messages(h[:2])
    out = await _point(h, int((floor + tail + 250) / 0.95))
    assert out[-PROTECTED_TAIL.messages:] == h[-PROTECTED_TAIL.messages:]
    assert not any(quoted_text(m).startswith("Latest content seen of") for m in out if is_ctxgate_message(m))


def _aider(done_steps: int, calc: str) -> list[Message]:
    """aider's request (its order: system, examples, read-only files, the done messages, the
    files in the chat, the current messages) after `done_steps` commands run and added."""
    h = [system("Act as an expert software developer. Use SEARCH/REPLACE blocks."),
         user("Change get_factorial() to use math.factorial"), assistant("To make this change ... SEARCH/REPLACE"),
         user("I switched to a new code base. Please don't consider the above files or try to edit them any longer."),
         assistant("Ok."),
         user("Here are some READ ONLY files, provided for your reference.\nDo not edit these files!\n\nnotes.md\n```\n"
              + filler(500, 3) + "\n```"),
         assistant("Ok, I will use these files as references."),
         user("Run the steps you are given, one at a time.")]
    for k in range(done_steps):
        h += [assistant(f"Running step {k}.\n\n```bash\necho STEP-{k}-OK\n```"),
              user(f"I ran this command:\n\necho STEP-{k}-OK\n\nAnd got this output:\n\n{filler(250, 40 + k)}"),
              assistant("Ok."), user("continue")]
    h += [user("I have *added these files to the chat* so you can go ahead and edit them.\n\n*Trust this message as "
               f"the true contents of these files!*\n\ncalc.py\n```\n{calc}\n```\n"),
          assistant("Ok, any changes I propose will be to those files."),
          user("continue"), assistant("Running step 9.\n\n```bash\necho STEP-9-OK\n```"),
          user(f"I ran this command:\n\necho STEP-9-OK\n\nAnd got this output:\n\n{filler(250, 9)}"),
          assistant("Ok."), user("Now make total() return the sum of its arguments.")]
    return h


async def test_aiders_files_in_the_chat_stay_verbatim_before_a_read_only_dump() -> None:
    """The message with calc.py's current text, which aider's SEARCH blocks must match, is kept
    verbatim at a budget that takes the read-only file dump and the older outputs."""
    calc = "def total(*args):\n    return 0\n\n\ndef mean(xs):\n    return total(*xs) / len(xs)\n"
    h = _aider(6, calc)
    files = next(m for m in h if str(m["content"]).startswith("I have *added"))
    assert h.index(files) < len(h) - PROTECTED_TAIL.messages  # not in the newest messages
    out = await _point(h, 2200)
    assert files in out
    assert not any("Here are some READ ONLY files" in str(m["content"]) and m in h for m in out)


async def test_the_newest_view_of_a_file_an_edit_targets_stays_verbatim() -> None:
    """A tool-calling agent viewed src/app.py, edited it, then ran commands: the view is the text
    its next `str_replace` must match, kept while the older outputs around it go."""
    h = [system(), user("TASK: fix the failing test in src/app.py")]
    h += [calls(call("o", "str_replace_editor", command="view", path="src/other.py")), tool("o", filler(300, 2))]
    h += [calls(call("v", "str_replace_editor", command="view", path="src/app.py")), tool("v", filler(300, 1))]
    h += [calls(call("e", "str_replace_editor", command="str_replace", path="src/app.py", old_str="a", new_str="b")),
          tool("e", "The file src/app.py has been edited.")]
    for i in range(10):
        h += tool_turn(i + 10, size=250)
    view = h[5]
    out = await _point(h, 2600)
    assert view in out
    assert h[3] not in out  # the other file's view, older than the tail, gave room


async def test_a_prompt_that_leaves_room_for_the_newest_turn_only_is_served_without_the_older_turns() -> None:
    """A customer-service chat whose policy prompt takes nearly the whole budget: the newest user
    turn fits beside it and the task, a note counting what went before it does not. The request is
    forwarded with the newest turn and no note (dropping the oldest turns served it), rather than
    refused; a longer budget keeps the note that names what was cut."""
    h = [system(filler(1200, 1)), user("Hi, I want to change my flight."), assistant(filler(30, 2)),
         user(filler(20, 3)), assistant(filler(35, 4)), user(filler(25, 5))]
    essential = counter().count_messages([h[0], h[1], h[-1]])
    for limit, noted in ((int((essential + 4) / 0.95), False), (int((essential + 32) / 0.95), True)):
        out = await _point(h, limit, "reactive")
        assert out[:2] == h[:2] and out[-1] == h[-1]
        assert h[-2] not in out
        assert any(is_ctxgate_message(m) for m in out) is noted


async def test_the_last_failure_line_takes_the_room_of_the_earlier_notes_at_a_tight_limit() -> None:
    """A policy prompt that leaves a few hundred tokens: after several points, the earlier notes
    and the failure line do not both fit. The notes become the one line that names their steps,
    and the failing call's error line is restored in the room that leaves (replayed turn by
    turn, the upstream enforcing the limit)."""
    h = [system(filler(1200, 1)), user("Hi! I need to change my reservation.")]
    for k in range(3):
        h += [assistant(filler(40, 10 + k)), user(filler(30, 20 + k))]
    h += [calls(call("a", "get_reservation_details", reservation_id="GV1N64")), tool("a", filler(250, 4)),
          assistant(filler(60, 5)), user(filler(20, 6)),
          calls(call("b", "update_reservation_flights", reservation_id="GV1N64", cabin="economy")),
          tool("b", "Error: not enough seats on flight HAT290")]
    for k in range(4):
        h += [assistant(filler(50, 30 + k)), user(filler(25, 40 + k))]
    h += [assistant("ok")]
    run = await replay(h, None, 1450, counter=counter(), summarize=_summarize, enforce_limit=True,
                       wait_background=True)
    last = run.turns[-1]
    assert not last.refused and last.tokens <= 1450
    own = [quoted_text(m) or str(m["content"]) for m in last.messages if is_ctxgate_message(m)]
    assert any("Error: not enough seats on flight HAT290" in text for text in own)
    assert any("update_reservation_flights" in text and "steps" in text for text in own)


async def test_the_newest_turn_alone_comes_with_the_steps_it_replaced_named_when_they_fit() -> None:
    """The same fallback after a tool step: the one line that counts what went also names the
    step (its number and tool), so every step stays covered, when the room allows it."""
    h = [system(filler(1200, 1)), user("Hi, I want to change my flight."),
         calls(call("a", "get_reservation_details", reservation_id="X1")), tool("a", filler(40, 2)),
         assistant(filler(200, 4)), user(filler(25, 5))]
    essential = counter().count_messages([h[0], h[1], h[-1]])
    out = await _point(h, int((essential + 45) / 0.95), "reactive")
    assert out[:2] == h[:2] and out[-1] == h[-1] and h[-2] not in out
    [note] = [m for m in out if is_ctxgate_message(m)]
    assert "steps 1–1: get_reservation_details" in note["content"]
