"""topics.yaml is applied to the real broker: created as declared, configs aligned, drift reported."""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewPartitions

from infra.errors import InfraError
from infra.kafka import broker_properties
from infra.settings import TOPICS
from infra.topics import TOPICS_FILE, ensure_topics, largest_message_bytes, load_specs


def _configs(admin: AdminClient, topic: str) -> dict[str, str]:
    res = ConfigResource(ConfigResource.Type.TOPIC, topic)
    return {k: v.value for k, v in admin.describe_configs([res])[res].result().items()}


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_topics_created_as_declared(polar_settings):
    admin = AdminClient(polar_settings.kafka_config())
    md = admin.list_topics(timeout=10).topics
    for name, spec in load_specs().items():
        topic = polar_settings.topic(name)
        assert len(md[topic].partitions) == spec.partitions
        configs = _configs(admin, topic)
        for key, value in spec.config.items():
            assert configs[key] == value, (topic, key)
    assert len(md[polar_settings.topic("calls")].partitions) == len(md[polar_settings.topic("session-events")].partitions)


def test_rerun_is_idempotent_and_repairs_configs_and_reports_drift(polar_settings):
    admin = AdminClient(polar_settings.kafka_config())
    assert ensure_topics(polar_settings).unchanged == [polar_settings.topic(n) for n in TOPICS]

    calls, policy = polar_settings.topic("calls"), polar_settings.topic("policy")
    entry = ConfigEntry("retention.ms", "1000", incremental_operation=AlterConfigOpType.SET)
    res = ConfigResource(ConfigResource.Type.TOPIC, calls, incremental_configs=[entry])
    admin.incremental_alter_configs([res])[res].result()  # someone shortened retention by hand
    admin.create_partitions([NewPartitions(policy, 2)])[policy].result()
    _until(lambda: _configs(admin, calls)["retention.ms"] == "1000")  # the broker applies it asynchronously
    _until(lambda: len(admin.list_topics(timeout=10).topics[policy].partitions) == 2)

    report = ensure_topics(polar_settings)
    assert report.altered == {calls: {"retention.ms": ["1000", "-1"]}}
    assert _configs(admin, calls)["retention.ms"] == "-1"
    assert list(report.drift) == [policy] and "partitions 2, topics.yaml says 1" in report.drift[policy][0]
    assert not report.ok and any(line.startswith("DRIFT") for line in report.lines())
    assert ensure_topics(polar_settings).altered == {}  # the config stays repaired


def test_broker_accepts_the_largest_topic_message(polar_settings):
    props = broker_properties(polar_settings, polar_settings.data_dir)
    assert int(props["message.max.bytes"]) > largest_message_bytes() >= 16 * 1024 * 1024
    assert props["listeners"] == (f"PLAINTEXT://127.0.0.1:{polar_settings.kafka_port},"
                                  f"CONTROLLER://127.0.0.1:{polar_settings.kafka_controller_port}")


def _spec_file(tmp_path, text: str):
    path = tmp_path / "topics.yaml"
    path.write_text(text)
    return path


def test_spec_validation(tmp_path):
    good = TOPICS_FILE.read_text()
    with pytest.raises(InfraError, match="co-partitioned topics need equal partition counts"):
        load_specs(_spec_file(tmp_path, good.replace("partitions: 4                      # = calls", "partitions: 3 #")))
    with pytest.raises(InfraError, match=r"topics missing \['judgements', 'policy', 'teacher'\]"):
        load_specs(_spec_file(tmp_path, good.split("  policy:")[0]))
    with pytest.raises(InfraError, match="tasks.partitions must be an integer of at least 1, got 0"):
        load_specs(_spec_file(tmp_path, good.replace("partitions: 2", "partitions: 0", 1)))
