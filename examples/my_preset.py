"""A preset of your own: tasks built in Python and handed to the driver, as the demo hands it the arith family.

    .venv/bin/python examples/my_preset.py [RUN_DIR]

starts every component on this machine, as ``polarstream run`` does (Kafka and S3 included), and trains two
steps of the built-in tiny model on ``preset``'s tasks: create a file of a given name. The untrained tiny
model rarely does, so expect a reward near 0: the example shows the plumbing. RUN_DIR (runs/my-preset)
gets report.md, reward.png and demo-summary.json.

A preset is a function of the run's ``RunConfig`` that returns a ``Preset`` (polarstream/driver/preset.py):
the train and held-out task templates, and optional hooks. Here ``warm_start`` says which model the run
serves (the tiny model as it is) and ``report`` adds a line to report.md; the demo's preset
(polarstream/demo/preset.py) also captures a real CLI's shape before its warm start.
"""

from __future__ import annotations

import sys
from pathlib import Path

from polarstream.driver import Preset, RunConfig, Stage, WarmStart, run
from schemas import EvaluatorSpec, HarnessSpec, TaskRequest, Timeouts

NAMES = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")


def task(name: str) -> TaskRequest:
    """One template: its id names it in the per-task figures; the driver sets the group size and the harness."""
    return TaskRequest(task_id=f"touch-{name}", instruction=f"Create an empty file named {name}.txt.",
                       evaluator=EvaluatorSpec(kind="command", command=f"test -f {name}.txt", timeout_s=10.0),
                       timeouts=Timeouts(agent_s=60.0))


def warm_start(stage: Stage) -> WarmStart:
    """The model every component loads: the built-in tiny model, untrained (a real preset would fine-tune it)."""
    from infra.models import ensure_model

    return WarmStart(ensure_model("tiny"), {"train_pass_rate": None, "working_correct": None})


def report(summary: dict) -> list[str]:
    return [f"- tasks: {len(NAMES) - 2} to train on and 2 held out, from examples/my_preset.py"]


def preset(cfg: RunConfig) -> Preset:
    """Four tasks to train on and two held out; every answer capped at 24 tokens, one turn a session."""
    tasks = [task(name) for name in NAMES]
    harness = HarnessSpec(name="builtin", config={"temperature": cfg.temperature, "max_tokens": 24, "max_turns": 1})
    return Preset(train=tasks[:-2], heldout=tasks[-2:], harness=harness, warm_start=warm_start, report=report)


def config(run_dir: Path) -> RunConfig:
    """Two steps of two tasks, two samples each; the held-out tasks once before and once after."""
    return RunConfig(name="my-preset", steps=2, tasks_per_step=2, samples=2, heldout_samples=1, runtime="auto",
                     task_set="my-preset", step_timeout_s=240, run_dir=run_dir)


if __name__ == "__main__":
    summary = run(config(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/my-preset")), preset=preset)
    print(summary)
