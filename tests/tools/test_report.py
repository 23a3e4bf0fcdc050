"""The report files: JSON equal to the report, a real PNG, an HTML table with the numbers."""

from __future__ import annotations

import json

from polarstream.tools.eval_run import EvalState
from producers.kafka_read import RawMessage
from polarstream.tools.report import write_report
from schemas import encode
from tests.tools.samples import traj


def test_files(tmp_path):
    state = EvalState("t.polar.trajectories", (2,), 1.0)
    for i, t in enumerate([traj("a", 0, 1.0), traj("a", 1, 0.0), traj("a", 0, 1.0, attempt=1, version=1),
                           traj("b", 0, 1.0, version=1, harness="claude_code")]):
        state.feed(RawMessage("trajectories", 0, i, 0, None, encode(t, packed=i % 2 == 1)))  # both encodings
    report = state.report()
    paths = write_report(report, tmp_path / "out")
    assert [p.name for p in paths] == ["eval.json", "eval.png", "eval.html"]
    assert json.loads(paths[0].read_text()) == json.loads(json.dumps(report))
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[1].stat().st_size > 5000
    page = paths[2].read_text()
    assert "<th>pass@2</th>" in page and "claude_code" in page and "data:image/png;base64," in page
    assert "1 superseded by a later attempt" in page
    assert not list((tmp_path / "out").glob(".*.tmp"))


def test_empty_report_has_no_plot(tmp_path):
    report = EvalState("t.polar.trajectories", (1,), 1.0).report()
    paths = write_report(report, tmp_path)
    assert [p.name for p in paths] == ["eval.json", "eval.html"]
