"""``polarstream run FILE --launcher slurm --render DIR``: the run as one Slurm job, in an sbatch script.

Each component is a job step (``srun``) started with the command line and environment a run on one machine
gives it (components.py: ``component_args`` and ``command_line``, ``child_env``; nothing here writes a
component's arguments): a trainer of several processes is torchrun's command, on the last of the job's nodes
(``trainer: {nodes}`` of them, one torchrun each). The driver is the batch step itself: it knows when the run
is done, and it drives the components (``--driver-only``) from a copy of the experiment that names their
URLs. A trainer step that ends before its steps are done (``scancel JOB.STEP``, a node lost) is started again
and resumes from its newest checkpoint, as the driver restarts its own trainer (``serve``). When the driver
exits, the job ends and Slurm stops the steps left.
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from infra.process import free_port
from infra.settings import Settings

from .components import child_env, command_line, component_args, pick_runtime, run_settings
from .config import RunConfig
from .experiment import Experiment, ExperimentError, SlurmSettings

# The job's steps in the order they start (components.start_components' order; the viewer is left out: a
# user runs `polarstream ui` where a browser reaches it), and where each served one answers once it is up
STEPS = ("engine", "node", "streams", "trainer", "rollout")
HEALTH = {"engine": "engine", "node": "gateway", "rollout": "rollout"}
PORTS = ("engine", "gateway", "rollout", "streams_metrics", "trainer_metrics")
# Names only the job knows, put in as it starts: the first node (where the served components are), the trainer's
# first node (torchrun's rendezvous), and each trainer node's rank among them (in the step, on that node)
HEAD, TRAINER_HEAD, NODE_RANK = "@HEAD@", "@TRAINER_HEAD@", "NODE_RANK_OF_THIS_NODE"
TRAINER_RESTARTS = 3  # as Processes.check_all: a trainer that keeps dying is a failed run, not a loop


def render(exp: Experiment, cfg: RunConfig, out: Path) -> Path:
    """Write ``out``/run.sbatch and experiment.in.yaml (the copy of the experiment the driver step reads, the
    first node's name put in at the job's start); returns the script's path.
    ExperimentError of one line where the run cannot be a Slurm job as the file stands."""
    slurm = exp.slurm or SlurmSettings()
    if not cfg.model:
        raise ExperimentError(f"model: {exp.model!r} is made by the driver's warm start on this machine; "
                              "--launcher slurm needs a model directory the nodes can read (model: PATH)")
    if cfg.trainer_nodes > slurm.nodes:
        raise ExperimentError(f"slurm.nodes: {slurm.nodes}, and the trainer runs on {cfg.trainer_nodes} (trainer.nodes); "
                              "the job needs at least as many")
    settings = run_settings(Settings(storage_url=exp.storage_url) if exp.storage_url else Settings(), cfg.run_id)
    if slurm.nodes > 1:
        _reachable(settings)
        # served components listen on every interface and are reached at the first node's name (each step
        # announces its own node's: the script sets POLAR_ADVERTISED_HOST per step)
        settings = settings.model_copy(update={"advertised_host": HEAD})
    if cfg.trainer_nodes > 1:  # torchrun's rendezvous: the file's port, at the trainer's first node
        cfg = dataclasses.replace(cfg, trainer_rendezvous=f"{TRAINER_HEAD}:{cfg.trainer_rendezvous.rpartition(':')[2]}")
    out, run_dir = out.absolute(), cfg.run_dir.absolute()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    # Ports picked here: the experiment's own where its URLs name them, else free ones (on a single node,
    # free ones now; on a cluster's node, as good as any fixed port)
    ports = {name: free_port() for name in PORTS}
    for name, url in (("engine", exp.engine_url), ("gateway", exp.gateway_url), ("rollout", exp.rollout_url)):
        ports[name] = (urlsplit(url).port if url else None) or ports[name]
    urls = {name: f"http://{settings.announced_host}:{port}" for name, port in ports.items()}
    commands = {name: command_line(component_args(name, cfg, settings, ports, urls, Path(cfg.model),
                                                  pick_runtime(cfg.runtime), run_dir, node_rank=NODE_RANK))
                for name in STEPS}
    driven = {**exp.model_dump(mode="json", exclude_defaults=True, exclude={"slurm"}), "run_id": cfg.run_id,
              "model": cfg.model, "engine_url": urls["engine"], "gateway_url": urls["gateway"],
              "rollout_url": urls["rollout"]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiment.in.yaml").write_text(
        f"# {exp.name} as the job's driver runs it (--driver-only): rendered by polarstream run --launcher slurm\n"
        + yaml.safe_dump(driven, sort_keys=False))
    env = {k: v for k, v in child_env(settings, run_dir).items() if k != "POLAR_ADVERTISED_HOST"}  # per step
    script = out / "run.sbatch"
    script.write_text(_script(slurm, cfg, env, commands, urls, out, run_dir))
    script.chmod(0o700)  # it holds the run's session secret and admin token
    return script


def submit(script: Path) -> str:
    """``sbatch`` the script; returns the job id. ExperimentError of one line where sbatch refuses it."""
    if not shutil.which("sbatch"):
        raise ExperimentError("--submit: sbatch is not installed here (Slurm's client; `make system` installs slurm-wlm)")
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ExperimentError(f"--submit: sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def _reachable(settings: Settings) -> None:
    """Several nodes reach Kafka and S3 at the addresses the script gives them: not this machine's loopback."""
    loopback = ("127.", "localhost", "[::1]")
    for what, address in (("Kafka (POLAR_KAFKA_BOOTSTRAP)", settings.kafka_bootstrap),
                          ("S3 (POLAR_S3_ENDPOINT)", settings.s3_endpoint_url)):
        if any(a.split("//")[-1].startswith(loopback) for a in address.split(",")):
            raise ExperimentError(f"slurm.nodes: {what} is {address}, this machine's loopback, which the job's "
                                  "other nodes cannot reach; set it to an address they can")


def _word(arg: str) -> str:
    """``arg`` quoted for bash, with the job's node names put in where the rendered URLs hold their marks."""
    for mark, var in ((HEAD, "HEAD"), (TRAINER_HEAD, "TRAINER_HEAD")):
        if mark in arg:
            return f'"${var}"'.join(_word(part) if part else "" for part in arg.split(mark))
    return shlex.quote(arg)


def _gpus(slurm: SlurmSettings, cfg: RunConfig) -> int:
    """GPUs the job asks for on each node: the engine's and the trainer's where they share the first node."""
    shared = slurm.nodes == cfg.trainer_nodes  # the trainer's nodes are the last ones; all of them here
    return slurm.engine_gpus + slurm.trainer_gpus if shared else max(slurm.engine_gpus, slurm.trainer_gpus)


def _script(slurm: SlurmSettings, cfg: RunConfig, env: dict[str, str], commands: dict[str, tuple[str, ...]],
            urls: dict[str, str], out: Path, run_dir: Path) -> str:
    python, q, several = slurm.python or sys.executable, shlex.quote, slurm.nodes > 1
    head = [f"#SBATCH --job-name={cfg.run_id}", f"#SBATCH --nodes={slurm.nodes}", f"#SBATCH --output={out}/slurm-%j.out"]
    head += [f"#SBATCH --{key}={value}" for key, value in (("partition", slurm.partition), ("account", slurm.account),
                                                          ("time", slurm.time)) if value]
    head += ["#SBATCH --exclusive"] * slurm.exclusive + ([f"#SBATCH --gpus-per-node={_gpus(slurm, cfg)}"] if _gpus(slurm, cfg) else [])
    head += [f"#SBATCH {option}" for option in slurm.sbatch]
    t = cfg.trainer_nodes
    lines = [
        "#!/bin/bash", f"# {cfg.name}: run {cfg.run_id} as one Slurm job (polarstream run --launcher slurm).",
        "# Every component is a step started with the command line and environment polarstream run gives",
        "# it on one machine; the driver is the batch step. Rendered: edit the experiment, not this.",
        *head, "set -uo pipefail", "",
        "# the run's environment (polarstream/driver/components.py: child_env)",
        *[f"export {k}={q(v)}" for k, v in env.items()],
        f"PY={q(python)}", 'export PATH="$(dirname "$PY"):$PATH"  # polarstream and torchrun beside it',
        f"RUN_DIR={q(str(run_dir))}", 'mkdir -p "$RUN_DIR/logs"',
        'NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        f'HEAD=${{NODES[0]}}; TRAINER_NODES=("${{NODES[@]: -{t}}}"); TRAINER_HEAD=${{TRAINER_NODES[0]}}',
        f'sed "s/{HEAD}/$HEAD/g" {q(str(out / "experiment.in.yaml"))} > "$RUN_DIR/experiment.yaml"', "",
        "# a step on N nodes of a list (one task each), its log under RUN_DIR/logs, sharing the nodes' CPUs",
        "# with the others (--overlap)" + (": on each node it announces that node's name and, in a trainer of "
                                           "several nodes, its rank" if several else ""),
        'step() { local name=$1 n=$2 where=$3 gpus=$4; shift 4  # gpus: srun\'s own --gpus option, or ""',
        '  srun --overlap --nodes="$n" --ntasks="$n" --ntasks-per-node=1 --nodelist="$where" --job-name="$name" $gpus \\',
        '    --kill-on-bad-exit=1 --open-mode=append --output="$RUN_DIR/logs/$name.log" ' +
        (f"bash -c 'export POLAR_ADVERTISED_HOST=$SLURMD_NODENAME; exec \"${{@//{NODE_RANK}/$SLURM_PROCID}}\"' \"$name\" "
         if several else "") + '"$@"; }',
        "wait_http() {  # until a served component answers, or its step has ended",
        '  local url=$1 pid=$2',
        '  until "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$url" 2>/dev/null; do',
        '    kill -0 "$pid" 2>/dev/null || { echo "its step ended before $url answered (RUN_DIR/logs)" >&2; exit 1; }',
        "    sleep 1; done; }",
        "pids=()", 'stop() { kill -TERM "${pids[@]}" 2>/dev/null; wait; }', "trap stop EXIT", "",
        "# Kafka's topics for this run, before any component uses them",
        '"$PY" -m polarstream infra topics >/dev/null || { echo "could not apply the run\'s topics" >&2; exit 1; }', ""]
    for name in STEPS:
        cmd = " ".join(_word(a) for a in commands[name])
        if name == "trainer":
            gpus = q(f"--gpus-per-node={slurm.trainer_gpus}" if slurm.trainer_gpus else "")
            lines += [f"# the trainer ({t} node(s) x {cfg.trainer_nproc} process(es)): started again when its step "
                      f"ends before its {cfg.steps} steps are done (it resumes from its newest checkpoint)",
                      f"( for attempt in $(seq 0 {TRAINER_RESTARTS}); do",
                      f'    step trainer {t} "$(IFS=,; echo "${{TRAINER_NODES[*]}}")" {gpus} {cmd} && exit 0',
                      '    echo "trainer step ended (attempt $attempt); starting it again" >&2',
                      "  done; exit 1 ) &", "pids+=($!)"]
        else:
            gpus = q(f"--gpus={slurm.engine_gpus}" if name == "engine" and slurm.engine_gpus else "")
            lines += [f'step {name} 1 "$HEAD" {gpus} {cmd} &', "pids+=($!)"]
        if name in HEALTH:
            lines.append(f'wait_http "{urls[HEALTH[name]].replace(HEAD, "$HEAD")}/health" $!')
    lines += ["", "# the driver: sends the steps' tasks, watches the run's topics, writes the report",
              '"$PY" -m polarstream run "$RUN_DIR/experiment.yaml" --driver-only --run-dir "$RUN_DIR"',
              "exit $?  # the job's state: the driver's (the EXIT trap stops the steps first)", ""]
    return "\n".join(lines)
