"""Issue 76: a run as one Slurm job on a real (one-node) Slurm cluster, submitted with sbatch by
``polarstream run --launcher slurm --render DIR --submit``: run to completion; then the same tasks and seed
with a trainer of two processes (torchrun in its step), that step cancelled mid-run (``scancel JOB.STEP``)
and started again by the job, then the whole job cancelled and its script submitted again: the run resumes
from the topics and the checkpoint to the same end: every step trains the tasks the uninterrupted run
trained, every group once, and no process outlives any of the jobs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from polarstream.demo import arith
from schemas import HarnessSpec

from ..demo.test_run_resume import _env, _tail
from ..demo.test_run_torchrun import _alive  # none of a finished job's processes may outlive it

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS, GROUPS, SAMPLES = 4, 2, 2


def _experiment(tmp_path: Path, name: str, **more) -> Path:
    from infra.models import ensure_model

    train, _ = arith.split(0)
    rows = [arith.task_request(q, a, task_id=f"train-{i}", num_samples=1, harness=HarnessSpec(name="builtin")).model_dump_json()
            for i, (q, a) in enumerate(train[:6])]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    exp = {"name": "slurmed", "model": str(ensure_model("tiny")), "train": "train.jsonl", "eval": "",
           "harness_config": {"max_tokens": 12, "max_turns": 1}, "runtime": "subprocess", "group_size": SAMPLES,
           "groups_per_step": GROUPS, "max_steps": STEPS, "seed": 3, "step_timeout_s": 240, **more}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _submit(slurm, infra, exp: Path, job_dir: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "polarstream", "run", str(exp), "--launcher", "slurm",
                           "--render", str(job_dir), "--submit"],
                          env={**_env(infra), "SLURM_CONF": slurm.env["SLURM_CONF"]}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    found = re.search(r"submitted: job (\d+)", done.stdout)
    assert found, done.stdout
    return found.group(1)


def _state(slurm, job: str) -> str:
    out = slurm.run("scontrol", "show", "job", job, check=False).stdout
    found = re.search(r"JobState=(\S+)", out)
    return found.group(1) if found else "GONE"


def _wait_done(slurm, job: str, job_dir: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while (state := _state(slurm, job)) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout}s:\n{_logs(job_dir, job)}"
        time.sleep(1)
    exit_code = re.search(r"ExitCode=(\S+)", slurm.run("scontrol", "show", "job", job).stdout).group(1)
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"job {job}: {state} {exit_code}\n{_logs(job_dir, job)}"


def _logs(job_dir: Path, job: str) -> str:
    parts = [f"--- slurm-{job}.out\n{_tail(job_dir / f'slurm-{job}.out')}"]
    parts += [f"--- {log.name}\n{_tail(log)}" for log in sorted((job_dir / "logs").glob("*.log"))]
    return "\n".join(parts)


def _trained(job_dir: Path) -> dict[int, list[str]]:
    """Each step's groups (by event id), as the step that survived trained them (the trainer's log)."""
    steps: dict[int, list[str]] = {}
    try:
        lines = (job_dir / "trainer" / "train.jsonl").read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        event = json.loads(line)
        if event.get("event") == "step":
            steps[event["step"]] = event["groups"]
    return steps


def _tasks_per_step(infra, exp: Path, job_dir: Path) -> dict[int, list[str]]:
    """Each trained step's tasks (the file's own task ids), read back from the run's topics."""
    from infra.settings import Settings
    from polarstream.driver.configure import run_id
    from polarstream.driver.experiment import load_experiment
    from producers.kafka_read import merged, plan_spans
    from schemas import TaskRequest, TrainingGroup, decode
    from schemas.records import RECORD_BY_TOPIC

    rid = run_id(load_experiment(exp), job_dir.absolute())
    settings = Settings(kafka_bootstrap=infra.settings.kafka_bootstrap, topic_prefix=f"{rid}.")
    groups, sources = {}, {}
    for m in merged(settings, plan_spans(settings, ("tasks", "groups"))):
        rec = decode(m.value, RECORD_BY_TOPIC[m.topic])
        if isinstance(rec, TaskRequest):
            sources[rec.task_id] = rec.metadata["source_task_id"]
        elif isinstance(rec, TrainingGroup):
            groups[rec.event_id] = rec
    trained = _trained(job_dir)
    events = [e for step in trained.values() for e in step]
    assert len(events) == len(set(events)), f"a group was trained twice: {trained}"
    return {step: sorted(sources[groups[e].group_id] for e in events) for step, events in trained.items()}


@pytest.mark.timeout(1500)
def test_a_run_submitted_with_sbatch_completes_and_resumes_after_its_trainer_step_is_cancelled(slurm, infra, tmp_path):
    exp = _experiment(tmp_path, "one")

    # 1: the run, through sbatch, to completion
    first = tmp_path / "first"
    job = _submit(slurm, infra, exp, first)
    _wait_done(slurm, job, first)
    assert not _alive(str(first).encode()), "a process of the finished job is still running"
    summary = json.loads((first / "run-summary.json").read_text())
    assert len(summary["reward_per_step"]) == STEPS
    uninterrupted = _tasks_per_step(infra, exp, first)
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))
    assert all(len(tasks) == GROUPS for tasks in uninterrupted.values()), uninterrupted

    # 2: the same tasks with a trainer of 2 processes (torchrun in its step); that step cancelled once it
    # has trained a step, the run resumed by the job
    ranks = _experiment(tmp_path, "ranks", trainer={"nproc": 2, "dist_timeout_s": 240})
    second = tmp_path / "second"
    job = _submit(slurm, infra, ranks, second)
    assert "torchrun --standalone --nproc-per-node 2" in (second / "run.sbatch").read_text()
    deadline = time.monotonic() + 600
    while not _trained(second):
        assert _state(slurm, job) in ("PENDING", "RUNNING", "CONFIGURING"), _logs(second, job)
        assert time.monotonic() < deadline, f"no step trained in 600s:\n{_logs(second, job)}"
        time.sleep(0.5)
    steps = dict(line.split() for line in slurm.run("squeue", "-h", "-s", "-j", job, "-o", "%i %j").stdout.splitlines())
    trainer = next(step for step, name in steps.items() if name == "trainer")
    slurm.run("scancel", trainer)
    # then the whole job, once the trainer started again has trained a step: the same script submitted again
    # continues the run (the driver reads where it stands from the topics, the trainer from its checkpoint)
    while len(_trained(second)) < 2:
        assert _state(slurm, job) in ("PENDING", "RUNNING", "CONFIGURING"), _logs(second, job)
        assert time.monotonic() < deadline, f"no second step trained in 600s:\n{_logs(second, job)}"
        time.sleep(0.5)
    assert "trainer step ended (attempt 0); starting it again" in (second / f"slurm-{job}.out").read_text()
    slurm.run("scancel", job)
    while _state(slurm, job) in ("RUNNING", "COMPLETING"):
        time.sleep(0.5)
    assert _state(slurm, job) == "CANCELLED"
    job = slurm.run("sbatch", "--parsable", str(second / "run.sbatch")).stdout.strip()
    _wait_done(slurm, job, second)
    assert "resuming " in (second / f"slurm-{job}.out").read_text()
    assert not _alive(str(second).encode()), "a process of the finished job is still running"
    assert len(json.loads((second / "run-summary.json").read_text())["reward_per_step"]) == STEPS
    # the same end: every step trained the uninterrupted run's tasks, each group once
    assert _tasks_per_step(infra, ranks, second) == uninterrupted
