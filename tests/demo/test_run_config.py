"""`polarstream run`'s experiment -> the demo loop's settings (polarstream/run.py): the arith example is the
demo's defaults, and a user's run takes their model and tasks instead of the warm start and the family."""

from __future__ import annotations

from pathlib import Path

from polarstream.demo import DemoConfig
from polarstream.run import demo_config
from producers.experiment import load_experiment

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_arith_example_at_s0_is_the_demo(tmp_path):
    cfg = demo_config(load_experiment(EXAMPLES / "arith.yaml"), tmp_path)
    demo = DemoConfig(run_dir=tmp_path)
    keep = ("steps", "tasks_per_step", "samples", "heldout", "heldout_samples", "harness", "seed", "lr", "temperature",
            "async_level", "eval_every", "model", "train_tasks", "eval_tasks", "task_set", "step_timeout_s")
    assert {k: getattr(cfg, k) for k in keep} == {k: getattr(demo, k) for k in keep}


def test_a_users_run_takes_their_model_tasks_and_harness(tmp_path):
    exp = load_experiment(EXAMPLES / "coding.yaml", async_level=2)
    exp.model = str(tmp_path)
    cfg = demo_config(exp, tmp_path / "run")
    assert cfg.model == str(tmp_path) and len(cfg.train_tasks) == 5 and len(cfg.eval_tasks) == 5
    assert (cfg.harness, cfg.api, cfg.harness_config, cfg.async_level, cfg.eval_every, cfg.task_set) == (
        "pi", "chat", {"api": "chat"}, 2, 5, "coding")
    assert all(t.evaluator.kind == "harbor" and t.workspace.mount == "/app" for t in cfg.train_tasks)
