"""torchrun with 2 CPU processes (gloo, FSDP2): the same update as one process on the same groups.

Issue 6: this test once hung past its 300 s limit in CI. Hangs now fail fast from inside: every
collective gives up after ``dist_timeout_s`` (a traceback names it), and on the outer limit the test
makes every process of the run print its Python stacks (SIGABRT with PYTHONFAULTHANDLER) and kills
the whole process group, so no orphaned rank outlives the test. The second half of the groups is
published only while rank 0 waits for it, so the other rank's wait rides on rank 0's heartbeats.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.weights import read_checkpoint
from polarstream.driver.processes import children_of  # torchrun starts each rank in a session of its own
from tests.plugins.trainer import make_group, publish_groups, settings_env
from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.metrics import effective_steps, read_log
from trainer.train import train

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# idle_timeout_s is only a safety net here (max_steps ends both runs): long, so that a slow broker on a
# loaded machine never splits a step. dist_timeout_s bounds every collective of the torchrun run.
COMMON = dict(groups_per_step=3, max_steps=2, token_budget=16, lr=1e-3, idle_timeout_s=60.0, poll_timeout_s=0.2,
              progress=False, tensorboard=False, sync_every=0, max_staleness=100, dist_timeout_s=60.0,
              heartbeat_s=0.5)
LIMIT_S = 240


def _weights(url, settings):
    return read_checkpoint(url, settings)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)  # each is the leader of its own process group
        except ProcessLookupError:
            pass


def _run_torchrun(cmd, env, out_path: Path, step_one_saved, later) -> int:
    """Run ``cmd`` (output to ``out_path``); ``later()`` 2 s after ``step_one_saved()`` (rank 0 is then
    waiting for step 2's groups). Past LIMIT_S every process prints its Python stacks (SIGABRT with
    PYTHONFAULTHANDLER) into the output and is killed; nothing outlives the test."""
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=out, stderr=subprocess.STDOUT,
                                cwd=Path(__file__).parents[2], start_new_session=True)
    deadline = time.monotonic() + LIMIT_S
    try:
        while proc.poll() is None and not step_one_saved() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)  # rank 0 is now waiting for step 2 (heartbeats every 0.5 s)
        later()
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        everyone = [proc.pid, *children_of(proc.pid)]  # before torchrun dies and its ranks lose their parent
        _signal_all(everyone, signal.SIGABRT)
        time.sleep(3)
        _signal_all(everyone, signal.SIGKILL)
        raise AssertionError(f"torchrun still running after {LIMIT_S}s; stacks:\n{out_path.read_text()[-12000:]}") from None
    finally:
        if proc.poll() is None:  # an error in this test, not in the run
            _signal_all([proc.pid, *children_of(proc.pid)], signal.SIGKILL)
        proc.wait()


def test_torchrun_two_processes_matches_one_process(polar_settings, trainer_model_dir, tmp_path):
    # one partition -> both runs read the groups in the same order; varied lengths so the token budget
    # splits each step into several micro-batches, unevenly per rank
    groups = [make_group(f"d{i}", [[50 + i] * (3 + i), [60 + i, 61]], [1.0, 0.0]) for i in range(6)]
    publish_groups(polar_settings, groups[:3], partition=0)

    ddp = polar_settings.model_copy(update={"storage_url": polar_settings.storage_url + "/ddp"})
    env = {**os.environ, **settings_env(ddp), "OMP_NUM_THREADS": "1"}
    sets = [a for k, v in COMMON.items() if k not in ("groups_per_step", "max_steps", "token_budget", "lr")
            for a in ("--set", f"{k}={v}")]
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "trainer", "--model", str(trainer_model_dir),
           "--groups-per-step", "3", "--max-steps", "2", "--token-budget", "16", "--lr", "1e-3",
           "--run-dir", str(tmp_path / "ddp"), "--set", "consumer_group=ddp", *sets]
    saved = lambda: getattr(checkpoint.latest(ddp.checkpoint_url, ddp), "step", 0) >= 1  # noqa: E731
    out = tmp_path / "torchrun.out"
    code = _run_torchrun(cmd, env, out, saved, lambda: publish_groups(polar_settings, groups[3:], partition=0))
    assert code == 0, out.read_text()[-6000:]

    single = polar_settings.model_copy(update={"storage_url": polar_settings.storage_url + "/single"})
    cfg = TrainConfig.from_overrides({**COMMON, "model": str(trainer_model_dir), "consumer_group": "single",
                                      "run_dir": str(tmp_path / "single")})
    train(cfg, single)

    starts = [r for r in read_log(tmp_path / "ddp" / "train.jsonl") if r.get("event") == "start"]
    assert (starts[0]["world_size"], starts[0]["strategy"]) == (2, "fsdp")
    one = effective_steps(read_log(tmp_path / "single" / "train.jsonl"))
    two = effective_steps(read_log(tmp_path / "ddp" / "train.jsonl"))
    assert len(one) == len(two) == 2
    assert [sorted(s["groups"]) for s in one] == [sorted(s["groups"]) for s in two]  # same groups per step
    assert two[1]["metrics"]["wait_s"] >= 1.0  # rank 1 waited on rank 0's heartbeats (every 0.5 s) meanwhile
    assert all(s["metrics"]["microbatches"] >= 3 for s in two)
    for m1, m2 in ((x["metrics"], y["metrics"]) for x, y in zip(one, two)):  # Adam hides gradient scale; these do not
        for key in ("grad_norm", "loss", "trained_tokens", "clip_frac"):
            assert abs(m1[key] - m2[key]) <= 1e-4 * max(1.0, abs(m1[key])), (key, m1[key], m2[key])

    a = _weights(checkpoint.latest(single.checkpoint_url, single).url, single)
    b = _weights(checkpoint.latest(ddp.checkpoint_url, ddp).url, ddp)
    base = load_file(Path(trainer_model_dir) / "model.safetensors")
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], base[k]) for k in a)  # training moved the weights
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
