"""Records a stage already consumed, read back by offset: state keeps a reference, not a copy.

A stage's tables used to hold each input's bytes until its session or group was done, so every token
went to Kafka twice more (the input topic, then the table's changelog). Now a table holds a reference,
``{"e": event id, "at": [partition, offset]}`` on the input topic, which is kept far longer than any
session or group stays open (polar.calls forever, polar.trajectories 30 days: infra/topics.yaml). The
data itself is served from ``Recent``, an in-memory cache filled as inputs arrive, and read back from
the topic only on a miss: after a restart, or when the cache overflowed.

The reference carries the event id, so a record that is no longer at its offset (a topic rewritten by
``polarstream forget``, or expired) is reported as gone, never mistaken for another.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Any, Generic, TypeVar

import orjson

V = TypeVar("V")


def reference(event_id: str, partition: int, offset: int) -> dict:
    """Where an input record sits, with its event id (no copy of a record has an ``at`` key)."""
    return {"e": event_id, "at": [partition, offset]}


def ref(event_id: str, partition: int, offset: int) -> bytes:
    """A table value that points at an input record: its ``reference``."""
    return orjson.dumps(reference(event_id, partition, offset))


class Recent(Generic[V]):
    """An LRU of values by key, each tagged with its event id and counted at a size the caller gives;
    a hit needs the same event id (another attempt under the same key is a miss)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.items: OrderedDict[str, tuple[str, V, int]] = OrderedDict()

    def put(self, key: str, event_id: str, value: V, size: int) -> None:
        self.pop(key)
        if size > self.max_bytes:
            return
        self.items[key] = (event_id, value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_e, _v, old) = self.items.popitem(last=False)
            self.bytes -= old

    def get(self, key: str, event_id: str) -> V | None:
        hit = self.items.get(key)
        if hit is None or hit[0] != event_id:
            return None
        self.items.move_to_end(key)
        return hit[1]

    def take(self, key: str, event_id: str) -> V | None:
        """``get``, and forget it."""
        value = self.get(key, event_id)
        if value is not None:
            self.pop(key)
        return value

    def pop(self, key: str) -> int:
        """Forget ``key``; the size it was counted at (0 if it was not held)."""
        hit = self.items.pop(key, None)
        if hit is None:
            return 0
        self.bytes -= hit[2]
        return hit[2]


class SourceLog:
    """Reads records of this worker's input topics back by (topic, partition, offset).

    One librdkafka consumer, assigned to one partition at a time, in a thread so the event loop (and the
    worker's heartbeats) go on while the broker answers. It commits nothing and joins no group. The
    offsets of one session or group are read in one pass where they lie close together (a seek only
    across a gap), since each fresh assignment costs a fetch round trip."""

    GAP = 256  # records read through rather than seeking past (a seek is a round trip)

    def __init__(self, settings: Any, timeout_s: float = 10.0, max_bytes: int = 64 * 1024 * 1024):
        self.settings, self.timeout_s, self.max_bytes = settings, timeout_s, max_bytes
        self._consumer: Any = None
        self._lock = threading.Lock()

    async def read(self, topic: str, partition: int, offsets: list[int]) -> dict[int, bytes | None]:
        """offset -> the record's value, or None when that offset holds no record any more; TimeoutError
        when the broker did not answer in time (worth retrying)."""
        return await asyncio.to_thread(self._read, topic, partition, sorted(set(offsets)))

    def _read(self, topic: str, partition: int, want: list[int]) -> dict[int, bytes | None]:
        from confluent_kafka import KafkaError, TopicPartition

        out: dict[int, bytes | None] = {}
        i = 0
        with self._lock:
            c = self._client()
            while i < len(want):
                c.assign([TopicPartition(topic, partition, want[i])])
                try:
                    while i < len(want):
                        msg = c.poll(self.timeout_s)
                        if msg is None:
                            raise TimeoutError(f"no answer for {topic}[{partition}]@{want[i]} in {self.timeout_s}s")
                        err = msg.error()
                        if err is not None:
                            if err.code() != KafkaError._AUTO_OFFSET_RESET:
                                raise TimeoutError(f"reading {topic}[{partition}]@{want[i]}: {err}")
                            # Below the log start (deleted): all of those at once, not a round trip each.
                            start, _ = c.get_watermark_offsets(TopicPartition(topic, partition), timeout=self.timeout_s)
                            out[want[i]] = None
                            i += 1
                            while i < len(want) and want[i] < start:
                                out[want[i]] = None
                                i += 1
                            break  # assign again at the next one
                        at = msg.offset()
                        while i < len(want) and want[i] < at:  # skipped over: no longer there
                            out[want[i]] = None
                            i += 1
                        if i < len(want) and want[i] == at:
                            out[at] = msg.value()
                            i += 1
                        if i < len(want) and want[i] - at > self.GAP:
                            break  # seek across the gap
                finally:
                    c.unassign()
        return out

    async def end_offset(self, topic: str, partition: int) -> int:
        """The partition's end (the offset its next record gets); TimeoutError when the broker does not
        answer in time."""
        return await asyncio.to_thread(self._end_offset, topic, partition)

    def _end_offset(self, topic: str, partition: int) -> int:
        from confluent_kafka import KafkaException, TopicPartition

        with self._lock:
            try:
                return self._client().get_watermark_offsets(TopicPartition(topic, partition), timeout=self.timeout_s)[1]
            except KafkaException as e:
                raise TimeoutError(f"end of {topic}[{partition}]: {e.args[0]}") from None

    def _client(self) -> Any:
        if self._consumer is None:
            from confluent_kafka import Consumer

            self._consumer = Consumer(self.settings.kafka_config(**{
                "group.id": "polarstream-source-log",  # required by the client; nothing is committed
                "enable.auto.commit": False,
                "auto.offset.reset": "error",  # an offset that is gone is an error, not a silent jump
                # A new assignment's first fetch waits for the previous long-poll fetch to return: at
                # librdkafka's default of 500 ms, every read took half a second (and a read-back blocks
                # its stage), 20 ms at this.
                "fetch.wait.max.ms": 10,
                "fetch.max.bytes": self.max_bytes,
                "max.partition.fetch.bytes": self.max_bytes,
                "queued.max.messages.kbytes": 65536,
                "enable.partition.eof": False,
            }))
        return self._consumer

    def close(self) -> None:
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None
