"""Bounded, deterministic reading of recorded topics, beside live consumers and without disturbing them.

The tools never join a consumer group's rebalancing and never commit: they ``assign`` partitions to
themselves under a fresh group id of their own, so live workers and the trainer do not notice them.
What to read is fixed before the first message (``plan_spans``): per partition, from a start offset to
the end offset captured at start, so a read of a topic that collection keeps appending to still ends.

``merged`` yields the messages of all spans in one deterministic order: by broker timestamp, then
topic, partition and offset (a k-way merge that only moves on once every unfinished partition has a
message at hand). The order therefore depends on the topics' contents, never on fetch timing, which is
what makes a replay byte-for-byte repeatable; timestamp order is also the closest to the order the
live stream processors saw.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from infra.settings import Settings

from .positions import Offsets, PositionError, Span

_PAUSE_AT = 5_000  # buffered messages of one partition before it is paused (a slower one must catch up)
_SETTLING = {"NOT_LEADER_FOR_PARTITION", "LEADER_NOT_AVAILABLE", "UNKNOWN_TOPIC_OR_PART"}


@dataclass(frozen=True)
class RawMessage:
    """One message, undecoded: the caller decodes by ``topic`` (logical name)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes


class ReadError(RuntimeError):
    """The broker or a topic is not there to read; the message names which."""


def fresh_group(tool: str) -> str:
    """A consumer group id nobody else uses (the tools never commit to it)."""
    return f"polar-{tool}-{uuid.uuid4().hex[:12]}"


def consumer(settings: Settings, group_id: str, **extra):
    """A confluent Consumer that never commits and reports partition ends."""
    from confluent_kafka import Consumer

    return Consumer(settings.kafka_config(**{
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        "reconnect.backoff.max.ms": 1000,
        **extra,
    }))


def _partitions(c, full: str, timeout: float) -> list[int]:
    from confluent_kafka import KafkaException

    try:
        md = c.list_topics(full, timeout=timeout).topics.get(full)
    except KafkaException as e:
        raise ReadError(f"kafka did not answer: {e.args[0]}") from None
    if md is None or md.error is not None or not md.partitions:
        raise ReadError(f"topic {full} does not exist (create it with `polarstream infra topics`)")
    return sorted(md.partitions)


def watermarks(c, full: str, partition: int, timeout: float = 15.0) -> tuple[int, int]:
    """(low, high) offsets of a partition, retried while the broker's leadership settles (a topic
    created a moment ago can answer NOT_LEADER until its metadata reaches this client)."""
    from confluent_kafka import KafkaException, TopicPartition

    deadline = time.monotonic() + timeout
    while True:
        try:
            return c.get_watermark_offsets(TopicPartition(full, partition), timeout=timeout)
        except KafkaException as e:
            err = e.args[0]
            if (not err.retriable() and err.name() not in _SETTLING) or time.monotonic() > deadline:
                raise ReadError(f"{full}[{partition}]: {err.str()}") from None
            time.sleep(0.2)


def plan_spans(settings: Settings, topics: tuple[str, ...], *, from_offsets: Offsets | None = None,
               from_time_ms: int | None = None, to_time_ms: int | None = None, timeout: float = 15.0) -> list[Span]:
    """The spans to read: every partition of ``topics`` from the given start (offsets, a time, or the
    beginning) to the end offset now, or to the first message at or after ``to_time_ms``."""
    c = consumer(settings, fresh_group("plan"))
    try:
        spans = []
        for topic in topics:
            full = settings.topic(topic)
            parts = _partitions(c, full, timeout)
            given = (from_offsets or {}).get(topic, {})
            unknown = sorted(set(given) - set(parts))
            if unknown:
                raise PositionError(f"offsets: {full} has partitions {parts}, not {unknown}")
            bounds = {p: watermarks(c, full, p, timeout) for p in parts}
            starts = {p: bounds[p][0] for p in parts}
            for p, o in given.items():
                low, high = bounds[p]
                if not low <= o <= high:
                    raise PositionError(f"offsets: {full}[{p}] offset {o} is outside the retained {low}..{high}")
                starts[p] = o
            if from_time_ms is not None:
                starts = _offsets_at(c, full, parts, from_time_ms, bounds, timeout)
            ends = {p: bounds[p][1] for p in parts}
            if to_time_ms is not None:
                ends = _offsets_at(c, full, parts, to_time_ms, bounds, timeout)
            spans += [Span(topic, p, min(starts[p], ends[p]), ends[p]) for p in parts]
        return spans
    finally:
        c.close()


def _offsets_at(c, full: str, parts: list[int], ms: int, bounds: dict, timeout: float) -> dict[int, int]:
    """Per partition, the first offset whose timestamp is at or after ``ms`` (the end when none is)."""
    from confluent_kafka import TopicPartition

    found = c.offsets_for_times([TopicPartition(full, p, ms) for p in parts], timeout=timeout)
    return {tp.partition: tp.offset if tp.offset >= 0 else bounds[tp.partition][1] for tp in found}


def merged(settings: Settings, spans: list[Span], group_id: str | None = None, poll_s: float = 0.5) -> Iterator[RawMessage]:
    """Every message of ``spans`` in (timestamp, topic, partition, offset) order; see the module doc."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    rank = {t: i for i, t in enumerate(dict.fromkeys(s.topic for s in spans))}
    active = {(s.topic, s.partition): s for s in spans if s.size > 0}
    if not active:
        return
    full = {t: settings.topic(t) for t in rank}
    logical = {v: k for k, v in full.items()}
    c = consumer(settings, group_id or fresh_group("read"))
    buffers: dict[tuple[str, int], deque[RawMessage]] = {k: deque() for k in active}
    exhausted: set[tuple[str, int]] = set()  # read up to its end (its buffer may still hold messages)
    paused: set[tuple[str, int]] = set()
    tps = {k: TopicPartition(full[k[0]], k[1], s.start) for k, s in active.items()}
    try:
        c.assign(list(tps.values()))
        while active:
            if all(buffers[k] or k in exhausted for k in active):
                k = min((k for k in active if buffers[k]),
                        key=lambda k: (buffers[k][0].timestamp_ms, rank[k[0]], k[1], buffers[k][0].offset), default=None)
                if k is None:  # every remaining partition is read to its end
                    break
                yield buffers[k].popleft()
                if k in exhausted and not buffers[k]:
                    del active[k]
                elif k in paused and len(buffers[k]) < _PAUSE_AT // 2:
                    c.resume([tps[k]])
                    paused.discard(k)
                continue
            for msg in c.consume(num_messages=1000, timeout=poll_s):
                err = msg.error()
                k = (logical.get(msg.topic(), ""), msg.partition())
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if k in active and msg.offset() >= active[k].end:
                            exhausted.add(k)
                        continue
                    if err.fatal():
                        raise KafkaException(err)
                    continue  # transient (broker restarting): librdkafka retries by itself
                if k not in active or k in exhausted:
                    continue
                if msg.offset() >= active[k].end:
                    exhausted.add(k)
                    c.pause([tps[k]])  # nothing past the planned end is wanted
                    continue
                buffers[k].append(RawMessage(k[0], k[1], msg.offset(), max(msg.timestamp()[1], 0), msg.key(), msg.value() or b""))
                if msg.offset() + 1 >= active[k].end:
                    exhausted.add(k)
                if len(buffers[k]) >= _PAUSE_AT and k not in paused:
                    c.pause([tps[k]])
                    paused.add(k)
            for k in [k for k in active if k in exhausted and not buffers[k]]:
                del active[k]
    finally:
        c.close()


def tail(settings: Settings, spans: list[Span], group_id: str | None = None, poll_s: float = 1.0) -> Iterator[list[RawMessage]]:
    """Messages that arrive after the spans' ends, in arrival order, as one batch per poll (empty when
    nothing came, so the caller can keep time). Runs until the caller stops iterating."""
    from confluent_kafka import KafkaException, TopicPartition

    full = {s.topic: settings.topic(s.topic) for s in spans}
    logical = {v: k for k, v in full.items()}
    c = consumer(settings, group_id or fresh_group("tail"), **{"enable.partition.eof": False})
    try:
        c.assign([TopicPartition(full[s.topic], s.partition, s.end) for s in spans])
        while True:
            batch = []
            for msg in c.consume(num_messages=1000, timeout=poll_s):
                err = msg.error()
                if err is not None:
                    if err.fatal():
                        raise KafkaException(err)
                    continue  # transient: librdkafka retries by itself
                batch.append(RawMessage(logical[msg.topic()], msg.partition(), msg.offset(),
                                        max(msg.timestamp()[1], 0), msg.key(), msg.value() or b""))
            yield batch
    finally:
        c.close()
