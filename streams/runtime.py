"""What the agents share inside one worker: the app, its tables and output topics, and counters.

Tables hold raw bytes (orjson documents we encode ourselves), so a value read back after a changelog
replay is exactly the value that was written, and the codec is ours rather than Faust's. Every outcome
that is not the happy path (duplicate, late, undecodable, oversized, ...) is a named counter; the
counters are logged and written to a small JSON file at intervals so an operator or a test can read them.

Emitting is pipelined but crash-safe. A stage sends its output and registers what must happen once the
broker acknowledged it (mark the session or group done, delete its inputs) as *pending*; the next event
the stage handles on the same partition (an input or a tick) settles every acknowledged send first.
Until then the state still says "not done", so a crash at any point can only lead to a byte-identical
re-send, never to a "done" marker for a record the broker does not have. (Waiting for each ack inside
the handler was the same guarantee at a fraction of the throughput.)
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson

from schemas import Record, RecordDecodeError, decode, encode

from .config import StreamsConfig
from .source_log import Recent
from .topology import Topology

log = logging.getLogger("streams")

# A record batch carries framing around the record; keep this much below the topic's limit.
_BATCH_OVERHEAD = 4096

T = TypeVar("T")


@dataclass
class Runtime:
    app: Any  # faust.App
    topo: Topology
    config: StreamsConfig
    tables: dict[str, Any]  # name -> faust Table (values are bytes)
    topics: dict[str, Any]  # name -> faust Topic we send to
    stats_path: Path | None = None
    counters: Counter = field(default_factory=Counter)
    # Per calls partition: the newest created_at among the calls processed here (see sessions.decide).
    calls_watermark: dict[int, float] = field(default_factory=dict)
    _logged: dict[str, int] = field(default_factory=dict)
    pending: dict[tuple[str, str], "Pending"] = field(default_factory=dict)  # (stage, key) -> unsettled send
    # (topic, partition) -> offset of the last event handled: the consumer lag metric (streams/metrics.py)
    processed: dict[tuple[str, int], int] = field(default_factory=dict)
    # Bumped each time the tables finish recovering after a rebalance (``recovered``, a table callback):
    # what a stage keeps in memory about its tables (its deadlines) is then rebuilt from them, once.
    generation: int = 0
    _indexes: dict[str, tuple[int, Any]] = field(default_factory=dict)
    # Inputs read back by offset (streams/source_log.py): the tables hold references to them, and
    # ``caches`` the recently seen ones by table key (kept across rebalances: a hit needs the event id).
    source: Any = None
    caches: dict[str, Recent] = field(default_factory=dict)

    async def recovered(self) -> None:
        """Tables are recovered (Faust calls this after each rebalance, before any event is handled)."""
        self.generation += 1

    def index(self, name: str, build: Callable[[], T]) -> T:
        """An in-memory structure derived from the tables: ``build()`` once per table generation."""
        held = self._indexes.get(name)
        if held is None or held[0] != self.generation:
            generation = self.generation
            held = (generation, build())
            self._indexes[name] = held
            self.count(f"{name}.index_rebuilt")
        return held[1]

    def cache(self, name: str, max_bytes: int) -> Recent:
        held = self.caches.get(name)
        if held is None:
            held = self.caches[name] = Recent(max_bytes)
        return held

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def agent(self, stage: str, topics: list[str], handle: Callable[[str, bytes, int, int], Awaitable[None]]) -> None:
        """Declare a stage's Faust agent: one loop over ``topics`` (raw bytes) that, for each event,
        first settles the stage's acknowledged sends on that partition (see ``settle``), then awaits
        ``handle(topic, value, partition, offset)``, and counts the time spent as ``<stage>.busy_us``."""
        channel = self.app.topic(*topics, key_serializer="raw", value_serializer="raw")

        async def loop(stream):  # noqa: ANN001 - a Faust stream
            async for event in stream.events():
                msg = event.message
                started = time.perf_counter()
                self.settle(stage, msg.partition)
                await handle(msg.topic, event.value, msg.partition, msg.offset)
                self.processed[(msg.topic, msg.partition)] = msg.offset
                self.count(f"{stage}.busy_us", int((time.perf_counter() - started) * 1e6))

        self.app.agent(channel, name=stage)(loop)

    def decode(self, value: bytes, cls: type, topic: str, partition: int, offset: int) -> Any | None:
        """The record, or None for bytes that are not one: counted as ``<record topic>.undecodable``,
        logged with where they sit, and skipped (a bad message must not stop the stage)."""
        try:
            return decode(value, cls)
        except RecordDecodeError as e:
            self.count(f"{cls.TOPIC}.undecodable")
            log.warning("skipping undecodable record at %s[%d]@%d: %s", topic, partition, offset, e)
            return None

    def get(self, table: str, key: str) -> dict[str, Any] | None:
        raw = self.tables[table].get(key)
        return None if raw is None else orjson.loads(raw)

    def put(self, table: str, key: str, value: dict[str, Any] | bytes) -> None:
        self.tables[table][key] = value if isinstance(value, bytes) else orjson.dumps(value)

    def delete(self, table: str, key: str) -> None:
        if key in self.tables[table]:
            del self.tables[table][key]

    async def send(self, topic: str, record: Record, max_bytes: int) -> Any | None:
        """Start sending a record; its delivery future, or None (counted, logged) when it is too large."""
        data = encode(record)
        if len(data) > max_bytes - _BATCH_OVERHEAD:
            self.count(f"{topic}.oversized")
            log.error("%s %s is %d bytes, over the topic's %d: not sent (its inputs stay in the source topics)",
                      type(record).__name__, record.event_id, len(data), max_bytes)
            return None
        self.count(f"{topic}.sent")
        return await self.topics[topic].send(key=record.key().encode(), value=data)

    def pend(self, stage: str, key: str, partition: int, future: Any, on_ack: Callable[[], None]) -> None:
        """Run ``on_ack`` (in a later event of ``partition``) once ``future`` says the broker has the record."""
        self.pending[(stage, key)] = Pending(partition, future, on_ack)

    def is_pending(self, stage: str, key: str) -> bool:
        return (stage, key) in self.pending

    def settle(self, stage: str, partition: int) -> None:
        """Apply the acknowledged sends of this stage's partition; a failed send crashes the worker (the
        inputs were not committed, so a restart replays them)."""
        for k, p in list(self.pending.items()):
            if k[0] == stage and p.partition == partition and p.future.done():
                p.future.result()  # raises the send's error
                p.on_ack()
                del self.pending[k]

    def write_stats(self) -> None:
        """Log the counters and write them to ``stats_path`` (atomically: a reader never sees half a file)."""
        snapshot = dict(sorted(self.counters.items()))
        events = {k: v for k, v in snapshot.items() if not k.endswith("_us")}  # ticks alone move busy time
        if events != self._logged:  # an idle worker does not repeat itself
            log.info("streams counters: %s", orjson.dumps(snapshot).decode())
            self._logged = events
        if self.stats_path is not None:
            self.stats_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.stats_path.with_suffix(".tmp")
            tmp.write_bytes(orjson.dumps({"time": time.time(), "pid": os.getpid(), "counters": snapshot}))
            tmp.replace(self.stats_path)


@dataclass
class Pending:
    partition: int
    future: Any  # faust's FutureMessage (an asyncio future)
    on_ack: Callable[[], None]
