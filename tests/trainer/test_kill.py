"""Kill the trainer process mid-run and restart it: every group trains exactly once, none skipped."""

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from transformers import AutoModelForCausalLM

from tests.plugins.trainer import end_offsets, make_group, publish_groups, settings_env
from trainer import checkpoint
from trainer.metrics import effective_steps, read_log

POLARSTREAM = str(Path(sys.executable).with_name("polarstream"))


def _trainer(model_dir, run_dir, env, out_path):
    cmd = [POLARSTREAM, "train", "--model", str(model_dir), "--groups-per-step", "1", "--idle-timeout", "2",
           "--sync-every", "0",
           "--run-dir", str(run_dir), "--lr", "1e-3", "--token-budget", "256",
           "--set", "poll_timeout_s=0.2", "--set", "progress=false", "--set", "tensorboard=false",
           "--set", "keep_checkpoints=2", "--set", "max_staleness=1000"]  # all sampled by version 0
    with open(out_path, "w") as out:  # a file, not a pipe: nobody reads while it runs
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _steps_logged(log_path):
    return sum(1 for r in read_log(log_path) if r.get("event") == "step") if log_path.exists() else 0


def test_sigkill_mid_run_then_restart_trains_each_group_once(polar_settings, trainer_model_dir, tmp_path):
    groups = [make_group(f"k{i}", [[30 + i, 31, 32], [40 + i, 41]], [1.0, 0.0]) for i in range(8)]
    publish_groups(polar_settings, groups)
    env = {**os.environ, **settings_env(polar_settings)}
    run_dir, log_path = tmp_path / "run", tmp_path / "run" / "train.jsonl"

    first = _trainer(trainer_model_dir, run_dir, env, tmp_path / "first.out")
    deadline = time.monotonic() + 180
    while _steps_logged(log_path) < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, (tmp_path / "first.out").read_text()  # still running: the kill lands mid-run
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    killed_at = _steps_logged(log_path)

    second = _trainer(trainer_model_dir, run_dir, env, tmp_path / "second.out")
    assert second.wait(300) == 0, (tmp_path / "second.out").read_text()

    records = read_log(log_path)
    trained = Counter(g for s in effective_steps(records) for g in s["groups"])
    assert trained == Counter(g.event_id for g in groups)  # each group exactly once, none missing
    starts = [r for r in records if r.get("event") == "start"]
    assert len(starts) == 2 and 0 < starts[1]["step"] <= killed_at and starts[1]["checkpoint"].startswith("s3://")

    # the final checkpoint, read back from S3: every position consumed, weights load as an HF model
    info = checkpoint.latest(polar_settings.checkpoint_url, polar_settings)
    assert info.url.startswith("s3://") and info.step == len(groups)
    state = checkpoint.read_state(info, polar_settings)
    assert {int(p): o for p, o in state["offsets"]["groups"].items()} == end_offsets(polar_settings)
    model = AutoModelForCausalLM.from_pretrained(checkpoint.download(info.url, tmp_path / "final", polar_settings))
    assert sum(p.numel() for p in model.parameters()) > 0
    assert len(checkpoint.list_checkpoints(polar_settings.checkpoint_url, polar_settings)) == 2  # pruned to keep=2
