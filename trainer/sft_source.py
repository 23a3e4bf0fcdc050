"""``polarstream sft``'s input: rows of polar.trajectories read from exact positions, up to a fixed end.

Like the trainer's GroupSource (kafka_io.py) the consumer assigns every partition itself and the checkpoint,
not Kafka's committed offsets, is the source of truth. Two things differ:

- A replay source has an end: by default the high watermarks when the run first started, saved in the
  state, so a resumed run stops where the uninterrupted one would, whatever was written since.
- Rows can wait undecided (best-of-group holds a group's rows until it is complete), so a position alone
  does not say what is done. The state is ``next`` (per partition, the next offset never read) plus
  ``pending`` (the [partition, offset] of every row read but not yet trained or dropped). A restart seeks
  each partition to its lowest pending offset and skips, below ``next``, every row not pending.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from infra.settings import Settings
from schemas import RecordDecodeError, Trajectory, decode

from .sft_select import Row


class RowSource:
    def __init__(self, settings: Settings, group_id: str, state: dict[str, Any] | None,
                 start: dict[int, int] | None = None, start_from: str = "earliest", follow: bool = False):
        """``state``: a checkpoint's (resume); else start at ``start`` ({partition: offset}, the rest at
        ``start_from``: earliest or latest) and, unless ``follow``, stop at today's high watermarks."""
        self.topic = settings.topic("trajectories")
        self._consumer = Consumer(settings.kafka_config(**{
            "group.id": group_id, "enable.auto.commit": False, "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest", "enable.partition.eof": False, "reconnect.backoff.max.ms": 1000,
        }))
        meta = self._consumer.list_topics(self.topic, timeout=15).topics.get(self.topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise KafkaException(f"topic {self.topic!r} is not available ({meta.error if meta else 'missing'})")
        parts = sorted(meta.partitions)
        if state:
            self._next = {int(p): int(o) for p, o in state["next"].items()}
            self._end = None if state.get("end") is None else {int(p): int(o) for p, o in state["end"].items()}
            pending = [(int(p), int(o)) for p, o in state.get("pending", [])]
        else:
            marks = {p: self._consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=15) for p in parts}
            start = start or {}
            self._next = {p: start.get(p, marks[p][0] if start_from == "earliest" else marks[p][1]) for p in parts}
            self._end = None if follow else {p: marks[p][1] for p in parts}
            pending = []
        self._replay = {p: {o for q, o in pending if q == p} for p in parts}  # rows to read again
        self._pos = {p: min([self._next.get(p, 0), *self._replay[p]]) for p in parts}
        self._consumer.assign([TopicPartition(self.topic, p, self._pos[p]) for p in parts])

    @property
    def exhausted(self) -> bool:
        """Every partition read up to its end (never, when following)."""
        return self._end is not None and all(self._pos[p] >= e for p, e in self._end.items())

    def take(self, n: int, poll_timeout_s: float, idle_timeout_s: float, should_stop=lambda: False) -> list[Row]:
        """Up to ``n`` rows; fewer when the end is reached, nothing arrived for ``idle_timeout_s`` (0: wait
        while following) or ``should_stop()``."""
        out: list[Row] = []
        last = time.monotonic()
        while len(out) < n and not should_stop() and not self.exhausted:
            msg = self._consumer.poll(poll_timeout_s)
            if msg is None:
                self._advance_positions()  # offsets without a message (transaction markers) still count
                if idle_timeout_s and time.monotonic() - last > idle_timeout_s:
                    break
                continue
            if msg.error():
                if msg.error().retriable() or not msg.error().fatal():
                    continue
                raise KafkaException(msg.error())
            last = time.monotonic()
            p, o = msg.partition(), msg.offset()
            self._pos[p] = o + 1
            if self._end is not None and o >= self._end.get(p, 0):
                continue  # past the end: not this run's
            if o < self._next.get(p, 0):
                if o not in self._replay[p]:
                    continue  # decided before the checkpoint
                self._replay[p].discard(o)
            else:
                self._next[p] = o + 1
            out.append(_row(p, o, msg.value()))
        return out

    def state(self, pending: list[Row]) -> dict[str, Any]:
        """What a checkpoint saves: the read frontier, the end and the rows still undecided."""
        undecided = sorted({(r.partition, r.offset) for r in pending}
                           | {(p, o) for p, offs in self._replay.items() for o in offs})
        return {"next": {str(p): o for p, o in self._next.items()},
                "end": None if self._end is None else {str(p): o for p, o in self._end.items()},
                "pending": [list(x) for x in undecided]}

    def _advance_positions(self) -> None:
        for tp in self._consumer.position([TopicPartition(self.topic, p) for p in self._pos]):
            if tp.offset >= 0 and tp.offset > self._pos[tp.partition]:
                self._pos[tp.partition] = tp.offset
                if tp.offset > self._next.get(tp.partition, 0) and not self._replay[tp.partition]:
                    self._next[tp.partition] = tp.offset

    def close(self) -> None:
        self._consumer.close()


def _row(partition: int, offset: int, value: bytes) -> Row:
    try:
        return Row.of(partition, offset, value, decode(value, Trajectory))
    except RecordDecodeError as e:
        return Row.of(partition, offset, value, None, str(e))
