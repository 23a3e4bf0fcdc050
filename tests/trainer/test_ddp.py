"""torchrun with 2 CPU processes (gloo): the same update as one process on the same groups."""

import pytest
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.plugins.trainer import make_group, publish_groups, settings_env
from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.metrics import effective_steps, read_log
from trainer.train import train

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
COMMON = dict(groups_per_step=3, max_steps=2, token_budget=16, lr=1e-3, idle_timeout_s=2.0, poll_timeout_s=0.2,
              progress=False, tensorboard=False, sync_every=0, max_staleness=100)


def _weights(url, settings, dest):
    return load_file(checkpoint.download(url, dest, settings) / "model.safetensors")


@pytest.mark.xfail(reason="hung past its 300 s timeout once in a clean CI run (passed in three others); under investigation, issue 6 open", strict=False)
def test_torchrun_two_processes_matches_one_process(polar_settings, trainer_model_dir, tmp_path):
    # one group id -> one partition -> both runs read the groups in the same order; varied lengths so
    # the token budget splits each step into several micro-batches, unevenly per rank
    groups = [make_group("d", [[50 + i] * (3 + i), [60 + i, 61]], [1.0, 0.0]) for i in range(6)]
    publish_groups(polar_settings, groups)

    single = polar_settings.model_copy(update={"storage_url": polar_settings.storage_url + "/single"})
    cfg = TrainConfig.from_overrides({**COMMON, "model": str(trainer_model_dir), "consumer_group": "single",
                                      "run_dir": str(tmp_path / "single")})
    train(cfg, single)

    ddp = polar_settings.model_copy(update={"storage_url": polar_settings.storage_url + "/ddp"})
    env = {**os.environ, **settings_env(ddp), "OMP_NUM_THREADS": "1"}
    sets = [a for k, v in COMMON.items() if k not in ("groups_per_step", "max_steps", "token_budget", "lr")
            for a in ("--set", f"{k}={v}")]
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "trainer.train", "--model", str(trainer_model_dir),
           "--groups-per-step", "3", "--max-steps", "2", "--token-budget", "16", "--lr", "1e-3",
           "--run-dir", str(tmp_path / "ddp"), "--set", "consumer_group=ddp", *sets]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    starts = [r for r in read_log(tmp_path / "ddp" / "train.jsonl") if r.get("event") == "start"]
    assert starts[0]["world_size"] == 2
    one = effective_steps(read_log(tmp_path / "single" / "train.jsonl"))
    two = effective_steps(read_log(tmp_path / "ddp" / "train.jsonl"))
    assert [sorted(s["groups"]) for s in one] == [sorted(s["groups"]) for s in two]  # same groups per step
    assert all(s["metrics"]["microbatches"] >= 3 for s in two)
    for m1, m2 in ((x["metrics"], y["metrics"]) for x, y in zip(one, two)):  # Adam hides gradient scale; these do not
        for key in ("grad_norm", "loss", "trained_tokens", "clip_frac"):
            assert abs(m1[key] - m2[key]) <= 1e-4 * max(1.0, abs(m1[key])), (key, m1[key], m2[key])

    a = _weights(checkpoint.latest(single.checkpoint_url, single).url, single, tmp_path / "w1")
    b = _weights(checkpoint.latest(ddp.checkpoint_url, ddp).url, ddp, tmp_path / "w2")
    base = load_file(Path(trainer_model_dir) / "model.safetensors")
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], base[k]) for k in a)  # training moved the weights
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
