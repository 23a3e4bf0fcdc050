"""An experiment file as the driver runs it: ``run_config`` (Experiment -> RunConfig) and the run's id.

What the file alone does not show is checked here, before anything starts (a run otherwise finds it out
only after six processes came up): the tasks in its sources, the model (resolved once, for every component
started here), the harness and the runtime, the tasks' images where the sessions run here (one that can be
neither pulled nor built refuses the run, not each of its sessions), and what ``--only`` needs. Each problem is an ExperimentError
of one line naming the key and the fix.

The same command continues a run that was killed: the run's id is a digest of the experiment and the run
directory (``run_id``), so the topics and checkpoints it names are found again, and the driver reads where
the run stands from them (schedule.py). Another experiment or run directory is another run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .components import COMPONENTS, SERVES, host_runtime, pick_runtime
from .config import RunConfig
from .experiment import Experiment, ExperimentError
from .preset import MakePreset
from .schedule import epoch_steps


def run_config(exp: Experiment, run_dir: Path, driver_only: bool = False, only: frozenset[str] = frozenset(),
               preset: MakePreset | None = None, node_rank: int = 0) -> RunConfig:
    """The run as the driver takes it: the user's model and tasks, or, where the file names a preset's tasks
    (``train: builtin:...``), ``preset``'s (the CLI's registry, polarstream/presets.py, finds it). ``only``:
    start these components here and drive nothing (``only_checked`` says what that needs); ``node_rank``: which
    of the trainer's machines this is (``trainer: {nodes}``; the others start it with ``--only trainer``).

    Checked here (module docstring): the tasks, the model, and, where the gateway node runs here, the
    harness and the runtime. ExperimentError of one line naming the key and the fix."""
    cfg = RunConfig(name=exp.name, steps=exp.max_steps, tasks_per_step=exp.groups_per_step, samples=exp.group_size, heldout=exp.heldout,
                     heldout_samples=exp.eval_samples, harness=exp.harness, runtime=exp.runtime, site_settings=exp.site_settings, seed=exp.seed, lr=exp.lr,
                     temperature=exp.temperature, step_timeout_s=exp.step_timeout_s, async_level=exp.async_level,
                     eval_every=exp.eval_every, harness_config=dict(exp.harness_config), run_dir=run_dir,
                     run_id=run_id(exp, run_dir), order=exp.order, min_completion=exp.min_completion,
                     early_stop_at=exp.early_stop_at, zero_signal=exp.zero_signal, replace_cap=exp.replace_cap,
                     retire=exp.retire, retire_after=exp.retire_after, loss=exp.loss, correction=exp.correction,
                     std_normalize=exp.std_normalize, overlong=exp.overlong.model_dump() if exp.overlong else {},
                     engine_logit_noise=exp.engine_logit_noise, engine_dtype=exp.engine_dtype)
    cfg.trainer_settings = trainer_settings(exp)
    cfg.trainer_nproc, cfg.trainer_nodes, cfg.trainer_rendezvous = trainer_launch(exp)
    if not 0 <= node_rank < cfg.trainer_nodes:
        raise ExperimentError(f"--node-rank {node_rank}: the trainer runs on {cfg.trainer_nodes} machine(s) "
                              f"(trainer.nodes), numbered 0 to {cfg.trainer_nodes - 1}")
    if node_rank and "trainer" not in only:
        raise ExperimentError(f"--node-rank {node_rank}: only a trainer machine has one; start it with --only trainer")
    cfg.node_rank = node_rank
    cfg.lora = exp.lora.model_dump() if exp.lora is not None else {}
    if exp.wandb is not None:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ExperimentError("wandb: Weights & Biases is turned on, but the wandb package is not installed "
                                  "(pip install wandb)")
        cfg.wandb = exp.wandb.model_dump()
    if driver_only:
        # the gateway where given: a LoRA run's on-policy gate reads its stamp (steps.py)
        cfg.attach = {"rollout": exp.rollout_url, "engine": exp.engine_url, **({"gateway": exp.gateway_url} if exp.gateway_url else {})}
    if only:
        cfg.only = only_checked(exp, only)
        cfg.attach = {k: v for k, v in component_urls(exp).items() if v}
    if exp.harness != "builtin" and "api" in exp.harness_config:
        cfg.api = str(exp.harness_config["api"])
    here = frozenset() if driver_only else only or frozenset(COMPONENTS)  # the components started on this machine
    if not exp.train.startswith("builtin:"):
        cfg.train_tasks = _tasks("train", exp.train, exp)
        cfg.eval_tasks = _tasks("eval", exp.eval, exp) if exp.eval else []
        cfg.task_set = exp.name
        # resolved where a component that loads it starts; the machines that start none leave it to those that do
        cfg.model = str(_model(exp.model)) if here & {"ui", "engine", "node", "trainer"} else exp.model
    elif preset is None:
        raise ExperimentError(f"train: {exp.train!r}: no preset provides it (polarstream/presets.py names them)")
    elif not exp.eval:
        cfg.heldout_samples = 0
    # the tasks the run will send: the file's own, or the preset's (the loop makes them again from the same cfg)
    made = preset(cfg) if cfg.train_tasks is None else None
    train, heldout = (made.train, made.heldout) if made is not None else (cfg.train_tasks, cfg.eval_tasks)
    _harness(exp.harness, installed=bool(cfg.model) and "node" in here)
    if "node" in here:  # the sessions run here
        cfg.runtime = _runtime(exp.runtime, [*train, *heldout])
        _images({"train": train, "eval": heldout}, cfg.runtime)
    if exp.order == "epochs" and exp.epochs:
        cfg.steps = min(cfg.steps, epoch_steps(len(train), exp.groups_per_step, exp.epochs))
    return cfg


def _tasks(key: str, source: str, exp: Experiment) -> list:
    """The tasks of the source at ``key`` (train or eval), under the file's agent_network and agent_processes;
    ExperimentError naming the key otherwise."""
    from producers.tasks import TaskSourceError, load_tasks, with_phase_policies

    try:
        return [with_phase_policies(t, exp.agent_network, exp.agent_processes) for t in load_tasks(source)]
    except TaskSourceError as e:
        raise ExperimentError(f"{key}: {e}") from None


MODEL_FIX = ("set model: to a built-in model (tiny), a local HF model directory, or a hub id already in the "
             "local HF cache (huggingface-cli download ORG/NAME)")


def _model(model: str) -> Path:
    """The local directory of the experiment's model (infra.models: the one resolver of every component)."""
    from infra.models import local_model_dir

    try:
        return local_model_dir(model)
    except FileNotFoundError as e:  # its message names the model already: "model 'X': ..."
        raise ExperimentError(f"model: {str(e).removeprefix('model ')}; {MODEL_FIX}") from None


def _harness(harness: str, installed: bool) -> None:
    """ExperimentError when ``harness`` is none an experiment can name, or (``installed``: a user's run whose
    sessions run here) its CLI is not installed here. A preset that makes the run's model installs its CLI
    itself (the demo's capture)."""
    from gateway.harnesses.install import NPM_HARNESSES, HarnessNotInstalled, bin_path
    from infra.settings import Settings

    if harness != "builtin" and harness not in NPM_HARNESSES:
        raise ExperimentError(f"harness: {harness!r}: expected builtin or one of {', '.join(NPM_HARNESSES)}")
    if installed and harness in NPM_HARNESSES:
        try:
            bin_path(harness, Settings().cache_dir)  # where the node will look for it
        except HarnessNotInstalled as e:
            raise ExperimentError(f"harness: {e}") from None


def _runtime(runtime: str, tasks: list) -> str:
    """The runtime the gateway node gets (components.pick_runtime), once it can run every one of ``tasks``:
    a task that brings an image (a Harbor task's environment/Dockerfile) needs a container engine, podman
    or docker (auto picks one); any other task runs on the host, and one that wants its workspace at a path
    of its own (a Harbor task with a workspace/: /app) needs the bwrap sandbox there."""
    import shutil

    from gateway.runtimes import container_engine

    picked = pick_runtime(runtime)
    install = "install bubblewrap (Debian: apt-get install bubblewrap)"
    imaged = [t for t in tasks if t.environment is not None]
    hosted = [t for t in tasks if t.environment is None]
    placed = next((t for t in hosted if t.workspace.mount or t.evaluator.kind == "harbor"), None)
    some = (f"{len(imaged)} tasks bring an image" if len(imaged) > 1 else f"task {imaged[0].task_id} brings an image"
            if imaged else "")
    if imaged and runtime in ("bwrap", "subprocess"):
        raise ExperimentError(f"runtime: {runtime} runs no image, and {some} (environment/Dockerfile); set runtime: "
                              "auto (podman or docker for those)")
    if imaged and runtime == "auto" and not container_engine():
        raise ExperimentError(f"runtime: {some} (environment/Dockerfile) and neither podman nor docker is installed "
                              "here; `make system` installs podman")
    if runtime in ("podman", "docker"):
        if not shutil.which(runtime):
            raise ExperimentError(f"runtime: {runtime} is not installed here"
                                  f"{'; `make system` installs podman' if runtime == 'podman' else ''}")
        if hosted:
            raise ExperimentError(f"runtime: {runtime} runs only tasks that bring an image, and task "
                                  f"{hosted[0].task_id} brings none; set runtime: auto (bwrap for those)")
        return picked
    # the tasks without an image: under bwrap, or, auto with no bwrap here, unsandboxed
    host = picked if picked in ("bwrap", "subprocess") else host_runtime()
    if not hosted:
        return picked
    if host == "bwrap" and not shutil.which("bwrap"):
        other = "" if placed else ", or set runtime: subprocess (sessions then run unsandboxed)"
        raise ExperimentError(f"runtime: bwrap is not installed here; {install}{other}")
    if host == "subprocess" and placed is not None:
        why, fix = (("found no bwrap here", install) if runtime == "auto" else
                    ("runs sessions unsandboxed", f"{install} and set runtime: bwrap"))
        raise ExperimentError(f"runtime: {runtime} {why}, and task {placed.task_id} wants its workspace at "
                              f"{placed.workspace.mount or '/app'}, which only bwrap can show; {fix}")
    # auto with no image among the tasks: the node gets what runs them, as it always did
    return host if not imaged else picked


def _images(sources: dict[str, list], runtime: str) -> None:
    """ExperimentError naming the first task whose image can be neither pulled nor built here (and how many
    more), asked of the container engine the node will use (gateway/runtimes/image_source.py)."""
    import asyncio

    from gateway.runtimes import container_engine
    from gateway.runtimes.image_source import plan_images

    imaged = [(key, t) for key, tasks in sources.items() for t in tasks if t.environment is not None]
    engine = runtime if runtime in ("podman", "docker") else container_engine()
    if not imaged or not engine:
        return
    plans = asyncio.run(plan_images([t.environment for _, t in imaged], engine))
    refused = [(key, t, plan) for (key, t), plan in zip(imaged, plans) if plan.refused]
    if refused:
        key, task, plan = refused[0]
        more = f" ({len(refused) - 1} more task(s) refused as well)" if len(refused) > 1 else ""
        raise ExperimentError(f"{key}: task {task.task_id}: {plan.why}{more}")


# Trainer settings the experiment sets itself, so that the driver and the trainer cannot disagree on them
OWNED = {"lr": "lr", "temperature": "temperature", "max_staleness": "async_level", "stale_mode": "async_level",
         "groups_per_step": "groups_per_step", "max_steps": "max_steps", "skip_task_sets": "eval",
         "skip_zero_variance": "zero_signal", "loss": "loss", "correction": "correction", "lora_rank": "lora",
         "lora_alpha": "lora", "lora_dropout": "lora", "lora_target_modules": "lora"}


# How the trainer is launched, not how it trains: the file's trainer: keys that are torchrun's, not --set's
LAUNCH = ("nproc", "nodes", "rendezvous")


def trainer_launch(exp: Experiment) -> tuple[int, int, str]:
    """The file's ``trainer: {nproc, nodes, rendezvous}``: processes per machine, machines, and where node 0
    hosts torchrun's rendezvous (host:port; needed once there are several machines). ExperimentError of one
    line naming the key otherwise."""
    given = exp.trainer
    counts = []
    for key in ("nproc", "nodes"):
        value = given.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = "trainer processes on each machine" if key == "nproc" else "machines the trainer runs on"
            raise ExperimentError(f"trainer.{key}: {value!r}: expected a whole number of {what}, 1 or more")
        counts.append(value)
    nproc, nodes = counts
    rendezvous = str(given.get("rendezvous", ""))
    host, _, port = rendezvous.rpartition(":")
    if rendezvous and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ExperimentError(f"trainer.rendezvous: {rendezvous!r}: expected host:port (where the trainer's node 0 "
                              "hosts torchrun's rendezvous)")
    if nodes > 1 and not rendezvous:
        raise ExperimentError(f"trainer.nodes: {nodes} machines need trainer.rendezvous: host:port, an address of "
                              "the machine that starts node 0 (--node-rank 0) which the others reach")
    return nproc, nodes, rendezvous


def trainer_settings(exp: Experiment) -> dict[str, str]:
    """The file's ``trainer:`` settings as the trainer's --set values (less LAUNCH's); ExperimentError names a
    key that is not a trainer setting, or one the experiment sets itself."""
    from dataclasses import fields

    from trainer.config import TrainConfig

    known = {f.name for f in fields(TrainConfig)} | set(LAUNCH)
    for key in exp.trainer:
        if key in OWNED:
            raise ExperimentError(f"trainer.{key}: set by the experiment's {OWNED[key]}, not here")
        if key not in known:
            raise ExperimentError(f"trainer.{key}: not a trainer setting (trainer/config.py)")
    settings = {k: v for k, v in exp.trainer.items() if k not in LAUNCH}
    if exp.lora is not None:
        settings.update(lora_rank=exp.lora.rank, lora_alpha=exp.lora.alpha, lora_dropout=exp.lora.dropout,
                        lora_target_modules=",".join(exp.lora.target_modules))
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items()}


def component_urls(exp: Experiment) -> dict[str, str]:
    """Where the file says the run's engine, gateway node and rollout server are ('' where it does not)."""
    return {"engine": exp.engine_url, "gateway": exp.gateway_url, "rollout": exp.rollout_url}


def only_checked(exp: Experiment, only: frozenset[str]) -> frozenset[str]:
    """``--only``'s components, once the file says all they need: the run's id (every machine must name the
    same run), the URL each one serves at (the others reach it there), and where the engine and gateway
    node that the node and trainer talk to are. ExperimentError of one line otherwise."""
    unknown = sorted(only - set(COMPONENTS))
    if unknown or not only:
        raise ExperimentError(f"--only {','.join(sorted(only))}: expected some of {','.join(COMPONENTS)}")
    if not exp.run_id:
        raise ExperimentError("--only needs run_id in the file: every machine of a run must name the same run")
    urls = component_urls(exp)
    # each URL a component here serves at or talks to: node -> engine; trainer -> engine, gateway node
    uses = {"node": ("engine",), "trainer": ("engine", "gateway")}
    for name in sorted(only):
        for url in ((SERVES[name],) if name in SERVES else ()) + uses.get(name, ()):
            if not urls[url]:
                raise ExperimentError(f"--only {name}: needs {url}_url in the file (where the "
                                      f"{'gateway node' if url == 'gateway' else url} of the run serves)")
    return only


# Where the components are, and where the figures also go, is not what the run is: the same run, driven
# from elsewhere or with W&B turned on, keeps its id.
NOT_IDENTITY = {"run_id", "rollout_url", "engine_url", "gateway_url", "wandb", "slurm", "kubernetes"}


def run_id(exp: Experiment, run_dir: Path) -> str:
    """The run's name on Kafka and in storage: the experiment's own ``run_id``, else its name and a digest
    of its settings and the run directory. Settings left at their defaults are not in the digest, so a
    setting added later does not rename the runs that predate it."""
    if exp.run_id:
        return exp.run_id
    digest = hashlib.sha256(f"{exp.model_dump_json(exclude=NOT_IDENTITY, exclude_defaults=True)}\n{run_dir.absolute()}".encode()).hexdigest()[:8]
    return f"{exp.name}-{digest}"
