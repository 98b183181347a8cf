"""activeRestore: the working state read from the transcript, and the blocks that bring it back."""
from __future__ import annotations

import json

import pytest

from ctxgate.pipeline.config import RestoreConfig
from ctxgate.pipeline.notes import (RESTORE_FILE, SNIP, SUMMARY, context_note, is_restore_block, kind_of,
                                   notice_message, quoted_text)
from ctxgate.pipeline.protocols.base import paths_in
from ctxgate.pipeline.restore import (ActiveRestore, CurrentFile, WorkingState, extract_working_state,
                                      shed_own_messages, state_block)

from pipeline_builders import call, calls, counter, filler, real_histories, system, tool, user

CFG = RestoreConfig()


def turn(cid: str, name: str, result: str = "ok", **args) -> list[dict]:
    return [calls(call(cid, name, **args)), tool(cid, result)]


def transcript() -> list[dict]:
    return [
        system(), user("task"),
        *turn("1", "str_replace_editor", "OBSERVATION: old app.py", command="view", path="/w/app.py"),
        *turn("2", "read_file", "contents of util.py", path="/w/util.py"),
        *turn("3", "str_replace_editor", "File created", command="create", path="/w/new.py", file_text="print(1)\n"),
        *turn("4", "TodoWrite", "ok", todos=[{"content": "write test", "status": "completed"},
                                             {"content": "fix bug", "status": "in_progress"},
                                             {"content": "update docs", "status": "pending"}]),
        *turn("5", "update_plan", "ok", explanation="Two steps left",
              plan=[{"step": "reproduce", "status": "completed"}, {"step": "patch", "status": "in_progress"}]),
        *turn("6", "Skill", "SKILL: always run the linter before committing", skill="lint"),
        *turn("7", "str_replace_editor", "OBSERVATION: NEW app.py v2", command="view", path="/w/app.py"),
        *turn("8", "write_file", "written", path="/w/util.py", content="def util():\n    return 2\n"),
        user("newest"),
    ]


def test_extracts_current_files_with_latest_content() -> None:
    state = extract_working_state(transcript(), CFG)
    assert [f.path for f in state.current_files] == ["/w/util.py", "/w/app.py", "/w/new.py"], "newest first"
    files = {f.path: f.content for f in state.current_files}
    assert files["/w/app.py"] == "OBSERVATION: NEW app.py v2", "the latest view wins"
    assert files["/w/util.py"] == "def util():\n    return 2\n", "what was written wins over the old read"
    assert files["/w/new.py"] == "print(1)\n", "file_text of a create"


def test_extracts_tasks_plan_and_skill() -> None:
    state = extract_working_state(transcript(), CFG)
    assert state.pending_tasks == ["fix bug [in_progress]", "update docs [pending]"]
    assert state.active_plan == "Two steps left\n- [completed] reproduce\n- [in_progress] patch"
    assert state.active_skill == "SKILL: always run the linter before committing"
    assert not state.is_empty()


def test_task_tracker_and_later_updates_override() -> None:
    h = [*turn("1", "task_tracker", task_list=[{"title": "a", "status": "done"}, {"title": "b", "status": "todo"}]),
         *turn("2", "update_plan", plan="1. read\n2. fix"),
         *turn("3", "TodoWrite", todos=[{"content": "x", "status": "pending"}]),
         *turn("4", "update_plan", plan=["read", "fix", "ship"])]
    state = extract_working_state(h, CFG)
    assert state.pending_tasks == ["x [pending]"]
    assert state.active_plan == "- read\n- fix\n- ship"
    state2 = extract_working_state(h[:4], CFG)
    assert state2.pending_tasks == ["b [todo]"] and state2.active_plan == "1. read\n2. fix"
    all_done = h + turn("5", "TodoWrite", todos=[{"content": "x", "status": "completed"}])
    assert extract_working_state(all_done, CFG).pending_tasks == []


def test_skill_without_result_keeps_its_arguments_and_bad_json_is_ignored() -> None:
    h = [calls(call("s", "load_skill", skill="pdf")), tool("s", ""),
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "b", "type": "function", "function": {"name": "read_file", "arguments": "{not json"}}]},
         tool("b", "whatever"),
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c", "type": "function", "function": {"name": "TodoWrite", "arguments": "[1, 2]"}}]},
         tool("c", "x")]
    state = extract_working_state(h, CFG)
    assert json.loads(state.active_skill) == {"skill": "pdf"}
    assert state.current_files == [] and state.pending_tasks == []


def test_max_file_names_keeps_the_newest() -> None:
    h = [m for i in range(8) for m in turn(str(i), "read_file", f"content {i}", path=f"/f{i}.py")]
    state = extract_working_state(h, RestoreConfig(max_file_names=5))
    assert [f.path for f in state.current_files] == [f"/f{i}.py" for i in (7, 6, 5, 4, 3)]
    assert extract_working_state(h, RestoreConfig(max_files=2)).current_files[1] == CurrentFile("/f6.py", "content 6",
                                                                                                 "read_file")


def test_nothing_to_restore() -> None:
    h = [system(), user("hi"), *turn("1", "get_user_details", user_id="u1")]
    state = extract_working_state(h, CFG)
    assert state.is_empty()
    assert ActiveRestore(CFG, state).blocks(counter(), 10_000) == []


def test_state_round_trip() -> None:
    state = extract_working_state(transcript(), CFG)
    assert WorkingState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_blocks_order_and_marker() -> None:
    state = extract_working_state(transcript(), CFG)
    blocks = ActiveRestore(CFG, state).blocks(counter(), 10_000)
    # Quoted data in a user-role block that names its source, never a system message.
    assert all(b["role"] == "user" and b["content"].startswith('<ctxgate-context source="')
               and is_restore_block(b) and b["content"].count("</ctxgate-context>") == 1 for b in blocks)
    assert blocks[1]["content"].startswith('<ctxgate-context source="tool:write_file path=/w/util.py">')
    # The state is one block (one pair of delimiters), its sections most important first.
    assert blocks[0]["content"].startswith('<ctxgate-context source="restored state">')
    texts = [quoted_text(b) for b in blocks]
    assert texts[0] == ("Pending tasks:\n- fix bug [in_progress]\n- update docs [pending]"
                        "\n\nActive plan:\nTwo steps left"
                        + texts[0].split("Two steps left", 1)[1].split("\n\nActive skill:")[0]
                        + "\n\nActive skill:\nSKILL: always run the linter before committing"
                        "\n\nCurrent files: /w/util.py, /w/app.py, /w/new.py")
    assert texts[1] == "Latest content seen of /w/util.py:\ndef util():\n    return 2\n"
    assert texts[2] == "Latest content seen of /w/app.py:\nOBSERVATION: NEW app.py v2"
    assert texts[3] == "Latest content seen of /w/new.py:\nprint(1)\n"
    assert len(blocks) == 4


@pytest.mark.parametrize("budget", [0, 10, 30, 60, 100, 150, 250, 400, 800, 1600, 3000, 6000])
def test_blocks_fit_the_restore_budget(budget: int) -> None:
    c = counter()
    state = WorkingState(current_files=[CurrentFile("/big.py", filler(5000, 1)), CurrentFile("/b.py", filler(900, 2))],
                         active_skill=filler(4000, 3), active_plan="- [ ] step", pending_tasks=["a", "b"])
    blocks = ActiveRestore(CFG, state).blocks(c, budget)
    assert sum(c.count_structured(b) for b in blocks) <= budget
    assert all(is_restore_block(b) for b in blocks)
    skill = [b for b in blocks if "Active skill:" in b["content"]]
    if skill:
        section = quoted_text(skill[0]).split("Active skill:\n", 1)[1].split("\n\nCurrent files: ")[0]
        assert c.count(section) <= CFG.skill_tokens
    for b in blocks:
        if "Latest content seen of /big.py" in b["content"]:
            assert quoted_text(b).endswith("\n[...]")


def test_content_still_visible_is_not_restored_twice() -> None:
    h = transcript()
    state = extract_working_state(h, CFG)
    visible = [tool("7", "OBSERVATION: NEW app.py v2")]
    blocks = ActiveRestore(CFG, state).blocks(counter(), 10_000, visible)
    assert not any("Latest content seen of /w/app.py" in b["content"] for b in blocks)
    assert any("Latest content seen of /w/util.py" in b["content"] for b in blocks)
    assert any(quoted_text(b).endswith("Current files: /w/util.py, /w/app.py, /w/new.py") for b in blocks)


def test_real_histories() -> None:
    c = counter()
    with_files = 0
    for name, h in real_histories():
        state = extract_working_state(h, CFG)
        for budget in (200, 2000):
            blocks = ActiveRestore(CFG, state).blocks(c, budget)
            assert sum(c.count_structured(b) for b in blocks) <= budget, name
            assert all(is_restore_block(b) for b in blocks)
        if name.startswith("openhands/"):
            assert state.current_files, name
            with_files += 1
            newest = state.current_files[0]
            # the newest file is one the last call that named a file named (an editor's path, a path in a command)
            named = [paths_in(tc["function"]["arguments"].replace("\\n", " ")) for m in h
                     for tc in m.get("tool_calls") or []]
            assert newest.path in [p for p in named if p][-1], name
    assert with_files == 5


def test_file_contents_take_only_the_room_left() -> None:
    """State lists always come back within the restore budget; file contents only into the
    room the compacted request has left (a content block with no room would only bring the
    next compaction closer)."""
    c = counter()
    state = extract_working_state(transcript(), CFG)
    roomy = ActiveRestore(CFG, state).blocks(c, 10_000, room=10_000)
    tight = ActiveRestore(CFG, state).blocks(c, 10_000, room=0)
    assert [b for b in roomy if "Latest content seen" not in b["content"]] == tight
    assert any("Current files:" in b["content"] for b in tight)
    lists = sum(c.count_structured(b) for b in tight)
    some = ActiveRestore(CFG, state).blocks(c, 10_000, room=lists + 120)  # the quote and its source take ~30
    contents = [b for b in some if "Latest content seen" in b["content"]]
    assert contents and sum(c.count_structured(b) for b in contents) <= 120


def test_the_last_error_is_restored_when_out_of_view() -> None:
    h = [system(), user("task"),
         *turn("1", "execute_bash", "Traceback (most recent call last):\n  File \"t.py\", line 3\nKeyError: 'x'",
               command="python t.py"),
         *turn("2", "execute_bash", "Error:\nmodule 'app' has no attribute 'run'", command="python -m app"),
         *turn("3", "str_replace_editor", "    12:    raise ValueError(msg)\n    13:  return", command="view",
               path="/w/app.py"),
         user("newest")]
    state = extract_working_state(h, CFG)
    # The newest failure; a line too short to say anything comes with the next; a file
    # view that shows `raise ValueError` is code, not a failure.
    assert state.last_error == "Error:\nmodule 'app' has no attribute 'run'"
    blocks = ActiveRestore(CFG, state).blocks(counter(), 10_000)
    assert any(state.last_error in b["content"] for b in blocks)
    # Still in the kept messages: not restored again.
    kept = ActiveRestore(CFG, state).blocks(counter(), 10_000, visible=h)
    assert not any("Last error" in b["content"] for b in kept)


def test_a_run_without_failures_restores_no_error() -> None:
    state = extract_working_state(transcript(), CFG)
    assert state.last_error == ""
    assert not any("Last error" in b["content"] for b in ActiveRestore(CFG, state).blocks(counter(), 10_000))


def test_swe_agent_windows_and_the_open_file_are_current_files() -> None:
    window = ("[File: /repo/src/fields.py (1000 lines total)]\n(400 more lines above)\n401:    def round(self):\n"
              "(Open file: /repo/src/fields.py)\n(Current directory: /repo)\nbash-$")
    h = [system(), user("TASK: fix rounding"),
         {"role": "assistant", "content": "```\nopen src/fields.py 401\n```"}, user(window),
         {"role": "assistant", "content": "```\ncreate reproduce.py\n```"},
         user("[File: /repo/reproduce.py (1 lines total)]\n1:\n(Open file: /repo/reproduce.py)"),
         {"role": "assistant", "content": "```\nls\n```"}, user("setup.py src tests\n(Open file: /repo/src/fields.py)")]
    state = extract_working_state(h, CFG)
    assert [f.path for f in state.current_files] == ["/repo/src/fields.py", "/repo/reproduce.py"]
    assert state.current_files[0].content.startswith("[File: /repo/src/fields.py (1000 lines total)]")
    blocks = ActiveRestore(CFG, state).blocks(counter(), 10_000)
    assert any(quoted_text(b).endswith("Current files: /repo/src/fields.py, /repo/reproduce.py") for b in blocks)


def test_names_beyond_the_restored_contents_are_listed() -> None:
    h = [system(), user("task")]
    for i in range(8):
        h += turn(str(i), "read_file", f"content {i}", path=f"/f{i}.py")
    state = extract_working_state(h, RestoreConfig(max_files=2))
    blocks = ActiveRestore(RestoreConfig(max_files=2), state).blocks(counter(), 10_000)
    names = next(b["content"] for b in blocks if "Current files:" in b["content"])
    assert all(f"/f{i}.py" in names for i in range(8))
    assert sum("Latest content seen of" in b["content"] for b in blocks) == 2


def test_own_messages_are_shed_files_first_and_at_the_last_resort_the_notes_then_the_state() -> None:
    c = counter()
    history = transcript()
    blocks = ActiveRestore(CFG, extract_working_state(history, CFG)).blocks(c, 10_000)
    lists, files = blocks[:1], blocks[1:]  # the state (tasks, plan, skill, file names); the file contents
    assert all(quoted_text(b).startswith("Latest") and kind_of(b) == RESTORE_FILE for b in files)
    messages = history[:2] + blocks + history[2:]
    notice = c.count_structured(notice_message())  # forwarded with ctxgate's quoted blocks, gone with the last
    full, bare = c.count_messages(messages) + notice, c.count_messages(history)
    with_lists = bare + sum(c.count_structured(b) for b in lists) + notice
    assert shed_own_messages(messages, c, full) == messages
    assert shed_own_messages(messages, c, with_lists) == history[:2] + lists + history[2:]
    sections = lists[0]["ctxgate"]["sections"]
    assert sections[-1].startswith("Current files: ")
    fewer = state_block([*sections[:-1], "Current files: /w/util.py, /w/app.py"])
    assert shed_own_messages(messages, c, with_lists - 1) == history[:2] + [fewer] + history[2:], \
        "the file names go with the files, the oldest first, before the rest of the state"
    unnamed = state_block(sections[:-1])
    assert shed_own_messages(messages, c, bare + c.count_structured(unnamed) + notice) == (
        history[:2] + [unnamed] + history[2:])
    rest = bare + c.count_structured(unnamed) + notice
    assert shed_own_messages(messages, c, rest - 1) is None, "the rest of the state goes only at the last resort"
    two = state_block(sections[:2])
    assert shed_own_messages(messages, c, bare + c.count_structured(two) + notice, everything=True) == (
        history[:2] + [two] + history[2:]), "the tasks and the plan go last"
    notes = [context_note(SNIP, "compaction: snip", "[ctxgate: context snipped] 4 earlier messages were removed."),
             context_note(SUMMARY, "compaction summary", "[ctxgate: context compaction point (Autocompact)]\n"
                          + "summary " * 40)]
    noted = history[:2] + notes + blocks + history[2:]
    noted_lists = history[:2] + notes + lists + history[2:]
    assert shed_own_messages(noted, c, with_lists + c.count_structured(notes[1]), everything=True) == (
        history[:2] + [notes[1]] + lists + history[2:]), "the files go first, then the oldest note"
    assert shed_own_messages(noted, c, with_lists, everything=True) == history[:2] + lists + history[2:], \
        "the notes go before the state lists"
    assert shed_own_messages(noted_lists, c, bare, everything=True) == history, "the notice goes with the last"
    assert shed_own_messages(noted, c, bare - 1, everything=True) is None


def test_a_folder_the_agent_viewed_is_named_but_its_listing_not_restored() -> None:
    """An editor's view of a folder lists its entries: restoring that listing as the "latest
    content" of a file only costs tokens. The folder stays among the paths worked on."""
    listing = ("OBSERVATION:\nHere's the files and directories up to 2 levels deep in /w/pkg:\n/w/pkg\n"
               "/w/pkg/__init__.py\n/w/pkg/core.py\n/w/pkg/util.py\n")
    messages = [system(), user("task"),
                *turn("1", "str_replace_editor", listing, command="view", path="/w/pkg"),
                *turn("2", "str_replace_editor", "OBSERVATION: def core(): ...", command="view", path="/w/pkg/core.py"),
                user("newest")]
    state = extract_working_state(messages, CFG)
    assert [(f.path, f.content) for f in state.current_files] == [("/w/pkg/core.py", "OBSERVATION: def core(): ..."),
                                                                   ("/w/pkg", "")]
    blocks = ActiveRestore(CFG, state).blocks(counter(), 2000)
    assert not any("/w/pkg/__init__.py" in str(b["content"]) for b in blocks)
    assert any("Latest content seen of /w/pkg/core.py" in str(b["content"]) for b in blocks)
    # A file whose content names a path under its own name is still a file (one such line).
    one = [system(), user("task"), *turn("1", "read_file", "see /w/notes.txt/ref once", path="/w/notes.txt")]
    assert [f.path for f in extract_working_state(one, CFG).current_files] == ["/w/notes.txt"]


def test_the_last_error_in_the_cut_middle_of_an_output_in_view_is_quoted_with_its_reference() -> None:
    """The failing command's output is still in view, its middle (with the failure line) cut by
    reference: the line is what the agent acts on next, so the restored state quotes it and
    names the reference the rest of the middle is under; an output out of view has its line
    quoted too, with the reference it is from."""
    output = "Traceback (most recent call last):\n" + filler(300, 2) + "\nAttributeError: no attribute 'pixel_array'"
    h = [system(), user("task"), *turn("1", "execute_bash", output, command="python repro.py"), user("newest")]
    state = extract_working_state(h, CFG)
    assert state.last_error == "AttributeError: no attribute 'pixel_array'"
    ref = "ctx:0123456789ab"
    cut = f"Traceback (most recent call last):\n... [middle 320 tokens truncated, ref {ref}] ..."
    visible = [*h[:3], tool("1", cut), h[-1]]
    blocks = ActiveRestore(CFG, state).blocks(counter(), 10_000, visible=visible, cuts={ref: output[40:]})
    text = "\n".join(quoted_text(b) for b in blocks)
    assert state.last_error in text and f"cut from an output still in view: ref {ref}" in text
    gone = ActiveRestore(CFG, state).blocks(counter(), 10_000, visible=[*h[:2], h[-1]], cuts={ref: output[40:]})
    text = "\n".join(quoted_text(b) for b in gone)
    assert state.last_error in text and f"the output it is from: ref {ref}" in text


def test_an_error_looking_line_inside_a_build_that_ended_well_is_no_failure_and_stays_cut() -> None:
    """check_expand's case: a 1,500-line build whose middle line says `error:` and which began
    and ended well (no exit status, no failure at its ends) reports no failure, so nothing
    brings that line back beside its reference; the same build ending in make's failure
    line does, and its last failure line is named."""
    lines = [f"build step {i}: compiling module_{i}.c ok" for i in range(1500)]
    lines[750] = "error: MIDDLE-MARKER-4242 undefined reference to frobnicate"
    build = "\n".join(lines)
    h = [system(), user("Build it."), *turn("1", "bash", build, command="make"), user("What failed?")]
    state = extract_working_state(h, CFG)
    assert state.last_error == ""
    ref = "ctx:0123456789ab"
    visible = [*h[:3], tool("1", f"{lines[0]}\n... [middle 30000 tokens truncated, ref {ref}] ...\n{lines[-1]}"), h[-1]]
    blocks = ActiveRestore(CFG, state).blocks(counter(), 10_000, visible=visible, cuts={ref: build})
    assert "MIDDLE-MARKER-4242" not in "\n".join(quoted_text(b) for b in blocks)
    failed = [*h[:2], *turn("1", "bash", build + "\nmake: *** [all] Error 2", command="make"), h[-1]]
    assert extract_working_state(failed, CFG).last_error == "make: *** [all] Error 2"


def test_the_error_sections_reference_gives_way_before_a_file_name() -> None:
    """At a tight room the state block drops the reference beside the failure line before it
    drops a file name: the reference is a pointer, the file names are what the agent works on."""
    h = [system(), user("task"), *turn("1", "read_file", "text", path="/w/src/app.py"),
         *turn("2", "execute_bash", "Traceback (most recent call last):\n  File \"x\"\nKeyError: 'a'",
               command="python x.py"), user("newest")]
    state = extract_working_state(h, CFG)
    cuts = {"ctx:0123456789ab": h[5]["content"]}
    visible = [*h[:2], h[-1]]
    full = ActiveRestore(CFG, state).blocks(counter(), 10_000, visible=visible, cuts=cuts)[0]
    lean = ActiveRestore(CFG, state).blocks(counter(), counter().count_structured(full) - 1, visible=visible,
                                            cuts=cuts)[0]
    assert "ref ctx:0123456789ab" in quoted_text(full) and "ref ctx:" not in quoted_text(lean)
    assert "KeyError: 'a'" in quoted_text(lean) and "/w/src/app.py" in quoted_text(lean)
