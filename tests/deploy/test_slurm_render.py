"""``polarstream run --launcher slurm --render DIR``, without a cluster: the script is valid bash, each step
runs the command line and environment components.py gives that component (no second list), the driver's
copy of the experiment is the same run, and what cannot be a Slurm job is one line."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from polarstream.cli import app
from polarstream.driver.components import child_env, command_line, component_args, run_settings
from polarstream.driver.configure import NOT_IDENTITY, run_config
from polarstream.driver.experiment import ExperimentError, load_experiment
from polarstream.driver.slurm import STEPS, render


@pytest.fixture
def experiment(tmp_path) -> Path:
    from infra.models import ensure_model

    (tmp_path / "train.jsonl").write_text('{"task_id": "t1", "instruction": "write 2 to answer.txt", "num_samples": 1, '
                                          '"min_valid": 1}\n')
    f = tmp_path / "exp.yaml"
    f.write_text(yaml.safe_dump({"name": "rendered", "model": str(ensure_model("tiny")), "train": "train.jsonl",
                                 "eval": "", "runtime": "subprocess", "max_steps": 3, "trainer": {"grad_clip": 0.5}}))
    return f


def _steps(script: str) -> dict[str, list[str]]:
    """Each step's command as bash will run it ("$HEAD": the first node's name, "$TRAINER_HEAD": the trainer's)."""
    steps = {}
    for line in script.splitlines():
        if line.strip().startswith("step "):  # `step NAME N NODES GPUS COMMAND... &` (or && exit 0)
            words = shlex.split(line.replace('"$HEAD"', "HEADNODE").replace('"$TRAINER_HEAD"', "TRAINERNODE"))
            command = words[5:]
            steps[words[1]] = command[:-1] if command[-1] == "&" else command[:-3]
    return steps


def _ports(args: dict[str, list[str]]) -> dict[str, int]:
    flag = lambda name, f: int(args[name][args[name].index(f) + 1])  # noqa: E731
    return {"engine": flag("engine", "--port"), "gateway": flag("node", "--port"), "rollout": flag("rollout", "--port"),
            "streams_metrics": flag("streams", "--metrics-port"), "trainer_metrics": flag("trainer", "--metrics-port")}


def test_each_step_is_the_components_own_command_line_and_environment(experiment, tmp_path, monkeypatch):
    monkeypatch.delenv("POLAR_TOPIC_PREFIX", raising=False)
    monkeypatch.delenv("POLAR_STORAGE_URL", raising=False)
    exp = load_experiment(experiment)
    run_dir = tmp_path / "job"
    cfg = run_config(exp, run_dir)
    script = render(exp, cfg, run_dir).read_text()
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0

    from infra.settings import Settings

    settings = run_settings(Settings(), cfg.run_id)
    assert settings.topic_prefix == f"{cfg.run_id}." and cfg.run_id in settings.storage_url
    exported = dict(line.removeprefix("export ").split("=", 1) for line in script.splitlines()
                    if line.startswith(("export POLAR_", "export OMP_")))
    assert {k: shlex.split(v)[0] if v else "" for k, v in exported.items()} == child_env(settings, run_dir.absolute())

    args = _steps(script)
    assert sorted(args) == sorted(STEPS)
    ports = _ports(args)
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    for name in STEPS:
        assert args[name] == list(command_line(component_args(name, cfg, settings, ports, urls, Path(cfg.model),
                                                              "subprocess", run_dir.absolute()))), name
    assert args["trainer"][:2] == ["polarstream", "train"]  # one process: no torchrun
    assert "grad_clip=0.5" in args["trainer"]  # the file's own trainer settings came through the generator

    # the driver (the batch step) runs the same experiment, as the same run, at the components' URLs
    copy = load_experiment(run_dir / "experiment.in.yaml")
    assert copy.model_dump(exclude=NOT_IDENTITY) == exp.model_dump(exclude=NOT_IDENTITY)
    assert copy.run_id == cfg.run_id and copy.engine_url == urls["engine"] and copy.rollout_url == urls["rollout"]


def test_several_nodes_name_the_first_and_give_the_engine_its_gpus(experiment, tmp_path, monkeypatch):
    body = yaml.safe_load(experiment.read_text())
    body["slurm"] = {"nodes": 2, "engine_gpus": 1, "partition": "gpu", "sbatch": ["--qos=high"]}
    experiment.write_text(yaml.safe_dump(body))
    exp = load_experiment(experiment)
    cfg = run_config(exp, tmp_path / "job")
    # this machine's loopback is no address for the job's other nodes
    monkeypatch.setenv("POLAR_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    with pytest.raises(ExperimentError, match="Kafka .* loopback"):
        render(exp, cfg, tmp_path / "job")
    monkeypatch.setenv("POLAR_KAFKA_BOOTSTRAP", "kafka-1.cluster:9092,kafka-2.cluster:9092")
    with pytest.raises(ExperimentError, match="S3 .* loopback"):
        render(exp, cfg, tmp_path / "job")
    monkeypatch.setenv("POLAR_S3_ENDPOINT", "http://s3.cluster:9000")
    script = render(exp, cfg, tmp_path / "job").read_text()
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=1", "#SBATCH --partition=gpu", "#SBATCH --qos=high"):
        assert line in script.splitlines()
    engine = next(line for line in script.splitlines() if line.startswith("step engine "))
    assert engine.startswith('step engine 1 "$HEAD" --gpus=1 polarstream engine ')
    args = _steps(script)
    assert f"polar=http://HEADNODE:{_ports(args)['engine']}" in args["trainer"]
    for name in ("engine", "node", "rollout"):  # reached from the other nodes: every interface
        assert args[name][args[name].index("--host") + 1] == "0.0.0.0", name
    # each step announces its own node (weight transfer's rendezvous: the trainer's), set on that node
    assert "export POLAR_ADVERTISED_HOST=$SLURMD_NODENAME" in script and "POLAR_ADVERTISED_HOST=" not in "".join(
        line for line in script.splitlines() if line.startswith("export "))
    assert 'TRAINER_NODES=("${NODES[@]: -1}")' in script  # one trainer node: the last
    copy = yaml.safe_load((tmp_path / "job" / "experiment.in.yaml").read_text())
    assert copy["engine_url"].startswith("http://@HEAD@:")  # the job's start puts the node's name in


def test_what_cannot_be_a_slurm_job_is_one_line(experiment, tmp_path):
    runs = {
        ("--launcher", "pbs", "--render", "x"): "--launcher pbs: expected one of local, podman, k8s, slurm",
        ("--launcher", "slurm"): "--launcher slurm needs --render DIR",
        ("--render", "x"): "--render is for a launcher",
        ("--launcher", "slurm", "--render", "x", "--driver-only"): "no --only or --driver-only",
    }
    for flags, words in runs.items():
        r = CliRunner().invoke(app, ["run", str(experiment), *flags])
        assert r.exit_code == 1 and words in r.stderr and len(r.stderr.splitlines()) == 1, (flags, r.stderr)
    # --submit where no Slurm client is installed: rendered, then one line saying so
    bare = tmp_path / "bin"
    bare.mkdir()
    r = CliRunner().invoke(app, ["run", str(experiment), "--launcher", "slurm", "--render", str(tmp_path / "job"), "--submit"],
                           env={"PATH": str(bare)})
    assert r.exit_code == 1 and "--submit: sbatch is not installed here" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and (tmp_path / "job" / "run.sbatch").exists()
    (tmp_path / "a-file").write_text("")
    r = CliRunner().invoke(app, ["run", str(experiment), "--launcher", "slurm", "--render", str(tmp_path / "a-file" / "job")])
    assert r.exit_code == 1 and r.stderr.startswith("error: --render ") and len(r.stderr.splitlines()) == 1, r.stderr
    warm = tmp_path / "arith.yaml"
    warm.write_text("model: builtin:arith\ntrain: builtin:arith\n")
    r = CliRunner().invoke(app, ["run", str(warm), "--launcher", "slurm", "--render", str(tmp_path / "job")])
    assert r.exit_code == 1 and "--launcher slurm needs a model directory" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_a_trainer_of_several_processes_and_nodes_is_torchruns_command_with_each_nodes_rank(experiment, tmp_path, monkeypatch):
    body = yaml.safe_load(experiment.read_text())
    body["trainer"] = {"nproc": 2}
    experiment.write_text(yaml.safe_dump(body))
    exp = load_experiment(experiment)
    script = render(exp, run_config(exp, tmp_path / "one"), tmp_path / "one").read_text()
    trainer = _steps(script)["trainer"]
    assert trainer[:5] == ["torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts"]

    body.update(trainer={"nproc": 2, "nodes": 2, "rendezvous": "node0:29555"}, slurm={"nodes": 2, "trainer_gpus": 2})
    experiment.write_text(yaml.safe_dump(body))
    exp = load_experiment(experiment)
    with pytest.raises(ExperimentError, match="slurm.nodes: 1, and the trainer runs on 2"):
        body["slurm"]["nodes"] = 1
        experiment.write_text(yaml.safe_dump(body))
        render(load_experiment(experiment), run_config(load_experiment(experiment), tmp_path / "two"), tmp_path / "two")
    monkeypatch.setenv("POLAR_KAFKA_BOOTSTRAP", "kafka.cluster:9092")
    monkeypatch.setenv("POLAR_S3_ENDPOINT", "http://s3.cluster:9000")
    script = render(exp, run_config(exp, tmp_path / "two"), tmp_path / "two").read_text()
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    trainer = _steps(script)["trainer"]
    flag = lambda f: trainer[trainer.index(f) + 1]  # noqa: E731
    # torchrun's static rendezvous at the trainer's first node, the file's port; each node's rank filled in there
    assert (flag("--nnodes"), flag("--rdzv-endpoint"), flag("--node-rank")) == ("2", "TRAINERNODE:29555", "NODE_RANK_OF_THIS_NODE")
    assert '${@//NODE_RANK_OF_THIS_NODE/$SLURM_PROCID}' in script
    line = next(line for line in script.splitlines() if line.strip().startswith("step trainer "))
    assert line.strip().startswith('step trainer 2 "$(IFS=,; echo "${TRAINER_NODES[*]}")" --gpus-per-node=2 torchrun ')
    assert "#SBATCH --gpus-per-node=2" in script.splitlines()  # the engine (no GPU) and trainer share no node
