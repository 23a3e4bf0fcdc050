"""Issue 62: the runtime an experiment's tasks need is checked before anything starts (configure.py).

A task that brings an image (a Harbor task's environment/Dockerfile) runs in a container: ``runtime: auto``
hands the node ``auto`` (podman or docker for those, bwrap for the rest), and a run whose image tasks no
installed engine can run, or whose runtime runs no image, is refused in one line. Which programs are
installed is faked by PATH: a folder of empty scripts named as they are.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from polarstream.cli import app
from polarstream.demo.image_tasks import write_tasks
from polarstream.driver.configure import _runtime
from polarstream.driver.experiment import ExperimentError
from producers.tasks import load_tasks
from schemas import TaskRequest

CODING = Path(__file__).parents[2] / "examples" / "coding"


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """``installed("podman", "bwrap")``: PATH holds exactly those programs (and nothing else)."""

    def put(*names: str) -> None:
        bin_dir = tmp_path / "bin"
        shutil.rmtree(bin_dir, ignore_errors=True)
        bin_dir.mkdir()
        for name in names:
            (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
            (bin_dir / name).chmod(0o755)
        monkeypatch.setenv("PATH", str(bin_dir))

    return put


@pytest.fixture(scope="module")
def image_tasks(tmp_path_factory) -> list[TaskRequest]:
    train, held = write_tasks(tmp_path_factory.mktemp("image-tasks"), seed=0, n=3)
    return [*load_tasks(train), *load_tasks(held)]  # 3 train, 1 held out


PLAIN = TaskRequest(task_id="plain", instruction="x")  # runs anywhere, even unsandboxed
PLACED = load_tasks(CODING / "fix-word-count")[0]  # a Harbor task with a workspace/: needs bwrap for /app


def test_the_generated_tasks_bring_one_image_and_the_demos_instruction_and_test(image_tasks):
    from polarstream.demo import arith

    assert {t.workspace.kind for t in image_tasks} == {"image"} and {t.workspace.mount for t in image_tasks} == {"/app"}
    assert len({t.environment.model_dump_json() for t in image_tasks}) == 1  # one context: built once
    task = image_tasks[0]
    assert task.task_id == "add-1-1" and task.instruction == arith.instruction("1 + 1")
    assert "/logs/verifier/reward.txt" in task.evaluator.tests["test.sh"] and "= 2 ]" in task.evaluator.tests["test.sh"]


def test_auto_hands_the_node_auto_for_image_tasks_and_what_it_always_did_for_the_rest(installed, image_tasks):
    installed("podman", "bwrap")
    assert _runtime("auto", image_tasks) == "auto"
    assert _runtime("auto", [*image_tasks, PLACED, PLAIN]) == "auto"  # the node's AutoRuntime: bwrap for those two
    assert _runtime("auto", [PLACED, PLAIN]) == "bwrap"  # no image: the node gets bwrap, as before
    assert _runtime("podman", image_tasks) == "podman"
    installed("docker")
    assert _runtime("auto", image_tasks) == "auto"  # the node's auto picks docker
    assert _runtime("auto", [PLAIN]) == "subprocess"  # neither bwrap nor an image: unsandboxed, as before
    installed()
    assert _runtime("auto", [PLAIN]) == "subprocess"


@pytest.mark.parametrize("runtime, have, tasks, words", [
    ("auto", ("bwrap",), "images", "runtime: 4 tasks bring an image (environment/Dockerfile) and neither podman nor "
                                   "docker is installed here; `make system` installs podman"),
    ("auto", (), "one", "runtime: task add-1-1 brings an image (environment/Dockerfile) and neither podman nor docker"),
    ("bwrap", ("bwrap", "podman"), "images", "runtime: bwrap runs no image, and 4 tasks bring an image "
                                             "(environment/Dockerfile); set runtime: auto"),
    ("subprocess", ("podman",), "images", "runtime: subprocess runs no image, and 4 tasks bring an image"),
    ("podman", ("bwrap",), "images", "runtime: podman is not installed here; `make system` installs podman"),
    ("docker", ("podman",), "images", "runtime: docker is not installed here"),
    ("podman", ("podman", "bwrap"), "mixed", "runtime: podman runs only tasks that bring an image, and task plain "
                                             "brings none; set runtime: auto"),
    # image tasks beside a Harbor task with its own workspace: the engine is there, bwrap (for /app) is not
    ("auto", ("podman",), "placed", "runtime: auto found no bwrap here, and task polarstream-fix-word-count wants its "
                                    "workspace at /app"),
])
def test_a_runtime_that_cannot_run_the_tasks_is_one_line(installed, image_tasks, runtime, have, tasks, words):
    installed(*have)
    given = {"images": image_tasks, "one": image_tasks[:1], "mixed": [*image_tasks, PLAIN],
             "placed": [*image_tasks, PLACED]}[tasks]
    with pytest.raises(ExperimentError) as e:
        _runtime(runtime, given)
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)


def _refuse(*a, **k):
    raise AssertionError("started something before the checks")


def test_polarstream_run_of_image_tasks_with_no_engine_is_refused_before_anything_starts(tmp_path, monkeypatch, installed):
    from infra.models import ensure_model

    monkeypatch.setattr("infra.stack.Stack.up", _refuse)
    monkeypatch.setattr("polarstream.driver.processes.Processes.start", _refuse)
    model = ensure_model("tiny")
    write_tasks(tmp_path / "tasks", seed=0, n=3)
    f = tmp_path / "exp.yaml"
    f.write_text(yaml.safe_dump({"model": str(model), "train": "tasks/train", "eval": "tasks/heldout"}))
    installed("bwrap")
    r = CliRunner().invoke(app, ["run", str(f), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1, r.output
    assert r.stderr.startswith(f"error: {f}: runtime: 4 tasks bring an image (environment/Dockerfile) and neither "
                               "podman nor docker is installed here"), r.stderr
    f.write_text(yaml.safe_dump({"model": str(model), "train": "tasks/train", "eval": "", "runtime": "bwrap"}))
    r = CliRunner().invoke(app, ["run", str(f), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1 and r.stderr.startswith(f"error: {f}: runtime: bwrap runs no image, and 3 tasks"), r.stderr
