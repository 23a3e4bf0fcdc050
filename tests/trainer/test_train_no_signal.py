"""trainer.train end to end (real Kafka and S3): a step without signal leaves the weights bit-identical,
yet still counts, checkpoints and publishes a policy version (the demo's on-policy loop waits for it)."""

import torch
from safetensors.torch import load_file

from engine.weights import read_checkpoint
from tests.plugins.trainer import make_group, publish_groups, read_policy
from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.metrics import effective_steps, read_log
from trainer.train import train


def test_no_signal_step_keeps_the_weights_and_publishes_a_version(polar_settings, trainer_model_dir, tmp_path):
    signal = make_group("a", [[10, 11, 12], [20, 21]], [1.0, 0.0])
    flat = make_group("b", [[30, 31], [40, 41, 42]], [1.0, 1.0])  # zero variance: every advantage 0
    publish_groups(polar_settings, [signal, flat], 0)  # one partition: read in this order
    cfg = TrainConfig.from_overrides(dict(
        model=str(trainer_model_dir), groups_per_step=1, token_budget=256, lr=1e-3, weight_decay=0.1,
        skip_zero_variance=False, max_steps=2, idle_timeout_s=3.0, poll_timeout_s=0.2,
        run_dir=str(tmp_path / "run"), progress=False, tensorboard=False))
    summary = train(cfg, polar_settings)
    assert summary["step"] == 2 and summary["policy_version"] == 2
    assert summary["counters"].get("no_update_no_signal") == 1

    steps = effective_steps(read_log(tmp_path / "run" / "train.jsonl"))
    assert [s["metrics"]["updated"] for s in steps] == [1.0, 0.0]
    assert [s["groups"] for s in steps] == [[signal.event_id], [flat.event_id]]

    ckpts = checkpoint.list_checkpoints(polar_settings.checkpoint_url, polar_settings)
    assert [c.step for c in ckpts] == [1, 2]
    first, second = (read_checkpoint(c.url, polar_settings) for c in ckpts)
    start = load_file(trainer_model_dir / "model.safetensors")
    assert any(not torch.equal(start[k], first[k]) for k in start)  # the step with signal trained
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)

    got = read_policy(polar_settings, 2)
    assert [(p.version, p.step) for p in got] == [(1, 1), (2, 2)]
