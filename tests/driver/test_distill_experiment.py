"""An experiment file's ``distill:`` (issue 78) reaches the trainer as its distill_* settings, a local teacher is
resolved where the trainer runs (its engine starts there), and a bad block is one line."""

from __future__ import annotations

import json

import pytest

from polarstream.driver.configure import run_config, trainer_settings
from polarstream.driver.experiment import ExperimentError, load_experiment
from trainer.config import TrainConfig


def _files(tmp_path, model="") -> dict:
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"task_id": "t1", "instruction": "do it", "num_samples": 1,
                                                      "min_valid": 1}) + "\n")
    return {"train": str(tmp_path / "tasks.jsonl"), "eval": "", "model": str(model or tmp_path), "rollout_url": "http://r:1",
            "engine_url": "http://e:2"}


def test_a_teacher_at_a_url_reaches_the_trainer_as_its_settings(tmp_path):
    exp = load_experiment(None, distill={"teacher": "http://t:8000", "teacher_model": "big", "weight": 0.5},
                          **_files(tmp_path))
    got = trainer_settings(exp)
    assert got == {"distill_weight": "0.5", "reward_weight": "0.0", "distill_url": "http://t:8000",
                   "distill_model": "big"}
    cfg = TrainConfig.from_overrides(got)  # what the trainer makes of its --set values
    assert (cfg.distill_url, cfg.distill_model, cfg.distill_weight, cfg.reward_weight) == ("http://t:8000", "big", 0.5, 0.0)
    assert run_config(exp, tmp_path, driver_only=True).teacher_dir == ""  # nothing to start: it runs elsewhere


def test_a_local_teacher_is_resolved_for_the_engine_the_run_starts(tmp_path, trainer_model_dir):
    exp = load_experiment(None, distill={"teacher": str(trainer_model_dir), "reward_weight": 1.0},
                          **_files(tmp_path, trainer_model_dir))
    assert "distill_url" not in trainer_settings(exp)  # the run's own teacher engine sets it (components.py)
    assert run_config(exp, tmp_path, driver_only=True).teacher_dir == ""  # the trainer runs elsewhere
    assert run_config(exp, tmp_path).teacher_dir == str(trainer_model_dir)


@pytest.mark.parametrize("overrides, field", [({"distill": {"weight": 1}}, "distill.teacher"),
                                              ({"distill": {"teacher": "x", "weight": -1}}, "distill.weight"),
                                              ({"trainer": {"distill_url": "http://t"}}, "trainer.distill_url"),
                                              ({"distill": {"teacher": str("/no/such/teacher")}}, "distill.teacher")])
def test_bad_distill_settings_are_one_line(overrides, field, tmp_path, trainer_model_dir):
    with pytest.raises(ExperimentError, match=field.replace(".", r"\.")) as e:
        exp = load_experiment(None, **overrides, **_files(tmp_path, trainer_model_dir))
        run_config(exp, tmp_path)
    assert "\n" not in str(e.value)
