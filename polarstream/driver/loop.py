"""The loop every run goes through (``polarstream run``; the demo is one such run, with its preset).

Kafka, the S3 server, the engine, a gateway node with its sandboxed harness runs, the Faust stream worker,
the trainer and the rollout server all run as their own processes, exactly as a user would run them. This
module ties the driver's parts together, in the order a run meets them: the run's settings and children
(processes.py), the preset's tasks and hooks (preset.py), the components (components.py), the step state
machine (steps.py) ticked under the live view (view.py), and the report (report.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

from infra.settings import Settings
from schemas import HarnessSpec

from .components import addresses, bring_up, child_env, pick_runtime, run_settings, serve, start_components
from .config import RunConfig
from .experiment import Experiment
from .preset import NO_WARM_START, MakePreset, Preset, Stage, from_config
from .processes import Processes, ProcessFailed
from .report import write_report, write_run_summary
from .steps import Steps
from .view import table
from .watcher import Watcher


def run(cfg: RunConfig, settings: Settings | None = None, on_step: Callable[[int, dict[str, str]], None] | None = None,
        preset: MakePreset = from_config) -> Path | None:
    """Run ``cfg`` on the tasks ``preset(cfg)`` hands it (by default the experiment's own); returns the path
    of demo-summary.json (None with ``cfg.only``: components served until they exit or the command is
    interrupted).

    ``on_step(step, metrics_urls)`` runs after each training step while every service is up; the
    URLs are each service's ``/metrics`` by name (the test parses them mid-run).
    """
    from rich.console import Console
    from rich.live import Live

    from .tracking import Tracker

    console = Console()
    run_dir = cfg.run_dir.absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = cfg.run_id or f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    settings = run_settings(settings or Settings(), run_id)
    t_start = time.monotonic()
    console.print(f"[bold]polarstream {cfg.name}[/] -> {run_dir}")
    bring_up(cfg, settings, console)
    env = child_env(settings, run_dir)
    # A named run keeps its components' pids and ports, so a driver started again adopts those still running.
    procs = Processes(run_dir / "logs", env,
                      registry=run_dir / "components.json" if cfg.run_id and (cfg.only or not cfg.attach) else None)
    ports, urls = addresses(cfg, procs, settings)
    metrics = {"gateway": f"{urls['gateway']}/metrics", "rollout": f"{urls['rollout']}/metrics",
               "streams": f"{urls['streams_metrics']}/metrics", "trainer": f"{urls['trainer_metrics']}/metrics"}
    runtime = pick_runtime(cfg.runtime)
    watcher: Watcher | None = None
    tracker: Tracker | None = None
    try:
        tracker = Tracker(run_dir, run_id, cfg.wandb, {"run_id": run_id, "seed": cfg.seed, "steps": cfg.steps,
                                                       "async_level": cfg.async_level, "lr": cfg.lr})
        stage = Stage(cfg, settings, env, run_dir, runtime, console)
        given = preset(cfg)
        if given.capture is not None and not cfg.model:  # before the components: what the preset needs to know
            given = given.capture(stage)
        model_dir, warm = _model(cfg, given, stage)
        t0 = time.monotonic()  # the run proper: everything after the (cached) warm start
        if cfg.only:  # some components here; the driver and the rest run elsewhere
            start_components(cfg, settings, procs, ports, urls, model_dir, runtime, run_dir, console, cfg.only)
            serve(cfg, procs, urls, console)
            return None
        if cfg.attach:  # --driver-only: they run elsewhere; this process only drives them
            console.print(f"driving the components at {', '.join(f'{k} {v}' for k, v in cfg.attach.items())}")
        else:
            start_components(cfg, settings, procs, ports, urls, model_dir, runtime, run_dir, console)
        watcher = Watcher(settings)
        # a user's run: their harness with its own settings; a preset's: the harness it says
        harness = (HarnessSpec(name=cfg.harness, config=cfg.harness_config) if cfg.model or given.harness is None
                   else given.harness)
        steps = Steps(cfg, run_id, settings, watcher, procs, tracker, urls, given.train, given.heldout, harness)
        sent_steps, sent_evals = steps.resume()
        if sent_steps or sent_evals:
            console.print(f"resuming {run_id}: {sent_steps} steps and {sent_evals} evals were sent; "
                          f"components adopted: {', '.join(procs.adopted) or 'none'}")
        held = steps.evals.held
        with Live(table(cfg, steps.results, steps.lag, "starting", held), console=console, refresh_per_second=2) as live:
            while not steps.done:
                status = steps.tick(on_step, metrics, console)
                live.update(table(cfg, steps.results, steps.lag, status, held))
            live.update(table(cfg, steps.results, steps.lag, "done", held))
        summary = write_report(run_dir, cfg, steps.results, watcher.policy, settings, time.monotonic() - t0, model_dir,
                               heldout=held, warm=warm, total_s=time.monotonic() - t_start, viewer_url=urls["ui"],
                               extra=steps.summary_extra(), preset_lines=given.report)
    finally:
        if watcher is not None:
            watcher.close()
        if tracker is not None:
            tracker.close()
        procs.stop_all()
    return summary


def _model(cfg: RunConfig, given: Preset, stage: Stage) -> tuple[Path, dict]:
    """The model every component started here loads, and its warm-start record: the experiment's own (or,
    with --driver-only, whatever the engine elsewhere serves), else the one the preset makes."""
    if cfg.model or (cfg.attach and not cfg.only):
        # configure.py resolved it once (infra.models.local_model_dir) for every component started here
        return (Path(cfg.model) if cfg.model else Path("(the engine's model)")), dict(NO_WARM_START)
    if given.warm_start is None:
        raise ProcessFailed("the run has no model: the experiment names none, and its preset makes none")
    made = given.warm_start(stage)
    return made.model_dir, made.record


def run_experiment(exp: Experiment, cfg: RunConfig, preset: MakePreset = from_config) -> Path | None:
    """Run ``exp`` as configure.run_config made it into ``cfg`` (checked, its model resolved), on
    ``preset``'s tasks; returns the path of run-summary.json (None with ``cfg.only``: those components are
    served until they exit)."""
    t0 = time.monotonic()
    settings = Settings(storage_url=exp.storage_url) if exp.storage_url else None  # else: the run's own prefix
    path = run(cfg, settings, preset=preset)
    if path is None:
        return None
    return write_run_summary(exp, cfg, path, time.monotonic() - t0)
