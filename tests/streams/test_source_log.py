"""State keeps references to its inputs: the cache of recent inputs, and reading one back by offset."""

from __future__ import annotations

import asyncio

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from schemas import CallRecorded, decode, encode
from streams.source_log import Recent, SourceLog
from tests.streams.helpers import publish, read_topic


def test_a_hit_needs_the_same_event_id():
    cache: Recent[str] = Recent(100)
    cache.put("g/0", "e1", "first", 10)
    assert cache.get("g/0", "e1") == "first"
    assert cache.get("g/0", "e2") is None  # another attempt under the same key
    assert cache.get("g/1", "e1") is None


def test_bounded_by_size_least_recently_used_first():
    cache: Recent[str] = Recent(25)  # room for two of 10
    cache.put("a", "ea", "A", 10)
    cache.put("b", "eb", "B", 10)
    assert cache.get("a", "ea") == "A"  # a is now the most recent
    cache.put("c", "ec", "C", 10)
    assert cache.get("b", "eb") is None  # evicted
    assert cache.get("a", "ea") == "A" and cache.get("c", "ec") == "C" and cache.bytes == 20
    cache.pop("a")
    cache.pop("a")  # twice is harmless
    assert cache.bytes == 10
    cache.put("c", "ec", "C", 10)  # replacing does not count twice
    assert cache.bytes == 10
    cache.put("big", "e", "X", 26)  # larger than the whole budget: not kept, nothing evicted
    assert cache.get("big", "e") is None and cache.get("c", "ec") == "C"


def test_reads_a_record_back_by_offset_and_knows_when_it_is_gone(polar_settings):
    s = polar_settings
    calls = [CallRecorded(session_id=f"src-{i % 3}", call_index=i, provider="engine", prompt_ids=[i, i + 1]) for i in range(12)]
    publish(s, calls)
    msgs = read_topic(s, "calls", until=lambda m: len({decode(x.value, CallRecorded).event_id for x in m} & {c.event_id for c in calls}) == 12)
    mine = {decode(m.value, CallRecorded).event_id: m for m in msgs}
    log = SourceLog(s, timeout_s=10)
    try:
        by_partition: dict[int, dict[int, bytes]] = {}
        for c in calls:
            m = mine[c.event_id]
            assert asyncio.run(log.read(s.topic("calls"), m.partition, [m.offset])) == {m.offset: m.value}
            assert m.value == encode(c, packed=True)  # the default record format
            by_partition.setdefault(m.partition, {})[m.offset] = m.value
        for p, values in by_partition.items():  # several at once, in one pass, in any order
            assert asyncio.run(log.read(s.topic("calls"), p, sorted(values, reverse=True))) == values
            # the end: one past the partition's last record (this test is the only writer of its topics)
            assert asyncio.run(log.end_offset(s.topic("calls"), p)) == max(m.offset for m in msgs if m.partition == p) + 1
        # Records deleted below an offset (what `polarstream forget` does before it re-publishes) are gone;
        # the ones after it are still read in the same call.
        p, values = max(by_partition.items(), key=lambda kv: len(kv[1]))
        first, second, *rest = sorted(values)
        assert rest, "a partition with three of the calls"
        tp = TopicPartition(s.topic("calls"), p, second + 1)
        admin = AdminClient(s.kafka_config())  # held: a collected client never completes its futures
        admin.delete_records([tp], request_timeout=10)[tp].result(30)
        got = asyncio.run(log.read(s.topic("calls"), p, [first, second, *rest]))
        assert got == {first: None, second: None, **{o: values[o] for o in rest}}
    finally:
        log.close()
