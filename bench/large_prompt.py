"""A session whose system prompt and tools take half or more of the limit (Claude Code's
shape: ~21K of system prompt and ~9K of tools schema, then 40 steps of ~2.4K, every fifth
ending in a failure line), made here deterministically and replayed with `ctxgate replay
--budget N` at 60K, 45K and 40K on a Claude route (o200k count, litellm's Anthropic prices):
each row is the replay's own report.json.

    .venv/bin/python bench/large_prompt.py [--out /tmp/x.md]
"""
from __future__ import annotations

import contextlib
import io
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from ctxgate.proxy.cli import main as ctxgate_main

MODEL = "claude-sonnet-4-5-20250929"
LIMITS = (60_000, 45_000, 40_000)
STEPS = 40
WORDS = ("the agent must read each file before editing it and keep changes minimal while running "
         "tests often").split()
CONFIG = f"""model_list:
  - model_name: {MODEL}
    litellm_params: {{model: anthropic/{MODEL}, api_key: sk-none}}
ctxgate:
  tokenizers:
    - {{pattern: "claude*", tokenizer: "tiktoken:o200k_base"}}
"""


def session(steps: int = STEPS, seed: int = 7) -> dict[str, Any]:
    """The session as an OpenAI-format recording: messages, tools, model."""
    rng = random.Random(seed)

    def prose(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    system = "You are an interactive CLI coding agent.\n" + "\n".join(f"Rule {i}: {prose(60)}." for i in range(310))
    tools = [{"type": "function", "function": {
        "name": f"Tool{i}", "description": prose(240),
        "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": prose(20)}}}}}
        for i in range(30)]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the failing test in tests/test_io.py and keep the public API."}]
    for k in range(steps):
        call = {"id": f"call_{k}", "type": "function",
                "function": {"name": "Tool1", "arguments": json.dumps({"arg": f"src/mod_{k}.py"})}}
        messages.append({"role": "assistant", "content": f"Step {k}: " + prose(450), "tool_calls": [call]})
        output = "\n".join(f"src/mod_{k}.py:{j}: {prose(14)}" for j in range(85))
        if k % 5 == 3:
            output += f"\nError: AssertionError in test_io_{k}: expected 3, got 4"
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": output})
    messages.append({"role": "assistant", "content": "Done."})
    return {"model": MODEL, "messages": messages, "tools": tools}


def replay(folder: Path, limit: int) -> dict[str, Any]:
    """`ctxgate replay` of the session at `limit`: its report's summary of the session."""
    out = folder / f"report-{limit}"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = ctxgate_main(["replay", "--config", str(folder / "ctxgate.yaml"), "--budget", str(limit),
                             "--out", str(out), str(folder / "session.json")])
    if code != 0:
        raise SystemExit(f"ctxgate replay exited {code} at limit {limit}")
    (report,) = json.loads((out / "report.json").read_text())
    return dict(report)


HEADERS = ["limit", "prompt + tools / limit", "turns", "points / 100 turns", "summary calls",
           "summaries / point", "prefix-stable", "cache read", "cache written", "cost without",
           "cost with", "cost ratio"]


def row(limit: int, fixed: int, r: dict[str, Any]) -> list[str]:
    turns = len(r["turns"])
    return [f"{limit:,}", f"{fixed / limit:.0%}", str(turns), f"{r['points_per_100_turns']:.1f}",
            str(r["summaries"]), f"{r['summaries_per_point']:.2f}", f"{r['stable_turns']}/{turns - 1}",
            f"{r['cache_read_tokens']:,}", f"{r['cache_write_tokens']:,}", f"${r['cost_without']:.4f}",
            f"${r['cost_with']:.4f}", f"{r['cost_with'] / r['cost_without']:.3f}"]


def main() -> None:
    args = common.parser(__doc__).parse_args()
    started = time.perf_counter()
    recording = session()
    counter = common.gpt4o_counter()
    fixed = counter.count_messages(recording["messages"][:2]) + counter.count_tools(recording["tools"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="ctxgate-large-prompt-") as tmp:
        folder = Path(tmp)
        (folder / "session.json").write_text(json.dumps(recording))
        (folder / "ctxgate.yaml").write_text(CONFIG)
        for limit in LIMITS:
            rows.append(row(limit, fixed, replay(folder, limit)))
            common.progress(f"limit {limit}: done")
    body = __doc__.split("\n\n    .venv")[0].strip()
    markdown = "\n".join([
        common.section_header("A prompt and tools that take most of the limit: `ctxgate replay`")
        + f"\n- wall time {time.perf_counter() - started:.0f}s\n",
        body + "\n",
        f"System prompt, task and tools schema: {fixed:,} tokens (o200k_base); the whole session "
        f"{counter.count_messages(recording['messages']) + counter.count_tools(recording['tools']):,}.\n",
        common.table(HEADERS, rows) + "\n"])
    common.publish("large-prompt", markdown, args.out)


if __name__ == "__main__":
    main()
