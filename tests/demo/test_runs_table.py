"""The README's table of demo runs is rendered from the committed run summaries, never typed."""

import json
from pathlib import Path

import pytest

from polarstream.driver.runs_table import (ASYNC_RUNS_END, ASYNC_RUNS_START, CLI_RUNS_END, CLI_RUNS_START, CLI_STEPS_END,
                                CLI_STEPS_START, IMAGE_RUNS_END, IMAGE_RUNS_START, JUDGE_RUNS_END, JUDGE_RUNS_START,
                                RUNS_END, RUNS_START, async_runs_table, cli_runs_table, cli_steps_table,
                                demo_run_summaries, image_runs_table, render_block, render_runs, runs_table)

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


def test_lora_runs_follow_the_full_weight_rows_named_by_their_rank():
    lora = {**_summary(0), "config": {"lora": {"rank": 16, "alpha": 32}}, "worst_fall_after_0.8": 0.156}
    lines = runs_table([lora, _summary(1), _summary(0)]).splitlines()
    assert [x.split(" |")[0] for x in lines[2:]] == ["| 0", "| 1", "| 0, LoRA r16"]
    assert "| 0.16 |" in lines[4]  # no per-step rewards kept: the summary's own worst fall


def test_readme_matches_the_committed_runs():
    summaries = demo_run_summaries(ROOT)
    assert any(not s.get("config", {}).get("lora") for s in summaries), "docs/demo-runs/seed*.json: none committed"
    readme = (ROOT / "README.md").read_text()
    assert render_runs(readme, summaries) == readme, \
        "README's demo table is stale: re-render it from docs/demo-runs (python -m polarstream.driver.runs_table)"


@pytest.mark.parametrize("pattern,table,start,end", [
    ("demo-runs/cli-*.json", cli_runs_table, CLI_RUNS_START, CLI_RUNS_END),  # real-CLI demo runs
    ("demo-runs/step-*.json", cli_steps_table, CLI_STEPS_START, CLI_STEPS_END),  # real-CLI step timings
    ("experiment-runs/arith-*.json", async_runs_table, ASYNC_RUNS_START, ASYNC_RUNS_END),  # polarstream run, S = 0, 1
    ("experiment-runs/image-arith-*.json", image_runs_table, IMAGE_RUNS_START, IMAGE_RUNS_END),  # in containers
    ("experiment-runs/judge-arith-*.json", image_runs_table, JUDGE_RUNS_START, JUDGE_RUNS_END),  # a judge's reward
], ids=["cli-runs", "cli-steps", "async-runs", "image-runs", "judge-runs"])
def test_readme_matches_the_committed_real_cli_summaries(pattern, table, start, end):
    runs = sorted((ROOT / "docs").glob(pattern))
    assert runs, f"docs/{pattern}: none committed"
    readme = (ROOT / "README.md").read_text()
    assert render_block(readme, start, end, table([json.loads(p.read_text()) for p in runs])) == readme, \
        f"README's table of docs/{pattern} is stale: re-render it"


def test_real_cli_table_shows_size_merge_rate_and_missed_bars():
    s = {**_summary(0, learned=False), "harness": "pi (anthropic)", "merge_rate": 0.4,
         "config": {"steps": 16, "tasks_per_step": 3, "samples": 6}}
    s["bars"] = {"reward_gain": False, "heldout_gain": True, "wall_time": True, "merge_rate": True}
    row = cli_runs_table([s]).splitlines()[2]
    assert row.startswith("| pi (anthropic) | 0 | 16 × 3 × 6 |") and "| 40% |" in row and row.endswith("| no: reward_gain |")


def test_cli_step_table_shows_tokens_per_session_and_wall_time():
    step = {"samples": 6, "calls": 9, "trace_tokens": 60_000, "sampled_tokens": 300, "wall_s": 123.4}
    s = {"harness": "qwen_code (chat)", "warm_start": {"shape": "qwen_code 0.9.1 over chat"}, "per_step": [step]}
    row = cli_steps_table([s]).splitlines()[2]
    assert row == "| qwen_code (chat) | qwen_code 0.9.1 | 6 | 9 | 10,000 | 300 | 123 s |"


def test_async_table_shows_the_level_and_steps_per_hour():
    s = {**_summary(0), "config": {"async_level": 1}, "steps": 24, "reward_per_step": [0.5] * 24}
    row = async_runs_table([s, {**s, "config": {"async_level": 0}}]).splitlines()
    assert row[2].startswith("| 0 | 0 |") and row[3].startswith("| 1 | 0 |") and "| 8.0 min | 180 | yes |" in row[3]
