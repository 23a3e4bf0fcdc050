"""An experiment file's ``lora:`` (issue 64) reaches the trainer as its lora_* settings, is checked in one line,
and ``polarstream demo --lora`` turns on the demo's adapter and rate."""

from __future__ import annotations

import json

import pytest

from polarstream.driver.configure import run_config, trainer_settings
from polarstream.driver.experiment import ExperimentError, load_experiment


def test_lora_reaches_the_trainer_as_its_settings(tmp_path):
    exp = load_experiment(None, lora={"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    assert trainer_settings(exp) == {"lora_rank": "8", "lora_alpha": "16", "lora_dropout": "0.0",
                                     "lora_target_modules": "q_proj,v_proj"}
    from trainer.config import TrainConfig

    cfg = TrainConfig.from_overrides(trainer_settings(exp))  # what the trainer makes of its --set values
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules) == (8, 16, ["q_proj", "v_proj"])
    assert trainer_settings(load_experiment(None)) == {}  # no lora: full fine-tuning, as before


@pytest.mark.parametrize("overrides, field", [({"lora": {"rank": 0}}, "lora.rank"),
                                              ({"lora": {"rank": 4, "scale": 2}}, "lora.scale"),
                                              ({"trainer": {"lora_rank": 4}}, "trainer.lora_rank")])
def test_bad_lora_settings_are_one_line(overrides, field, tmp_path):
    with pytest.raises(ExperimentError, match=field.replace(".", r"\.")) as e:
        exp = load_experiment(None, **overrides)
        run_config(exp, tmp_path, driver_only=True)
    assert "\n" not in str(e.value)


def test_the_demos_lora_flag():
    from polarstream.demo.preset import demo_experiment
    from polarstream.demo_cli import DEMO_LORA

    exp = demo_experiment(**DEMO_LORA)
    assert exp.lora is not None and (exp.lora.rank, exp.lora.alpha, exp.lr) == (16, 32, 1.5e-3)
    assert demo_experiment().lora is None


def test_driver_only_attaches_the_gateway_a_lora_run_reads_its_version_from(tmp_path):
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"task_id": "t1", "instruction": "do it", "num_samples": 1, "min_valid": 1}) + "\n")
    urls = {"rollout_url": "http://r:1", "engine_url": "http://e:2", "train": str(tmp_path / "tasks.jsonl"), "eval": "",
            "model": str(tmp_path)}
    exp = load_experiment(None, lora={"rank": 4}, gateway_url="http://g:3", **urls)
    assert run_config(exp, tmp_path, driver_only=True).attach == {"rollout": "http://r:1", "engine": "http://e:2",
                                                                  "gateway": "http://g:3"}
    assert run_config(load_experiment(None, **urls), tmp_path, driver_only=True).attach == {"rollout": "http://r:1",
                                                                                           "engine": "http://e:2"}
