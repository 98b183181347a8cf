"""Codex's manual compaction (the TUI's `/compact`), both ways (docs/native-context.md),
through `ctxgate run`: `codex exec` cannot ask for it, so the suite drives Codex's app server
(tests/codex_app_server.py), whose `thread/compact/start` is that command.

One thread, on each route of ROUTES: a first turn of FIRST's steps, the manual compaction,
then a second turn that carries on to SECOND's end. The steps of both turns together (about
30K tokens) are past the model's limit (`LIMIT`). Codex's automatic compaction is set out of
reach, so the one compaction is the one asked for: locally, Codex's own summary request goes
through ctxgate to the upstream; with `--codex-remote-compaction`, Codex asks ctxgate (0.171.0
by a `compaction_trigger` item on `/responses`; `/responses/compact` is taken as well) and
hands its sealed item back. A recorder in front of ctxgate shows
what Codex sent; the second turn's first request holds the compacted history (the summary,
or ctxgate's item) and none of the first turn's tool outputs."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import orjson
import pytest
import yaml

from codex_app_server import AppServer
from real_agents import npm_agent
from recorder import Recorder, Sent
from servers import KEYS, Gateway, _model, child_env, ctxgate_command, start_gateways
from test_real_agent_codex_compaction import CHECKPOINT, ROUTES, _summary_requests
from test_real_agents import LIMIT, _limited
from upstream import ScriptedUpstream

FIRST, SECOND = "agent-steps-3", "agent-steps-6"
CARRY_ON = "Carry on from STEP-3-OK."
"""The second turn's prompt. The scripted model reads its progress from the newest message
alone (tests/agent_steps.py), here this one: it names the step the first turn ended on."""
SUMMARY = "Summary: steps run so far, the newest STEP-3-OK."
"""The scripted model's answer to Codex's summary request after the first turn."""
NO_AUTO = ["-c", "model_auto_compact_token_limit=1000000"]
"""Codex's automatic compaction out of reach: the manual one is the only one."""


@pytest.fixture(params=ROUTES)
def front(request: Any, tmp_path: Path) -> Iterator[tuple[ScriptedUpstream, Gateway, Recorder]]:
    """The scripted upstream, a gateway routing FIRST and SECOND to it as ROUTES says, and a
    recorder in front of the gateway."""
    upstream, path = _limited(tmp_path, LIMIT, FIRST)
    config = yaml.safe_load(path.read_text())
    config["model_list"].append(_model(SECOND, f"{upstream.url}/v1", max_input_tokens=LIMIT))
    if request.param == "chat":  # a provider with no Responses API: litellm's bridge speaks chats to it
        for entry in config["model_list"]:
            if entry["model_name"] in (FIRST, SECOND):
                entry["litellm_params"]["model"] = f"deepseek/{entry['model_name']}"
    gateway = start_gateways({"front": (tmp_path / "gateway", config)})["front"]
    recorder = Recorder(gateway.base).start()
    try:
        yield upstream, gateway, recorder
    finally:
        recorder.stop()
        gateway.stop()
        upstream.stop()
    served = {r.door for r in upstream.log if r.body and r.body.get("model") in (FIRST, SECOND)}
    assert served == ({"responses"} if request.param == "openai" else {"chat"}), served


def _session(tmp_path: Path, url: str, session: str, *launcher: str) -> None:
    """Codex's app server under `ctxgate run --url url`: the first turn, the manual compaction,
    the second turn, each completed."""
    codex = npm_agent("@openai/codex", "codex")
    home = tmp_path / "home"
    home.mkdir()
    argv = [*ctxgate_command(), "run", "--url", url, "--session", session, *launcher, "--",
            str(codex), *NO_AUTO, "app-server"]
    _drive(AppServer(argv, tmp_path, {**child_env(), "HOME": str(home), "OPENAI_API_KEY": KEYS["acme"]}), tmp_path)


def _drive(server: AppServer, cwd: Path) -> None:
    done: list[Any] = []
    try:
        thread = server.start(model=FIRST, cwd=str(cwd), approvalPolicy="never", sandbox="danger-full-access")
        done.append(server.turn(thread, "Run the steps you are given, one at a time."))
        done.append(server.compact(thread))
        done.append(server.turn(thread, CARRY_ON, model=SECOND))
    finally:
        code = server.close()
    assert code == 0, server.stderr.read_text(errors="replace")[-3000:]
    for turn, _ in done:
        assert turn["status"] == "completed", turn
    first, compaction, second = (items for _, items in done)
    assert _answers(first) == ["DONE-3"] and _answers(second) == ["DONE-6"], (_answers(first), _answers(second))
    assert [i["type"] for i in compaction] == ["contextCompaction"], compaction


def _between_the_turns(log: list[Any], asked: list[Any], model: Any) -> None:
    """Every one of `asked` (entries of `log`) came after the first turn's requests and before
    the second's (`model`: an entry's model): the compaction was the one asked between them."""
    at = [i for i, e in enumerate(log) if any(e is a for a in asked)]
    models = [model(e) for e in log]
    last_first = max(i for i, m in enumerate(models) if m == FIRST and i not in at)
    first_second = models.index(SECOND)
    assert at and all(last_first < i < first_second for i in at), (at, last_first, first_second)


def _answers(items: list[dict[str, Any]]) -> list[str]:
    return [i["text"] for i in items if i["type"] == "agentMessage"]


def _responses(sent: list[Sent], model: str) -> list[dict[str, Any]]:
    """The bodies Codex sent to `/responses` for `model`, in order."""
    bodies = [orjson.loads(s.raw) for s in sent if s.path.endswith("/responses")]
    return [b for b in bodies if b.get("model") == model]


def _asks_to_compact(sent: Sent) -> bool:
    """A request for the server's compaction: `/responses/compact`, or (Codex 0.171.0's) a
    `/responses` turn whose last input item is a `compaction_trigger`."""
    if sent.path.endswith("/responses/compact"):
        return True
    if not sent.path.endswith("/responses"):
        return False
    items = orjson.loads(sent.raw).get("input")
    return isinstance(items, list) and bool(items) and items[-1].get("type") == "compaction_trigger"


def _tool_outputs(body: dict[str, Any]) -> list[Any]:
    return [i for i in body["input"] if i.get("type") == "function_call_output"]


def _client_compactions(gateway: Gateway, session: str) -> list[dict[str, Any]]:
    """ctxgate's compactions asked for by the client, from its WAL."""
    assert gateway.data_dir is not None
    wal = gateway.data_dir / "wal" / "acme" / f"wal_{session}.jsonl"
    events = [orjson.loads(line) for line in wal.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("type") == "COMPRESSION" and e.get("reason") == "client"]


def _within_limit(upstream: ScriptedUpstream) -> None:
    prompts = [r.prompt_tokens for r in upstream.log if r.body and r.body.get("model") in (FIRST, SECOND)]
    assert prompts and all(p is not None and p <= LIMIT for p in prompts), prompts


def test_codex_manual_compaction_local_through_ctxgate(front: Any, tmp_path: Path) -> None:
    upstream, gateway, recorder = front
    _session(tmp_path, recorder.url, "codex-manual-local")
    summaries = _summary_requests(upstream)
    _between_the_turns(upstream.log, summaries, lambda r: r.body.get("model") if isinstance(r.body, dict) else None)
    assert not [s for s in recorder.log if _asks_to_compact(s)]
    assert not _client_compactions(gateway, "codex-manual-local")
    second = _responses(recorder.log, SECOND)[0]
    raw = orjson.dumps(second["input"]).decode()
    assert SUMMARY in raw and CHECKPOINT not in raw, raw[-2000:]
    assert not _tool_outputs(second), "the first turn's tool outputs outlived the compaction"
    _within_limit(upstream)


def test_codex_manual_compaction_remote_on_ctxgate(front: Any, tmp_path: Path) -> None:
    upstream, gateway, recorder = front
    _session(tmp_path, recorder.url, "codex-manual-remote", "--codex-remote-compaction")
    asked = [s for s in recorder.log if _asks_to_compact(s)]
    assert len(asked) == 1, [s.path for s in recorder.log]
    _between_the_turns(recorder.log, asked, lambda s: orjson.loads(s.raw).get("model") if s.raw else None)
    assert len(_client_compactions(gateway, "codex-manual-remote")) == 1
    assert not _summary_requests(upstream)  # compacted on the server, not by a summary of Codex's own
    second = _responses(recorder.log, SECOND)[0]
    items = [i for i in second["input"] if i.get("type") == "compaction"]
    assert len(items) == 1 and items[0]["encrypted_content"].startswith("ctxs1."), second["input"]
    assert not _tool_outputs(second), "the first turn's tool outputs outlived the compaction"
    assert not [r for r in upstream.log if b"ctxs1." in r.raw]  # ctxgate expanded its item before forwarding
    _within_limit(upstream)
