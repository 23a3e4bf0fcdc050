"""What a run across containers starts (polarstream/driver/containers.py), checked without starting it: no
component is told to reach another on loopback, each command is the one a process of the run gets, the
driver's experiment file is one `run --driver-only` accepts. The run itself: tests/deploy/test_run_in_containers.py."""

from __future__ import annotations

import re
from pathlib import Path

from infra.kafka import broker_properties
from infra.settings import Settings
from polarstream.driver.components import command_line, component_args
from polarstream.driver.config import RunConfig
from polarstream.driver.containers import (MODEL, PORTS, components, driver_experiment, network_settings, on_network,
                                           run_args, stack, urls)
from polarstream.driver.experiment import Experiment, load_experiment

LOOPBACK = re.compile(r"127\.0\.0\.1|localhost|\[::1\]")


def test_no_container_is_told_to_reach_another_on_loopback(tmp_path):
    settings = network_settings("run-1")
    every = [*stack(3), *components(RunConfig(run_dir=tmp_path), settings)]
    for c in every:
        said = " ".join([*c.argv, *(f"{k}={v}" for k, v in c.env.items())])
        assert not LOOPBACK.search(said), f"{c.host}: {said}"
    assert [c.host for c in every] == ["kafka-1", "kafka-2", "kafka-3", "s3", "engine", "node-1", "node-2",
                                       "streams", "rollout", "trainer"]


def test_each_component_runs_the_command_a_process_of_the_run_gets_announcing_its_own_name(tmp_path):
    cfg, settings = RunConfig(run_dir=tmp_path), network_settings("run-1")
    by_host = {c.host: c for c in components(cfg, settings)}
    run_dir = Path("/var/lib/polarstream/run")
    for host, name in (("engine", "engine"), ("streams", "streams"), ("rollout", "rollout"), ("trainer", "trainer")):
        own = settings.model_copy(update={"advertised_host": host})
        assert by_host[host].argv == command_line(component_args(name, cfg, own, PORTS, urls(), MODEL, "bwrap", run_dir))
        assert by_host[host].env["POLAR_ADVERTISED_HOST"] == host
    for name in ("engine", "node-1", "rollout"):
        argv = by_host[name].argv
        assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert by_host["trainer"].argv[by_host["trainer"].argv.index("--gateway") + 1] == "http://node-1:8100"
    assert by_host["node-1"].argv[-2:] == ("--node-id", "node-1") and by_host["node-2"].argv[-2:] == ("--node-id", "node-2")


def test_a_trainer_of_two_machines_is_two_containers_meeting_at_the_first(tmp_path):
    cfg = on_network(RunConfig(run_dir=tmp_path, trainer_nodes=2, trainer_rendezvous="somewhere:29500", run_id="r1"))
    trainers = [c for c in components(cfg, network_settings("r1")) if c.host.startswith("trainer")]
    assert [c.host for c in trainers] == ["trainer-1", "trainer-2"]
    for rank, c in enumerate(trainers):
        assert c.argv[0] == "torchrun" and c.argv[c.argv.index("--node-rank") + 1] == str(rank)
        assert c.argv[c.argv.index("--rdzv-endpoint") + 1] == "trainer-1:29500"
        assert c.restart and c.model


def test_the_run_has_its_own_secrets_topics_and_storage():
    a, b = network_settings("run-a"), network_settings("run-b")
    assert a.admin_token != b.admin_token and a.session_secret != b.session_secret
    assert a.admin_token != Settings().admin_token  # the gateway refuses the development one beyond loopback
    assert (a.topic_prefix, a.storage_url) == ("run-a.", "s3://polarstream/run-a")
    assert a.kafka_bootstrap == "kafka-1:9092,kafka-2:9092,kafka-3:9092"


def test_the_kafka_nodes_form_one_quorum_and_announce_their_own_names(tmp_path):
    nodes = stack(3)[:3]
    voters = {n.argv[n.argv.index("--voters") + 1] for n in nodes}
    ids = {n.argv[n.argv.index("--cluster-id") + 1] for n in nodes}
    assert voters == {"1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"} and len(ids) == 1
    from infra.kafka import ClusterMember

    props = broker_properties(Settings(), tmp_path, ClusterMember(2, 3, voters.pop(), ids.pop()), advertise="kafka-2")
    assert props["listeners"] == "PLAINTEXT://0.0.0.0:9092,CONTROLLER://0.0.0.0:9093"
    assert props["advertised.listeners"] == "PLAINTEXT://kafka-2:9092"
    assert props["min.insync.replicas"] == "2"
    loopback = broker_properties(Settings(), tmp_path)  # infra up's: loopback only, as before
    assert loopback["listeners"].count("127.0.0.1") == 2


def test_podman_flags_sandbox_only_the_nodes_and_restart_the_trainer(tmp_path):
    by_host = {c.host: c for c in components(RunConfig(run_dir=tmp_path), network_settings("r"))}
    node = run_args(by_host["node-1"], "img", "net", "p", Path("/models/m"))
    engine = run_args(by_host["engine"], "img", "net", "p", Path("/models/m"))
    trainer = run_args(by_host["trainer"], "img", "net", "p", Path("/models/m"))
    assert "unmask=ALL" in node and "unmask=ALL" not in engine and "--cap-add" not in node
    assert "--restart" in trainer and "--restart" not in node  # a dead node's sessions move to the other
    assert f"/models/m:{MODEL}:ro" in engine
    assert node[node.index("--network-alias") + 1] == "node-1" and node[node.index("--name") + 1] == "p-node-1"
    env = {a.split("=", 1)[0]: a.split("=", 1)[1] for a, flag in zip(engine[1:], engine) if flag == "-e"}
    assert env["POLAR_KAFKA_BOOTSTRAP"] == "kafka-1:9092,kafka-2:9092,kafka-3:9092"
    assert env["POLAR_S3_ENDPOINT"] == "http://s3:9000"


def test_the_drivers_experiment_file_is_one_run_driver_only_accepts(tmp_path):
    exp = load_experiment(Path(__file__).parents[2] / "examples" / "arith.yaml")
    path = tmp_path / "experiment.yaml"
    import yaml

    path.write_text(yaml.safe_dump(driver_experiment(exp, "arith-1")))
    again = load_experiment(path)
    assert isinstance(again, Experiment)
    assert (again.run_id, again.rollout_url, again.engine_url) == ("arith-1", "http://rollout:8080", "http://engine:8000")
    assert again.model_dump(exclude={"run_id", "rollout_url", "engine_url", "gateway_url", "storage_url"}) == \
        exp.model_dump(exclude={"run_id", "rollout_url", "engine_url", "gateway_url", "storage_url"})
