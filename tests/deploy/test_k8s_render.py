"""``polarstream run FILE --launcher k8s --render DIR`` (polarstream/driver/k8s.py): the manifests of 1-, 2- and
4-node topologies, each object checked against the pinned Kubernetes API's schemas (kubernetes-validate,
strict: no field the API does not know), and what they start checked against the run's own generator.

No cluster runs here: what the pods would do is checked as far as the files show it (every URL a pod is
given is a Service of the render, the driver's copy of the experiment loads as polarstream run would load
it, torchrun reads the trainer's command as the indexed Job means it)."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from polarstream.driver.configure import run_config
from polarstream.driver.experiment import ExperimentError, load_experiment
from polarstream.driver.k8s import API_VERSION, render
from polarstream.presets import preset_for

# the environment of the machine that renders decides which Kafka and S3 the pods use: none here
OUTSIDE = ("POLAR_KAFKA_BOOTSTRAP", "POLAR_S3_ENDPOINT", "POLAR_ADMIN_TOKEN", "POLAR_SESSION_SECRET", "POLAR_CONFIG")


@pytest.fixture(autouse=True)
def _no_outside_settings(monkeypatch):
    for name in OUTSIDE:
        monkeypatch.delenv(name, raising=False)


def _experiment(tmp_path: Path, nodes: int, nproc: int = 1, **kube) -> Path:
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t1", "instruction": "do it", "num_samples": 2, "min_valid": 1}\n')
    trainer = {"nproc": nproc, "nodes": nodes, "kl_coef": 0.01, **({"rendezvous": "ignored:1"} if nodes > 1 else {})}
    exp = {"name": "deploy", "run_id": f"Deploy_{nodes}.nodes", "model": "tiny", "train": "tasks.jsonl", "eval": "tasks.jsonl",
           "runtime": "auto", "group_size": 2, "groups_per_step": 2, "max_steps": 3, "trainer": trainer,
           "kubernetes": {"image": "registry.example/polarstream:abc123", "namespace": "rl", "nodes": nodes,
                          "streams": nodes, **kube}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _render(tmp_path: Path, path: Path) -> list[dict]:
    exp = load_experiment(path)
    cfg = run_config(exp, tmp_path / "run", preset=preset_for(exp))
    out = render(exp, cfg, tmp_path / "k8s")
    files = sorted(out.glob("*.yaml"))
    return [yaml.safe_load(f.read_text()) for f in files]


def _objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _command(docs: list[dict], kind: str, name: str) -> list[str]:
    return _objects(docs, kind)[name]["spec"]["template"]["spec"]["containers"][0]["command"]


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_every_manifest_of_a_topology_validates_against_the_pinned_api(tmp_path, nodes):
    docs = _render(tmp_path, _experiment(tmp_path, nodes, nproc=2 if nodes == 1 else 1, engine_gpus=1))
    for doc in docs:
        kubernetes_validate.validate(doc, API_VERSION, strict=True)  # raises, naming the field, where it does not
        assert doc["metadata"].get("namespace") == "rl"
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Secret", "ConfigMap", "Service", "StatefulSet", "Service", "StatefulSet",  # Kafka, S3
                            "Service", "Deployment", "Service", "Deployment", "Deployment", "Service", "Deployment",
                            "Service", "Job", "Job"])
    name = "deploy-2-nodes" if nodes == 2 else f"deploy-{nodes}-nodes"
    deployments = _objects(docs, "Deployment")
    # the gateway node and the stream worker scale by replicas; the engine is one, with its GPU
    assert deployments[f"{name}-node"]["spec"]["replicas"] == nodes
    assert deployments[f"{name}-streams"]["spec"]["replicas"] == nodes
    engine = deployments[f"{name}-engine"]["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert engine["command"][:2] == ["polarstream", "engine"] and engine["command"][engine["command"].index("--host") + 1] == "0.0.0.0"
    # the trainer: an indexed Job of one pod per machine, each torchrun, as torchrun itself reads the command
    job = _objects(docs, "Job")[f"{name}-trainer"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", nodes, nodes)
    from torch.distributed.run import parse_args

    command = _command(docs, "Job", f"{name}-trainer")
    # as the pod of index 1 runs it: Kubernetes expands $(JOB_COMPLETION_INDEX) from the pod's environment
    launch = parse_args([a.replace("$(JOB_COMPLETION_INDEX)", "1") for a in command[1:]])
    assert command[0] == "torchrun" and launch.training_script == "polarstream" and launch.training_script_args[0] == "train"
    if nodes == 1:
        assert launch.standalone and launch.nproc_per_node == "2"
    else:  # node 0's pod hosts the rendezvous, by its name in the Job's headless Service
        assert (launch.nnodes, launch.node_rank, launch.rdzv_backend, launch.rdzv_endpoint) == (
            str(nodes), 1, "static", f"{name}-trainer-0.{name}-trainer:29400")
        assert command[command.index("--node-rank") + 1] == "$(JOB_COMPLETION_INDEX)"
        assert job["template"]["spec"]["subdomain"] == f"{name}-trainer"
        assert _objects(docs, "Service")[f"{name}-trainer"]["spec"]["clusterIP"] == "None"
    assert "kl_coef=0.01" in command


def test_what_the_pods_are_given_is_the_runs_own_and_reaches_only_services_of_the_render(tmp_path):
    docs = _render(tmp_path, _experiment(tmp_path, 2))
    services = {(d["metadata"]["name"], p["port"]) for d in docs if d["kind"] == "Service" for p in d["spec"]["ports"]}
    pods = [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] in ("Deployment", "Job")]
    secret = _objects(docs, "Secret")["deploy-2-nodes-secrets"]["stringData"]
    for name, spec in pods:
        for c in spec["initContainers"] + spec["containers"]:
            env = {e["name"]: e for e in c["env"]}
            text = " ".join(c["command"]) + " " + " ".join(e.get("value", "") for e in c["env"])
            # every host:port of the run a pod is told (URLs, the bootstrap, the rendezvous) is a Service's, by
            # its name or as <pod>.<service>
            for host, port in re.findall(r"(deploy-2-nodes[\w.-]*):(\d+)", text):
                assert (host.split(".")[-1], int(port)) in services, (name, host, port)
            assert "127.0.0.1" not in text and "localhost" not in text, (name, text)
            # the run's settings (components.child_env): Kafka and S3 are the render's Services
            assert env["POLAR_KAFKA_BOOTSTRAP"]["value"] == "deploy-2-nodes-kafka-0.deploy-2-nodes-kafka:9092"
            assert env["POLAR_S3_ENDPOINT"]["value"] == "http://deploy-2-nodes-s3:9000"
            assert env["POLAR_TOPIC_PREFIX"]["value"] == "Deploy_2.nodes."
            # each pod announces its own address ($(POD_IP), defined before it) and reads secrets by reference
            assert [e["name"] for e in c["env"]].index("POD_IP") < [e["name"] for e in c["env"]].index("POLAR_ADVERTISED_HOST")
            assert env["POLAR_ADVERTISED_HOST"]["value"] == "$(POD_IP)"
            for key in secret:
                assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "deploy-2-nodes-secrets", "key": key}
    # no secret is written into any other object; the development tokens, refused off loopback, are not the run's
    text = "".join(yaml.safe_dump(d) for d in docs if d["kind"] != "Secret")
    assert not [k for k, v in secret.items() if v in text]
    assert secret["POLAR_ADMIN_TOKEN"] != "polar-admin" and secret["POLAR_SESSION_SECRET"] != "polar-dev-session-secret"
    # the node and the trainer are handed the engine's and gateway node's Services
    node = _command(docs, "Deployment", "deploy-2-nodes-node")
    assert node[node.index("--engine-url") + 1] == "http://deploy-2-nodes-engine:8000"
    trainer = _command(docs, "Job", "deploy-2-nodes-trainer")
    assert "polar=http://deploy-2-nodes-engine:8000" in trainer and "http://deploy-2-nodes-node:8100" in trainer


def test_the_drivers_copy_of_the_experiment_loads_as_the_run_and_drives_the_services(tmp_path):
    docs = _render(tmp_path, _experiment(tmp_path, 1))
    files = _objects(docs, "ConfigMap")["deploy-1-nodes-experiment"]["data"]
    pod = tmp_path / "pod"
    pod.mkdir()
    for name, text in files.items():
        (pod / name).write_text(text)
    copy = yaml.safe_load(files["experiment.yaml"])
    assert copy["train"] == "/polar/experiment/train.jsonl" and files["train.jsonl"] == (tmp_path / "tasks.jsonl").read_text()
    # in the pod the ConfigMap is at /polar/experiment; here, beside the copy
    (pod / "experiment.yaml").write_text(files["experiment.yaml"].replace("/polar/experiment/", ""))
    exp = load_experiment(pod / "experiment.yaml")
    cfg = run_config(exp, tmp_path / "driver", driver_only=True)
    assert cfg.attach == {"rollout": "http://deploy-1-nodes-rollout:8080", "engine": "http://deploy-1-nodes-engine:8000",
                          "gateway": "http://deploy-1-nodes-node:8100"}
    assert cfg.run_id == "Deploy_1.nodes" and (cfg.steps, cfg.samples) == (3, 2) and len(cfg.train_tasks) == 1
    driver = _command(docs, "Job", "deploy-1-nodes-driver")
    assert driver == ["polarstream", "run", "/polar/experiment/experiment.yaml", "--driver-only", "--run-dir", "/polar/run"]


def test_an_external_kafka_and_s3_are_used_as_the_environment_names_them(tmp_path, monkeypatch):
    monkeypatch.setenv("POLAR_KAFKA_BOOTSTRAP", "kafka-0.data.svc:9092,kafka-1.data.svc:9092")
    monkeypatch.setenv("POLAR_S3_ENDPOINT", "https://s3.example.com")
    docs = _render(tmp_path, _experiment(tmp_path, 1))
    assert not _objects(docs, "StatefulSet")  # neither is rendered
    for doc in docs:
        kubernetes_validate.validate(doc, API_VERSION, strict=True)
    env = {e["name"]: e.get("value") for e in _objects(docs, "Deployment")["deploy-1-nodes-engine"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POLAR_KAFKA_BOOTSTRAP"] == "kafka-0.data.svc:9092,kafka-1.data.svc:9092"
    assert env["POLAR_S3_ENDPOINT"] == "https://s3.example.com"


def test_a_run_the_pods_cannot_make_is_refused_in_one_line(tmp_path):
    path = _experiment(tmp_path, 1)
    data = yaml.safe_load(path.read_text())
    with pytest.raises(ExperimentError, match=r"^model: 'builtin:arith' is made by the driver's warm start"):
        exp = load_experiment(path, model="builtin:arith", train="builtin:arith", eval="")
        render(exp, run_config(exp, tmp_path / "run", preset=preset_for(exp)), tmp_path / "k8s")
    data["kubernetes"]["nodes"] = 0
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ExperimentError, match=r"kubernetes\.nodes: Input should be greater than or equal to 1"):
        load_experiment(path)


def test_the_command_renders_the_manifests_and_says_where(tmp_path):
    from typer.testing import CliRunner

    from polarstream.cli import app

    path, out = _experiment(tmp_path, 2), tmp_path / "manifests"
    r = CliRunner().invoke(app, ["run", str(path), "--launcher", "k8s", "--render", str(out)])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(out)
    files = sorted(p.name for p in out.glob("*.yaml"))
    assert files[0] == "00-secret-deploy-2-nodes-secrets.yaml" and (out / files[0]).stat().st_mode & 0o077 == 0
    # applied in order: the Secret, the experiment, Kafka and S3 before the components, the driver last
    assert len(files) == 16 and files[-3:] == ["13-service-deploy-2-nodes-trainer.yaml", "14-job-deploy-2-nodes-trainer.yaml",
                                               "15-job-deploy-2-nodes-driver.yaml"]
    assert files[2:6] == ["02-service-deploy-2-nodes-kafka.yaml", "03-statefulset-deploy-2-nodes-kafka.yaml",
                          "04-service-deploy-2-nodes-s3.yaml", "05-statefulset-deploy-2-nodes-s3.yaml"]
