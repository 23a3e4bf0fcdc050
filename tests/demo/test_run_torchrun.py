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

from polarstream.demo import arith
from schemas import HarnessSpec

from .test_run_resume import _env, _tail

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _experiment(tmp_path: Path) -> Path:
    from infra.models import ensure_model

    train, _ = arith.split(0)
    rows = [arith.task_request(q, a, task_id=f"train-{i}", num_samples=1, harness=HarnessSpec(name="builtin")).model_dump_json()
            for i, (q, a) in enumerate(train[:4])]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
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
