"""Issue 49's kill test: ``polarstream run`` SIGKILLed three times and its trainer once, during one run
(~60 s alone); after the third kill ``--driver-only`` finishes it, driving the components left running.

The same command, run again after each kill, continues from what Kafka and the checkpoints hold: it adopts
the components the killed driver left running, sends only what never reached polar.tasks, and the trainer
started again resumes from its checkpoint. The run must train exactly the tasks an uninterrupted run
trains (``step_batches``: the draws are a function of the seed and the step, pinned to the demo's own
order by tests/producers/test_driver.py), fan every task out once, and still evaluate at its steps.

It runs with ``zero_signal: replace`` and a cap of 0: the untrained tiny model never solves a task, so the
trainer drops every step's own groups (they have no signal) and the driver sends a replacement for each,
which, past the cap, is trained masked. So the kills also land between a drop and its replacement, and a
restarted driver must send exactly the replacements still due. It also retires every task whose last group
was unsolved (``retire: unsolved``, after 1): each step then skips the tasks earlier steps tried, until
all are retired and the filter stands aside, and a restarted driver must draw what the uninterrupted run
drew from the retired sets of its own time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from polarstream.demo import arith
from polarstream.driver.schedule import step_batches
from schemas import HarnessSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS, GROUPS, SAMPLES, CAP = 4, 2, 2, 0


def _env(infra) -> dict[str, str]:
    s = infra.settings
    return {**os.environ, "POLAR_KAFKA_BOOTSTRAP": s.kafka_bootstrap, "POLAR_KAFKA_PORT": str(s.kafka_port),
            "POLAR_KAFKA_CONTROLLER_PORT": str(s.kafka_controller_port), "POLAR_S3_PORT": str(s.s3_port),
            "POLAR_DATA_DIR": str(s.data_dir), "POLAR_CACHE_DIR": str(s.cache_dir), "POLAR_TOPIC_PREFIX": "",
            "POLAR_STORAGE_URL": ""}


def _experiment(tmp_path: Path) -> Path:
    from infra.models import ensure_model

    train, heldout = arith.split(0)
    harness = HarnessSpec(name="builtin")
    for name, problems in (("train.jsonl", train[:6]), ("eval.jsonl", heldout[:2])):
        rows = [arith.task_request(q, a, task_id=f"{name[:-6]}-{i}", num_samples=1, harness=harness).model_dump_json()
                for i, (q, a) in enumerate(problems)]
        (tmp_path / name).write_text("\n".join(rows) + "\n")
    exp = {"name": "killed", "model": str(ensure_model("tiny")), "train": "train.jsonl", "eval": "eval.jsonl",
           "harness_config": {"max_tokens": 12, "max_turns": 1}, "runtime": "subprocess", "group_size": SAMPLES,
           "groups_per_step": GROUPS, "max_steps": STEPS, "eval_every": 2, "eval_samples": 1, "seed": 5,
           "step_timeout_s": 180, "zero_signal": "replace", "replace_cap": CAP,
           "retire": "unsolved", "retire_after": 1}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _trained_steps(run_dir: Path) -> int:
    try:
        lines = (run_dir / "trainer" / "train.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(line).get("step", 0) for line in lines if '"event": "step"' in line), default=0)


@pytest.mark.timeout(900)
def test_a_run_killed_three_times_and_its_trainer_once_trains_what_an_uninterrupted_run_trains(infra, tmp_path):
    from infra.settings import Settings
    from polarstream.driver.configure import run_id
    from polarstream.driver.experiment import load_experiment
    from polarstream.driver.schedule import Curriculum, outcome, replacement, retired, zero_signal_wish
    from producers.kafka_read import merged, plan_spans
    from schemas import SessionAssigned, TaskRequest, TrainingGroup, decode
    from schemas.records import RECORD_BY_TOPIC

    exp_path, run_dir = _experiment(tmp_path), tmp_path / "run"
    env = _env(infra)
    cmd = [sys.executable, "-m", "polarstream", "run", str(exp_path), "--run-dir", str(run_dir)]

    def start() -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, stdout=open(tmp_path / "driver.log", "ab"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def wait_until(what: str, ok, driver: subprocess.Popen, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert driver.poll() is None, f"the driver exited ({driver.returncode}) before {what}:\n{_tail(tmp_path / 'driver.log')}"
            assert time.monotonic() < deadline, f"no {what} within {timeout}s:\n{_tail(tmp_path / 'driver.log')}"
            time.sleep(0.2)

    driver = start()
    try:
        # 1: killed once the first step is trained (the eval of version 0 and step 1 went out before)
        wait_until("step 1", lambda: _trained_steps(run_dir) >= 1, driver)
        driver.kill(), driver.wait()
        driver = start()
        # the trainer, killed mid-run: the driver starts it again and it resumes from its checkpoint
        wait_until("step 2", lambda: _trained_steps(run_dir) >= 2, driver)
        components = json.loads((run_dir / "components.json").read_text())["children"]
        os.killpg(components["trainer"]["pid"], signal.SIGKILL)
        # 2: killed once the step after the trainer's restart is trained
        wait_until("step 3", lambda: _trained_steps(run_dir) >= 3, driver)
        driver.kill(), driver.wait()
        driver = start()
        # 3: killed as soon as it has read the run back from the topics, while it goes on from there
        wait_until("the second resume", lambda: (tmp_path / "driver.log").read_text().count("resuming killed-") == 2, driver)
        driver.kill(), driver.wait()
        # the rest driven from "elsewhere": --driver-only, given the running rollout server and engine (the
        # file gains their URLs, which are not part of the run's identity: it is the same run)
        ports = json.loads((run_dir / "components.json").read_text())["ports"]
        exp = yaml.safe_load(exp_path.read_text())
        exp.update(rollout_url=f"http://127.0.0.1:{ports['rollout']}", engine_url=f"http://127.0.0.1:{ports['engine']}")
        exp_path.write_text(yaml.safe_dump(exp))
        cmd.append("--driver-only")
        driver = start()
        assert driver.wait(timeout=600) == 0, _tail(tmp_path / "driver.log")
    finally:
        if driver.poll() is None:
            driver.kill()
        _stop_components(run_dir)
    log = (tmp_path / "driver.log").read_text()
    assert log.count("resuming killed-") == 3 and "trainer exited; started it again" in log and "driving the components at" in log

    summary = json.loads((run_dir / "run-summary.json").read_text())
    assert len(summary["reward_per_step"]) == STEPS
    demo = json.loads((run_dir / "demo-summary.json").read_text())
    assert set(demo["heldout_per_eval"]) == {"before", "step 2", "after"}  # eval still ran at its steps

    # What went out and what was trained, read back from the run's topics
    exp = load_experiment(exp_path)
    rid = run_id(exp, run_dir)
    settings = Settings(kafka_bootstrap=infra.settings.kafka_bootstrap, topic_prefix=f"{rid}.")
    tasks, sessions, groups = {}, Counter(), {}
    for m in merged(settings, plan_spans(settings, ("tasks", "sessions", "groups"))):
        rec = decode(m.value, RECORD_BY_TOPIC[m.topic])
        if isinstance(rec, TaskRequest):
            assert rec.task_id not in tasks, f"task {rec.task_id} went out twice"
            tasks[rec.task_id] = rec
        elif isinstance(rec, SessionAssigned):
            sessions[rec.session_id] += 1
        elif isinstance(rec, TrainingGroup):
            groups[rec.event_id] = rec
    assert sessions and max(sessions.values()) == 1, "a session was fanned out twice"

    # The trainer's log, across its restart: each step's groups, as the step that survived trained them
    trained: dict[int, list[str]] = {}
    for line in (run_dir / "trainer" / "train.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "step":
            trained[event["step"]] = sorted(groups[e].group_id for e in event["groups"])
    assert sorted(trained) == list(range(1, STEPS + 1))
    train = [TaskRequest.model_validate_json(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    by_gid = {g.group_id: g for g in groups.values()}
    # The uninterrupted run, replayed from what came back: step k draws the next tasks of the epochs' stream
    # that were not retired by the groups of the steps before it (S = 0)
    curriculum, history, replaced = Curriculum(train, exp.seed, exp.order, GROUPS, key=lambda t: t.task_id), {}, 0
    for k in range(STEPS):
        batch = curriculum.draw(retired(history, "unsolved", 1))
        sent = sorted((int(t.rsplit("-t", 1)[1]), t) for t in tasks if t.startswith(f"{rid}-s{k:03d}-"))
        assert [tasks[t].metadata["source_task_id"] for i, t in sent if i < GROUPS] == [t.task_id for t in batch], k
        pool = [t for t in train if t.task_id not in curriculum.retired[k]]  # replacements skip the retired too
        for i, t in sent[GROUPS:]:  # replacement j = i - GROUPS: the seeded draw, asking for what the cap says
            assert tasks[t].metadata["source_task_id"] == replacement(pool, exp.seed, k, i - GROUPS).task_id
            assert tasks[t].zero_signal == zero_signal_wish(i, GROUPS, CAP)
        dropped = [t for i, t in sent if by_gid[t].no_signal and tasks[t].zero_signal == "drop"]
        assert len(sent) == GROUPS + len(dropped), f"step {k}: one replacement per dropped group, no more: {sent}"
        # the step the trainer took is the step's groups less those it dropped: what an uninterrupted run trains
        assert trained[k + 1] == sorted(t for _, t in sent if t not in dropped), k
        replaced += len(dropped)
        for _, t in sent:
            history.setdefault(tasks[t].metadata["source_task_id"], []).append(outcome([x.reward for x in by_gid[t].trajectories]))
    assert replaced > 0 and summary["zero_signal_groups"]["replaced"] == replaced
    # the filter did skip tasks: seed 5's plain epochs would draw, at steps 1 and 2, tasks that step 0 (its own
    # and its replacements, all unsolved) retired; and the run reports what it retired
    assert curriculum.batches != step_batches(train, exp.seed, STEPS, GROUPS, exp.order)
    assert sorted(summary["retired"]) == sorted(retired(history, "unsolved", 1)) != []


def _stop_components(run_dir: Path) -> None:
    """What a driver killed last left running (a passing run stopped it all and removed the file)."""
    try:
        children = json.loads((run_dir / "components.json").read_text())["children"]
    except OSError:
        return
    for child in children.values():
        try:
            os.killpg(child["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
