"""``polarstream demo``: the experiment shipped with the package (demo.yaml: the arith family, on-policy),
with the demo's options on top. It runs as any experiment file does (polarstream/run.py)."""

from __future__ import annotations

from pathlib import Path

from producers.experiment import Experiment, load_experiment

PRESET = Path(__file__).with_name("demo.yaml")

# A real CLI's run, sized to fit 15 minutes on 2 cores: each session starts a Node.js process (a few
# seconds of CPU), so fewer sessions per step, and fewer held-out samples, than the built-in harness's.
CLI_SIZE = {"max_steps": 14, "groups_per_step": 3, "group_size": 6, "eval_samples": 2}


def demo_experiment(harness: str = "builtin", api: str | None = None, **given) -> Experiment:
    """The preset for ``harness`` (a real CLI: sized by CLI_SIZE, speaking ``api``), then the options the
    user ``given`` (experiment fields; None: not given). ExperimentError of one line on a bad value."""
    size = CLI_SIZE if harness != "builtin" else {}
    config = {"api": api} if harness != "builtin" and api else {}
    return load_experiment(PRESET, harness=harness, harness_config=config or None,
                           **{**size, **{k: v for k, v in given.items() if v is not None}})
