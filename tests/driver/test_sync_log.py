"""Each step's weight sync in the run's report (polarstream/driver/results.py): the trainer's ``sync`` events,
read incrementally from its train.jsonl, onto the step whose version they loaded."""

from __future__ import annotations

import json

from polarstream.driver.results import StepResult, SyncLog, sync_figures


def _step(k: int) -> StepResult:
    return StepResult(step=k, reward=0.5, samples=4, groups=1, traces=4, calls=4, sampled_tokens=40, wall_s=1.0,
                      policy_version=k)


def test_sync_figures_name_the_path_and_the_longest_engine_pause():
    broadcast = {"event": "sync", "policy_version": 3, "mode": "auto", "sync_s": 0.25, "broadcast": ["http://a"],
                 "engine_pause_s": {"http://a": 0.01}}
    assert sync_figures(broadcast) == {"sync_s": 0.25, "sync_mode": "broadcast", "engine_pause_s": 0.01}
    mixed = {**broadcast, "storage": ["http://b"], "engine_pause_s": {"http://a": 0.01, "http://b": 0.4}}
    assert sync_figures(mixed)["sync_mode"] == "mixed" and sync_figures(mixed)["engine_pause_s"] == 0.4
    plain = {"event": "sync", "policy_version": 1, "mode": "storage", "sync_s": 1.5}  # no engine figures logged
    assert sync_figures(plain) == {"sync_s": 1.5, "sync_mode": "storage", "engine_pause_s": None}
    lora = {"event": "sync", "policy_version": 2, "mode": "auto", "adapter": True, "sync_s": 0.05, "broadcast": ["http://a"]}
    assert sync_figures(lora)["sync_mode"] == "broadcast adapter"
    assert sync_figures({**lora, "broadcast": None, "storage": ["http://v"]})["sync_mode"] == "storage adapter"


def test_sync_log_fills_each_step_from_its_version_reading_only_whole_new_lines(tmp_path):
    path = tmp_path / "trainer" / "train.jsonl"
    log = SyncLog(path)
    results = [_step(0), _step(1)]
    log.fill(results)  # no trainer log yet: nothing, and no error
    assert results[0].sync_s is None
    path.parent.mkdir()
    lines = [{"event": "step", "step": 1, "policy_version": 1},
             {"event": "sync", "step": 1, "policy_version": 1, "mode": "auto", "sync_s": 0.2, "broadcast": ["u"],
              "engine_pause_s": {"u": 0.03}},
             {"event": "sync_error", "step": 2, "policy_version": 2, "error": "x"}]
    text = "".join(json.dumps(r) + "\n" for r in lines)
    half = json.dumps({"event": "sync", "policy_version": 2, "sync_s": 0.3, "storage": ["u"]})
    path.write_text(text + half[:10])  # the trainer is still writing its next line
    log.fill(results)
    assert (results[0].sync_s, results[0].sync_mode, results[0].engine_pause_s) == (0.2, "broadcast", 0.03)
    assert results[1].sync_s is None  # step 1 (version 2) failed its first sync and is not whole yet
    with path.open("a") as f:
        f.write(half[10:] + "\n")
    log.fill(results)
    assert (results[1].sync_s, results[1].sync_mode) == (0.3, "storage")
    assert log.pos == path.stat().st_size
