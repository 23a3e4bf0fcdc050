"""The trainer's Kafka input: groups from polar.groups, read from exact positions.

The consumer assigns every partition of polar.groups itself and seeks to the offsets saved in the
newest checkpoint; the checkpoint, not Kafka's committed offsets, is the source of truth, because
weights and positions must move together. Offsets are also committed to the trainer's consumer group
after each checkpoint, so ordinary tools show the trainer's lag. PolicyVersion records go out through
the project's durable publisher (``producers.publisher``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, TopicPartition

from infra.settings import Settings
from schemas import RecordDecodeError, TrainingGroup, decode

# {logical topic: {partition: next offset to read}}, e.g. {"groups": {0: 12, 1: 9}}; the logical name
# (no prefix) is the project's convention for stored positions (see producers.consumer).
Offsets = dict[str, dict[int, int]]


@dataclass(frozen=True)
class Polled:
    """One message taken from polar.groups: a decoded group, or why it could not be decoded."""

    topic: str
    partition: int
    offset: int
    group: TrainingGroup | None
    error: str = ""


def offsets_from_json(data: dict) -> Offsets:
    return {t: {int(p): int(o) for p, o in parts.items()} for t, parts in (data or {}).items()}


class GroupSource:
    """Reads TrainingGroups from polar.groups starting exactly at given offsets."""

    def __init__(self, settings: Settings, consumer_group: str, offsets: Offsets, start_from: str = "earliest"):
        self.topic = settings.topic("groups")
        self._consumer = Consumer(settings.kafka_config(**{
            "group.id": consumer_group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": start_from,
            "enable.partition.eof": False,
            "reconnect.backoff.max.ms": 1000,  # back within a second of a broker restart
        }))
        meta = self._consumer.list_topics(self.topic, timeout=15)
        topic_meta = meta.topics.get(self.topic)
        if topic_meta is None or topic_meta.error is not None or not topic_meta.partitions:
            why = topic_meta.error if topic_meta is not None else "missing"
            raise KafkaException(f"topic {self.topic!r} is not available ({why})")
        saved = offsets.get("groups", {})
        # A partition without a saved position starts at its low (earliest) or high (latest) watermark,
        # resolved now and kept, so the first checkpoint pins it and a restart never re-resolves it.
        self._positions: dict[int, int] = {}
        assignment = []
        for p in sorted(topic_meta.partitions):
            if p not in saved:
                low, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=15)
                saved = {**saved, p: low if start_from == "earliest" else high}
            self._positions[p] = saved[p]
            assignment.append(TopicPartition(self.topic, p, saved[p]))
        self._consumer.assign(assignment)

    def take(self, n: int, poll_timeout_s: float, idle_timeout_s: float, should_stop=lambda: False) -> list[Polled]:
        """Up to ``n`` decodable groups (plus any undecodable messages met on the way).

        Returns early with what it has when nothing arrived for ``idle_timeout_s`` (0: wait forever)
        or when ``should_stop()`` turns true.
        """
        out: list[Polled] = []
        good = 0
        last = time.monotonic()
        while good < n and not should_stop():
            msg = self._consumer.poll(poll_timeout_s)
            if msg is None:
                if idle_timeout_s and time.monotonic() - last > idle_timeout_s:
                    break
                continue
            if msg.error():
                if msg.error().retriable() or not msg.error().fatal():
                    continue
                raise KafkaException(msg.error())
            last = time.monotonic()
            self._positions[msg.partition()] = msg.offset() + 1
            try:
                group, error = decode(msg.value(), TrainingGroup), ""
                good += 1
            except RecordDecodeError as e:
                group, error = None, str(e)
            out.append(Polled(msg.topic(), msg.partition(), msg.offset(), group, error))
        return out

    def positions(self) -> Offsets:
        """Next offset per partition after everything ``take`` has handed out."""
        return {"groups": dict(self._positions)}

    def commit(self, offsets: Offsets) -> None:
        """Record positions in the consumer group (for lag monitoring; restarts use the checkpoint)."""
        tps = [TopicPartition(self.topic, p, o) for p, o in offsets.get("groups", {}).items()]
        if tps:
            self._consumer.commit(offsets=tps, asynchronous=False)

    def close(self) -> None:
        self._consumer.close()
