"""The demo as a preset of the driver: the experiment shipped with the package (demo.yaml: the arith family,
on-policy) with the demo's options on top (``demo_experiment``), and what the family hands the driver
(``arith_preset``): its train and held-out problems as task templates, the built-in harness's settings, the
warm start of the tiny model, and, for a real CLI, the capture of that CLI's shape first. The CLI's
registry (polarstream/presets.py) names it for ``train: builtin:arith``.
"""

from __future__ import annotations

from pathlib import Path

from polarstream.driver.config import RunConfig
from polarstream.driver.experiment import Experiment, load_experiment
from polarstream.driver.preset import Preset, Stage, WarmStart
from polarstream.driver.processes import ProcessFailed
from schemas import HarnessSpec

from . import arith
from .shape import Shape, harness_config

PRESET = Path(__file__).with_name("demo.yaml")

# A real CLI's run, sized to fit 15 minutes on 2 cores: each session starts a Node.js process (a few
# seconds of CPU), so fewer sessions per step, and fewer held-out samples, than the built-in harness's.
CLI_SIZE = {"max_steps": 14, "groups_per_step": 3, "group_size": 6, "eval_samples": 2}

Problems = list[tuple[str, str]]


def demo_experiment(harness: str = "builtin", api: str | None = None, **given) -> Experiment:
    """The preset for ``harness`` (a real CLI: sized by CLI_SIZE, speaking ``api``), then the options the
    user ``given`` (experiment fields; None: not given). ExperimentError of one line on a bad value."""
    size = CLI_SIZE if harness != "builtin" else {}
    config = {"api": api} if harness != "builtin" and api else {}
    return load_experiment(PRESET, harness=harness, harness_config=config or None,
                           **{**size, **{k: v for k, v in given.items() if v is not None}})


def arith_preset(cfg: RunConfig) -> Preset:
    """The arith family for ``cfg``: ``cfg.heldout`` problems held out by the seed, the rest trained on."""
    train, heldout = arith.split(cfg.seed, cfg.heldout)
    return _preset(cfg, train, heldout, None)


def _preset(cfg: RunConfig, train: Problems, heldout: Problems, shape: Shape | None) -> Preset:
    """The family's tasks, asking for the answer with the harness's file tool, and the hooks; a real CLI's
    preset captures its shape first (``shape`` None), and is then made again in that shape."""
    if shape is None:
        # Every answer is capped at 48 tokens (a tool call takes about 36). Without a cap, text the tiny model
        # rambles around a correct call costs nothing, so GRPO reinforces it with the call until the policy
        # degenerates (a pi run without the cap did, on seed 1); with it, a rambling answer is cut before its
        # call closes and scores 0.
        harness = HarnessSpec(name=cfg.harness, config={"temperature": cfg.temperature, "max_tokens": 48, "max_turns": 3})
    else:  # a real CLI sends its own settings; the node pins the run's temperature on every call
        harness = HarnessSpec(name=cfg.harness, config=harness_config(cfg.harness, cfg.api))
    tool = shape.tool if shape is not None else "write_file"
    capture = (lambda stage: _capture(stage, train, heldout)) if cfg.harness != "builtin" and shape is None else None
    return Preset(train=[arith.template(q, a, tool) for q, a in train],
                  heldout=[arith.template(q, a, tool) for q, a in heldout], harness=harness, capture=capture,
                  warm_start=lambda stage: _warm_start(stage, train, shape), report=_report_lines)


def _capture(stage: Stage, train: Problems, heldout: Problems) -> Preset:
    """A real CLI's requests, captured through the gateway (capture.py), so the warm start teaches in its shape."""
    from infra.models import ensure_model

    from .capture import capture

    cfg, console = stage.cfg, stage.console
    if cfg.attach:
        raise ProcessFailed("--driver-only and --only run a real CLI only with the experiment's own model (the "
                            "arith family's warm start for a CLI is made where all the components start)")
    with console.status(f"capturing {cfg.harness}'s requests through the gateway (once per CLI version and API)"):
        shape = capture(cfg.harness, cfg.api, stage.settings, stage.env, stage.run_dir, ensure_model("tiny"), stage.runtime)
    console.print(f"{cfg.harness} {shape.version} over {shape.api}: a system prompt of "
                  f"{len(shape.first[0].get('content') or '')} characters, tools {[t['name'] for t in shape.tools]}")
    return _preset(cfg, train, heldout, shape)


def _warm_start(stage: Stage, train: Problems, shape: Shape | None) -> WarmStart:
    """The tiny model after its cached warm start (model.py), gated on its pass rate on the train split."""
    from .model import demo_model

    cfg, console = stage.cfg, stage.console
    with console.status("warm start: supervised fine-tuning of the tiny model (first run only, then cached)"):
        model_dir, warm = demo_model(cfg, stage.settings, train, shape)
    if warm["train_pass_rate"] is not None:
        console.print(f"warm start: train-split pass rate {warm['train_pass_rate']:.3f} before RL, sums right "
                      f"{warm.get('working_correct', float('nan')):.3f} of the time ({model_dir.name})")
        if warm["train_pass_rate"] < cfg.min_pass_rate:
            raise ProcessFailed(f"the warm-started model solves {warm['train_pass_rate']:.3f} of the train tasks "
                                f"(< {cfg.min_pass_rate}): RL would have no signal; change --seed or the warm start")
    return WarmStart(model_dir, warm)


def _report_lines(summary: dict) -> list[str]:
    """report.md's line on the warm start: how often it solved the train split before RL, and how often its
    sums are right (the ceiling RL can reach)."""
    warm = summary.get("warm_start") or {}
    fmt = lambda v: "-" if v is None else format(v, ".3f")  # noqa: E731
    return [f"- warm start: train-split pass rate {fmt(warm.get('train_pass_rate'))} before RL; its working adds up",
            f"  {fmt(warm.get('working_correct'))} of the time (the ceiling RL can reach)"]
