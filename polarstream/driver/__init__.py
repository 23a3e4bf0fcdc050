"""The experiment driver: ``polarstream run`` and ``polarstream demo`` from an experiment file to a report.

Like prime-rl's orchestrator it meets the components only through Kafka topics and HTTP (the rollout
server, the engine's version), and its state is read back from the log, so a killed driver run again
goes on where it stopped. Read it top-down:

- ``experiment``: the experiment file (one pydantic model), and ``configure``: that file as a ``RunConfig``
  (``config``), checked before anything starts, and the run's id;
- ``preset``: what hands the driver its tasks (the file's own, the demo's arith family, yours) and hooks;
- ``loop``: one run from start to report, tying the rest together:
  ``processes`` and ``components`` (what it starts), ``watcher`` (what the run's topics say),
  ``serving`` (the version the engine serves), ``schedule`` (pure: which step goes out when),
  ``submit`` (each task as it goes out), ``steps`` (the state machine), ``evaluation`` (held-out evals),
  ``results`` (what a step gave), ``tracking`` (TensorBoard, W&B), ``view`` (the terminal table) and
  ``report`` (reward.png, report.md, the summaries; ``runs_table``: the README's tables of them).

The driver imports no preset: the demo (polarstream/demo/) stands on it, and the CLI's registry
(polarstream/presets.py) hands it the demo's preset where a file says ``train: builtin:arith``.
docs/architecture.md draws the imports.
"""

from .config import RunConfig
from .configure import run_config, run_id
from .experiment import Experiment, ExperimentError, load_experiment
from .loop import run, run_experiment
from .preset import MakePreset, Preset, Stage, WarmStart, from_config

__all__ = ["Experiment", "ExperimentError", "MakePreset", "Preset", "RunConfig", "Stage", "WarmStart", "from_config",
           "load_experiment", "run", "run_config", "run_experiment", "run_id"]
