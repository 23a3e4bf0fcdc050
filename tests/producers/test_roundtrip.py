"""Every record type goes through the real broker and comes back equal, keyed and on its own topic."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer

from infra.settings import TOPICS
from producers.consumer import Deduper, RecordConsumer
from producers.publisher import Publisher, PublishError
from schemas import PolicyVersion, SessionAssigned
from tests.schemas.samples import sample_records, task


def drain(consumer: RecordConsumer, want: int, timeout: float = 30.0) -> list:
    """Poll until ``want`` records arrived (or time runs out)."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += consumer.poll(0.5)
    return got


async def test_every_record_type_round_trips(polar_settings):
    records = sample_records()
    async with Publisher(polar_settings) as pub:
        deliveries = [await pub.publish(r) for r in records]
        assert pub.stats.acked == len(records) and pub.stats.failed == 0
    assert all(d.offset >= 0 for d in deliveries)
    with RecordConsumer(polar_settings, topics=list(TOPICS), group_id="rt") as consumer:
        got = drain(consumer, len(records))
        consumer.commit()
    assert len(got) == len(records)
    by_id = {item.record.event_id: item for item in got}
    for record, delivery in zip(records, deliveries):
        item = by_id[record.event_id]
        assert item.record == record  # every field, including nested models and floats
        assert type(item.record) is type(record)
        assert item.key == record.key()
        assert item.logical_topic == record.TOPIC
        assert (item.topic, item.partition, item.offset) == (delivery.topic, delivery.partition, delivery.offset)


async def test_same_key_same_partition_in_order(polar_settings):
    versions = [PolicyVersion(model="m", version=v, checkpoint_url=f"file:///c/{v}") for v in range(20)]
    async with Publisher(polar_settings) as pub:
        deliveries = await pub.publish_many(versions)
    assert len({d.partition for d in deliveries}) == 1
    assert [d.offset for d in deliveries] == sorted(d.offset for d in deliveries)
    with RecordConsumer(polar_settings, topics=["policy"]) as consumer:
        got = drain(consumer, 20)
    assert [i.record.version for i in got] == list(range(20))


def test_consumer_skips_undecodable_and_keeps_going(polar_settings):
    topic = polar_settings.topic("policy")
    good = PolicyVersion(model="m", version=1, checkpoint_url="file:///c/1")
    raw = Producer(polar_settings.kafka_config())
    raw.produce(topic, b"{not json", key=b"m")
    raw.produce(topic, b'{"schema_version": 99, "model": "m"}', key=b"m")
    raw.flush(10)
    raw.close()
    with Publisher(polar_settings) as pub:
        pub.publish_sync(good, timeout=30)
    with RecordConsumer(polar_settings, topics=["policy"]) as consumer:
        got = drain(consumer, 1)
        committed = consumer.commit()
        assert consumer.undecodable == 2
    assert [i.record for i in got] == [good]
    assert committed == {(topic, 0): 3}  # the bad messages count as handled: they never block the partition


def test_commit_resumes_after_last_processed(polar_settings):
    versions = [PolicyVersion(model="m", version=v, checkpoint_url="x") for v in range(6)]
    with Publisher(polar_settings) as pub:
        for v in versions:
            pub.submit(v)
        assert pub.flush(30) == 0
    with RecordConsumer(polar_settings, topics=["policy"], group_id="g") as c:
        first = drain(c, 6)
        assert c.positions() == {("policy", 0): 6}  # what a checkpoint stores
        c.commit()
    with RecordConsumer(polar_settings, topics=["policy"], group_id="g") as c:
        assert c.poll(2.0) == []  # everything was committed
    with RecordConsumer(polar_settings, topics=["policy"], start_offsets={("policy", 0): 4}) as c:
        assert [i.record.version for i in drain(c, 2)] == [4, 5]
    assert [i.record.version for i in first] == list(range(6))


def test_oversized_record_fails_loudly(polar_settings):
    huge = PolicyVersion(model="m", version=1, checkpoint_url="x" * (80 * 1024 * 1024))
    with Publisher(polar_settings) as pub:
        with pytest.raises(PublishError) as e:
            pub.publish_sync(huge, timeout=30)
        assert pub.stats.acked == 0
    assert "MSG_SIZE_TOO_LARGE" in e.value.code
    assert e.value.event_id == huge.event_id


def test_deduper_bounded():
    d = Deduper(capacity=3)
    assert [d.seen(x) for x in "abca"] == [False, False, False, True]
    d.seen("d")  # evicts the oldest ("b"; "a" was refreshed)
    assert "b" not in d and "a" in d and len(d) == 3
    assert d.duplicates == 1


def test_one_group_shares_the_partitions(polar_settings):
    a = RecordConsumer(polar_settings, topics=["sessions"], group_id="nodes")
    b = RecordConsumer(polar_settings, topics=["sessions"], group_id="nodes")
    seen: dict[str, list[str]] = {"a": [], "b": []}
    try:
        deadline = time.monotonic() + 60
        def settled() -> bool:
            return bool(a.assignment()) and bool(b.assignment()) and len(a.assignment() + b.assignment()) == 4

        while not settled() and time.monotonic() < deadline:
            a.poll(0.2), b.poll(0.2)  # polling lets both members join and receive their partitions
        assert sorted(a.assignment() + b.assignment()) == [("sessions", p) for p in range(4)]

        sessions = [SessionAssigned(session_id=f"s-{i}", group_id="g", task_id="t", sample_index=i, session_key="k",
                                    task=task("t")) for i in range(40)]
        with Publisher(polar_settings) as pub:
            deliveries = [pub.submit(s) for s in sessions]
            assert pub.flush(30) == 0
        owner = {p: "a" for _, p in a.assignment()} | {p: "b" for _, p in b.assignment()}
        while len(seen["a"]) + len(seen["b"]) < 40 and time.monotonic() < deadline:
            for name, c in (("a", a), ("b", b)):
                seen[name] += [i.record.session_id for i in c.poll(0.3)]
                c.commit()
    finally:
        a.close()
        b.close()
    # Each session went to exactly the member that owns its partition.
    for s, d in zip(sessions, deliveries):
        assert s.session_id in seen[owner[d.result().partition]]
    assert sorted(seen["a"] + seen["b"]) == sorted(s.session_id for s in sessions)
