"""Each step's weight sync in the run's report (polarstream/driver/results.py): the trainer's ``sync`` events,
as it publishes them on polar.policy (each version again, with its sync, once the engines serve it), onto
the step whose version they loaded; nothing read from the trainer's disk."""

from __future__ import annotations

from polarstream.driver.results import StepResult, fill_syncs, sync_figures
from schemas import PolicyVersion


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


def _version(v: int, sync: dict | None = None) -> PolicyVersion:
    return PolicyVersion(model="m", version=v, checkpoint_url=f"s3://b/v{v}", step=v, sync=sync or {})


def test_each_step_takes_the_sync_its_version_was_published_again_with():
    results = [_step(0), _step(1)]
    policies = {1: _version(1), 2: _version(2)}  # trained, not yet served
    fill_syncs(results, policies)
    assert results[0].sync_s is None and results[1].sync_s is None
    policies[1] = _version(1, {"mode": "auto", "sync_s": 0.2, "broadcast": ["u"], "engine_pause_s": {"u": 0.03}})
    fill_syncs(results, policies)
    assert (results[0].sync_s, results[0].sync_mode, results[0].engine_pause_s) == (0.2, "broadcast", 0.03)
    assert results[1].sync_s is None  # version 2's sync has not come (or failed)
    policies[2] = _version(2, {"mode": "storage", "sync_s": 0.3, "storage": ["u"]})
    fill_syncs(results, policies)
    assert (results[1].sync_s, results[1].sync_mode) == (0.3, "storage")
    # the record crosses the topic as any other: its sync survives the codec
    from schemas import decode, encode

    assert decode(encode(policies[2]), PolicyVersion).sync == policies[2].sync
