"""The README's table of demo runs is rendered from the committed run summaries, never typed."""

import json
from pathlib import Path

from polarstream.report import RUNS_END, RUNS_START, render_runs, runs_table

ROOT = Path(__file__).resolve().parents[2]


def _summary(seed, learned=True):
    bars = {"reward_gain": True, "last_quarter": learned, "heldout_gain": True, "wall_time": True}
    return {"seed": seed, "first_quarter_mean": 0.1, "last_quarter_mean": 0.7 if learned else 0.5,
            "heldout_before": 0.2, "heldout_after": 0.6, "wall_time_s": 480.0, "bars": bars, "learned": learned}


def test_table_names_the_missed_bars():
    table = runs_table([_summary(1, learned=False), _summary(0)])
    lines = table.splitlines()
    assert lines[2].startswith("| 0 |") and lines[3].startswith("| 1 |")  # sorted by seed
    assert lines[2].endswith("| yes |") and "no: last_quarter" in lines[3]
    text = render_runs(f"intro\n{RUNS_START}\nstale\n{RUNS_END}\noutro", [_summary(0)])
    assert "stale" not in text and text.startswith("intro\n") and text.endswith("\noutro")


def test_readme_matches_the_committed_runs():
    runs = sorted((ROOT / "docs" / "demo-runs").glob("seed*.json"))
    assert runs, "docs/demo-runs/seed*.json: no demo run summaries committed"
    summaries = [json.loads(p.read_text()) for p in runs]
    readme = (ROOT / "README.md").read_text()
    assert render_runs(readme, summaries) == readme, "README's demo table is stale: re-render it from docs/demo-runs"
