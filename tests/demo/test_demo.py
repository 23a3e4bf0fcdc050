"""A short demo through the real system: every component as its own process, on the test's broker."""

from __future__ import annotations

import json

import pytest

from polarstream.demo import DemoConfig, run
from polarstream.report import quarter_means

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_short_demo_runs_end_to_end_and_its_checkpoint_loads(infra, tmp_path):
    from engine.models import load_model
    from engine.weights import apply_state, check_state, read_checkpoint

    # a warm start this short solves almost nothing: the gate is off here (its rule has its own test)
    cfg = DemoConfig(steps=2, tasks_per_step=2, samples=2, heldout=2, heldout_samples=2, sft_steps=15,
                     min_pass_rate=0.0, run_dir=tmp_path / "demo", runtime="subprocess", step_timeout_s=240)
    base = infra.settings.model_copy(update={"topic_prefix": "", "storage_url": ""})
    summary_path = run(cfg, base)

    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 2 and len(summary["reward_per_step"]) == 2
    assert all(0.0 <= r <= 1.0 for r in summary["reward_per_step"])
    assert (summary["first_quarter_mean"], summary["last_quarter_mean"]) == quarter_means(summary["reward_per_step"])
    assert summary["policy_version"] == 2  # one weight push per step
    assert summary["seed"] == 0 and 0.0 <= summary["heldout_before"] <= 1.0 and 0.0 <= summary["heldout_after"] <= 1.0
    assert summary["learned"] == all(summary["bars"].values()) and set(summary["bars"]) == {"reward_gain", "last_quarter", "heldout_gain", "wall_time"}
    for step in summary["per_step"]:
        assert step["samples"] == 2 * 2 and step["calls"] >= step["traces"] >= step["samples"]
    for name in ("reward.png", "report.md"):
        assert (cfg.run_dir / name).stat().st_size > 0
    assert summary["checkpoint_url"] in (cfg.run_dir / "report.md").read_text()

    # The engine's own loader takes the trained weights from S3.
    settings = base.model_copy(update={"topic_prefix": summary["topic_prefix"]})
    assert summary["checkpoint_url"].startswith("s3://")
    state = read_checkpoint(summary["checkpoint_url"], settings)
    loaded = load_model(summary["model_dir"])
    check_state(loaded.model, state)
    apply_state(loaded.model, state)
    # What the engine now serves is exactly what the trainer stored (a short run's groups may all have
    # zero advantages, so the weights need not have moved).
    own = loaded.model.state_dict()
    assert all(own[k].equal(v.to(own[k].dtype)) for k, v in state.items())
