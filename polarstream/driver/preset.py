"""What a preset hands the driver: the tasks a run trains and evaluates on, and optional hooks.

A preset is a function of the run's ``RunConfig`` that returns a ``Preset``. An experiment file's own task
sources are one (``from_config``); the demo's arith family is another (polarstream/demo/preset.py), and a
few lines of Python make your own (examples/my_preset.py). What it holds:

- ``train`` and ``heldout``: TaskRequest templates. Each step draws its tasks from ``train`` (schedule.py)
  and each eval sends every one of ``heldout``; every copy gets the run's id, group size, harness and
  sampling (submit.py). A template keeps what it sets itself (its workspace, evaluator, timeouts, its own
  ``min_valid`` or ``early_stop``), and its ``task_id`` names it in the per-task figures and the curriculum.
- ``harness``: what every session runs (None: the experiment's ``harness`` and ``harness_config``).
- ``capture(stage) -> Preset``: runs once Kafka and S3 are up and before any component starts, where the
  run makes its own model (the experiment names none). It may run sessions of its own (the demo captures a
  real CLI's requests through the gateway) and returns the preset to run, whose tasks and harness may
  depend on what it found.
- ``warm_start(stage) -> WarmStart``: the model the run serves where the experiment names none (the demo's
  tiny model after its cached supervised warm start), with its record for the report.
- ``report(summary) -> list[str]``: lines of the preset's own in report.md's summary list.

The driver imports no preset: the CLI's registry (polarstream/presets.py) maps an experiment's ``train:
builtin:NAME`` to one, and a script hands its own to ``loop.run``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.settings import Settings
from schemas import HarnessSpec, TaskRequest

from .config import RunConfig

# The warm-start record of a run that made no model of its own (report.py's "warm_start")
NO_WARM_START = {"train_pass_rate": None, "working_correct": None}


@dataclass(frozen=True)
class Stage:
    """Where a preset's hooks run: the run, its settings (its topic prefix and storage), the environment its
    children get, its directory, the sandbox runtime picked, and the console to say what they do on."""

    cfg: RunConfig
    settings: Settings
    env: dict[str, str]
    run_dir: Path
    runtime: str
    console: Any  # rich.console.Console


@dataclass(frozen=True)
class WarmStart:
    """The model a preset made for the run (every component loads ``model_dir``) and its record (the report's
    ``warm_start``; ``train_pass_rate`` there is also ``warm_start_train_pass_rate``)."""

    model_dir: Path
    record: dict[str, Any]


@dataclass(frozen=True)
class Preset:
    train: list[TaskRequest]
    heldout: list[TaskRequest]
    harness: HarnessSpec | None = None
    capture: Callable[[Stage], Preset] | None = None
    warm_start: Callable[[Stage], WarmStart] | None = None
    report: Callable[[dict], list[str]] | None = None


# A preset as the driver and the CLI take it: made from the run's config, once that is known
MakePreset = Callable[[RunConfig], Preset]


def from_config(cfg: RunConfig) -> Preset:
    """The experiment's own tasks (its ``train`` and ``eval`` sources, read by configure.py), no hooks."""
    return Preset(train=list(cfg.train_tasks or []), heldout=list(cfg.eval_tasks or []))
