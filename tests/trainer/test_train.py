"""The trainer end to end against the real Kafka broker and S3 server."""

import importlib
import json
import socket

import pytest
from confluent_kafka import Producer
from transformers import AutoModelForCausalLM

from schemas import PolicyVersion
from tests.plugins.trainer import end_offsets, make_group, publish_groups, read_policy
from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.metrics import effective_steps, read_log
from trainer.train import train
from trainer.sync.storage import WeightSyncError


def _groups(n, start=0, version=0):
    # published to one partition (read in publish order); every group has its own group and event id
    return [make_group(f"g{i}", [[10 + i, 11, 12], [20 + i, 21]], [1.0, 0.0], policy_version=version)
            for i in range(start, start + n)]


def _cfg(model_dir, run_dir, **kw):
    base = dict(model=str(model_dir), groups_per_step=2, token_budget=256, lr=1e-3, idle_timeout_s=3.0,
                poll_timeout_s=0.2, run_dir=str(run_dir), progress=False, tensorboard=False)
    return TrainConfig.from_overrides({**base, **kw})


def test_train_consumes_checkpoints_to_s3_publishes_and_resumes(polar_settings, trainer_model_dir, tmp_path):
    groups = _groups(4)
    raw = Producer(polar_settings.kafka_config())
    raw.produce(polar_settings.topic("groups"), b"{not json", key=b"g")  # bad input: skipped, counted, logged
    raw.flush(10)
    del raw
    # the first two as JSON (an earlier build's records), the rest packed: the trainer reads both
    publish_groups(polar_settings.model_copy(update={"record_format": "json"}), groups[:2], 0)
    publish_groups(polar_settings, [groups[1], groups[2], groups[3]], 0)  # g1 redelivered, in the other encoding

    summary = train(_cfg(trainer_model_dir, tmp_path / "run", tensorboard=True, progress=True), polar_settings)
    assert summary["step"] == 2 and summary["policy_version"] == 2
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert summary["checkpoint"].startswith("s3://")
    records = read_log(tmp_path / "run" / "train.jsonl")
    steps = effective_steps(records)
    assert sorted(g for s in steps for g in s["groups"]) == sorted(g.event_id for g in groups)
    reasons = [k["reason"] for r in records if r.get("event") in ("step", "skip") for k in r["skipped"]]
    assert sorted(reasons) == ["duplicate", "undecodable"]
    for key in ("loss", "clip_frac", "approx_kl", "entropy", "reward_mean", "adv_std", "tokens", "staleness_max"):
        assert key in steps[0]["metrics"]

    # the checkpoint on S3 holds the exact end positions and loads as an HF model
    info = checkpoint.latest(polar_settings.checkpoint_url, polar_settings)
    state = checkpoint.read_state(info, polar_settings)
    assert {int(p): o for p, o in state["offsets"]["groups"].items()} == end_offsets(polar_settings)
    local = checkpoint.download(info.url, tmp_path / "ckpt", polar_settings)
    assert AutoModelForCausalLM.from_pretrained(local).config.vocab_size > 0
    assert (local / "tokenizer_config.json").exists()  # tokenizer files travel with the weights

    # one PolicyVersion per update, pointing at a loadable checkpoint
    got = read_policy(polar_settings, 2)
    assert [(p.version, p.step) for p in got] == [(1, 1), (2, 2)] and all(isinstance(p, PolicyVersion) for p in got)
    assert got[-1].checkpoint_url == info.url
    # and each again once synced (here: no engine to load it), with the sync train.jsonl records, for a driver
    # that cannot read this disk
    synced = read_policy(polar_settings, 2, synced=True)
    logged = [r for r in records if r.get("event") == "sync"]
    assert [(p.version, p.metrics, p.checkpoint_url) for p in synced] == [(p.version, p.metrics, p.checkpoint_url) for p in got]
    assert [p.sync["sync_s"] for p in synced] == [r["sync_s"] for r in logged] and all(p.sync["mode"] for p in synced)

    # resume: only the new groups train, from step 2 on
    more = _groups(2, start=4, version=1)
    publish_groups(polar_settings, more, 0)
    summary = train(_cfg(trainer_model_dir, tmp_path / "run"), polar_settings)
    assert summary["step"] == 3
    steps = effective_steps(read_log(tmp_path / "run" / "train.jsonl"))
    assert [s["groups"] for s in steps][-1] == [g.event_id for g in more]
    assert steps[-1]["metrics"]["staleness_max"] == 1  # sampled by version 1, trained at version 2


@pytest.mark.parametrize("mode", ["drop", "downweight"])
def test_stale_groups_are_dropped_or_downweighted(polar_settings, trainer_model_dir, tmp_path, mode):
    groups = _groups(2, version=0)
    publish_groups(polar_settings, groups, 0)
    cfg = _cfg(trainer_model_dir, tmp_path / "a", groups_per_step=1, max_staleness=0, max_steps=2, stale_mode=mode,
               checkpoint_every=2, sync_every=0)
    train(cfg, polar_settings)  # the first group trains at version 0; the second is then 1 version behind
    records = read_log(tmp_path / "a" / "train.jsonl")
    steps = effective_steps(records)
    skipped = [s for r in records if r.get("event") == "skip" for s in r["skipped"]]
    if mode == "drop":
        assert len(steps) == 1 and [s["reason"] for s in skipped] == ["stale"]
        assert {steps[0]["groups"][0], skipped[0]["event_id"]} == {g.event_id for g in groups}
    else:
        assert [s["weights"] for s in steps] == [[1.0], [0.5]] and not skipped
        assert steps[1]["metrics"]["staleness_max"] == 1


def _dead_engine() -> str:
    """An engine URL nothing listens on: every weight sync to it fails at once (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"polar=http://127.0.0.1:{port}"


def test_failed_syncs_keep_served_groups_fresh_then_stop_after_a_checkpoint(polar_settings, trainer_model_dir,
                                                                            tmp_path):
    groups = _groups(4, version=0)  # all sampled by version 0, which the engines keep serving
    publish_groups(polar_settings, groups, 0)
    cfg = _cfg(trainer_model_dir, tmp_path / "run", groups_per_step=1, max_staleness=0, checkpoint_every=2,
               engines=[_dead_engine()], max_sync_failures=3)
    with pytest.raises(WeightSyncError, match=r"^3 weight syncs in a row failed .* stopped at step 3, checkpoint "
                                              r"s3://\S+; engines still serve policy version 0; last error: ") as e:
        train(cfg, polar_settings)
    assert "\n" not in str(e.value)
    records = read_log(tmp_path / "run" / "train.jsonl")
    steps = effective_steps(records)
    # failed syncs do not make the served policy's groups stale: none dropped, each fresh
    assert [s["groups"] for s in steps] == [[g.event_id] for g in groups[:3]]
    assert [s["metrics"]["staleness_max"] for s in steps] == [0, 0, 0]
    assert [r["failures_in_a_row"] for r in records if r.get("event") == "sync_error"] == [1, 2, 3]
    assert records[-1]["event"] == "stop" and records[-1]["reason"] == "error"
    # checkpointed first (step 3 is not a checkpoint_every step), with the sync state and exact positions
    info = checkpoint.latest(polar_settings.checkpoint_url, polar_settings)
    assert info.step == 3 and info.url in str(e.value)
    state = checkpoint.read_state(info, polar_settings)
    assert (state["policy_version"], state["synced_version"], state["sync_failures"]) == (3, 0, 3)
    assert int(state["offsets"]["groups"]["0"]) == 3  # the fourth group is left for the restart


def test_policy_versions_stay_monotonic_across_a_crash_between_checkpoints(polar_settings, trainer_model_dir,
                                                                          tmp_path, monkeypatch):
    publish_groups(polar_settings, _groups(3), 0)
    loaded = []

    def sync(engines, url, version, gateway=None):
        loaded.append((version, url))
        if len(loaded) == 3:  # version 3 is published (a weights-only export), then the process dies
            raise RuntimeError("crash")

    monkeypatch.setattr(importlib.import_module("trainer.sync.syncer"), "sync_weights", sync)
    with pytest.raises(RuntimeError, match="crash"):
        train(_cfg(trainer_model_dir, tmp_path / "run", groups_per_step=1, checkpoint_every=2), polar_settings)
    assert checkpoint.latest(polar_settings.checkpoint_url, polar_settings).step == 2

    # the restart redoes step 3 from checkpoint 2; its weights differ from the lost ones, so a new version
    summary = train(_cfg(trainer_model_dir, tmp_path / "run", groups_per_step=1, checkpoint_every=2, max_steps=3),
                    polar_settings)
    assert summary["step"] == 3 and summary["policy_version"] == 4
    assert [v for v, _ in loaded] == [1, 2, 3, 4] and len({u for _, u in loaded}) == 4
    got = read_policy(polar_settings, 4)
    assert [(p.version, p.step) for p in got] == [(1, 1), (2, 2), (3, 3), (4, 3)]  # one version, one set of weights
