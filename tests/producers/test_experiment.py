"""The experiment file (producers/experiment.py): defaults that run the arith family, every problem one
line naming the file and the field, task sources read relative to the file."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner
import pytest

from polarstream.cli import app
from producers.experiment import Experiment, ExperimentError, load_experiment, print_config

EXAMPLES = __import__("pathlib").Path(__file__).parents[2] / "examples"


def test_print_config_is_the_defaults_as_yaml_with_every_field_explained():
    text = print_config()
    assert yaml.safe_load(text) == Experiment().model_dump()
    comments = [ln for ln in text.splitlines() if ln.startswith("# ")]
    assert len(comments) == len(Experiment.model_fields) + 1 and all(len(c) > 12 for c in comments)
    r = CliRunner().invoke(app, ["run", "--print-config"])
    assert r.exit_code == 0 and r.stdout == text


def test_the_examples_load_and_sources_are_read_from_the_files_folder():
    arith = load_experiment(EXAMPLES / "arith.yaml", async_level=1)
    assert (arith.train, arith.async_level, arith.group_size) == ("builtin:arith", 1, 8)
    coding = load_experiment(EXAMPLES / "coding.yaml")
    assert coding.train == str((EXAMPLES / "coding").resolve()) and coding.harness == "pi"


@pytest.mark.parametrize("body, words", [
    ("colour: red\n", "colour: Extra inputs are not permitted"),
    ("async_level: -1\n", "async_level: Input should be greater than or equal to 0"),
    ("train: no/such/tasks\n", "train: "),  # the missing task dir, resolved against the file's folder
    ("eval: builtin:arith-everything\n", "eval: 'builtin:arith-everything': the built-in sources are"),
    ("group_size: many\n", "group_size: Input should be a valid integer"),
    ("zero_signal: drop\n", "zero_signal: Input should be 'mask'"),
    ("- a list\n", "expected a mapping of settings"),
    ("max_steps: [1,\n", "malformed YAML"),
])
def test_a_bad_experiment_file_is_one_line_naming_the_field(tmp_path, body, words):
    f = tmp_path / "exp.yaml"
    f.write_text(body)
    with pytest.raises(ExperimentError) as e:
        load_experiment(f)
    assert str(e.value).startswith(f"{f}") and words in str(e.value) and "\n" not in str(e.value)
    r = CliRunner().invoke(app, ["run", str(f)])
    assert r.exit_code == 1 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1


def test_an_empty_split_and_a_task_that_needs_docker_stop_the_run_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr("infra.stack.Stack.up", lambda *a: (_ for _ in ()).throw(AssertionError("started the stack")))
    (tmp_path / "empty.jsonl").write_text("\n")
    docker = tmp_path / "docker-task"
    (docker / "environment").mkdir(parents=True)
    (docker / "tests").mkdir()
    (docker / "instruction.md").write_text("x\n")
    (docker / "tests" / "test.sh").write_text("exit 0\n")
    (docker / "environment" / "Dockerfile").write_text("FROM x\n")
    for train, words in (("empty.jsonl", "no tasks in it"), ("docker-task", "needs an image built from environment/Dockerfile")):
        f = tmp_path / "exp.yaml"
        f.write_text(yaml.safe_dump({"model": str(tmp_path), "train": train, "eval": ""}))
        r = CliRunner().invoke(app, ["run", str(f), "--run-dir", str(tmp_path / "run")])
        assert r.exit_code == 1 and words in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
