"""The experiment file (polarstream/driver/experiment.py): defaults that run the arith family, every problem one
line naming the file and the field, task sources read relative to the file."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner
import pytest

from polarstream.cli import app
from polarstream.driver.experiment import Experiment, load_experiment, print_config

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


def test_print_config_of_a_file_is_its_settings_with_the_defaults_filled_in(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("name: mine\nmodel: tiny\ngroup_size: 2\ntrain: tasks.jsonl\neval: ''\n")
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t1", "instruction": "do it"}\n')
    r = CliRunner().invoke(app, ["run", str(f), "--print-config", "--seed", "3"])
    assert r.exit_code == 0, r.output
    printed = yaml.safe_load(r.stdout)
    assert printed == load_experiment(f, seed=3).model_dump(mode="json")
    # the file's values, a flag's, and a default where the file sets none; the source read beside the file
    assert (printed["name"], printed["model"], printed["group_size"], printed["seed"], printed["lr"]) == ("mine", "tiny", 2, 3, 5e-4)
    assert printed["train"] == str(tmp_path / "tasks.jsonl") and r.stdout != print_config()
    comments = [ln for ln in r.stdout.splitlines() if ln.startswith("# ")]
    assert len(comments) == len(Experiment.model_fields) + 1 and str(f) in comments[0]
