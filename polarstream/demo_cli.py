"""`polarstream demo` (the main job, end to end on this machine) and `polarstream run` (an experiment file):
each reads its options into an experiment, finds the preset that hands the driver its tasks
(polarstream/presets.py), and runs it with polarstream/driver/."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


# `polarstream demo --lora`: the adapter and the rate it learns the demo with (LoRA moves a few weights, and
# needs a larger rate than full fine-tuning's 5e-4): 3x; in the in-process loop (polarstream/demo/learning.py) 2.5x
# learned about as fast as full weights and 8x collapsed (docs/trainer.md "LoRA" has the curves)
DEMO_LORA = {"lora": {"rank": 16, "alpha": 32}, "lr": 1.5e-3}


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        steps: Annotated[Optional[int], typer.Option(help="GRPO steps (one batch of task groups each) [default: 24; a real CLI: see --harness]")] = None,
        tasks_per_step: Annotated[Optional[int], typer.Option(help="task groups per step [default: 4]")] = None,
        samples: Annotated[Optional[int], typer.Option(help="samples per task (group size) [default: 8]")] = None,
        harness: Annotated[str, typer.Option(help="builtin, or a real CLI run unmodified: pi (measured; sized to 15 min), "
                                                  "qwen_code, claude_code, gemini_cli, opencode")] = "builtin",
        api: Annotated[Optional[str], typer.Option(help="the API the CLI speaks where it has a choice: pi anthropic, chat, "
                                                        "responses or google; opencode chat, anthropic or responses "
                                                        "[default: the first]")] = None,
        runtime: Annotated[str, typer.Option(help="auto (bwrap when installed; the demo's tasks bring no image), bwrap or subprocess")] = "auto",
        seed: Annotated[int, typer.Option(help="fixes the model, the warm start and the task order")] = 0,
        lr: Annotated[Optional[float], typer.Option(help="trainer learning rate [default: 5e-4]")] = None,
        heldout: Annotated[int, typer.Option(help="problems kept out of RL and evaluated before and after it")] = 16,
        run_dir: Annotated[Optional[Path], typer.Option(help="where logs, the report and demo-summary.json go")] = None,
        loss: Annotated[Optional[str], typer.Option(help="the policy loss: ppo_clip, gspo or cispo [default: ppo_clip]")] = None,
        correction: Annotated[Optional[str], typer.Option(help="engine/trainer mismatch correction: none, tis, icepop, "
                                                               "token_rs, seq_mask_geo or seq_mask_arith [default: none]")] = None,
        no_std_normalize: Annotated[bool, typer.Option("--no-std-normalize", help="advantages r - mean, not divided by "
                                                       "the group's std (Dr. GRPO)")] = False,
        logit_noise: Annotated[Optional[float], typer.Option(help="the engine adds N(0, SIGMA^2) noise to its logits: a "
                                                                  "controlled engine/trainer mismatch [default: 0]")] = None,
        engine_dtype: Annotated[Optional[str], typer.Option(help="the engine's weights and matmuls: float32 or bfloat16 "
                                                                 "(against the trainer's float32: a reduced-precision "
                                                                 "mismatch) [default: float32]")] = None,
        lora: Annotated[bool, typer.Option("--lora", help="train a LoRA adapter (rank 16, alpha 32) on the frozen "
                                                         "model instead of every weight, at lr 1.5e-3 unless --lr")] = False,
    ) -> None:
        """Train an agent end to end (Kafka, S3, engine, gateway node, Faust, trainer, rollout) and report.
        The run is `polarstream run` of the experiment file shipped with the package (polarstream/demo/demo.yaml)."""
        import time

        from .demo.preset import demo_experiment
        from .demo.shape import APIS
        from .driver.configure import run_config
        from .driver.experiment import ExperimentError
        from .presets import preset_for

        if harness != "builtin" and harness not in APIS:
            typer.echo(f"demo: --harness {harness}: expected builtin or one of {', '.join(sorted(APIS))}", err=True)
            raise typer.Exit(2)
        apis = APIS.get(harness, ("anthropic",))  # builtin: its own harness; --api does not apply
        if api is not None and api not in apis:
            spoken = f"{', '.join(apis[:-1])} or {apis[-1]}" if len(apis) > 1 else apis[0]
            typer.echo(f"demo: --api {api}: {harness} speaks {spoken} here", err=True)
            raise typer.Exit(2)
        try:
            exp = demo_experiment(harness, api or apis[0], runtime=runtime, seed=seed, heldout=heldout, max_steps=steps,
                                  groups_per_step=tasks_per_step, group_size=samples, loss=loss,
                                 correction=correction, std_normalize=False if no_std_normalize else None,
                                 engine_logit_noise=logit_noise, engine_dtype=engine_dtype,
                                 **({**DEMO_LORA, "lr": lr or DEMO_LORA["lr"]} if lora else {"lr": lr}))
            preset = preset_for(exp)  # demo.yaml trains on builtin:arith: the demo's own preset
            out = run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
            cfg = run_config(exp, out, preset=preset)  # checked before anything starts
        except ExperimentError as e:
            typer.echo(f"demo: {e}", err=True)
            raise typer.Exit(2) from None
        path = _run_to_end("demo", exp, cfg, preset)
        typer.echo(path.with_name("demo-summary.json"))

    @app.command("run")
    def run_command(
        experiment: Annotated[Optional[Path], typer.Argument(help="the experiment YAML (polarstream/driver/experiment.py); "
                                                                  "none: the arith family's defaults")] = None,
        seed: Annotated[Optional[int], typer.Option(help="overrides the file's seed")] = None,
        async_level: Annotated[Optional[int], typer.Option(help="overrides the file's async_level (S)")] = None,
        max_steps: Annotated[Optional[int], typer.Option(help="overrides the file's max_steps")] = None,
        run_dir: Annotated[Optional[Path], typer.Option(help="where logs, the report and run-summary.json go")] = None,
        driver_only: Annotated[bool, typer.Option("--driver-only", help="start nothing: drive the components that run "
                                                  "elsewhere (the file's rollout_url and engine_url)")] = False,
        only: Annotated[Optional[str], typer.Option("--only", help="start these components here (comma separated: ui, "
                                                     "engine, node, streams, trainer, rollout) and drive nothing: "
                                                     "one file, a run spread over machines")] = None,
        node_rank: Annotated[int, typer.Option("--node-rank", help="with --only trainer on one of several trainer "
                                               "machines (the file's trainer: nodes): which one this is, 0 hosting "
                                               "the rendezvous")] = 0,
        print_config: Annotated[bool, typer.Option("--print-config", help="print every setting with its meaning, as "
                                                                          "YAML, and exit: the file's (defaults filled "
                                                                          "in), or without one the defaults")] = False,
        launcher: Annotated[str, typer.Option(help="local: every component here; podman: each in a container of the "
                                                   "project image on one network, the driver too, as on hosts of their "
                                                   "own; slurm: an sbatch script of the run; k8s: Kubernetes manifests "
                                                   "(with --render DIR, then --submit; docs/deploy.md)")] = "local",
        render: Annotated[Optional[Path], typer.Option(help="--launcher slurm|k8s: write the job's files (the "
                                                            "manifests) to this directory (slurm: the run's too, "
                                                            "unless --run-dir)")] = None,
        submit: Annotated[bool, typer.Option("--submit", help="--launcher slurm: submit the rendered job (sbatch) "
                                                              "and print its id; k8s: kubectl apply it")] = False,
    ) -> None:
        """Run an RL experiment from one file: every component on this machine, your tasks, bounded asynchrony, evals."""
        import time

        from .driver.experiment import ExperimentError, load_experiment
        from .driver.experiment import print_config as settings_yaml

        where = str(experiment or "experiment")
        try:
            exp = load_experiment(experiment, seed=seed, async_level=async_level, max_steps=max_steps)
        except ExperimentError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        if print_config:
            given = experiment is not None or any(v is not None for v in (seed, async_level, max_steps))
            typer.echo(settings_yaml(exp, where) if given else settings_yaml(), nl=False)
            return
        if launcher == "podman":  # started from here, every part in a container of its own
            if driver_only or only is not None or render is not None or submit:
                typer.echo("error: --launcher podman starts every component and the driver in containers: no --only, "
                           "--driver-only, --render or --submit with it", err=True)
                raise typer.Exit(1)
            raise typer.Exit(_run_in_containers(exp, where, run_dir or Path("runs") / time.strftime(f"{exp.name}-%Y%m%d-%H%M%S")))
        if launcher != "local":  # the run rendered for a cluster manager, not started here
            _launch(launcher, exp, where, render, run_dir, submit, driver_only or only is not None)
            return
        if render is not None or submit:
            typer.echo(f"error: --{'render' if render is not None else 'submit'} is for a launcher "
                       "(--launcher slurm or k8s); the local run starts every component here", err=True)
            raise typer.Exit(1)
        if driver_only and not (exp.rollout_url and exp.engine_url):
            typer.echo(f"error: {where}: --driver-only needs rollout_url and engine_url in the file", err=True)
            raise typer.Exit(1)
        if driver_only and exp.lora is not None and not exp.gateway_url:  # its engines report the base's version only
            typer.echo(f"error: {where}: --driver-only with lora needs gateway_url in the file (the adapter's version "
                       "is the gateway's stamp)", err=True)
            raise typer.Exit(1)
        if driver_only and only is not None:
            typer.echo("error: --only starts components and --driver-only drives them: give one", err=True)
            raise typer.Exit(1)
        components = frozenset(c.strip() for c in only.split(",") if c.strip()) if only is not None else frozenset()
        out = run_dir or Path("runs") / time.strftime(f"{exp.name}-%Y%m%d-%H%M%S")
        from .driver.configure import run_config
        from .presets import preset_for

        preset = preset_for(exp)  # train: builtin:arith is the demo's family; a file or directory, the file's own tasks
        try:  # the model, the tasks, the harness and the runtime: checked before anything starts
            cfg = run_config(exp, out, driver_only, components, preset, node_rank)
        except ExperimentError as e:
            typer.echo(f"error: {where}: {e}", err=True)
            raise typer.Exit(1) from None
        path = _run_to_end("run", exp, cfg, preset)
        if path is not None:
            typer.echo(path)


def _run_in_containers(exp, where: str, run_dir: Path) -> int:
    """``run --launcher podman``: the project image (built, or found by its inputs' hash), the model made here,
    then every component and the driver in containers (polarstream/driver/containers.py); the driver's exit code."""
    from rich.console import Console

    from .driver.configure import run_config
    from .driver.containers import ContainerError, host_model, run_in_containers
    from .driver.experiment import ExperimentError
    from .presets import preset_for
    from .project_image import ProjectImageError, build_project_image

    console = Console()
    preset = preset_for(exp)
    try:
        cfg = run_config(exp, run_dir.absolute(), preset=preset)
        with console.status("the project image (polarstream images project; the first build takes minutes)"):
            image = build_project_image()
        console.print(f"image {image}")
        code = run_in_containers(exp, cfg, host_model(cfg, preset, console), cfg.run_dir, image, console)
    except ExperimentError as e:
        typer.echo(f"error: {where}: {e}", err=True)
        return 1
    except (ProjectImageError, ContainerError) as e:
        typer.echo(f"run failed: {' '.join(str(e).split())}", err=True)
        return 1
    console.print(f"driver exited {code}; its report: {cfg.run_dir / 'driver'}")
    return code


# `polarstream run --launcher NAME`: local, or a cluster manager the run is rendered for (_launch): each one a
# module of polarstream/driver by that name, with render(exp, cfg, DIR) -> path and submit(path) -> what to print
LAUNCHERS = ("slurm", "k8s")


def _launch(launcher: str, exp, where: str, render: Path | None, run_dir: Path | None, submit: bool,
            split: bool) -> None:
    """Render the run for ``launcher`` into ``render`` (and submit it); one line on stderr where it cannot."""
    from .driver.configure import run_config
    from .driver.experiment import ExperimentError
    from .presets import preset_for

    if launcher not in LAUNCHERS:
        typer.echo(f"error: --launcher {launcher}: expected one of local, podman, {', '.join(sorted(LAUNCHERS))}", err=True)
        raise typer.Exit(1)
    if render is None:
        typer.echo(f"error: --launcher {launcher} needs --render DIR (where the job's files go)", err=True)
        raise typer.Exit(1)
    if split:
        typer.echo(f"error: --launcher {launcher} places every component itself: no --only or --driver-only", err=True)
        raise typer.Exit(1)
    from .driver import k8s, slurm

    module = {"slurm": slurm, "k8s": k8s}[launcher]
    try:  # checked as a local run is, before anything is written
        cfg = run_config(exp, (run_dir or render).absolute(), preset=preset_for(exp))
        script = module.render(exp, cfg, render)
        typer.echo(script)
        if submit:
            typer.echo(f"submitted: {'job ' if launcher == 'slurm' else ''}{module.submit(script)}")
    except ExperimentError as e:
        typer.echo(f"error: {where}: {e}", err=True)
        raise typer.Exit(1) from None
    except OSError as e:  # the job's files could not be written there
        typer.echo(f"error: --render {render}: {e.strerror or e}", err=True)
        raise typer.Exit(1) from None


def _run_to_end(what: str, exp, cfg, preset) -> Path | None:
    """``run_experiment`` on ``preset``'s tasks, with SIGTERM taken as Ctrl-C; a failure or an interruption is
    one line on stderr and an exit code (1; 130, or 143 for SIGTERM), every process the run started stopped."""
    from producers.tasks import TaskSourceError

    from .driver.experiment import ExperimentError
    from .driver.loop import run_experiment
    from .driver.processes import ProcessFailed, stop_on_sigterm

    stop_on_sigterm()
    try:
        return run_experiment(exp, cfg, preset)
    except (ProcessFailed, TaskSourceError, ExperimentError) as e:
        typer.echo(f"{what} failed: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt as e:
        typer.echo(f"{what} interrupted; every process it started was stopped (infra stays up: polarstream infra down)",
                   err=True)
        raise typer.Exit(getattr(e, "exit_code", 130)) from None
