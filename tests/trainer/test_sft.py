"""``polarstream sft`` against the real Kafka broker and S3 server: what it trains, and an exact resume."""

import hashlib
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from confluent_kafka import Producer

from schemas import Trace, Trajectory, encode
from tests.plugins.trainer import settings_env
from trainer import checkpoint
from trainer.metrics import effective_steps, read_log
from trainer.sft import SftSpec, sft, sft_config
from trainer.sft_select import Rule

POLARSTREAM = str(Path(sys.executable).with_name("polarstream"))


def _traj(group, i, reward, completion, n=2, prompt=(1, 2, 3, 4)):
    ids = [*prompt, *completion]
    trace = Trace(call_indices=[0], token_ids=ids, loss_mask=[0] * len(prompt) + [1] * len(completion),
                  logprobs=[0.0] * len(prompt) + [-1.0] * len(completion), policy_versions=[0])
    return Trajectory(session_id=f"{group}-s{i}", group_id=group, sample_index=i, num_samples=n, reward=reward,
                      traces=[trace])


def _publish(settings, trajs) -> list[str]:
    """To partition 0 in this order; returns the sha256 of each message, as sft logs them."""
    producer = Producer(settings.kafka_config(**{"acks": "all"}))
    digests = []
    for t in trajs:
        value = encode(t, packed=settings.packed)
        producer.produce(settings.topic("trajectories"), value, key=t.key().encode(), partition=0)
        digests.append(hashlib.sha256(value).hexdigest())
    assert producer.flush(30) == 0
    return digests


def _cfg(model_dir, run_dir, **kw):
    return sft_config({"model": str(model_dir), "token_budget": 256, "lr": 1e-2, "poll_timeout_s": 0.2,
                       "run_dir": str(run_dir), "progress": False, "tensorboard": False, **kw})


def test_sft_trains_only_the_kept_rows_sampled_tokens_and_the_nll_falls(polar_settings, trainer_model_dir, tmp_path):
    good = [_traj(f"g{i}", 0, 1.0, [50, 51, 52, 53]) for i in range(8)]  # one answer, eight times
    bad = [_traj(f"g{i}", 1, 0.0, [60, 61]) for i in range(8)]
    digests = _publish(polar_settings, [t for pair in zip(good, bad) for t in pair])
    later = _traj("late", 0, 1.0, [70])  # written after the run starts: past its end, not read

    spec = SftSpec(rule=Rule(min_reward=1.0), rows_per_step=2)
    summary = sft(_cfg(trainer_model_dir, tmp_path / "run"), polar_settings, spec)
    _publish(polar_settings, [later])

    records = read_log(tmp_path / "run" / "sft.jsonl")
    steps = [r for r in records if r["event"] == "step"]
    assert [d for s in steps for d in s["rows"]] == digests[0::2]  # the reward-1 rows, in order, once
    dropped = [x for r in records if r["event"] in ("step", "skip") for x in r["dropped"]]  # skip: after the last step
    assert sorted(d for d, _ in dropped) == sorted(digests[1::2]) and {why for _, why in dropped} == {"reward"}
    # the loss mask: 4 sampled tokens a row trained, the 4 prompt tokens never (position 0 predicts nothing)
    assert summary["counters"]["tokens"] == 8 * 4 and summary["step"] == 4
    nll = [s["metrics"]["nll"] for s in steps]
    assert abs(nll[0] - math.log(256)) < 0.2, nll  # the logged loss is the NLL: a fresh tiny model is ~uniform
    assert nll[-1] < 0.75 * nll[0], nll  # the same answer again and again: learned

    info = checkpoint.latest(f"{polar_settings.checkpoint_url}/sft", polar_settings)
    state = checkpoint.read_state(info, polar_settings)
    # the last row was read after the last step: dropped, and (as the trainer does) not worth a checkpoint
    assert info.step == 4 and state["source"]["pending"] == [] and state["source"]["next"]["0"] == 15
    # a second run resumes from that checkpoint: only that row is left, and the row written later is past the end
    again = sft(_cfg(trainer_model_dir, tmp_path / "run"), polar_settings, spec)
    assert again["step"] == 4 and again["counters"]["dropped"] == 7 + 1  # the checkpoint counted 7
    assert read_log(tmp_path / "run" / "sft.jsonl")[-2] == {"event": "skip", "step": 4,
                                                             "dropped": [[digests[15], "reward"]]}


def _sft_cli(model_dir, run_dir, url, env, out_path):
    cmd = [POLARSTREAM, "sft", "--model", str(model_dir), "--best-of-group", "--rows-per-step", "1",
           "--run-dir", str(run_dir), "--checkpoint-url", url, "--lr", "1e-3", "--token-budget", "256",
           "--set", "poll_timeout_s=0.2", "--set", "progress=false", "--set", "tensorboard=false",
           "--set", "keep_checkpoints=2"]
    with open(out_path, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _consumed(log_path) -> Counter:
    """Every row the surviving steps decided: trained ones and dropped ones, by hash."""
    records = read_log(log_path)
    steps = effective_steps(records)
    got = Counter(("trained", d) for s in steps for d in s["rows"])
    got += Counter(("dropped", d) for s in steps for d, _ in s["dropped"])
    got += Counter(("dropped", d) for r in records if r["event"] == "skip" for d, _ in r["dropped"])
    return got


def test_sigkill_mid_run_then_resume_consumes_every_row_once_as_an_uninterrupted_run(
        polar_settings, trainer_model_dir, tmp_path):
    # groups interleaved (every group's first sample, then every second one), so best-of-group holds rows
    # undecided across steps: a checkpoint must name them for the restart to read them again
    n = 12
    firsts = [_traj(f"k{i}", 0, float(i % 2), [30 + i, 31]) for i in range(n)]
    seconds = [_traj(f"k{i}", 1, 0.5, [40 + i, 41, 42]) for i in range(n)]
    digests = _publish(polar_settings, firsts[:6] + seconds[:6] + firsts[6:] + seconds[6:])
    env = {**os.environ, **settings_env(polar_settings)}
    root = polar_settings.checkpoint_url

    first = _sft_cli(trainer_model_dir, tmp_path / "a", f"{root}/a", env, tmp_path / "first.out")
    log_a = tmp_path / "a" / "sft.jsonl"
    deadline = time.monotonic() + 180
    steps = lambda: sum(r["event"] == "step" for r in read_log(log_a)) if log_a.exists() else 0  # noqa: E731
    while steps() < 3 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, (tmp_path / "first.out").read_text()  # the kill lands mid-run
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    second = _sft_cli(trainer_model_dir, tmp_path / "a", f"{root}/a", env, tmp_path / "second.out")
    assert second.wait(300) == 0, (tmp_path / "second.out").read_text()
    starts = [r for r in read_log(log_a) if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["step"] > 0  # it did resume from a checkpoint
    assert starts[1]["pending"] > 0  # holding undecided rows, read again

    whole = _sft_cli(trainer_model_dir, tmp_path / "b", f"{root}/b", env, tmp_path / "whole.out")
    assert whole.wait(300) == 0, (tmp_path / "whole.out").read_text()

    resumed, uninterrupted = _consumed(log_a), _consumed(tmp_path / "b" / "sft.jsonl")
    assert resumed == uninterrupted
    assert sorted(d for _, d in resumed.elements()) == sorted(digests)  # every row once
    assert sum(k == "trained" for k, _ in resumed.elements()) == n  # one per group


def test_bad_input_is_one_line_before_anything_is_read(trainer_model_dir, tmp_path):
    from typer.testing import CliRunner

    from polarstream.cli import app

    bad = tmp_path / "offsets.json"
    bad.write_text('{"calls": {"0": 1}}')
    cases = [(["--from-offsets", str(bad)], "topic 'calls' is not one of trajectories"),
             (["--follow"], "--follow needs --idle-timeout"),
             (["--set", "loss=ppo_clip"], "sft trains with loss='cispo'"),
             (["--rows-per-step", "0"], "must be >= 1")]
    for args, want in cases:
        got = CliRunner().invoke(app, ["sft", "--model", str(trainer_model_dir), *args])
        assert got.exit_code == 2 and want in " ".join(got.output.split()), (args, got.output)


def test_sft_trains_a_lora_adapter(polar_settings, trainer_model_dir, tmp_path):
    _publish(polar_settings, [_traj(f"l{i}", 0, 1.0, [50, 51, 52, 53]) for i in range(4)])
    cfg = _cfg(trainer_model_dir, tmp_path / "run", lora_rank=4, lora_alpha=8)
    summary = sft(cfg, polar_settings, SftSpec(rows_per_step=2, checkpoint_url=f"{polar_settings.checkpoint_url}/lora"))
    assert summary["step"] == 2
    info = checkpoint.latest(f"{polar_settings.checkpoint_url}/lora", polar_settings)
    assert "adapter_config.json" in info.manifest["files"]  # the adapter (PEFT's layout), not the weights
    nll = [r["metrics"]["nll"] for r in read_log(tmp_path / "run" / "sft.jsonl") if r["event"] == "step"]
    assert nll[-1] < nll[0], nll


def test_sft_under_torchrun_shards_the_model_with_fsdp2(polar_settings, trainer_model_dir, tmp_path):
    digests = _publish(polar_settings, [_traj(f"f{i}", 0, 1.0, [50, 51, 52]) for i in range(4)])
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "polarstream", "sft", "--model", str(trainer_model_dir),
           "--rows-per-step", "2", "--run-dir", str(tmp_path / "run"), "--lr", "1e-3", "--token-budget", "256",
           "--set", "poll_timeout_s=0.2", "--set", "progress=false", "--set", "tensorboard=false"]
    env = {**os.environ, **settings_env(polar_settings), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    records = read_log(tmp_path / "run" / "sft.jsonl")
    assert [d for r in records if r["event"] == "step" for d in r["rows"]] == digests
    assert (records[0]["world_size"], records[0]["strategy"]) == (2, "fsdp")  # rank 0 read Kafka, both trained
    info = checkpoint.latest(f"{polar_settings.checkpoint_url}/sft", polar_settings)
    assert info.step == 2 and any(f.startswith("train_state/") for f in info.manifest["files"])
