"""The replay report opened in headless Chromium: it renders with no network, each chart
has a point per turn, and its compaction markers are the levels that fired."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from browser import artifact_path, wait
from test_replay_cli import BUDGET, run_replay, write_claude_code, write_openai_jsonl

TRACES = """
return [...document.querySelectorAll('.replay-chart .plotly-graph-div')].map(div => ({
  id: div.id, traces: div.data.map(t => ({name: t.name, x: Array.from(t.x), y: Array.from(t.y)})),
  shapes: (div.layout.shapes || []).length}));
"""


@pytest.fixture
def report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, list[dict[str, Any]]]:
    sessions = [write_openai_jsonl(tmp_path / "openai.jsonl"), write_claude_code(tmp_path / "claude.jsonl")]
    out = tmp_path / "report"
    code, _, err = run_replay(capsys, *map(str, sessions), "--budget", str(BUDGET), "--out", str(out))
    assert code == 0, err
    return out / "report.html", json.loads((out / "report.json").read_text())


def test_the_report_renders_a_point_per_turn_and_a_marker_per_compaction(chromium: Any, report: Any) -> None:
    page, results = report
    html = page.read_text()
    assert "<script src=" not in html and "<link " not in html  # nothing fetched at view time
    chromium.get(page.as_uri())
    wait(chromium, lambda d: d.execute_script("return typeof window.Plotly") == "object"
         and d.execute_script(TRACES), "plotly and the charts")
    charts = chromium.execute_script(TRACES)
    assert [c["id"] for c in charts] == [f"chart-{k}" for k in range(len(results))]
    for chart, r in zip(charts, results):
        traces = {t["name"]: t for t in chart["traces"]}
        turns = [t["turn"] for t in r["turns"]]
        assert traces["agent history"]["x"] == turns and traces["forwarded"]["x"] == turns
        assert traces["agent history"]["y"] == [t["sent"] for t in r["turns"]]
        assert traces["forwarded"]["y"] == [t["forwarded"] for t in r["turns"]]
        markers = {name.removeprefix("compaction: "): t["x"] for name, t in traces.items()
                   if name.startswith("compaction: ")}
        assert markers == r["levels_fired"] and markers
        assert sorted({turn for at in markers.values() for turn in at}) == [p["turn"] for p in r["compactions"]]
        assert chart["shapes"] >= 2  # the limit and the trigger lines, and the shaded stable spans
    rows = chromium.execute_script("return document.querySelectorAll('#totals tr').length")
    assert rows == 1 + len(results) + 1  # the header, a row per session, the totals
    chromium.set_window_size(1400, 1500)
    assert chromium.save_screenshot(str(artifact_path("replay-report.png")))
