"""Named clusters and the MM2 properties, without starting anything."""

from __future__ import annotations

import json
import re
import time

import pytest
from typer.testing import CliRunner

from infra.clusters import cluster_settings
from infra.discovery import check_name, cluster_names, home_bootstrap
from infra.errors import InfraError
from infra.mirror import DOWNSTREAM, UPSTREAM, flows_of, mirror_properties, parse_properties
from infra.process import render_properties
from infra.settings import TOPICS, Settings


@pytest.fixture
def base(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path, topic_prefix="exp.")


def test_cluster_ports_are_chosen_once_and_remembered(base):
    eu = cluster_settings(base, "eu", create=True)
    again = cluster_settings(base, "eu")
    assert (eu.kafka_port, eu.kafka_controller_port) == (again.kafka_port, again.kafka_controller_port)
    assert eu.kafka_bootstrap == f"127.0.0.1:{eu.kafka_port}" and eu.kafka_port != eu.kafka_controller_port
    assert eu.data_dir == base.data_dir / "clusters" / "eu" and eu.topic_prefix == "exp."
    us = cluster_settings(base, "us", create=True)
    assert {us.kafka_port, us.kafka_controller_port}.isdisjoint({eu.kafka_port, eu.kafka_controller_port})
    assert cluster_names(base.data_dir) == ["eu", "us"]


def test_unknown_cluster_and_bad_names_are_one_clear_error(base):
    with pytest.raises(InfraError, match=r"cluster 'ap' is unknown .* run `polarstream infra up --cluster ap` first"):
        cluster_settings(base, "ap")
    for bad in ("", "a.b", "eu west", "-x", "x" * 41, "a->b"):
        with pytest.raises(InfraError, match="bad cluster name"):
            check_name(bad)
    assert check_name("eu-west_1") == "eu-west_1"


def test_home_cluster_is_the_bootstrap(base):
    eu = cluster_settings(base, "eu", create=True)
    assert Settings(data_dir=base.data_dir, home_cluster="eu").kafka_bootstrap == eu.kafka_bootstrap
    assert Settings(home_cluster="kafka-eu:9092,kafka-eu2:9092").kafka_bootstrap == "kafka-eu:9092,kafka-eu2:9092"
    # An explicit bootstrap wins; an unknown local name says how to create it.
    assert Settings(data_dir=base.data_dir, home_cluster="eu", kafka_bootstrap="h:1").kafka_bootstrap == "h:1"
    with pytest.raises(InfraError, match="home_cluster 'ap': no such local cluster"):
        home_bootstrap("ap", base.data_dir)


def test_each_topic_flows_one_way_with_identity_names(base):
    props = mirror_properties("eu", "e:1", "center", "c:2", base)
    assert props["replication.policy.class"] == "org.apache.kafka.connect.mirror.IdentityReplicationPolicy"
    up, down = re.compile(props["eu->center.topics"]), re.compile(props["center->eu.topics"])
    names = [base.topic(t) for t in TOPICS]
    assert [n for n in names if up.fullmatch(n)] == [base.topic(t) for t in UPSTREAM]
    assert [n for n in names if down.fullmatch(n)] == [base.topic(t) for t in DOWNSTREAM]
    # No cycle: nothing matches both directions, and another prefix's topics are left alone.
    assert not any(up.fullmatch(n) and down.fullmatch(n) for n in names)
    assert not up.fullmatch("other.polar.calls") and not up.fullmatch("expXpolar.calls")
    # Offsets are translated downstream only; heartbeats (which would loop with identity names) are off.
    assert props["center->eu.sync.group.offsets.enabled"] == "true"
    assert props["eu->center.sync.group.offsets.enabled"] == "false"
    assert props["emit.heartbeats.enabled"] == "false"
    assert all(props[k] == "1" for k in props if k.endswith("replication.factor"))


def test_properties_file_round_trips_into_flows(base):
    props = mirror_properties("eu", "e:1", "center", "c:2", base)
    parsed = parse_properties("# comment\n\n" + render_properties(props))
    assert parsed == props
    flows = {(f.source, f.target): f for f in flows_of(parsed)}
    assert set(flows) == {("eu", "center"), ("center", "eu")}
    assert flows["eu", "center"].source_bootstrap == "e:1" and flows["eu", "center"].target_bootstrap == "c:2"
    assert flows["eu", "center"].offsets_topic == "mm2-offsets.eu.internal"
    assert flows["center", "eu"].topics == props["center->eu.topics"]


def _cli(*args, env=None):
    from polarstream.cli import app

    return CliRunner().invoke(app, ["infra", *args], env=env)


def test_print_config_needs_no_running_cluster(tmp_path):
    res = _cli("mirror", "--from", "eu", "--to", "center", "--print-config",
               env={"POLAR_DATA_DIR": str(tmp_path), "POLAR_TOPIC_PREFIX": "p."})
    assert res.exit_code == 0, res.output
    props = parse_properties(res.output)
    assert props["eu.bootstrap.servers"] == "EU-BOOTSTRAP-SERVERS:9092"  # placeholder to edit
    assert props["eu->center.topics"] == r"p\.polar\.calls|p\.polar\.session\-events"
    assert (tmp_path / "mirror" / "eu-center.properties").read_text().endswith(res.output.split("\n", 1)[1])


def test_cli_errors_are_one_line(tmp_path):
    env = {"POLAR_DATA_DIR": str(tmp_path)}
    res = _cli("mirror", "--from", "eu", "--to", "eu", env=env)
    assert res.exit_code == 1 and "a cluster does not mirror to itself" in res.output
    res = _cli("status", "--cluster", "nope", env=env)
    assert res.exit_code == 1 and "cluster 'nope' is unknown" in res.output
    res = _cli("up", "--cluster", "a.b", env=env)
    assert res.exit_code == 1 and "bad cluster name 'a.b'" in res.output


def test_mirror_refuses_a_cluster_that_is_not_running(tmp_path):
    base = Settings(data_dir=tmp_path)
    cluster_settings(base, "eu", create=True), cluster_settings(base, "center", create=True)  # known, not started
    res = _cli("mirror", "--from", "eu", "--to", "center", env={"POLAR_DATA_DIR": str(tmp_path)})
    assert res.exit_code == 1 and "cluster 'eu' is not running: `polarstream infra up --cluster eu` first" in res.output
    assert not (tmp_path / "mirror" / "eu-center.pid").exists()


def test_status_of_a_mirror_whose_clusters_are_down_is_quick_and_says_so(tmp_path):
    from infra.process import free_port

    props = mirror_properties("eu", f"127.0.0.1:{free_port()}", "center", f"127.0.0.1:{free_port()}", Settings())
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / "eu-center.properties").write_text(render_properties(props))
    started = time.monotonic()
    res = _cli("status", "--json", "--window", "0", env={"POLAR_DATA_DIR": str(tmp_path)})
    assert res.exit_code == 0, res.output
    (mirror,) = json.loads(res.output)["mirrors"]
    assert mirror["name"] == "eu-center" and not mirror["running"]
    assert [f["error"].split(" (")[0] for f in mirror["flows"]] in (["cluster eu", "cluster center"],
                                                                    ["cluster center", "cluster eu"])
    assert time.monotonic() - started < 15
