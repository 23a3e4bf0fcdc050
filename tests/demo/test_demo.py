"""A short demo through the real system: every component as its own process, on the test's broker."""

from __future__ import annotations

import json
import time

import pytest

from polarstream.demo.preset import arith_preset
from polarstream.driver import RunConfig, run
from polarstream.driver.report import quarter_means

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# What each service's /metrics must show once a training step is done (issue 22): a counter that moved.
# The gateway's own call counters (gateway/metrics.py) are only declared until gateway/service.py calls
# record_*; its state gauges and the node's (same process, same endpoint) are read live.
MOVED = {
    "gateway": [("polar_node_sessions_finished_total", {}, 1), ("polar_node_run_slot_busy_seconds_total", {}, 1e-9),
                ("polar_gateway_calls_total", {"status": "ok"}, 1), ("polar_gateway_publish_seconds_count", {}, 1),
                ("polar_gateway_stage_seconds_count", {"stage": "tokenize"}, 1),
                ("polar_gateway_chain_breaks_total", {"reason": "first_call"}, 1)],
    "rollout": [("polar_rollout_session_events_total", {}, 1), ("polar_rollout_sessions", {"stage": "finished"}, 1)],
    "streams": [("polar_streams_events_total", {"name": "groups.sent"}, 1),
                ("polar_streams_group_latency_seconds_count", {}, 1)],
    "trainer": [("polar_trainer_steps_total", {}, 1), ("polar_trainer_tokens_total", {}, 1),
                ("polar_trainer_syncs_total", {"outcome": "ok"}, 1)],
}
DECLARED = {"gateway": ["polar_gateway_calls", "polar_gateway_errors", "polar_gateway_added_latency_seconds",
                        "polar_gateway_publish_seconds", "polar_gateway_stage_seconds", "polar_gateway_chain_breaks", "polar_gateway_sessions",
                        "polar_node_sessions", "polar_node_ready_buffer", "polar_node_run_slot_utilization"],
            "streams": ["polar_streams_consumer_lag", "polar_streams_sessions_open"],
            "trainer": ["polar_trainer_reward_mean", "polar_trainer_staleness", "polar_trainer_tokens_per_second",
                        "polar_trainer_sync_failures_in_a_row"]}


def _samples(text: str) -> tuple[set[str], dict[tuple[str, frozenset], float]]:
    """Family names and {(sample name, labels): value} of a /metrics page, via prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    families, values = set(), {}
    for fam in text_string_to_metric_families(text):
        families.add(fam.name)
        for s in fam.samples:
            values[(s.name, frozenset(s.labels.items()))] = s.value
    return families, values


def _total(values: dict, name: str, labels: dict) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in values.items() if n == name and set(labels.items()) <= ls)


def scrape_moved(urls: dict[str, str], timeout: float = 30.0) -> dict[str, tuple[set[str], dict]]:
    """Parse every service's /metrics until each of its MOVED counters reached its floor (a step's side
    effects, e.g. the trainer's sync record, land a moment after the demo sees the new policy)."""
    import httpx

    deadline, got = time.monotonic() + timeout, {}
    for name, url in urls.items():
        while True:
            families, values = _samples(httpx.get(url, timeout=5).text)
            got[name] = (families, values)
            if all(_total(values, m, ls) >= floor for m, ls, floor in MOVED[name]) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    return got


def test_short_demo_runs_end_to_end_and_its_checkpoint_loads(infra, tmp_path):
    from engine.models import load_model
    from engine.weights import apply_state, check_state, read_checkpoint

    # a warm start this short (and this small a step: 4 conversations, 16 drills) solves almost nothing: the
    # gate is off here (its rule has its own test); it is built from nothing in every CI run, and these are
    # test_cli_demo's settings (p_tool 1.0 included), so the two share one build (demo_model's lock)
    cfg = RunConfig(steps=2, tasks_per_step=2, samples=2, heldout=2, heldout_samples=2, sft_steps=15, sft_batch=4,
                     sft_drills=16, p_tool=1.0, min_pass_rate=0.0, run_dir=tmp_path / "demo", runtime="subprocess",
                     step_timeout_s=240)
    base = infra.settings.model_copy(update={"topic_prefix": "", "storage_url": ""})
    scraped: dict = {}

    def after_step(step: int, urls: dict[str, str]) -> None:
        if step == 0:  # every service is up and one step went through all of them
            scraped.update(scrape_moved(urls))

    summary_path = run(cfg, base, on_step=after_step, preset=arith_preset)

    assert set(scraped) == {"gateway", "rollout", "streams", "trainer"}
    for name, (families, values) in scraped.items():
        for metric, labels, floor in MOVED[name]:
            assert _total(values, metric, labels) >= floor, f"{name}: {metric}{labels} did not move"
        missing = set(DECLARED.get(name, [])) - families
        assert not missing, f"{name}: /metrics lacks {sorted(missing)}"

    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 2 and len(summary["reward_per_step"]) == 2
    assert all(0.0 <= r <= 1.0 for r in summary["reward_per_step"])
    assert (summary["first_quarter_mean"], summary["last_quarter_mean"]) == quarter_means(summary["reward_per_step"])
    assert summary["policy_version"] == 2  # one weight push per step
    # the training loop's figures (bench/driver.py): steps per hour over it, the engine's idle share in it
    assert summary["rl_loop_s"] > 0 and abs(summary["steps_per_hour"] * summary["rl_loop_s"] / 3600 - 2) < 0.05
    assert 0.0 <= summary["engine_idle_fraction"] < 1.0
    assert summary["seed"] == 0 and 0.0 <= summary["heldout_before"] <= 1.0 and 0.0 <= summary["heldout_after"] <= 1.0
    assert summary["learned"] == all(summary["bars"].values()) and set(summary["bars"]) == {"reward_gain", "last_quarter", "heldout_gain", "wall_time"}
    for step in summary["per_step"]:
        assert step["samples"] == 2 * 2 and step["calls"] >= step["traces"] >= step["samples"]
        # groups without signal, counted by kind: a step that scored 0 (1) is all-wrong (all-correct) groups
        assert step["all_correct"] + step["all_wrong"] <= step["groups"]
        assert (step["reward"] == 0.0) <= (step["all_wrong"] == step["groups"])
        assert (step["reward"] == 1.0) <= (step["all_correct"] == step["groups"])
        # the weights went to the engine in memory (the default), and the report shows how long that took
        assert step["sync_mode"] == "broadcast" and step["sync_s"] > 0 and step["engine_pause_s"] >= 0, step
    assert summary["zero_signal_groups"] == {"all_correct": sum(s["all_correct"] for s in summary["per_step"]),
                                             "all_wrong": sum(s["all_wrong"] for s in summary["per_step"]), "groups": 4,
                                             "replaced": 0}  # the demo masks them
    for name in ("reward.png", "report.md"):
        assert (cfg.run_dir / name).stat().st_size > 0
    report = (cfg.run_dir / "report.md").read_text()
    assert summary["checkpoint_url"] in report
    assert "| sync s | sync | engine pause s |" in report and report.count(" | broadcast | ") == 2
    for step in summary["per_step"]:  # each step links its groups' viewer pages
        assert len(step["group_ids"]) == 2 and all(f"/r/0/group/{g})" in report for g in step["group_ids"])

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
