"""Issue 62: `polarstream run` of tasks as published, each bringing its image (environment/Dockerfile).

The demo's arith family written as Harbor task directories (polarstream/demo/image_tasks.py) is run as a
user's experiment with ``runtime: auto``: the driver hands the node ``auto``, which runs every session in a
container of the tasks' image (podman), built once for all of them. Two steps of two groups of two with the
untrained tiny model: the rewards are whatever it scores (mostly 0); what is checked is that the sessions ran
in containers (the node's runtime, the image build timed in the sessions' metrics, no container left) and
that the trainer stepped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from polarstream.demo.image_tasks import write_tasks

from .test_run_resume import _env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _records(infra, topic: str, prefix: str) -> list[dict]:
    r = subprocess.run([sys.executable, "-m", "polarstream", "cat", topic, "--prefix", prefix], env=_env(infra),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


@pytest.mark.timeout(300)
def test_image_tasks_run_in_containers_of_their_image_and_the_trainer_steps(infra, tmp_path, podman_base):
    train, _ = write_tasks(tmp_path / "tasks", seed=0, n=4)
    # a Dockerfile of this test's own (a comment: the same layers, cached), so its image is built in this
    # run and the build shows in the sessions' metrics
    mark = f"# test {uuid.uuid4().hex}\n"
    for dockerfile in train.glob("*/environment/Dockerfile"):
        dockerfile.write_text(dockerfile.read_text() + mark)
    exp = {"name": "image-arith", "model": "tiny", "train": "tasks/train", "eval": "", "harness": "builtin",
           "harness_config": {"max_tokens": 12, "max_turns": 1}, "runtime": "auto", "group_size": 2,
           "groups_per_step": 2, "max_steps": 2, "seed": 0, "step_timeout_s": 180}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "polarstream", "run", "exp.yaml", "--run-dir", str(run_dir)], cwd=tmp_path,
                       env=_env(infra), capture_output=True, text=True, timeout=280)
    try:
        assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        summary = json.loads((run_dir / "demo-summary.json").read_text())
        assert summary["steps"] == 2 and summary["policy_version"] == 2, summary  # one weight push per step
        assert [s["samples"] for s in summary["per_step"]] == [4, 4], summary["per_step"]
        node_log = (run_dir / "logs" / "node.log").read_text()
        assert ", runtime auto," in node_log, node_log[-2000:]
        finished = [e for e in _records(infra, "session-events", summary["topic_prefix"]) if e["kind"] == "finished"]
        assert len(finished) >= 8 and all(e["status"] == "ok" for e in finished), finished
        # every session opened a container of the image (which one built it, the rest found it or waited)
        assert all("image_build_s" in e["metrics"] for e in finished) and max(e["metrics"]["image_build_s"] for e in finished) > 0
        assert all(e["metrics"].get("reward_file") == 1.0 for e in finished)  # the verifier's reward.txt
        left = subprocess.run(["podman", "ps", "-a", "--format", '{{index .Labels "io.polarstream.owner"}}'],
                              capture_output=True, text=True, timeout=60).stdout.split()
        assert not [o for o in left if o.startswith(str(run_dir))], left  # each session's container removed
    finally:
        _remove_own_image(train)


def _remove_own_image(train: Path) -> None:
    """Remove the image this test's unique Dockerfile built (images.py tags it by its context's hash)."""
    from gateway.runtimes.images import context_files, task_tag
    from producers.tasks import harbor_task

    env = harbor_task(next(train.iterdir())).environment
    subprocess.run(["podman", "rmi", "-f", task_tag(context_files(env))], capture_output=True,
                   timeout=120)
