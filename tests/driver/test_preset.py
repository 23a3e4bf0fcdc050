"""What a preset hands the driver (polarstream/driver/preset.py): the demo's arith family through the CLI's
registry, as the tasks the driver always sent, and a user's own preset (examples/my_preset.py) through the
driver's API, without Kafka."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from polarstream.demo import arith
from polarstream.demo.preset import arith_preset
from polarstream.driver import Preset, RunConfig, Stage, WarmStart
from polarstream.driver.configure import run_config
from polarstream.driver.experiment import BUILTIN_SOURCES, ExperimentError, load_experiment
from polarstream.driver.schedule import step_batches
from polarstream.driver.submit import task_payload
from polarstream.presets import PRESETS, preset_for
from schemas import HarnessSpec

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_train_builtin_arith_is_the_demos_preset_and_the_driver_needs_one_to_run_it(tmp_path):
    exp = load_experiment(EXAMPLES / "arith.yaml")
    assert set(PRESETS) <= set(BUILTIN_SOURCES) and preset_for(exp) is PRESETS["builtin:arith"]
    given = preset_for(exp)(run_config(exp, tmp_path, preset=preset_for(exp)))
    train, heldout = arith.split(0, 16)
    assert [t.task_id for t in given.train] == [q for q, _ in train] and len(given.heldout) == 16 == len(heldout)
    assert given.harness == HarnessSpec(name="builtin", config={"temperature": 1.0, "max_tokens": 48, "max_turns": 3})
    assert given.capture is None and given.warm_start is not None  # a real CLI's preset captures its shape first
    assert arith_preset(RunConfig(harness="pi", run_dir=tmp_path)).capture is not None
    with pytest.raises(ExperimentError, match="no preset provides it"):  # the driver itself knows no preset
        run_config(exp, tmp_path)
    # order: epochs stops after that many passes over the preset's 65 train problems, 4 a step
    epochs = load_experiment(EXAMPLES / "arith.yaml", order="epochs", epochs=1)
    assert run_config(epochs, tmp_path, preset=preset_for(epochs)).steps == 17


def test_the_arith_preset_draws_and_sends_what_the_loop_sent_when_it_knew_the_family(tmp_path):
    """Its templates are the split's problems in the split's order, so the seeded draws are the same tasks;
    each goes out as arith.task_request made it (the run's group size, minimum and harness)."""
    cfg = RunConfig(run_dir=tmp_path)
    given = arith_preset(cfg)
    pairs = arith.split(cfg.seed, cfg.heldout)[0]
    drawn = step_batches(given.train, cfg.seed, cfg.steps, cfg.tasks_per_step, cfg.order)
    assert [[t.task_id for t in b] for b in drawn] == [[q for q, _ in b] for b in
                                                       step_batches(pairs, cfg.seed, cfg.steps, cfg.tasks_per_step, cfg.order)]
    sent = task_payload(given.train[0], "r-s000-t0", cfg.samples, cfg.task_set, given.harness)
    q, a = pairs[0]
    whole = arith.task_request(q, a, task_id="r-s000-t0", num_samples=cfg.samples, harness=given.harness).model_dump(mode="json")
    differ = {k for k in sent if sent[k] != whole[k]}
    assert differ == {"event_id", "created_at", "metadata"} and sent["metadata"] == {**whole["metadata"], "source_task_id": q}


def test_the_demos_report_line_is_its_warm_start(tmp_path):
    lines = arith_preset(RunConfig(run_dir=tmp_path)).report({"warm_start": {"train_pass_rate": 0.25, "working_correct": 1.0}})
    assert lines == ["- warm start: train-split pass rate 0.250 before RL; its working adds up",
                     "  1.000 of the time (the ceiling RL can reach)"]


def _example():
    spec = importlib.util.spec_from_file_location("my_preset", EXAMPLES / "my_preset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_preset_of_your_own_hands_the_driver_its_tasks_and_hooks(tmp_path):
    """examples/my_preset.py: its templates go out as the driver sends every task, its warm start is the model
    the run serves, and its report line lands in report.md."""
    from infra.models import ensure_model
    from infra.settings import Settings
    from polarstream.driver.report import write_report
    from polarstream.driver.results import StepResult

    mine = _example()
    cfg = mine.config(tmp_path / "run")
    given = mine.preset(cfg)
    assert isinstance(given, Preset) and (len(given.train), len(given.heldout)) == (4, 2)
    sent = [task_payload(t, f"r-s000-t{i}", cfg.samples, cfg.task_set, given.harness) for i, t in enumerate(given.train)]
    assert [(s["task_id"], s["num_samples"], s["min_valid"], s["task_set"], s["harness"]["config"]["max_tokens"]) for s in sent[:1]] == [
        ("r-s000-t0", 2, 1, "my-preset", 24)]
    assert {s["metadata"]["source_task_id"] for s in sent} == {"touch-alpha", "touch-beta", "touch-gamma", "touch-delta"}
    made = given.warm_start(Stage(cfg, Settings(), {}, tmp_path, "subprocess", None))
    assert isinstance(made, WarmStart) and made.model_dir == ensure_model("tiny")
    cfg.run_dir.mkdir(parents=True)
    step = StepResult(step=0, reward=0.0, samples=4, groups=2, traces=4, calls=4, sampled_tokens=40, wall_s=3.0, policy_version=1)
    write_report(cfg.run_dir, cfg, [step], None, Settings(), 3.0, made.model_dir, warm=made.record, preset_lines=given.report)
    assert "- tasks: 4 to train on and 2 held out, from examples/my_preset.py\n" in (cfg.run_dir / "report.md").read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_a_preset_of_your_own_runs_end_to_end(infra, tmp_path):
    """examples/my_preset.py through every component, as its __main__ runs it (~1 minute): two steps
    trained on its tasks, its held-out tasks evaluated, its line in report.md."""
    import json

    from polarstream.driver import run

    mine = _example()
    cfg = mine.config(tmp_path / "run")
    summary = json.loads(run(cfg, infra.settings.model_copy(update={"topic_prefix": "", "storage_url": ""}),
                             preset=mine.preset).read_text())
    assert summary["steps"] == 2 and summary["policy_version"] == 2 and set(summary["heldout_per_eval"]) == {"before", "after"}
    assert set(summary["per_task"]) <= {"touch-alpha", "touch-beta", "touch-gamma", "touch-delta"} and summary["per_task"]
    assert summary["warm_start"] == {"train_pass_rate": None, "working_correct": None}
    assert "- tasks: 4 to train on and 2 held out, from examples/my_preset.py" in (cfg.run_dir / "report.md").read_text()
