"""`polarstream run` with ``trainer: {nproc: 2}``: the driver starts the trainer under torchrun (2 gloo ranks,
FSDP2) with the rest of the run on the real broker and S3 server, and the run trains its steps to the end,
each step's weights brought to the engine, and every process of it gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from .test_run_resume import _env, _tail
from .test_run_split import write_train_tasks

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _experiment(tmp_path: Path) -> Path:
    from infra.models import ensure_model

    write_train_tasks(tmp_path)
    exp = {"name": "ranks", "run_id": f"ranks-{uuid.uuid4().hex[:6]}", "model": str(ensure_model("tiny")),
           "train": "train.jsonl", "eval": "", "harness_config": {"max_tokens": 12, "max_turns": 1}, "runtime": "subprocess",
           "group_size": 2, "groups_per_step": 2, "max_steps": 2, "seed": 1, "step_timeout_s": 240,
           "trainer": {"nproc": 2, "dist_timeout_s": 240}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _alive(marker: bytes) -> list[int]:
    """Processes whose command line holds ``marker`` (this run's own directory): none may outlive the run."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


@pytest.mark.timeout(600)
def test_a_run_starts_its_trainer_of_two_processes_under_torchrun(infra, tmp_path):
    exp, out = _experiment(tmp_path), tmp_path / "run"
    log = tmp_path / "run.log"
    with open(log, "wb") as f:
        proc = subprocess.run([sys.executable, "-m", "polarstream", "run", str(exp), "--run-dir", str(out)],
                              env=_env(infra), stdout=f, stderr=subprocess.STDOUT, timeout=540)
    assert proc.returncode == 0, _tail(log) + "\n--- trainer:\n" + _tail(out / "logs" / "trainer.log")
    records = [json.loads(line) for line in (out / "trainer" / "train.jsonl").read_text().splitlines()]
    start = next(r for r in records if r.get("event") == "start")
    assert (start["world_size"], start["strategy"]) == (2, "fsdp")
    assert [r["step"] for r in records if r.get("event") == "step"] == [1, 2]
    summary = json.loads((out / "demo-summary.json").read_text())
    assert summary["policy_version"] == 2 and len(summary["reward_per_step"]) == 2
    for step in summary["per_step"]:  # each step's weights reached the engine, as from one process
        assert step["sync_mode"] is not None and step["sync_s"] > 0, step
    # the driver started torchrun, torchrun the ranks (sessions of their own): the driver's stop reached them all
    assert _alive(str(out).encode()) == []


@pytest.mark.timeout(600)
def test_a_trainer_of_two_machines_meets_at_node_0s_rendezvous(infra, tmp_path):
    """``trainer: {nodes: 2}``: each "machine" (a process with a run dir of its own) starts its trainer with
    --only trainer and its --node-rank, the rest of the run as test_run_split spreads it; the two torchruns
    meet at node 0's rendezvous and train the run's steps as one trainer of 2 ranks."""
    import os
    import signal
    import time

    from infra.process import free_port

    path = _experiment(tmp_path)
    exp = yaml.safe_load(path.read_text())
    exp["trainer"] = {"nproc": 1, "nodes": 2, "rendezvous": f"127.0.0.1:{free_port()}", "dist_timeout_s": 240}
    exp.update({f"{name}_url": f"http://127.0.0.1:{free_port()}" for name in ("engine", "gateway", "rollout")})
    path.write_text(yaml.safe_dump(exp))
    env, started = _env(infra), []

    def polarstream(*args: str, where: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "polarstream", "run", str(path), "--run-dir", str(tmp_path / where), *args],
                             env=env, stdout=open(tmp_path / f"{where}.log", "ab"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        started.append((p, where))
        return p

    try:
        for where, args in (("a", ("--only", "engine,node")), ("b", ("--only", "streams,trainer,rollout")),
                            ("c", ("--only", "trainer", "--node-rank", "1"))):
            p = polarstream(*args, where=where)
            deadline = time.monotonic() + 240
            while "Ctrl-C stops them" not in (tmp_path / f"{where}.log").read_text(errors="replace"):
                assert p.poll() is None and time.monotonic() < deadline, _tail(tmp_path / f"{where}.log")
                time.sleep(0.2)
        driver = polarstream("--driver-only", where="driver")
        assert driver.wait(timeout=420) == 0, (_tail(tmp_path / "driver.log") + "\n--- node 0:\n"
                                               + _tail(tmp_path / "b" / "logs" / "trainer.log") + "\n--- node 1:\n"
                                               + _tail(tmp_path / "c" / "logs" / "trainer.log"))
        records = [json.loads(line) for line in (tmp_path / "b" / "trainer" / "train.jsonl").read_text().splitlines()]
        start = next(r for r in records if r.get("event") == "start")
        assert (start["world_size"], start["strategy"]) == (2, "fsdp")  # one rank on each machine
        assert [r["step"] for r in records if r.get("event") == "step"] == [1, 2]
        assert not (tmp_path / "c" / "trainer" / "train.jsonl").exists()  # rank 0 alone writes the run's record
        assert json.loads((tmp_path / "driver" / "run-summary.json").read_text())["steps"] == 2
    finally:
        for p, where in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p, where in started:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    assert _alive(str(tmp_path).encode()) == []  # every machine's part stopped what it started, ranks included
