"""`polarstream run`'s experiment -> the driver's settings (polarstream/driver/configure.py): the arith example is
the demo's defaults, and a user's run takes their model and tasks instead of the arith preset's warm start
and family."""

from __future__ import annotations

import shutil
from pathlib import Path

from polarstream.driver.config import RunConfig
from polarstream.driver.configure import run_config
from polarstream.driver.experiment import load_experiment
from polarstream.presets import preset_for

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_arith_example_at_s0_is_the_demo(tmp_path):
    exp = load_experiment(EXAMPLES / "arith.yaml")
    cfg = run_config(exp, tmp_path, preset=preset_for(exp))
    demo = RunConfig(run_dir=tmp_path)
    keep = ("steps", "tasks_per_step", "samples", "heldout", "heldout_samples", "harness", "seed", "lr", "temperature",
            "async_level", "eval_every", "model", "train_tasks", "eval_tasks", "task_set", "step_timeout_s", "order")
    assert {k: getattr(cfg, k) for k in keep} == {k: getattr(demo, k) for k in keep}


def test_a_users_run_takes_their_model_tasks_and_harness(tmp_path):
    exp = load_experiment(EXAMPLES / "coding.yaml", async_level=2)
    # driven from here only: pi and bwrap are the node's to have, and the model is left to the machines
    # that load it (test_a_built_in_model_is_resolved_once_for_every_component resolves one)
    cfg = run_config(exp, tmp_path / "run", driver_only=True)
    assert cfg.model == "tiny" and len(cfg.train_tasks) == 5 and len(cfg.eval_tasks) == 5
    assert (cfg.harness, cfg.api, cfg.harness_config, cfg.async_level, cfg.eval_every, cfg.task_set) == (
        "pi", "chat", {"api": "chat"}, 2, 5, "coding")
    assert all(t.evaluator.kind == "harbor" and t.workspace.mount == "/app" for t in cfg.train_tasks)
    assert cfg.trainer_settings == {}  # the file's trainer: settings reach the trainer as --set
    exp.trainer = {"kl_coef": 0.01, "activation_checkpointing": True}
    assert run_config(exp, tmp_path / "run", driver_only=True).trainer_settings == {"kl_coef": "0.01", "activation_checkpointing": "true"}
    exp.trainer = {}
    # every task once an epoch: 8 epochs of 5 tasks, 2 a step, is 20 steps; 3 epochs would stop at 8
    assert (cfg.order, cfg.steps) == ("epochs", 20)
    exp.epochs = 3
    assert run_config(exp, tmp_path / "run", driver_only=True).steps == 8


def test_a_built_in_model_is_resolved_once_for_every_component_and_the_run_keeps_its_name(tmp_path):
    """`model: tiny` is the cached tiny model's directory, whatever the working directory (the driver once
    handed the viewer <cwd>/tiny); the run's name is on its console line, report and plot."""
    from infra.models import ensure_model

    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t1", "instruction": "do it", "num_samples": 1, "min_valid": 1}\n')
    f = tmp_path / "exp.yaml"
    f.write_text("name: mine\nmodel: tiny\ntrain: tasks.jsonl\neval: ''\nruntime: subprocess\n")
    cfg = run_config(load_experiment(f), tmp_path / "run")
    assert (cfg.model, cfg.name, cfg.runtime) == (str(ensure_model("tiny")), "mine", "subprocess")
    # a model directory is read beside the file, as its task sources are
    shutil.copytree(ensure_model("tiny"), tmp_path / "models" / "m")
    f.write_text(f.read_text().replace("model: tiny", "model: models/m"))
    assert run_config(load_experiment(f), tmp_path / "run").model == str(tmp_path / "models" / "m")
    # the demo's preset is named demo, so the demo keeps saying so
    from polarstream.demo.preset import arith_preset, demo_experiment

    assert run_config(demo_experiment(), tmp_path / "demo", preset=arith_preset).name == "demo"


def test_the_reward_plot_is_titled_with_the_runs_name(tmp_path):
    from PIL import Image

    from polarstream.driver.report import plot_rewards

    plot_rewards([0.0, 0.5, 0.25], tmp_path / "reward.png", name="mine")
    assert Image.open(tmp_path / "reward.png").text["Title"] == "polarstream mine: reward while training"


def test_a_run_id_names_the_experiment_and_run_dir_and_nothing_else(tmp_path):
    from polarstream.driver.configure import run_id

    exp = load_experiment(EXAMPLES / "arith.yaml")
    rid = run_id(exp, tmp_path / "a")
    assert rid.startswith("arith-") and rid == run_id(load_experiment(EXAMPLES / "arith.yaml"), tmp_path / "a")
    assert rid != run_id(exp, tmp_path / "b") != run_id(load_experiment(EXAMPLES / "arith.yaml", seed=1), tmp_path / "a")
    # where the components run is not what the run is: driven from elsewhere, it keeps its id
    elsewhere = load_experiment(EXAMPLES / "arith.yaml", rollout_url="http://10.0.0.2:8700", engine_url="http://10.0.0.3:8000")
    assert run_id(elsewhere, tmp_path / "a") == rid
    assert run_id(load_experiment(EXAMPLES / "arith.yaml", run_id="shared-run"), tmp_path / "b") == "shared-run"


def test_per_task_statistics_follow_the_groups_trained_on_each_task():
    from polarstream.demo import arith
    from polarstream.driver.results import per_task
    from schemas import TaskRequest, Trajectory, TrainingGroup

    def group(gid: str, rewards: list[float]) -> TrainingGroup:
        trajs = [Trajectory(session_id=f"{gid}.s{i}", group_id=gid, task_id=gid, reward=r)
                 for i, r in enumerate(rewards)]
        return TrainingGroup(group_id=gid, task_id=gid, trajectories=trajs, advantages=[0.0] * len(trajs))

    fix = TaskRequest(task_id="fix-bug", instruction="fix it")
    trained = {"r-s000-t0": fix, "r-s000-t1": arith.template("1 + 2", "3"), "r-s001-t0": fix, "r-s001-t1": fix}
    groups = {g.group_id: g for g in (group("r-s000-t0", [0, 1]), group("r-s000-t1", [1, 1]), group("r-s001-t0", [1, 1]))}
    assert per_task(trained, groups) == {"fix-bug": {"groups": 2, "mean_reward": 0.75},
                                         "1 + 2": {"groups": 1, "mean_reward": 1.0}}  # an arith problem: its question


def test_a_tasks_minimum_completion_and_straggler_early_stop_come_from_the_experiment():
    from polarstream.demo import arith
    from polarstream.driver.submit import task_payload
    from schemas import HarnessSpec, TaskRequest

    pi, fix = HarnessSpec(name="pi"), TaskRequest(task_id="fix-bug", instruction="fix it", event_id="e1")
    default = task_payload(fix, "r-s000-t0", 8, "coding", pi)
    assert (default["min_valid"], default["early_stop"], default["num_samples"]) == (4, 0, 8)  # the demo's: half
    assert default["event_id"] != "e1" and default["metadata"]["source_task_id"] == "fix-bug"
    assert default["group_id"] == default["task_id"] == "r-s000-t0" and default["harness"]["name"] == "pi"
    strict = task_payload(fix, "r-s000-t1", 8, "coding", pi, min_completion=0.75, early_stop_at=0.6)
    assert (strict["min_valid"], strict["early_stop"]) == (6, 6)  # early stop never below the minimum
    # an arith problem's template sets no minimum of its own: the run's applies
    sums = task_payload(arith.template("1 + 2", "3"), "r-s000-t2", 3, "demo-arith", pi, early_stop_at=0.5)
    assert (sums["min_valid"], sums["early_stop"], sums["metadata"]["answer"]) == (1, 2, "3")
    # a task file's own minimum and early stop are the task's, not the run's (capped at the run's group size)
    own = TaskRequest.model_validate_json('{"task_id": "flaky", "instruction": "x", "min_valid": 3, "early_stop": 12}')
    mine = task_payload(own, "r-s000-t3", 8, "coding", pi, min_completion=0.75, early_stop_at=0.6)
    assert (mine["min_valid"], mine["early_stop"]) == (3, 8)
    assert task_payload(own.model_copy(update={"min_valid": 6}), "r-s000-t4", 4, "coding", pi)["min_valid"] == 4


def test_the_demo_is_the_packaged_preset_of_the_arith_example(tmp_path):
    """`polarstream demo` runs demo.yaml (shipped in the package) through `polarstream run`: the same
    experiment as examples/arith.yaml under its own name, and a real CLI's run sized to 15 minutes."""
    from polarstream.demo.preset import CLI_SIZE, PRESET, arith_preset, demo_experiment

    assert PRESET.exists() and demo_experiment().model_dump(exclude={"name"}) == load_experiment(
        EXAMPLES / "arith.yaml").model_dump(exclude={"name"})
    assert run_config(demo_experiment(seed=3, max_steps=5), tmp_path, preset=arith_preset).steps == 5
    pi = demo_experiment("pi", "responses", seed=1, group_size=4)
    assert {k: getattr(pi, k) for k in CLI_SIZE} == {**CLI_SIZE, "group_size": 4}  # what the user gave wins
    cfg = run_config(pi, tmp_path, preset=arith_preset)
    assert (cfg.harness, cfg.api, cfg.model, cfg.train_tasks, cfg.seed) == ("pi", "responses", "", None, 1)


def test_the_loss_correction_and_advantage_settings_reach_the_run(tmp_path):
    """Issue 65: the experiment's loss, correction, std_normalize, overlong and engine_logit_noise reach the
    RunConfig (components.py passes them to the trainer, the streams and the engine); the trainer: block may
    not set the two the file owns; the defaults are today's (ppo_clip, no correction, std-normalized)."""
    import pytest

    from polarstream.demo.preset import demo_experiment
    from polarstream.driver.experiment import ExperimentError

    plain = run_config(load_experiment(EXAMPLES / "arith.yaml"), tmp_path, driver_only=True, preset=preset_for(load_experiment(None)))
    assert (plain.loss, plain.correction, plain.std_normalize, plain.overlong, plain.engine_logit_noise, plain.engine_dtype) == (
        "ppo_clip", "none", True, {}, 0.0, "float32")
    exp = load_experiment(EXAMPLES / "arith.yaml", loss="cispo", correction="icepop", std_normalize=False,
                          overlong={"max_tokens": 48, "buffer": 8}, engine_logit_noise=0.5, engine_dtype="bfloat16")
    cfg = run_config(exp, tmp_path, driver_only=True, preset=preset_for(exp))
    assert (cfg.loss, cfg.correction, cfg.std_normalize, cfg.engine_logit_noise, cfg.engine_dtype) == (
        "cispo", "icepop", False, 0.5, "bfloat16")
    assert cfg.overlong == {"max_tokens": 48, "buffer": 8, "penalty": 1.0}
    exp.trainer = {"correction": "tis"}
    with pytest.raises(ExperimentError, match="trainer.correction: set by the experiment's correction"):
        run_config(exp, tmp_path, driver_only=True, preset=preset_for(exp))
    with pytest.raises(ExperimentError, match="correction"):
        load_experiment(EXAMPLES / "arith.yaml", correction="icepops")
    with pytest.raises(ExperimentError, match="engine_dtype"):
        load_experiment(EXAMPLES / "arith.yaml", engine_dtype="float16")
    with pytest.raises(ExperimentError, match="overlong.*buffer: 60 is more than max_tokens 48"):
        load_experiment(EXAMPLES / "arith.yaml", overlong={"max_tokens": 48, "buffer": 60})
    demo = demo_experiment(loss="gspo", correction="seq_mask_geo", std_normalize=False)  # polarstream demo's flags
    assert (demo.loss, demo.correction, demo.std_normalize) == ("gspo", "seq_mask_geo", False)
