"""The components a run starts, each its own process exactly as a user would run it: the viewer, the engine,
a gateway node with its sandboxed harness runs, the Faust stream worker, the trainer and the rollout
server (or some of them: ``--only``, served until they exit), on Kafka and the S3 server (``bring_up``),
with the environment they get (``child_env``) and where each one is (``addresses``)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from infra.settings import Settings

from .config import RunConfig
from .evaluation import HELDOUT_SET
from .processes import TORCHRUN, Processes

# What a run starts, in this order; ``polarstream run --only`` starts some of them on one machine
COMPONENTS = ("ui", "engine", "node", "streams", "trainer", "rollout")
# The components other machines reach, and the URL (in RunConfig.attach, the experiment's *_url) they use
SERVES = {"engine": "engine", "node": "gateway", "rollout": "rollout"}


def bring_up(cfg: RunConfig, settings: Settings, console) -> None:
    """Kafka and the S3 server, started here; or, where they run elsewhere (``--driver-only``, ``--only``),
    the run's topics, which must exist whichever part of the run starts first."""
    if not cfg.attach and not cfg.only:
        from infra.stack import Stack

        with console.status("bringing up Kafka and the S3 server (first run fetches jars from Maven Central)"):
            Stack(settings).up()
        return
    from infra.reach import require_kafka
    from infra.topics import ensure_topics

    require_kafka(settings, wait_s=settings.wait_for_s)
    ensure_topics(settings)


def run_settings(base: Settings, run_id: str) -> Settings:
    """``base`` with the run's own topic prefix and checkpoint folder (where it names none): unique per run,
    so topics and checkpoints of earlier runs on the same cluster never mix in."""
    return base.model_copy(update={
        "topic_prefix": base.topic_prefix or f"{run_id}.",
        "storage_url": base.storage_url or f"s3://{base.s3_bucket}/{run_id}",
    })


def child_env(settings: Settings, run_dir: Path) -> dict[str, str]:
    """What every component gets in its environment: the run's Kafka, topics, storage and secrets."""
    return {
        "POLAR_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "POLAR_TOPIC_PREFIX": settings.topic_prefix,
        "POLAR_STORAGE_URL": settings.storage_url, "POLAR_S3_PORT": str(settings.s3_port),
        "POLAR_S3_ENDPOINT": settings.s3_endpoint_url, "POLAR_DATA_DIR": str(run_dir / "data"),
        "POLAR_SESSION_SECRET": settings.session_secret, "POLAR_ADMIN_TOKEN": settings.admin_token,
        "OMP_NUM_THREADS": "1",
        **({"POLAR_ADVERTISED_HOST": settings.advertised_host} if settings.advertised_host else {}),
    }


def addresses(cfg: RunConfig, procs: Processes, settings: Settings) -> tuple[dict[str, int], dict[str, str]]:
    """Each component's port here and the URL the driver and the others reach it at: here (every component, or
    the ``--only`` ones, at the ports of their URLs in the experiment; at the machine's advertised host), or
    elsewhere (``cfg.attach``)."""
    ports = {name: procs.port(name) for name in ("engine", "gateway", "rollout", "ui", "streams_metrics", "trainer_metrics")}
    for name in cfg.only & SERVES.keys():  # served where the experiment's URL says the others will find it
        ports[SERVES[name]] = urlsplit(cfg.attach[SERVES[name]]).port or ports[SERVES[name]]
    # what runs on this machine: everything, nothing (--driver-only), or the --only components
    here = ({SERVES.get(name, name) for name in cfg.only} | {"streams_metrics", "trainer_metrics"} if cfg.only
            else set() if cfg.attach else set(ports))
    urls = {name: f"http://{settings.announced_host}:{port}" if name in here else "" for name, port in ports.items()}
    urls.update({k: v for k, v in cfg.attach.items() if k not in here})
    return ports, urls


def host_runtime() -> str:
    """Where a task without an image runs: bwrap where it is installed, else subprocess (unsandboxed)."""
    return "bwrap" if shutil.which("bwrap") else "subprocess"


def pick_runtime(requested: str) -> str:
    """The runtime the gateway node gets: ``auto`` stays auto where a container engine (podman, docker) is
    installed, so the node runs a task that brings an image in a container of it and any other task under
    host_runtime(), as that alone would; with no engine, ``auto`` is host_runtime() itself."""
    if requested != "auto":
        return requested
    # gateway.runtimes.container_engine's test, here without importing the gateway into the driver
    return "auto" if shutil.which("podman") or shutil.which("docker") else host_runtime()


def component_args(name: str, cfg: RunConfig, settings: Settings, ports: dict[str, int], urls: dict[str, str],
                   model_dir: Path, runtime: str, run_dir: Path, host: str = "",
                   node_rank: str | None = None) -> tuple[str, ...]:
    """The ``polarstream`` arguments that start component ``name`` of this run: the one place they are written,
    for a process here, a container, a Slurm step or a Kubernetes pod alike. ``host``: the listen address of
    the components others reach (engine, node, rollout, ui); '' = the settings' (loopback on one machine,
    every interface once ``advertised_host`` is set). A trainer of several processes (``cfg.trainer_nproc``,
    ``cfg.trainer_nodes``) is a ``torchrun`` command instead (``command_line``): ``node_rank`` is this
    machine's among the trainer's (``cfg.node_rank`` if None; a launcher passes what its scheduler expands
    per node, such as ``$(JOB_COMPLETION_INDEX)``)."""
    host = host or settings.listen_host
    listen = ("--host", host) if host != "127.0.0.1" and name in ("ui", "engine", "node", "rollout") else ()
    return (*_args(name, cfg, settings, ports, urls, model_dir, runtime, run_dir, node_rank), *listen)


def _args(name: str, cfg: RunConfig, settings: Settings, ports: dict[str, int], urls: dict[str, str],
          model_dir: Path, runtime: str, run_dir: Path, node_rank: str | None) -> tuple[str, ...]:
    if name == "ui":
        return ("ui", "--port", str(ports["ui"]), "--model", str(model_dir))
    if name == "engine":
        return ("engine", "--model", str(model_dir), "--port", str(ports["engine"]),
                "--seed", str(cfg.seed), "--threads", "1",
                *(("--logit-noise", str(cfg.engine_logit_noise)) if cfg.engine_logit_noise else ()),
                *(("--dtype", cfg.engine_dtype) if cfg.engine_dtype != "float32" else ()))
    if name == "node":
        return ("node", "--engine-url", urls["engine"], "--model", str(model_dir),
                "--runtime", runtime, "--site-settings", cfg.site_settings, "--port", str(ports["gateway"]),
                "--run-workers", "4",
                "--init-workers", "4", "--ready-target", "4", "--postrun-workers", "4",
                "--temperature", str(cfg.temperature))  # pinned: the trainer's temperature
    if name == "streams":
        return ("streams", "worker", "--builder", "prefix_merging", "--group-deadline", "120",
                "--missing-calls-grace", "10", "--stats-interval", "2",
                "--metrics-port", str(ports["streams_metrics"]),
                *(() if cfg.std_normalize else ("--advantage", "no_std")),  # Dr. GRPO: r - mean
                *[a for k, v in cfg.overlong.items() for a in (f"--overlong-{k.replace('_', '-')}", str(v))])
    if name == "trainer":
        args = ("train", "--model", str(model_dir), "--groups-per-step", str(cfg.tasks_per_step),
                "--max-steps", str(cfg.steps), "--lr", str(cfg.lr), "--engine", f"polar={urls['engine']}",
                "--gateway", urls["gateway"], "--run-dir", str(run_dir / "trainer"),
                "--storage-url", settings.storage_url, "--metrics-port", str(ports["trainer_metrics"]),
                # a group where every sample scored the same still closes the demo's on-policy step;
                # the trainer publishes the step but leaves the weights untouched (no signal)
                "--set", "skip_zero_variance=false", "--set", "weight_decay=0.0",
                "--set", f"temperature={cfg.temperature}",
                "--set", f"loss={cfg.loss}", "--set", f"correction={cfg.correction}",
                # the driver's bound, enforced again where the groups are trained (one setting for both).
                # Groups finish out of order, so one of step k can reach the trainer after step k+1's,
                # a version later than the bound: it is down-weighted (0.5 per version past S), not
                # dropped, since a dropped group would leave its step a group short for good.
                "--set", f"max_staleness={cfg.async_level}", "--set", "stale_mode=downweight",
                # held-out groups are for evaluation only: the trainer consumes and skips them
                "--set", f"skip_task_sets={HELDOUT_SET}",
                # LoRA: each version's adapter is served as <this name>-v<version>, one name per run
                *(("--set", f"model_name={cfg.run_id or cfg.name}") if cfg.lora else ()),
                # the experiment's own trainer settings (configure.py checked that none of the above)
                *[a for k, v in cfg.trainer_settings.items() for a in ("--set", f"{k}={v}")])
        return torchrun(cfg, str(cfg.node_rank) if node_rank is None else node_rank, args)
    if name == "rollout":
        return ("rollout", "--port", str(ports["rollout"]))
    raise ValueError(f"no component {name!r} (one of {', '.join(COMPONENTS)})")


def torchrun(cfg: RunConfig, node_rank: str, args: tuple[str, ...]) -> tuple[str, ...]:
    """``polarstream ARGS`` as one process, or under torchrun as ``cfg.trainer_nproc`` processes on each of
    ``cfg.trainer_nodes`` machines: FSDP2 (trainer/parallel.py) shards the model over them. One machine: a
    rendezvous of its own (--standalone). Several: torchrun's static rendezvous at ``cfg.trainer_rendezvous``,
    hosted by node 0, whose first process is global rank 0 (the one that talks to Kafka and the engines)."""
    if cfg.trainer_nproc == 1 and cfg.trainer_nodes == 1:
        return args
    where = (("--standalone",) if cfg.trainer_nodes == 1 else
             ("--nnodes", str(cfg.trainer_nodes), "--node-rank", node_rank, "--rdzv-backend", "static",
              "--rdzv-endpoint", cfg.trainer_rendezvous, "--rdzv-id", cfg.run_id or cfg.name))
    # a rank that dies ends them all (max-restarts 0): the driver starts the trainer again, from its checkpoint
    return (TORCHRUN, *where, "--nproc-per-node", str(cfg.trainer_nproc), "--max-restarts", "0",
            "-m", "polarstream", *args)


def command_line(args: tuple[str, ...]) -> tuple[str, ...]:
    """component_args as the command a container, Slurm step or pod runs (the project's venv on its PATH)."""
    return args if args[:1] == (TORCHRUN,) else ("polarstream", *args)


# Where each served component answers once it is up
_HEALTH = {"ui": ("ui", "/seq"), "engine": ("engine", "/health"), "node": ("gateway", "/health"),
           "rollout": ("rollout", "/health")}


def start_components(cfg: RunConfig, settings: Settings, procs: Processes, ports: dict[str, int], urls: dict[str, str],
                     model_dir: Path, runtime: str, run_dir: Path, console, only: Sequence[str] = COMPONENTS) -> None:
    """The viewer, engine, gateway node, stream worker, trainer and rollout server (those in ``only``), each
    its own process (adopted instead where a killed driver of this run left it running)."""
    def start(name: str) -> None:
        child = procs.start(name, *component_args(name, cfg, settings, ports, urls, model_dir, runtime, run_dir))
        if name in _HEALTH:
            url, path = _HEALTH[name]
            procs.wait_http(child, f"{urls[url]}{path}")

    # The viewer before the services: it follows the run's topics from their creation on (with the
    # model's tokenizer, so traces read as text).
    if "ui" in only:
        start("ui")
        console.print(f"viewer: [bold]{urls['ui']}/[/]  (groups, sessions with their chains, traces; live)")
    with console.status(f"starting {', '.join(c for c in COMPONENTS[1:] if c in only)}"):
        for name in COMPONENTS[1:]:
            if name in only:
                start(name)


def serve(cfg: RunConfig, procs: Processes, urls: dict[str, str], console) -> None:
    """``--only``: keep this machine's components running (a trainer that dies is started again, and one
    that finished its steps may exit) until all have exited or the command is interrupted."""
    console.print(f"running {', '.join(c for c in COMPONENTS if c in cfg.only)} of run {cfg.run_id} "
                  f"({', '.join(f'{SERVES[c]} {urls[SERVES[c]]}' for c in COMPONENTS if c in cfg.only and c in SERVES) or 'no URL'}); "
                  "Ctrl-C stops them")
    while any(c.proc.poll() is None for c in procs.children):
        for name in procs.check_all(finished_ok=frozenset({"trainer"}), restart=frozenset({"trainer"})):
            console.print(f"{name} exited; started it again (it resumes from its newest checkpoint)")
        time.sleep(1.0)
