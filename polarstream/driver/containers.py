"""A run across containers, as across hosts: ``polarstream run FILE --launcher podman``.

Every part of the run is a container of the project image (polarstream/project_image.py) on one podman
network, each with its own network namespace and file system, reaching the others by name only: a Kafka
cluster (kafka-1..3, ``polarstream infra serve kafka``), the S3 server (s3), the engine, gateway nodes
(node-1, node-2: each sandboxes its sessions with bwrap inside its container), the stream worker, the
rollout server, the trainer, and the driver (``polarstream run --driver-only``). Nothing crosses between
them but Kafka, S3 and HTTP; the model directory is each host's, mounted read-only, as a model cache would be.

A component's command is components.component_args and its environment components.child_env (of the
network's Settings): the one place each is written, for a process, a container, a Slurm step or a pod.
The trainer and the stream worker restart on failure (a SIGKILLed trainer resumes from its newest
checkpoint in S3); a node that dies is left dead: its sessions move to the other node through Kafka.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from gateway.runtimes.images import engine_argv
from infra.kafka import cluster_id
from infra.settings import Settings

from .components import child_env, command_line, component_args
from .config import RunConfig
from .experiment import Experiment

class ContainerError(RuntimeError):
    """A container of the run could not start or became not ready; the message names it, with its log's tail."""


MODEL = Path("/model")  # where a host's model directory is mounted in the containers that load it
DATA = Path("/var/lib/polarstream")  # a container's own state (POLAR_DATA_DIR in the image)
PORTS = {"engine": 8000, "gateway": 8100, "rollout": 8080, "ui": 8200, "streams_metrics": 9100, "trainer_metrics": 9101}
HOSTS = {"engine": "engine", "gateway": "node-1", "rollout": "rollout", "ui": "ui", "streams_metrics": "streams",
         "trainer_metrics": "trainer"}  # the first trainer's, where several (trainer-1: its rank 0 serves /metrics)


@dataclass(frozen=True)
class Container:
    """One host of the run: its name on the network, its command in the image, its environment."""

    host: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    model: bool = False  # mounts the model directory read-only at MODEL
    sandbox: bool = False  # runs bwrap sandboxes inside (a gateway node)
    restart: bool = False  # started again when it exits with an error (as an orchestrator would)


def network_settings(run_id: str, brokers: int = 3) -> Settings:
    """The run's Settings as every container sees them: the brokers and S3 by their names on the network,
    the run's topics and checkpoints, and secrets of its own (the gateway listens beyond loopback)."""
    return Settings(kafka_bootstrap=",".join(f"kafka-{i}:9092" for i in range(1, brokers + 1)),
                    s3_endpoint="http://s3:9000", topic_prefix=f"{run_id}.", storage_url=f"s3://polarstream/{run_id}",
                    admin_token=secrets.token_hex(16), session_secret=secrets.token_hex(16), data_dir=DATA)


def urls() -> dict[str, str]:
    """Where each served component answers, by its name on the network."""
    return {name: f"http://{HOSTS[name]}:{port}" for name, port in PORTS.items()}


def stack(brokers: int = 3) -> list[Container]:
    """The Kafka nodes (one KRaft quorum of all of them, one cluster id) and the S3 server."""
    voters = ",".join(f"{i}@kafka-{i}:9093" for i in range(1, brokers + 1))
    cid = cluster_id()
    kafka = [Container(f"kafka-{i}", ("polarstream", "infra", "serve", "kafka", "--node-id", str(i), "--voters", voters,
                                      "--cluster-id", cid, "--advertise", f"kafka-{i}", "--heap-mb", "384"), restart=True)
             for i in range(1, brokers + 1)]
    return [*kafka, Container("s3", ("polarstream", "infra", "serve", "s3"), restart=True)]


def components(cfg: RunConfig, settings: Settings, runtime: str = "bwrap", nodes: int = 2) -> list[Container]:
    """The engine, the gateway nodes, the stream worker, the rollout server and the trainer (a container per
    trainer machine: ``trainer: {nodes: N}``, torchrun's rendezvous at trainer-1), each with the command line
    and environment a process of the same run gets (component_args, child_env), announcing its own name."""
    run_dir = DATA / "run"

    def part(host: str, name: str, node_rank: str | None = None, **kw) -> Container:
        own = settings.model_copy(update={"advertised_host": host})  # listens on every interface, announces host
        args = component_args(name, cfg, own, PORTS, urls(), MODEL, runtime, run_dir, node_rank=node_rank)
        return Container(host, command_line(args), child_env(own, run_dir), **kw)

    out = [part("engine", "engine", model=True)]
    for i in range(1, nodes + 1):
        node = part(f"node-{i}", "node", model=True, sandbox=True)
        out.append(replace(node, argv=(*node.argv, "--node-id", f"node-{i}")))
    out += [part("streams", "streams", restart=True), part("rollout", "rollout")]
    out += [part(trainer_host(cfg, rank), "trainer", str(rank), model=True, restart=True) for rank in range(cfg.trainer_nodes)]
    return out


def trainer_host(cfg: RunConfig, rank: int) -> str:
    """The trainer's container of machine ``rank``: trainer, or trainer-1, trainer-2... for several."""
    return "trainer" if cfg.trainer_nodes == 1 else f"trainer-{rank + 1}"


def on_network(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the trainer's rendezvous at its first container (torchrun's static rendezvous, hosted by
    node 0), whatever host the file named: the launcher names the hosts."""
    if cfg.trainer_nodes == 1:
        return cfg
    port = cfg.trainer_rendezvous.rpartition(":")[2] or "29400"
    return replace(cfg, trainer_rendezvous=f"{trainer_host(cfg, 0)}:{port}")


def driver_experiment(exp: Experiment, run_id: str) -> dict:
    """The experiment file the driver's container runs with --driver-only: the user's, with the run's id and
    where the components it drives answer."""
    u = urls()
    return {**exp.model_dump(mode="json", exclude_none=True), "run_id": run_id, "rollout_url": u["rollout"],
            "engine_url": u["engine"], "gateway_url": u["gateway"], "storage_url": f"s3://polarstream/{run_id}"}


def run_args(c: Container, image: str, network: str, prefix: str, model_dir: Path | None = None,
             mounts: tuple[tuple[Path, str], ...] = ()) -> list[str]:
    """``podman run`` of container ``c`` (after podman's own argv): detached, on ``network`` under its host
    name, with its environment."""
    # bwrap in a container: a user namespace (seccomp's default profile refuses one) and a fresh /proc (the
    # kernel refuses to mount one over podman's masked /proc paths). No capability is added: checked by hand,
    # and by tests/deploy/test_project_image.py.
    sandbox = ["--security-opt", "seccomp=unconfined", "--security-opt", "unmask=ALL"] if c.sandbox else []
    vols = [*(("-v", f"{model_dir}:{MODEL}:ro") if c.model and model_dir else ()),
            *(a for host, ctr in mounts for a in ("-v", f"{host}:{ctr}"))]
    return ["run", "-d", "--name", f"{prefix}-{c.host}", "--hostname", c.host,
            "--network", network, "--network-alias", c.host, "--label", f"io.polarstream.run={prefix}",
            "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",  # crun's defaults fail here (containers.md)
            *(["--restart", "on-failure:5"] if c.restart else []), *sandbox, *vols,
            *(a for k, v in sorted(c.env.items()) for a in ("-e", f"{k}={v}")), image, *c.argv]


def _podman(*args: str, check: bool = True, timeout: float | None = 120.0) -> subprocess.CompletedProcess:
    out = subprocess.run([*engine_argv("podman"), *args], capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    if check and out.returncode != 0:
        raise ContainerError(f"podman {' '.join(args[:3])}: {(out.stderr or out.stdout).strip()[-300:]}")
    return out


class ContainerRun:
    """The containers of one run on one network: started, waited for, and removed (with the network)."""

    def __init__(self, prefix: str, image: str, model_dir: Path, console=None):
        self.prefix, self.image, self.model_dir, self.console = prefix, image, model_dir, console
        self.network = f"{prefix}-net"
        self.started: list[str] = []

    def name(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def __enter__(self) -> "ContainerRun":
        _podman("network", "create", self.network)
        return self

    def start(self, c: Container, mounts: tuple[tuple[Path, str], ...] = ()) -> None:
        _podman(*run_args(c, self.image, self.network, self.prefix, self.model_dir, mounts))
        self.started.append(self.name(c.host))
        if self.console is not None:
            self.console.print(f"started {self.name(c.host)}: {' '.join(c.argv[:4])} ...")

    def wait_log(self, host: str, text: str, timeout_s: float) -> None:
        """Until ``host``'s output says ``text`` (a server's ready line); ContainerError with its log's tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = _podman("logs", self.name(host), check=False)
            if text in out.stdout + out.stderr:
                return
            state = _podman("inspect", "--format", "{{.State.Status}}", self.name(host), check=False).stdout.strip()
            if state in ("exited", "stopped"):
                raise ContainerError(f"{self.name(host)} exited before it was ready:\n{self.logs(host)}")
            time.sleep(1.0)
        raise ContainerError(f"{self.name(host)} not ready in {timeout_s:.0f} s:\n{self.logs(host)}")

    def logs(self, host: str, lines: int = 25) -> str:
        out = _podman("logs", "--tail", str(lines), self.name(host), check=False)
        return (out.stdout + out.stderr).strip()

    def wait(self, host: str) -> int:
        """Block until ``host``'s container exits; its exit code."""
        out = _podman("wait", self.name(host), check=False, timeout=None)
        return int(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else 1

    def __exit__(self, *exc) -> None:
        for name in reversed(self.started):
            _podman("rm", "-f", "-t", "5", name, check=False)
        _podman("network", "rm", "-f", self.network, check=False)


def host_model(cfg: RunConfig, preset, console) -> Path:
    """The model directory the containers mount: the experiment's own, or the one its preset makes here
    (the arith family's cached warm start)."""
    from .preset import Stage

    if cfg.model:
        return Path(cfg.model)
    given = preset(cfg)
    if given.capture is not None or given.warm_start is None:
        raise ContainerError("--launcher podman runs a preset's tasks only with its built-in harness and warm start "
                             "(a CLI harness's warm start is captured where every component runs on one host)")
    stage = Stage(cfg, Settings(), {}, cfg.run_dir, "bwrap", console)
    return given.warm_start(stage).model_dir


def run_in_containers(exp: Experiment, cfg: RunConfig, model_dir: Path, run_dir: Path, image: str, console,
                      brokers: int = 3, nodes: int = 2) -> int:
    """The whole run in containers; the driver's exit code (its report lands in ``run_dir``/driver)."""
    cfg, run_id = on_network(cfg), cfg.run_id
    prefix = f"polar-{secrets.token_hex(3)}"
    settings = network_settings(run_id, brokers)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "experiment.yaml").write_text(yaml.safe_dump(driver_experiment(exp, run_id), sort_keys=False))
    (run_dir / "containers.txt").write_text(prefix + "\n")
    servers, parts = stack(brokers), components(cfg, settings, nodes=nodes)
    with ContainerRun(prefix, image, model_dir, console) as run:
        for c in servers:
            run.start(c)
        for c in servers:
            run.wait_log(c.host, "ready", 300)
        # the run's topics before anything reads or writes them (as `bring_up` makes them for a run on one host)
        run.start(Container("topics", ("polarstream", "infra", "topics"), child_env(settings, DATA / "run")))
        if run.wait("topics") != 0:
            raise ContainerError(f"creating the run's topics failed:\n{run.logs('topics')}")
        for c in parts:
            run.start(c)
        driver = Container("driver", ("polarstream", "run", "/run-dir/experiment.yaml", "--driver-only", "--run-dir", "/run-dir/driver"),
                           child_env(settings, DATA / "run"))
        run.start(driver, mounts=((run_dir.absolute(), "/run-dir"),))
        follow = subprocess.Popen([*engine_argv("podman"), "logs", "-f", run.name("driver")], stdin=subprocess.DEVNULL)
        try:
            code = run.wait("driver")
        finally:
            follow.terminate()
            follow.wait()
            for c in (*servers, *parts, driver):  # every host's log, and the trainer's records, before they go
                (run_dir / f"{c.host}.log").write_text(run.logs(c.host, 2000) + "\n")
            _podman("cp", f"{run.name(trainer_host(cfg, 0))}:{DATA / 'run' / 'trainer'}", str(run_dir / "trainer"), check=False)
        return code
