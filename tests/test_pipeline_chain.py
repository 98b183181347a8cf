"""CompressionPipeline: the chain of levels, activeRestore after it, and build_pipeline."""
from __future__ import annotations

from ctxgate.pipeline.autocompact import AutocompactBreaker, AutocompactStrategy
from ctxgate.pipeline.chain import CompressionPipeline, build_pipeline, restore_position
from ctxgate.pipeline.collapse import CollapseStore, CollapseStrategy
from ctxgate.pipeline.config import PROFILE_DEFAULTS, PipelineConfig
from ctxgate.pipeline.microcompact import MicrocompactStrategy
from ctxgate.pipeline.notes import AUTOCOMPACT_MARKER, SNIP_MARKER, is_compaction_note, is_restore_block, quoted_text
from ctxgate.pipeline.restore import extract_working_state
from ctxgate.pipeline.snip import SnipStrategy
from ctxgate.pipeline.strategy import Stopwatch, level_result
from ctxgate.pipeline.request import CompressionRequest
from ctxgate.pipeline.types import CompressionResult, Level
from ctxgate.pipeline.turns import leading_instructions, task_index

from pipeline_builders import (LAST_UNIT, Message, agent_history, assert_invariants, assistant, call, calls,
                               chat_history, counter, filler, snapshot, system, tool, tool_turn, user)
from test_pipeline_autocompact import Scripted


class Fake:
    """A level that drops `drop` messages after the first two, recording what it was given."""

    def __init__(self, level: Level, drop: int | None, steps: bool = True) -> None:
        self.level, self.drop, self.steps = level, drop, steps
        self.seen: list[tuple[list[dict], int]] = []

    async def compress(self, request: CompressionRequest) -> CompressionResult | None:
        self.seen.append((request.messages, request.token_budget))
        if self.drop is None:
            return None
        if not self.steps:
            return CompressionResult(request.messages, 0, self.level, [f"{self.level.value}: failed"], [],
                                     fits=False)
        out = request.messages[:2] + request.messages[2 + self.drop:]
        return level_result(self.level, request, out, (2, 2 + self.drop), Stopwatch(), self.drop,
                            [f"{self.level.value}: dropped {self.drop}"])


def compact(pipeline, messages, budget, reason="proactive"):
    return pipeline.compact(CompressionRequest(messages, budget, counter(), reason))


def config(**kw) -> PipelineConfig:
    return PipelineConfig(**kw)


async def test_stops_at_the_first_level_that_fits_and_chains_outputs() -> None:
    h = chat_history(30, 40)
    c = counter()
    per = c.count_structured(h[2])
    fakes = [Fake(Level.SNIP, 5), Fake(Level.MICROCOMPACT, None), Fake(Level.COLLAPSE, 5), Fake(Level.AUTOCOMPACT, 5)]
    budget = c.count_messages(h) - 8 * per  # dropping 5 does not fit, dropping 10 does
    result = await compact(CompressionPipeline(fakes), h, budget)
    assert fakes[0].seen[0][0] is h or fakes[0].seen[0][0] == h
    snip_out = h[:2] + h[7:]
    assert fakes[1].seen[0][0] == snip_out, "a level that had nothing to do passes its input on"
    assert fakes[2].seen[0][0] == snip_out, "each level works on the previous one's output"
    assert fakes[3].seen == [], "the chain stops at the first level that fits"
    assert result.level_used is Level.COLLAPSE and result.fits
    assert [s.level for s in result.steps] == [Level.SNIP, Level.COLLAPSE]
    assert result.compressed_messages == h[:2] + h[12:]
    assert result.recovery_hints == ["snip: dropped 5", "collapse: dropped 5"]
    assert result.tokens_freed == c.count_messages(h) - c.count_messages(result.compressed_messages)


async def test_already_fitting_input_is_not_touched() -> None:
    h = chat_history(10, 10)
    fake = Fake(Level.SNIP, 5)
    result = await compact(CompressionPipeline([fake]), h, 10**6)
    assert fake.seen == [] and result.level_used is None and result.steps == []
    assert result.compressed_messages == h and result.fits and result.tokens_freed == 0


async def test_failed_level_adds_its_hint_and_changes_nothing() -> None:
    h = chat_history(30, 40)
    fakes = [Fake(Level.AUTOCOMPACT, 0, steps=False), Fake(Level.SNIP, 20)]
    result = await compact(CompressionPipeline(fakes), h, 100)
    assert fakes[1].seen[0][0] == h
    assert result.recovery_hints[0] == "autocompact: failed"
    assert [s.level for s in result.steps] == [Level.SNIP]
    assert not result.fits


async def test_real_chain_snip_is_enough() -> None:
    h = agent_history(30, 200)
    total = counter().count_messages(h)
    p = build_pipeline(config(snip={"keep_recent": 10}), summarize=Scripted(), effective_budget=total)
    result = await compact(p, h, total - 2500)
    assert result.level_used is Level.SNIP and len(result.steps) == 1 and result.fits
    assert quoted_text(result.compressed_messages[2]).startswith(SNIP_MARKER)
    assert_invariants(h, result.compressed_messages)


async def test_real_chain_falls_through_to_microcompact_and_autocompact() -> None:
    # 10 messages, all in the recent window: Snip has nothing to cut; the chain's last resort cuts
    # the long output, older than the protected tail (the newest 6: pipeline/tail.py)
    h = [system(), user("task"), *tool_turn(0, size=6000), *tool_turn(1, size=100), *tool_turn(2, size=100),
         user("newest"), assistant("ok")]
    p = build_pipeline(config(), summarize=Scripted(), effective_budget=100_000)
    result = await compact(p, h, 3000)
    assert result.level_used is Level.MICROCOMPACT and [s.level for s in result.steps] == [Level.MICROCOMPACT]
    assert result.fits
    # a long agent run with a tiny budget needs everything down to Autocompact
    fake = Scripted()
    h2 = agent_history(40, 300)
    p2 = build_pipeline(config(snip={"keep_recent": 30}), summarize=fake, effective_budget=100_000)
    r2 = await compact(p2, h2, 3000)
    assert r2.level_used is Level.AUTOCOMPACT and len(fake.calls) == 1 and r2.fits
    assert [s.level for s in r2.steps] == [Level.SNIP, Level.AUTOCOMPACT]
    assert any(quoted_text(m).startswith(AUTOCOMPACT_MARKER) for m in r2.compressed_messages if m["role"] == "user")
    assert_invariants(h2, r2.compressed_messages)


def editing_history(turns: int = 30) -> list[dict]:
    h = [system(), user("TASK: fix app.py")]
    h += [calls(call("v", "str_replace_editor", command="view", path="/w/app.py")), tool("v", filler(300, 5))]
    h += [calls(call("t", "TodoWrite", todos=[{"content": "fix app.py", "status": "in_progress"}])), tool("t", "ok")]
    for i in range(turns):
        h += tool_turn(i, size=150)
    h += [user("NEWEST: and add a test"), *tool_turn(999, size=20)]
    return h


async def test_restore_blocks_after_a_compaction() -> None:
    h = editing_history()
    before = snapshot(h)
    state = extract_working_state(h, PipelineConfig().restore)
    budget = 4000
    p = build_pipeline(config(snip={"keep_recent": 10}), summarize=Scripted(), working_state=state,
                       effective_budget=budget)
    result = await compact(p, h, budget)
    assert h == before
    out = result.compressed_messages
    assert result.steps and result.fits
    assert restore_position(h, True) == 2
    at = restore_position(out, True)
    assert at > 2 and all(is_compaction_note(m) for m in out[2:at]), "the notes follow the system prompt and task"
    blocks = [m for m in out if is_restore_block(m)]
    assert blocks and out[at:at + len(blocks)] == blocks, \
        "restore blocks follow the notes: they change at every point, the notes before them do not"
    assert not is_compaction_note(out[at + len(blocks)])
    assert any("Pending tasks:\n- fix app.py [in_progress]" in b["content"] for b in blocks)
    assert any("Latest content seen of /w/app.py" in b["content"] for b in blocks)
    assert sum(counter().count_structured(b) for b in blocks) <= int(budget * 0.10)
    assert_invariants(h, out)
    # nothing to compact: no restore blocks either
    calm = await compact(p, h, 10**6)
    assert calm.compressed_messages == h


async def test_restore_blocks_are_regenerated_not_stacked() -> None:
    h = editing_history()
    state = extract_working_state(h, PipelineConfig().restore)
    p = build_pipeline(config(snip={"keep_recent": 10}), summarize=Scripted(), working_state=state,
                       effective_budget=6000)
    first = (await compact(p, h, 4000)).compressed_messages
    n_blocks = sum(map(is_restore_block, first))
    assert n_blocks >= 2
    # the next turn: the compacted view plus new work, compacted again with less room
    grown = first + [assistant("next")] + [user("NEWEST 2")] + tool_turn(1000, size=400) + tool_turn(1001, size=400)
    second = await compact(p, grown, 2500)
    out = second.compressed_messages
    assert second.steps
    assert sum(map(is_restore_block, out)) <= n_blocks
    kinds = [quoted_text(b).split(":", 2)[1] for b in out if is_restore_block(b)]
    assert len(kinds) == len(set(kinds)), "one block of each kind"
    assert all(out.count(b) == 1 for b in out if is_restore_block(b))
    assert not is_restore_block(out[-1])
    assert_invariants(grown, out)
    # A point whose levels change nothing (it only folds earlier notes) keeps the restored state
    # as it was: dropped with nothing in its place, the last error and the files went with it.
    calm = await compact(p, first, 10**6)
    assert not calm.steps and calm.compressed_messages == first


def test_build_pipeline_honours_levels_and_profiles() -> None:
    minimal = config(**PROFILE_DEFAULTS["minimal"])
    p = build_pipeline(minimal)
    assert [type(s) for s in p.strategies] == [SnipStrategy]
    assert p.strategies[0].config.keep_recent == 50
    full = build_pipeline(config(**PROFILE_DEFAULTS["professional"]))
    assert [type(s) for s in full.strategies] == [SnipStrategy, MicrocompactStrategy, CollapseStrategy,
                                                  AutocompactStrategy]
    assert [s.level for s in full.strategies] == [Level.SNIP, Level.MICROCOMPACT, Level.COLLAPSE, Level.AUTOCOMPACT]
    custom = build_pipeline(config(levels=["autocompact", "microcompact"]))
    assert [s.level for s in custom.strategies] == [Level.AUTOCOMPACT, Level.MICROCOMPACT]
    assert build_pipeline(config(levels=[])).strategies == []
    enterprise = config(**PROFILE_DEFAULTS["enterprise"])
    assert enterprise.effective_budget(100_000) == 94_000
    assert config().effective_budget(10) == 9 and config(reserve_tokens=50).effective_budget(10) == 1


def test_build_pipeline_shares_session_state() -> None:
    store, breaker = CollapseStore(), AutocompactBreaker(failures=1)
    p = build_pipeline(config(), collapse_store=store, breaker=breaker, effective_budget=20_000)
    by_level = {s.level: s for s in p.strategies}
    assert by_level[Level.COLLAPSE].store is store
    assert by_level[Level.AUTOCOMPACT].breaker is breaker
    assert by_level[Level.MICROCOMPACT].threshold_for("read_file") == 1000
    assert p.restore is None and p.restore_budget == 2000


async def test_minimal_profile_only_snips() -> None:
    # long tool outputs only Microcompact could cut: the minimal chain cannot fit, and says so honestly
    h = [system(), user("task"), *tool_turn(0, size=8000), user("newest"), assistant("ok")]
    fake = Scripted()
    p = build_pipeline(config(**PROFILE_DEFAULTS["minimal"]), summarize=fake, effective_budget=4000)
    result = await compact(p, h, 4000)
    assert result.steps == [] and not result.fits and fake.calls == []
    assert result.compressed_messages == h
    h2 = agent_history(60, 100)
    r2 = await compact(p, h2, 4000)
    assert [s.level for s in r2.steps] == [Level.SNIP]
    assert r2.compressed_messages[-50:] == h2[-50:]


async def test_degrade_reaches_autocompact() -> None:
    h = agent_history(40, 200)
    fake = Scripted()
    p = build_pipeline(config(levels=["autocompact"]), summarize=fake, effective_budget=100_000)
    result = await compact(p, h, 10, reason="degrade")
    assert len(fake.calls) == 1
    assert result.compressed_messages[3:] == h[-3:]


async def test_a_level_that_would_grow_the_context_is_not_applied() -> None:
    """Found by the property tests: Snip over nine 'ok' messages put in a note bigger than
    what it cut (62 -> 73 tokens); Collapse and Autocompact did the same on tiny spans."""
    h = [system("You are an agent.")] + [user("ok") for _ in range(9)]
    snip = SnipStrategy(PipelineConfig(snip={"keep_recent": 2}).snip, pin_first_user=False)
    alone = await snip.compress(CompressionRequest(h, 20, counter(), window=LAST_UNIT))
    assert alone is not None and alone.tokens_after > counter().count_messages(h)
    result = await compact(CompressionPipeline([snip], pin_first_user=False), h, 20)
    assert result.steps == [] and result.compressed_messages == h and not result.fits
    fake = Scripted()
    p = build_pipeline(config(levels=["autocompact"], pin_first_user=False), summarize=fake, effective_budget=20)
    tiny = [system("You are an agent."), user("ok"), user("ok too")]
    r2 = await compact(p, tiny, 20)
    assert r2.steps == [] and r2.compressed_messages == tiny


async def test_the_chain_leaves_the_protected_tail_to_the_planners_fallbacks() -> None:
    """SWE-agent style: observations are user messages inside the recent window. When the newest
    messages alone are over the budget, the chain does not cut them: the planner's fallbacks do,
    once everything older and ctxgate's own blocks have given room (tests/test_pipeline_planner.py)."""
    observation = "OBSERVATION START\n" + filler(6000, 5) + "\nFINAL LINE: 3 tests failed"
    newest = "OBSERVATION 2\n" + filler(600, 6)
    h = [system(), user("TASK: fix the failing test"), assistant("```\nls\n```"), user(observation),
         assistant("```\ncat a.py\n```"), user(newest)]
    budget = 2000
    result = await compact(build_pipeline(config(), summarize=Scripted(), effective_budget=budget), h, budget)
    assert not result.fits and result.compressed_messages == h and not result.steps


async def test_the_task_after_a_demonstration_is_kept_not_the_demonstration() -> None:
    """SWE-agent sends a worked example of another task first; the real task is the next
    user message, and that is what every level pins."""
    demo = user("Here is a demonstration of how to correctly accomplish this task.\n" + filler(1500, 9))
    task = user("We're currently solving the following issue within our repository: TASK-42 " + filler(200, 8))
    h = [system(), demo, task]
    for i in range(30):
        h += [assistant(f"step {i}"), user(f"OBSERVATION {i}: " + filler(120, i))]
    pipeline = build_pipeline(PipelineConfig(), summarize=Scripted(), effective_budget=6000,
                              working_state=extract_working_state(h, PipelineConfig().restore))
    result = await compact(pipeline, h, 3000)
    out = result.compressed_messages
    assert result.fits
    assert task in out, "the task statement is pinned"
    assert demo not in out, "the demonstration is history like any other"
    assert out[0] == h[0] and out[-1] == h[-1]


async def test_worked_examples_a_client_closes_itself_are_instructions_and_the_task_follows_them() -> None:
    """aider sends worked examples of its edit format as user and assistant turns, closes them
    with a turn setting them aside, and hands over context it answers itself ("Ok."). The
    examples stay whole with the system prompt; the task is the first turn the model answered."""
    examples = [user("Change get_factorial() to use math.factorial"),
                assistant("mathweb/flask/app.py\n" + filler(300, 1)),
                user("I switched to a new code base. Please don't consider the above files or try to edit them any "
                     "longer."), assistant("Ok.")]
    task = user("Make the config loader accept retry_after. TASK-7")
    h = [system(), *examples, user("I am not sharing any files that you can edit yet."), assistant("Ok."), task]
    for i in range(30):
        h += [assistant(f"Running step {i}.\n\n```bash\necho STEP-{i}-OK\n```"), user(f"Output {i}: " + filler(120, i)),
              assistant("Ok"), user("continue")]
    pipeline = build_pipeline(PipelineConfig(), summarize=Scripted(), effective_budget=6000,
                              working_state=extract_working_state(h, PipelineConfig().restore))
    result = await compact(pipeline, h, 3000)
    out = result.compressed_messages
    assert result.fits
    assert out[:5] == h[:5], "the examples stay with the system prompt, as sent"
    assert task in out, "the task statement is pinned"
    assert out[-1] == h[-1]


def test_examples_and_acknowledgements_in_text_blocks_read_as_in_strings() -> None:
    """The Messages API (and litellm talking to it for aider) carries a turn's text as a list of
    text blocks: the worked examples, the closing turn, the client's "Ok." and the task read the
    same as with string contents; a turn with any other block is not talk."""
    def blocks(message: Message) -> Message:
        return {**message, "content": [{"type": "text", "text": message["content"]}]}

    h = [system(), user("Change get_factorial() to use math.factorial"), assistant("mathweb/flask/app.py"),
         user("I switched to a new code base. Please don't consider the above files."), assistant("Ok."),
         user("I am not sharing any files that you can edit yet."), assistant("Ok."),
         user("Make the config loader accept retry_after."), assistant("Running step 1.")]
    as_blocks = [h[0], *(blocks(m) for m in h[1:])]
    found = (leading_instructions(as_blocks), task_index(as_blocks))
    assert found == (leading_instructions(h), task_index(h)) == (5, 7)
    tool_use = {"type": "tool_use", "id": "t1", "name": "x", "input": {}}
    with_tool = [*as_blocks[:2], {**as_blocks[2], "content": [*as_blocks[2]["content"], tool_use]}]
    assert leading_instructions(with_tool + as_blocks[3:]) == 1, "a turn with a tool block ends the examples"
