"""Memory on its own, over real files: capture rules (on hand-built and recorded runs),
the loader's priority, relevance and budget, auto-dream with a scripted LLM (its timeout
and failure paths), TTL expiry by a controllable clock, the project scan, and many
concurrent captures feeding one buffer."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from ctxgate.memory.capture import capture, workspace_root
from ctxgate.memory.config import MemoryConfig
from ctxgate.memory.dream import Consolidator, Dream, auto_dream
from ctxgate.memory.entries import Category, MemoryEntry
from ctxgate.memory.file_store import FileMemoryStore
from ctxgate.memory.loader import HEADER, MemoryContextLoader
from ctxgate.memory.manager import MemoryManager
from ctxgate.memory.project_scan import scan_project
from ctxgate.memory.short_term import BufferScope, Candidate, SessionBuffer
from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.provenance import message_spans
from trajectories import openhands, swe_agent

DAY = 86400.0


class Clock:
    """Time the tests move by hand."""
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _words(text: str) -> int:
    return len(text.split())


def _cut(text: str, tokens: int) -> str:
    return " ".join(text.split()[:tokens])


def _call(call_id: str, name: str, args: str = "{}") -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]}


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are an agent working in /workspace/acme-shop."},
    {"role": "user", "content": "Fix the checkout bug. I prefer answers in Esperanto. Please always use type hints."},
    _call("c1", "execute_bash", '{"command": "ls"}'),
    {"role": "tool", "tool_call_id": "c1", "content": "src\nsetup.cfg\nREADME.md\ntests\npyproject.toml"},
    _call("c2", "str_replace_editor", '{"path": "pyproject.toml"}'),
    {"role": "tool", "tool_call_id": "c2",
     "content": "[project]\nname = 'shop'\ndependencies = ['fastapi', 'pytest']\n"},
    _call("c3", "web_fetch", '{"url": "https://docs.example.com/checkout"}'),
    {"role": "tool", "tool_call_id": "c3",
     "content": "# Checkout API\n" + "The checkout endpoint takes a cart id. " * 200},
    {"role": "assistant", "content": "I used unittest for the new test."},
    {"role": "user", "content": "No, use pytest instead of unittest, that is our code style."},
]


def test_capture_finds_preferences_corrections_project_facts_and_references() -> None:
    found = capture(CONVERSATION, message_spans(CONVERSATION, set(range(len(CONVERSATION)))), _cut, now=1000.0)
    by = {c: [cand for _, cand in found if cand.category == c] for c in Category}
    assert [c.content for c in by[Category.USER]] == ["I prefer answers in Esperanto.", "Please always use type hints."]
    feedback = by[Category.FEEDBACK][0]
    assert feedback.data["correction_type"] == "code_style"
    assert feedback.data["original_action"] == "I used unittest for the new test."
    assert "use pytest instead of unittest" in feedback.data["corrected_action"]
    assert ([m["role"] for m in feedback.data["context_snippet"]][-1] == "user"
            and len(feedback.data["context_snippet"]) == 7)
    stacks = [c.data["tech_stack"] for c in by[Category.PROJECT] if "tech_stack" in c.data]
    assert stacks == [{"language": "python", "manifest": "pyproject.toml", "frameworks": ["fastapi", "pytest"]}]
    listing = next(c for c in by[Category.PROJECT] if "file_index" in c.data)
    assert set(listing.data["file_index"]) == {"src", "setup.cfg", "README.md", "tests", "pyproject.toml"}
    reference = by[Category.REFERENCE][0]
    assert reference.data["source"] == "https://docs.example.com/checkout" and reference.data["topic"] == "Checkout API"
    assert reference.data["original_length"] > 5000 and _words(reference.data["summary"]) == 500
    assert workspace_root(CONVERSATION) == "/workspace/acme-shop"


MANIFEST_FILES = {
    "pyproject.toml": ("python", '[build-system]\nrequires = ["hatchling"]\n\n[project]\nname = "shop"\n'),
    "package.json": ("javascript", '{\n  "name": "shop",\n  "devDependencies" : {\n    "jest": "^29.0.0"\n  }\n}\n'),
    "go.mod": ("go", "module example.com/shop\n\ngo 1.22\n\nrequire github.com/gin-gonic/gin v1.9.1\n"),
    "Cargo.toml": ("rust", '[package]\nname = "shop"\nversion = "0.1.0"\nedition = "2021"\n'),
    "requirements.txt": ("python", "django==5.0.1\npytest>=8.0\nrequests~=2.31\n"),
}


@pytest.mark.parametrize("manifest", sorted(MANIFEST_FILES))
def test_each_manifest_a_tool_shows_names_the_stack(manifest: str) -> None:
    """Each manifest's pattern is tried only on a text holding one of its strings (`_MANIFESTS`):
    a string it does not need would hide the manifest."""
    language, text = MANIFEST_FILES[manifest]
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "cat f"}'}}
    messages = [{"role": "user", "content": "Look at the project."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": text}]
    found = capture(messages, message_spans(messages, set(range(len(messages)))), _cut, now=1000.0)
    stacks = [c.data["tech_stack"] for _, c in found if "tech_stack" in c.data]
    assert [(s["manifest"], s["language"]) for s in stacks] == [(manifest, language)]


def test_a_column_of_numbers_is_not_a_listing_of_files() -> None:
    output = "STEP-1-OK\n" + "\n".join(str(i) for i in range(1, 301))
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "seq 1 300"}'}}
    messages = [{"role": "user", "content": "Run the steps."}, {"role": "assistant", "content": None,
                                                                 "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": output}]
    found = capture(messages, message_spans(messages, set(range(len(messages)))), _cut, now=1000.0)
    assert not [c for _, c in found if "file_index" in c.data], found


def test_capture_only_looks_at_the_messages_it_is_given() -> None:
    assert capture(CONVERSATION, message_spans(CONVERSATION, {0, 2, 4}), _cut) == []


def test_capture_on_recorded_agent_runs_finds_the_project() -> None:
    """OpenHands returns listings and manifests as tool messages; SWE-agent as user observations."""
    for runs in (openhands(), swe_agent()):
        found = [cand for t in runs
                 for _, cand in capture(t.messages, message_spans(t.messages, set(range(len(t.messages)))), _cut)]
        assert any(c.category == Category.PROJECT for c in found), runs[0].source
    roots = {workspace_root(t.messages) for t in openhands()}
    assert any(r and r.startswith("/workspace") for r in roots), roots


def _entry(category: Category, content: str, **kw: Any) -> MemoryEntry:
    return MemoryEntry(category=category, tenant="t1", content=content, **kw)


def test_the_loader_fills_its_budget_in_priority_order_and_by_relevance(tmp_path: Path) -> None:
    store = FileMemoryStore(tmp_path)

    async def run() -> tuple[str, str, str]:
        for e in [_entry(Category.REFERENCE, "Checkout API: the endpoint takes a cart id"),
                  _entry(Category.REFERENCE, "Payment webhooks retry three times"),
                  _entry(Category.PROJECT, "Project uses fastapi and pytest", project="p1"),
                  _entry(Category.PROJECT, "Another project entirely", project="p2"),
                  _entry(Category.FEEDBACK, "Use pytest, not unittest", project="p1"),
                  _entry(Category.USER, "Answers in Esperanto", user="u1"),
                  _entry(Category.USER, "Someone else's preference", user="u2")]:
            await store.put(e)
        loader = MemoryContextLoader(store)
        wide = await loader.block("t1", "u1", "p1", "why does checkout fail for this cart", 1000, _words, 0.0)
        narrow = await loader.block("t1", "u1", "p1", "why does checkout fail for this cart", 25, _words, 0.0)
        again = await loader.block("t1", "u1", "p1", "why does checkout fail for this cart", 1000, _words, 0.0)
        return wide, narrow, again

    wide, narrow, again = asyncio.run(run())
    assert wide == again  # the same memory and turn give the same bytes
    lines = wide.splitlines()
    assert lines[0] == HEADER
    assert lines.index("## User preferences") < lines.index("## Corrections to keep in mind") < \
        lines.index("## Project") < lines.index("## Reference notes")
    assert "- [memory API] Answers in Esperanto" in lines
    assert "Someone else's preference" not in wide
    assert "Another project entirely" not in wide
    assert "Checkout API" in wide and "webhooks" not in wide  # a reference only when the turn is about it
    assert _words(narrow) <= 25 and "Esperanto" in narrow and "Checkout API" not in narrow


def _llm(answer: str = "The user prefers Esperanto.", delay: float = 0.0, fail: bool = False) -> Any:
    calls: list[list[dict[str, Any]]] = []

    async def complete(messages: list[dict[str, Any]]) -> str:
        calls.append(messages)
        await asyncio.sleep(delay)
        if fail:
            raise RuntimeError("upstream 500")
        return answer

    complete.calls = calls  # type: ignore[attr-defined]
    return complete


def _dream(buf: SessionBuffer, llm: Any) -> Dream:
    return Dream(buf, "s1", Consolidator(llm), MemoryConfig().feedback_ttl_s())


def _buffered() -> tuple[SessionBuffer, list[Candidate]]:
    buf = SessionBuffer("t1", "u1", "p1")
    entries = [Candidate(Category.USER, "I prefer answers in Esperanto."),
               Candidate(Category.FEEDBACK, "Correction (tool_choice): use rg, not grep",
                         {"correction_type": "tool_choice"}),
               Candidate(Category.PROJECT, "Tech stack: python", {"tech_stack": {"language": "python"}}),
               Candidate(Category.REFERENCE, "Checkout API: takes a cart id", {"source": "inline", "topic": "x"})]
    return buf, entries


def test_auto_dream_consolidates_by_category_and_keeps_feedback_verbatim(tmp_path: Path) -> None:
    store, llm = FileMemoryStore(tmp_path), _llm()
    buf, entries = _buffered()
    event = asyncio.run(auto_dream(_dream(buf, llm), entries, store, 5.0, now=1000.0))
    assert event == {"entries_count": 4, "categories": ["feedback", "project", "reference", "user"], "written": 4,
                     "consolidated": True}
    assert len(llm.calls) == 3  # reference, project, user; never feedback
    prompts = sorted(call[0]["content"].split()[0] for call in llm.calls)
    assert prompts == ["Extract", "Merge", "Merge"]
    saved = asyncio.run(store.list("t1"))
    feedback = next(e for e in saved if e.category == Category.FEEDBACK)
    assert feedback.content == "Correction (tool_choice): use rg, not grep" and feedback.project == "p1"
    assert feedback.expires_at == 1000.0 + 7 * DAY
    user = next(e for e in saved if e.category == Category.USER)
    assert user.user == "u1" and user.content == "The user prefers Esperanto."


@pytest.mark.parametrize("llm", [_llm(delay=2.0), _llm(fail=True)], ids=["timeout", "failure"])
def test_auto_dream_writes_the_raw_entries_when_the_llm_is_slow_or_fails(tmp_path: Path, llm: Any) -> None:
    store = FileMemoryStore(tmp_path)
    buf, entries = _buffered()
    event = asyncio.run(auto_dream(_dream(buf, llm), entries, store, 0.3, now=1000.0))
    assert event["consolidated"] is False and event["written"] == 4
    saved = {e.content: e for e in asyncio.run(store.list("t1"))}
    assert set(saved) == {c.content for c in entries}  # nothing lost
    raw = saved["I prefer answers in Esperanto."]
    assert raw.quarantined and raw.quarantine is not None and raw.quarantine.attempts == 1
    assert saved["Correction (tool_choice): use rg, not grep"].quarantine is None  # verbatim, written first


def test_feedback_expires_by_its_correction_type_on_a_controllable_clock(tmp_path: Path) -> None:
    store = FileMemoryStore(tmp_path)
    buf = SessionBuffer("t1", None, "p1")
    entries = [Candidate(Category.FEEDBACK, "style", {"correction_type": "code_style"}),
               Candidate(Category.FEEDBACK, "tool", {"correction_type": "tool_choice"})]
    asyncio.run(auto_dream(_dream(buf, None), entries, store, None, now=0.0))

    def alive(now: float) -> set[str]:
        return {e.content for e in asyncio.run(store.list("t1", now=now))}

    assert alive(6 * DAY) == {"style", "tool"}
    assert alive(8 * DAY) == {"style"}
    assert asyncio.run(store.purge_expired("t1", 31 * DAY)) == 2
    assert asyncio.run(store.list("t1")) == []


def test_the_project_scan_is_incremental_and_stays_inside_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "repo", tmp_path / "secret"
    (root / "src").mkdir(parents=True)
    (root / "tests").mkdir()
    outside.mkdir()
    (outside / "key.txt").write_text("do not read")
    (root / "pyproject.toml").write_text("[project]\nname='x'\ndependencies=['django']\n")
    (root / "src" / "app.py").write_text("print(1)\n")
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "leak.txt").symlink_to(outside / "key.txt")
    (root / "node_modules").mkdir()
    (root / "node_modules" / "big.js").write_text("x")
    first = scan_project(root, None, now=1000.0)
    assert set(first["file_index"]) == {"pyproject.toml", "src/app.py"}
    assert first["tech_stack"]["language"] == "python" and first["tech_stack"]["frameworks"] == ["django"]
    assert "tests live in tests/" not in first["conventions"] and "sources live in src/" in first["conventions"]
    old = 900.0
    for f in (root / "pyproject.toml", root / "src" / "app.py"):
        os.utime(f, (old, old))
    again = scan_project(root, first, now=2000.0)
    assert again["changed_files"] == 0 and again["last_scan"] == 2000.0
    (root / "src" / "new.py").write_text("x = 1\n")
    (root / "src" / "app.py").unlink()
    later = scan_project(root, again, now=3000.0)
    assert later["changed_files"] == 1 and later["removed_files"] == ["src/app.py"]


def test_many_concurrent_captures_feed_one_buffer_without_loss_or_duplicates(tmp_path: Path) -> None:
    async def dreamt(key: Any, event: dict[str, Any]) -> None:
        events.append(event)

    events: list[dict[str, Any]] = []

    async def run() -> list[MemoryEntry]:
        config = MemoryConfig(triggers=["B"], dream_model="scripted")
        manager = MemoryManager(FileMemoryStore(tmp_path), config, lambda model, msgs: _llm()(msgs), dreamt)
        history: list[dict[str, Any]] = [{"role": "system", "content": "s"}]
        turns = []
        for i in range(40):
            history = history + [{"role": "user", "content": f"Please always use tabs number {i}."},
                                 {"role": "assistant", "content": "ok"}]
            turns.append(list(history))
        scope = BufferScope("u1", "p1", "professional", None)
        for messages in turns + turns:  # every request twice: resent history is captured once
            manager.observe(("t1", "s1"), scope, messages, [message_fingerprint(m) for m in messages], _cut,
                        lambda unseen: message_spans(messages, unseen))
        await manager.idle_tasks()
        _, buffered = await manager.short_term.peek(("t1", "s1"))
        assert sorted(c.content for c in buffered) == sorted(f"Please always use tabs number {i}." for i in range(40))
        await manager.end_session(("t1", "s1"))
        return await manager.store.list("t1")

    saved = asyncio.run(run())
    assert len(events) == 1 and events[0]["entries_count"] == 40 and events[0]["trigger"] == "B"
    assert [e.category for e in saved] == [Category.USER]


def _manager(tmp_path: Path, events: list[dict[str, Any]], clock: Any = None, **config: Any) -> MemoryManager:
    async def dreamt(key: Any, event: dict[str, Any]) -> None:
        events.append(event)

    llm = _llm()
    return MemoryManager(FileMemoryStore(tmp_path / "mem"), MemoryConfig(dream_model="scripted", **config),
                         lambda model, msgs: llm(msgs), dreamt, **({"clock": clock} if clock else {}))


def _turns_saying(n: int) -> list[list[dict[str, Any]]]:
    history: list[dict[str, Any]] = [{"role": "system", "content": "s"}]
    out = []
    for i in range(n):
        history = history + [{"role": "user", "content": f"From now on name branches feature-{i}."},
                             {"role": "assistant", "content": "ok"}]
        out.append(list(history))
    return out


def _feed(manager: MemoryManager, turns: list[list[dict[str, Any]]], profile: str) -> None:
    for messages in turns:
        manager.observe(("t1", "s1"), BufferScope("u1", "p1", profile, None), messages,
                        [message_fingerprint(m) for m in messages], _cut,
                        lambda unseen: message_spans(messages, unseen))


def test_trigger_a_consolidates_past_the_threshold_for_enterprise_only(tmp_path: Path) -> None:
    async def run(profile: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        manager = _manager(tmp_path / profile, events, threshold_count=5)
        for messages in _turns_saying(8):
            _feed(manager, [messages], profile)
            await manager.idle_tasks()
        return events

    enterprise = asyncio.run(run("enterprise"))
    assert [e["trigger"] for e in enterprise] == ["A"] and enterprise[0]["entries_count"] == 6
    assert asyncio.run(run("professional")) == []  # professional: session end only (trigger B)


def test_trigger_c_consolidates_after_the_interval_with_more_than_five_entries(tmp_path: Path) -> None:
    clock = Clock()

    async def run() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        manager = _manager(tmp_path, events, clock, dream_interval_s=600, threshold_count=100)
        turns = _turns_saying(8)
        for messages in turns[:7]:
            _feed(manager, [messages], "enterprise")
            await manager.idle_tasks()
        assert events == []  # six entries, but the interval has not passed
        clock.now += 601
        _feed(manager, [turns[7]], "enterprise")
        await manager.idle_tasks()
        return events

    events = asyncio.run(run())
    assert [(e["trigger"], e["entries_count"]) for e in events] == [("C", 8)]


def test_an_idle_session_ends_and_is_consolidated(tmp_path: Path) -> None:
    clock = Clock()

    async def run() -> tuple[int, int, list[dict[str, Any]]]:
        events: list[dict[str, Any]] = []
        manager = _manager(tmp_path, events, clock, idle_timeout_s=1800)
        _feed(manager, _turns_saying(2)[-1:], "professional")
        await manager.idle_tasks()
        clock.now += 1000
        early = await manager.sweep()
        clock.now += 1000
        late = await manager.sweep()
        return early, late, events

    early, late, events = asyncio.run(run())
    assert (early, late) == (0, 1) and [e["trigger"] for e in events] == ["B"]


def test_the_optional_classifier_places_what_the_rules_could_not(tmp_path: Path) -> None:
    store = FileMemoryStore(tmp_path)
    buf = SessionBuffer("t1", "u1", "p1")
    entries = [Candidate(None, "The deploy script lives in ops/deploy.sh"), Candidate(None, "lunch was nice")]
    classifier = _llm('["project", "drop"]')
    event = asyncio.run(auto_dream(_dream(buf, _llm("Deploy script: ops/deploy.sh")), entries, store, 5.0,
                                   classify=classifier, now=1.0))
    assert event["categories"] == ["project"] and event["entries_count"] == 2
    assert [e.content for e in asyncio.run(store.list("t1"))] == ["Deploy script: ops/deploy.sh"]
    assert "lunch was nice" in classifier.calls[0][1]["content"]


def test_a_configured_workspace_is_scanned_when_a_session_starts(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "src").mkdir(parents=True)
    (root / "package.json").write_text('{"name": "shop", "dependencies": {"react": "18"}}')
    (root / "src" / "index.js").write_text("x")

    async def run() -> list[MemoryEntry]:
        manager = _manager(tmp_path, [], workspace_root=str(root))
        _feed(manager, _turns_saying(1), "professional")
        await manager.idle_tasks()
        return await manager.store.list("t1", Category.PROJECT)

    [project] = asyncio.run(run())
    assert project.project == "p1" and set(project.data["file_index"]) == {"package.json", "src/index.js"}
    assert (project.data["tech_stack"]["language"] == "javascript"
            and "react" in project.data["tech_stack"]["frameworks"])
    assert "2 files" in project.content


def test_a_classifier_answering_other_json_loses_nothing_the_rules_placed(tmp_path: Path) -> None:
    store = FileMemoryStore(tmp_path)
    buf = SessionBuffer("t1", "u1", "p1")
    entries = [Candidate(Category.PROJECT, "The deploy script lives in ops/deploy.sh"), Candidate(None, "lunch")]
    event = asyncio.run(auto_dream(_dream(buf, _llm("Deploy script: ops/deploy.sh")), entries, store, 5.0,
                                   classify=_llm('{"1": "project"}'), now=1.0))
    assert event["categories"] == ["project"]
    assert [e.content for e in asyncio.run(store.list("t1"))] == ["Deploy script: ops/deploy.sh"]


def test_short_term_buffers_that_hold_nothing_go_past_the_cap() -> None:
    """A conversation that never comes back must not hold memory: past `max_sessions`, the
    empty buffers go, oldest first; one holding candidates stays (they are not consolidated yet)."""
    from ctxgate.memory.entries import Category
    from ctxgate.memory.short_term import BufferScope, Candidate, LocalShortTermStore

    async def run() -> None:
        store = LocalShortTermStore(max_sessions=10)
        scope = BufferScope("u1", "p1", "professional", None)
        await store.add(("t", "keeper"), scope, ["fp-k"], [(0, Candidate(Category.USER, "I prefer tabs."))], 1.0)
        for i in range(30):
            await store.add(("t", f"s{i}"), scope, [f"fp-{i}"], [], 2.0 + i)
        assert len(store) <= 10
        assert (await store.peek(("t", "keeper")))[0] is not None and (await store.peek(("t", "s29")))[0] is not None
        assert (await store.peek(("t", "s0")))[0] is None
        assert store.unseen(("t", "s0"), ["fp-0"]) == {0}  # it comes back unseen

    asyncio.run(run())


def test_a_long_correction_is_kept_to_a_whole_word() -> None:
    """What memory stores of a long sentence stops at a word, never inside one (issue 36, item 3)."""
    words = " ".join(f"word{i:03d}" for i in range(80))
    messages = [{"role": "user", "content": "Fix the parser."},
                {"role": "assistant", "content": "I will rewrite parser.py with regexes."},
                {"role": "user", "content": f"No, use the tokenizer module instead of regexes, {words}"}]
    found = capture(messages, message_spans(messages, set(range(len(messages)))), _cut, now=1000.0)
    said = next(c.data["corrected_action"] for _, c in found if c.category is Category.FEEDBACK)
    assert 200 < len(said) <= 300 and said in messages[2]["content"]
    assert said.split()[-1] in words.split() or said.endswith(",")
    follows = messages[2]["content"][len(said):len(said) + 1]
    assert follows in (" ", ""), (said[-20:], follows)
