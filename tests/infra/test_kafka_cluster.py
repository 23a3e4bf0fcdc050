"""The replicated local cluster (`infra up --brokers 3`, infra/kafka_cluster.py).

The integration test runs three real brokers: topics at replication factor 3 with min.insync.replicas 2,
the durable Publisher carrying on through a SIGKILL of a partition leader, committed consumer offsets
read back while that broker is down, and every acknowledged event consumed exactly once. The rest are
fast checks of the layout, the remembered state and the replication rules.
"""

from __future__ import annotations

import json
import time

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from infra.discovery import brokers_state_file, local_bootstrap, read_brokers_state
from infra.errors import InfraError
from infra.kafka import ClusterMember, broker_properties
from infra.kafka_cluster import KafkaCluster, resolve_brokers
from infra.maven import fetch
from infra.process import free_port
from infra.settings import TOPICS, Settings
from infra.topics import ensure_topics, load_specs
from producers.consumer import RecordConsumer
from producers.publisher import Publisher
from schemas import CallRecorded

# --------------------------------------------------------------------------------------- fast checks


def test_replication_follows_the_number_of_brokers():
    spec = load_specs()["calls"]
    assert spec.replication_factor is None  # topics.yaml: auto
    one, two, three, five = (spec.for_brokers(n) for n in (1, 2, 3, 5))
    assert (one.replication_factor, two.replication_factor, three.replication_factor, five.replication_factor) == (1, 2, 3, 3)
    assert one.config == spec.config and "min.insync.replicas" not in two.config  # one broker: exactly as before
    assert three.config["min.insync.replicas"] == five.config["min.insync.replicas"] == "2"


def test_node_properties_form_one_quorum(tmp_path):
    s = Settings(data_dir=tmp_path, kafka_port=19092, kafka_controller_port=19093)
    single = broker_properties(s, tmp_path)
    assert single["offsets.topic.replication.factor"] == "1" and single["controller.quorum.voters"] == "1@127.0.0.1:19093"
    member = ClusterMember(2, 3, "1@127.0.0.1:19093,2@127.0.0.1:19095,3@127.0.0.1:19097", "cid")
    props = broker_properties(s, tmp_path, member)
    assert props["node.id"] == "2" and props["controller.quorum.voters"] == member.voters
    assert {k: props[k] for k in ("default.replication.factor", "offsets.topic.replication.factor",
                                  "transaction.state.log.replication.factor")} == dict.fromkeys(
        ("default.replication.factor", "offsets.topic.replication.factor", "transaction.state.log.replication.factor"), "3")
    assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "2"


def test_layout_is_remembered_and_clients_find_every_broker(tmp_path):
    port, cport = free_port(), free_port()
    s = Settings(data_dir=tmp_path, kafka_port=port, kafka_controller_port=cport)
    cluster = KafkaCluster(s, 3)
    nodes = cluster.state["nodes"]
    assert [n["node_id"] for n in nodes] == [1, 2, 3] and (nodes[0]["port"], nodes[0]["controller_port"]) == (port, cport)
    assert len({p for n in nodes for p in (n["port"], n["controller_port"])}) == 6
    assert read_brokers_state(tmp_path) is None  # nothing is written before the first launch
    cluster._save()
    assert json.loads(brokers_state_file(tmp_path).read_text())["brokers"] == 3
    again = KafkaCluster(Settings(data_dir=tmp_path), None)  # a later process: no --brokers needed
    assert again.bootstrap == cluster.bootstrap == local_bootstrap(tmp_path)
    assert Settings(data_dir=tmp_path).kafka_bootstrap == cluster.bootstrap  # every component's default
    assert Settings(data_dir=tmp_path, kafka_bootstrap="kafka:9092").kafka_bootstrap == "kafka:9092"  # explicit wins
    assert resolve_brokers(Settings(data_dir=tmp_path), None) == 3
    with pytest.raises(InfraError, match="holds a 3-broker cluster, not 1"):
        resolve_brokers(Settings(data_dir=tmp_path), 1)


def test_a_single_broker_data_dir_is_not_turned_into_a_cluster(tmp_path):
    s = Settings(data_dir=tmp_path)
    assert resolve_brokers(s, None) == resolve_brokers(s, 1) == 1
    (tmp_path / "kafka" / "data").mkdir(parents=True)
    (tmp_path / "kafka" / "data" / "meta.properties").write_text("")
    with pytest.raises(InfraError, match="holds a single-broker Kafka"):
        resolve_brokers(s, 3)


# --------------------------------------------------------------------------------------- real brokers


def _call(i: int) -> CallRecorded:
    return CallRecorded(session_id=f"s{i % 24}", call_index=i, provider="engine", prompt_ids=list(range(i % 50)))


def _publish(pub: Publisher, start: int, n: int) -> list:
    """Publish ``n`` calls (16 in flight at a time); every one must be acknowledged."""
    out = []
    for lo in range(start, start + n, 16):
        futures = [pub.submit(_call(i)) for i in range(lo, min(lo + 16, start + n))]
        out += [f.result(60) for f in futures]
    return out


def _read(settings: Settings, group: str, want: int, timeout: float = 60.0) -> list[str]:
    """Event ids a member of ``group`` reads from its committed position: ``want`` of them, then a short
    grace poll so that a duplicate would show up; commits what it read."""
    consumer = RecordConsumer(settings, ["calls"], group_id=group)
    ids: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while len(ids) < want and time.monotonic() < deadline:
            ids += [r.record.event_id for r in consumer.poll(0.5)]
        ids += [r.record.event_id for r in consumer.poll(1.0)]
        consumer.commit()
    finally:
        consumer.close()
    return ids


def _topic_config(admin: AdminClient, topic: str, timeout_s: float = 30.0) -> dict:
    """The topic's config. A new topic's metadata reaches the brokers one by one: the broker that answers may
    not know it yet (UNKNOWN_TOPIC_OR_PART, seen under load just after ensure_topics), so ask again until then."""
    from confluent_kafka import KafkaError, KafkaException

    res, deadline = ConfigResource(ConfigResource.Type.TOPIC, topic), time.monotonic() + timeout_s
    while True:
        try:
            return admin.describe_configs([res])[res].result()
        except KafkaException as e:
            if e.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.integration
def test_three_brokers_lose_no_acknowledged_event_when_a_leader_is_killed(tmp_path):
    started = time.monotonic()
    base = Settings(data_dir=tmp_path, kafka_port=free_port(), kafka_controller_port=free_port(), topic_prefix="rep.")
    fetch("kafka", base)
    cluster = KafkaCluster(base, 3, heap_mb=256, die_with_parent=True, quick_jit=True)
    try:
        cluster.start(120)
        settings = Settings(data_dir=tmp_path, topic_prefix="rep.")  # what any component gets: every broker
        assert settings.kafka_bootstrap == cluster.bootstrap and settings.kafka_bootstrap.count(",") == 2
        ensure_topics(settings)
        admin = AdminClient(settings.kafka_config(log_level=0))  # quiet when a broker goes away
        md = admin.list_topics(timeout=10)
        assert sorted(md.brokers) == [1, 2, 3]
        for name in TOPICS:
            topic = settings.topic(name)
            assert {len(p.replicas) for p in md.topics[topic].partitions.values()} == {3}, topic
            assert _topic_config(admin, topic)["min.insync.replicas"].value == "2", topic
        res = ConfigResource(ConfigResource.Type.BROKER, "1")
        broker = {k: v.value for k, v in admin.describe_configs([res])[res].result().items()}
        assert (broker["offsets.topic.replication.factor"], broker["transaction.state.log.replication.factor"],
                broker["transaction.state.log.min.isr"], broker["min.insync.replicas"]) == ("3", "3", "2", "2")
        calls = settings.topic("calls")

        with Publisher(settings) as pub:
            before = _publish(pub, 0, 120)
            assert sorted(_read(settings, "g", 120)) == sorted(d.event_id for d in before)  # offsets committed
            offsets = admin.list_topics("__consumer_offsets", timeout=10).topics["__consumer_offsets"]
            assert {len(p.replicas) for p in offsets.partitions.values()} == {3}

            victim = cluster.leader_index(calls, 0)
            killed_at = time.monotonic()
            cluster.kill(victim)
            during = _publish(pub, 120, 120)  # acks=all still holds: two replicas are left
            on_p0 = [d for d in during if d.partition == 0]
            assert on_p0, "no publish reached the partition whose leader was killed"
            recovered_s = time.monotonic() - killed_at
            assert cluster.leader_index(calls, 0) != victim
            # The group's committed offsets outlive the broker: it resumes after the first 120.
            assert sorted(_read(settings, "g", 120)) == sorted(d.event_id for d in during)

            cluster.revive(victim, 90)
            after = _publish(pub, 240, 60)
        acked = [d.event_id for d in before + during + after]
        assert len(set(acked)) == 300
        everything = _read(settings, "all", 300)  # a fresh group reads the topic from the start
        assert len(everything) == len(set(everything)) == 300 and set(everything) == set(acked)
    finally:
        cluster.stop(force=True)
    print(f"\n3-broker test: {time.monotonic() - started:.1f} s, leader of {calls}[0] (broker {victim}) killed; "
          f"publishes through the election took {recovered_s:.1f} s, slowest ack "
          f"{max(d.latency_ms for d in during):.0f} ms")
