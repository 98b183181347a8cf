"""`ctxgate replay` over the recorded runs in ../shared/trajectories: every format is told
from its content and replayed at half of each session's size."""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest

from ctxgate.proxy.replay.driver import agent_turns
from ctxgate.proxy.replay.formats import read_recordings
from test_replay_cli import run_replay, table_row
from trajectories import ROOT, _require

_require()

SWE_AGENT = sorted(glob.glob(os.path.join(ROOT, "swe-agent", "**", "*.traj"), recursive=True))
FILES = [  # (the format, a file of it)
    ("openhands", os.path.join(ROOT, "swe-gym-openhands", "sample_raw.json")),
    ("openhands-text", os.path.join(ROOT, "openhands-text", "openhands_sample_sft_openhands.json")),
    ("mini-swe-agent", os.path.join(ROOT, "mini-swe-agent", "mini-coder_sample_raw.json")),
    ("swe-agent", next(p for p in SWE_AGENT if p.endswith("function_calling_simple.traj"))),  # tool calls
    ("swe-agent", next(p for p in SWE_AGENT if "pydicom" in p)),  # commands in the assistant's text
]


def _tau_bench_sample(tmp_path: Path) -> str:
    """The first tasks of the tau-bench file, copied as they are (200 tasks would only take longer)."""
    with open(os.path.join(ROOT, "tau-bench", "gpt-4o-airline.json")) as f:
        records = json.load(f)[:4]
    path = tmp_path / "gpt-4o-airline.json"
    path.write_text(json.dumps(records))
    return str(path)


def test_every_shared_format_is_detected_and_replayed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = [*FILES, ("tau-bench", _tau_bench_sample(tmp_path))]
    out = tmp_path / "out"
    code, stdout, err = run_replay(capsys, *(path for _, path in files), "--ratio", "0.5", "--out", str(out))
    assert code == 0, err
    results = json.loads((out / "report.json").read_text())
    by_file: dict[str, list[dict]] = {}
    for r in results:
        by_file.setdefault(r["file"], []).append(r)
    for expected, path in files:
        fmt, recordings = read_recordings(path)
        assert fmt == expected
        replayed = by_file[path]
        assert [r["format"] for r in replayed] == [fmt] * len(recordings)
        for recording, r in zip(recordings, replayed):
            assert len(r["turns"]) == len(agent_turns(recording.messages))
            assert r["limit"] == max(1, int(0.5 * r["peak"]))
            over = [t["turn"] for t in r["turns"] if t["forwarded"] is not None and t["forwarded"] > r["limit"]]
            assert r["over_limit_turns"] == over
            if fmt == "openhands":  # long coding runs whose system prompt and task are far below half of them
                assert over == []
    assert sum(len(r["compactions"]) for r in results) > 0
    assert {level for r in results for level in r["levels_fired"]} >= {"microcompact", "autocompact"}
    total = table_row(stdout, "total")
    assert total["tokens sent"] == str(sum(r["sent_total"] for r in results))
    assert total["tokens forwarded"] == str(sum(r["forwarded_total"] for r in results))
    assert total["refused"] == str(sum(r["refused_turns"] for r in results))
    assert total["over limit"] == str(sum(len(r["over_limit_turns"]) for r in results))
    assert len(list(out.glob("*.png"))) == len(results)
