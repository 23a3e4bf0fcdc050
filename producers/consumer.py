"""A typed consumer with manual commits, and the Deduper every effectively-once reader uses.

    consumer = RecordConsumer(settings, topics=["calls"], group_id="replay")
    try:
        while running:
            for item in consumer.poll(1.0):
                handle(item.record)          # a CallRecorded, already validated
            consumer.commit()                # only after processing: at-least-once
    finally:
        consumer.close()

Offsets are committed only by ``commit()``, for what ``poll`` returned so far, so a crash between the
two replays records instead of skipping them; a ``Deduper`` on ``event_id`` turns that replay into
effectively-once. A message that does not decode is counted, logged and skipped: it can neither
crash the reader nor block its partition.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from infra.security import AUTHZ_ERRORS, access_denied
from infra.settings import Settings
from schemas import RECORD_BY_TOPIC, Record, RecordDecodeError, decode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsumedRecord:
    """A decoded record and where it came from."""

    record: Record
    topic: str  # full topic name (with prefix)
    logical_topic: str  # "calls"
    partition: int
    offset: int
    key: str | None
    timestamp_ms: int


def logical_topic(full: str, prefix: str) -> str:
    """'exp1.polar.calls' with prefix 'exp1.' -> 'calls'; ValueError for a topic outside the prefix."""
    if not full.startswith(prefix + "polar."):
        raise ValueError(f"topic {full!r} is not a polarstream topic under prefix {prefix!r}")
    return full[len(prefix) + len("polar."):]


class Deduper:
    """Remembers the last ``capacity`` event ids; ``seen`` tells a re-delivered event from a new one.

    Bounded so a long-running consumer does not grow forever: an id older than ``capacity`` distinct
    events is forgotten, which is safe as long as redeliveries come within that window (they replay
    from the last committed offset, so size it above the records between two commits).
    """

    def __init__(self, capacity: int = 100_000):
        if capacity < 1:
            raise ValueError("capacity: must be at least 1")
        self.capacity = capacity
        self.duplicates = 0
        self._ids: OrderedDict[str, None] = OrderedDict()

    def seen(self, event_id: str) -> bool:
        """True if ``event_id`` was seen before (a duplicate); otherwise remember it and return False."""
        if event_id in self._ids:
            self._ids.move_to_end(event_id)
            self.duplicates += 1
            return True
        self._ids[event_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return False

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class RecordConsumer:
    """Consumes polarstream topics as typed records, committing only when told to."""

    def __init__(self, settings: Settings, topics: list[str] | tuple[str, ...] = ("calls",), group_id: str | None = None,
                 from_beginning: bool = True, start_offsets: dict[tuple[str, int], int] | None = None,
                 config: dict[str, Any] | None = None):
        """``start_offsets`` maps (logical topic, partition) to the next offset to read, overriding the
        group's committed position (a trainer resuming from the offsets in its checkpoint)."""
        self.settings = settings
        self.topics = [settings.topic(t) for t in topics]
        self.group_id = group_id or f"polar-{uuid.uuid4().hex[:12]}"
        self.undecodable = 0
        self._start = {(settings.topic(t), p): o for (t, p), o in (start_offsets or {}).items()}
        self._pending: dict[tuple[str, int], int] = {}  # (topic, partition) -> next offset to commit
        cfg = settings.kafka_config(**{
            "group.id": self.group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest" if from_beginning else "latest",
            "enable.partition.eof": False,
            "reconnect.backoff.max.ms": 1000,
            "logger": logging.getLogger("librdkafka"),  # not raw stderr: callers choose what they see
        })
        cfg.update(config or {})
        self._consumer = Consumer(cfg)
        self._consumer.subscribe(self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke)

    def _on_assign(self, consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            if (tp.topic, tp.partition) in self._start:
                tp.offset = self._start[(tp.topic, tp.partition)]
        consumer.assign(partitions)

    def _on_revoke(self, consumer, partitions: list[TopicPartition]) -> None:
        # What we polled from a revoked partition but did not commit will be re-read by its new
        # owner; committing it here could claim records nobody processed.
        for tp in partitions:
            self._pending.pop((tp.topic, tp.partition), None)
        consumer.unassign()

    def poll(self, timeout: float = 1.0, max_records: int = 500) -> list[ConsumedRecord]:
        """Up to ``max_records`` decoded records, waiting at most ``timeout`` seconds for the first."""
        out = []
        for msg in self._consumer.consume(num_messages=max_records, timeout=timeout):
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise KafkaException(err)
                if err.name() in AUTHZ_ERRORS:  # retrying cannot help: say who may not read what
                    raise access_denied(self.settings, err.name(), err.str(), f"read {msg.topic() or self.topics} "
                                        f"as consumer group {self.group_id!r}")
                log.warning("consumer %s: %s", self.group_id, err.str())
                continue
            topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            self._pending[(topic, partition)] = offset + 1
            item = self._decode(msg, topic, partition, offset)
            if item is not None:
                out.append(item)
        return out

    def _decode(self, msg, topic: str, partition: int, offset: int) -> ConsumedRecord | None:
        name = logical_topic(topic, self.settings.topic_prefix)
        try:
            record = decode(msg.value() or b"", RECORD_BY_TOPIC[name])
        except RecordDecodeError as e:
            self.undecodable += 1
            log.warning("skipping undecodable message %s[%d]@%d: %s", topic, partition, offset, e)
            return None
        key = msg.key()
        return ConsumedRecord(record, topic, name, partition, offset, key.decode() if key is not None else None,
                              msg.timestamp()[1])

    def commit(self) -> dict[tuple[str, int], int]:
        """Commit everything ``poll`` returned so far (synchronously); returns the committed positions."""
        if not self._pending:
            return {}
        offsets = [TopicPartition(t, p, o) for (t, p), o in self._pending.items()]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:
            if e.args[0].code() != KafkaError._NO_OFFSET:
                raise
        done, self._pending = self._pending, {}
        return done

    def assignment(self) -> list[tuple[str, int]]:
        """(logical topic, partition) pairs this member owns right now (empty until the group is joined)."""
        prefix = self.settings.topic_prefix
        return sorted((logical_topic(tp.topic, prefix), tp.partition) for tp in self._consumer.assignment())

    def positions(self) -> dict[tuple[str, int], int]:
        """(logical topic, partition) -> next offset of every record handed out and committed or pending.

        What a checkpoint stores to resume exactly: pass it back as ``start_offsets``.
        """
        assigned = self._consumer.assignment()
        pos = {(tp.topic, tp.partition): tp.offset for tp in self._consumer.position(assigned) if tp.offset >= 0}
        pos.update(self._pending)
        prefix = self.settings.topic_prefix
        return {(logical_topic(t, prefix), p): o for (t, p), o in pos.items()}

    def close(self) -> None:
        """Leave the group (uncommitted records will be re-delivered to whoever reads next)."""
        self._consumer.close()

    def __enter__(self) -> "RecordConsumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
