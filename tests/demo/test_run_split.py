"""One experiment file, a run spread over "machines" (here: processes with run dirs of their own): the
stream worker, trainer and rollout server started first with ``--only``, the engine and gateway node after
them, and the driver with ``--driver-only``. Nothing is started in order: the trainer waits for the
engine and gateway node the file names, saying so, and the run trains its steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from infra.process import free_port
from polarstream.demo import arith
from schemas import HarnessSpec

from .test_run_resume import _env, _tail

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def write_train_tasks(tmp_path: Path) -> None:
    """Four arith tasks of one sample each as ``train.jsonl`` beside the experiment file."""
    train, _ = arith.split(0)
    rows = [arith.task_request(q, a, task_id=f"train-{i}", num_samples=1, harness=HarnessSpec(name="builtin")).model_dump_json()
            for i, (q, a) in enumerate(train[:4])]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")


def _experiment(tmp_path: Path) -> Path:
    from infra.models import ensure_model

    write_train_tasks(tmp_path)
    urls = {f"{name}_url": f"http://127.0.0.1:{free_port()}" for name in ("engine", "gateway", "rollout")}
    exp = {"name": "split", "run_id": f"split-{uuid.uuid4().hex[:6]}", "model": str(ensure_model("tiny")),
           "train": "train.jsonl", "eval": "", "harness_config": {"max_tokens": 12, "max_turns": 1}, "runtime": "subprocess",
           "group_size": 2, "groups_per_step": 2, "max_steps": 2, "seed": 1, "step_timeout_s": 180, **urls}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


@pytest.mark.timeout(600)
def test_a_run_spread_over_machines_from_one_file_started_in_any_order(infra, tmp_path):
    exp, env = _experiment(tmp_path), _env(infra)
    started: list[tuple[subprocess.Popen, Path]] = []

    def polarstream(*args: str, where: str) -> subprocess.Popen:
        log = tmp_path / f"{where}.log"
        p = subprocess.Popen([sys.executable, "-m", "polarstream", "run", str(exp), "--run-dir", str(tmp_path / where), *args],
                             env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        started.append((p, log))
        return p

    def wait_for(what: str, log: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while what not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"exited ({proc.returncode}) before {what!r}:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"no {what!r} within {timeout}s:\n{_tail(log)}"
            time.sleep(0.2)

    try:
        b = polarstream("--only", "streams,trainer,rollout", where="b")  # before the engine it trains for
        wait_for("Ctrl-C stops them", tmp_path / "b.log", b)
        a = polarstream("--only", "engine,node", where="a")
        wait_for("Ctrl-C stops them", tmp_path / "a.log", a)
        driver = polarstream("--driver-only", where="driver")
        assert driver.wait(timeout=400) == 0, _tail(tmp_path / "driver.log")
        summary = json.loads((tmp_path / "driver" / "run-summary.json").read_text())
        assert len(summary["reward_per_step"]) == 2 and summary["run_id"] == yaml.safe_load(exp.read_text())["run_id"]
        # the trainer came up before the engine: it waited for it, said so, and then trained both steps
        trainer_log = (tmp_path / "b" / "logs" / "trainer.log").read_text(errors="replace")
        assert "waiting up to 60s: cannot reach the engine" in trainer_log, trainer_log[-2000:]
        steps = [json.loads(line) for line in (tmp_path / "b" / "trainer" / "train.jsonl").read_text().splitlines()
                 if '"event": "step"' in line]
        assert [s["step"] for s in steps] == [1, 2]
        # the driver has no access to the trainer's run dir, yet each step's sync is the one the trainer
        # logged there: it came over polar.policy (each version published again once the engine served it)
        logged = {json.loads(line)["policy_version"]: json.loads(line) for line in
                  (tmp_path / "b" / "trainer" / "train.jsonl").read_text().splitlines() if '"event": "sync"' in line}
        per_step = json.loads((tmp_path / "driver" / "demo-summary.json").read_text())["per_step"]
        assert [(s["sync_s"], s["sync_mode"]) for s in per_step] == [
            (logged[s["step"] + 1]["sync_s"], "broadcast") for s in per_step], (per_step, logged)
        children = {w: json.loads((tmp_path / w / "components.json").read_text())["children"] for w in ("a", "b")}
        assert set(children["a"]) == {"engine", "node"} and set(children["b"]) == {"streams", "trainer", "rollout"}
        # A deployment stops each part with SIGTERM: each stops what it started. (Not SIGINT: a background
        # job of a non-interactive shell, as CI may run the suite, inherits SIGINT ignored.)
        for p, log in started[:2]:
            os.killpg(p.pid, signal.SIGTERM)
            assert p.wait(timeout=60) == 128 + signal.SIGTERM, _tail(log)
        for child in [*children["a"].values(), *children["b"].values()]:
            with pytest.raises(ProcessLookupError):
                os.kill(child["pid"], 0)
    finally:
        for p, _ in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for w in ("a", "b"):
            try:
                for child in json.loads((tmp_path / w / "components.json").read_text())["children"].values():
                    os.killpg(child["pid"], signal.SIGKILL)
            except (OSError, ProcessLookupError, ValueError):
                pass
