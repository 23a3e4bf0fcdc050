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

import asyncio
import logging
import os
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import orjson

from schemas import Record, RecordDecodeError, RecordTooLarge, TrainingGroup, Trajectory, decode, split_record

from .config import StreamsConfig
from .source_log import Recent
from .topology import Topology

log = logging.getLogger("streams")

# A record batch carries framing around the record; keep this much below the topic's limit.
BATCH_OVERHEAD = 4096

T = TypeVar("T")
K = TypeVar("K")


def split_counted(topic: str, record: Trajectory | TrainingGroup, max_bytes: int,
                  count: Callable[[str, int], None],
                  encoded: Iterable[tuple[Record, bytes]] = (), *, packed: bool) -> list[tuple[Record, bytes]] | None:
    """The record and its bytes, or its parts when it is past the topic's limit (schemas/parts.py),
    counted as ``<topic>.split`` and ``<topic>.parts``; None (``<topic>.oversized``) when a single trace
    is too large for any part. The live stages and the replay (polarstream.tools.rederive) both split
    here, so their outputs and counters agree. ``encoded``: records inside whose bytes are known;
    ``packed``: the encoding written (Settings.record_format)."""
    try:
        records = split_record(record, max_bytes - BATCH_OVERHEAD, encoded, packed=packed)  # each part's bytes under the limit
    except RecordTooLarge as e:
        count(f"{topic}.oversized", 1)
        log.error("%s: left out (its inputs stay in the source topics)", e)
        return None
    if len(records) > 1:
        count(f"{topic}.split", 1)
        count(f"{topic}.parts", len(records))
    return records


@dataclass
class Runtime:
    app: Any  # faust.App
    topo: Topology
    config: StreamsConfig
    tables: dict[str, Any]  # name -> a table's in-memory store (values are bytes): written here, not by Faust
    topics: dict[str, Any]  # name -> faust Topic we send to
    stats_path: Path | None = None
    packed: bool = True  # records are written packed (Settings.record_format), else JSON
    counters: Counter = field(default_factory=Counter)
    # Per calls partition: the newest created_at among the calls processed here (see sessions.decide).
    calls_watermark: dict[int, float] = field(default_factory=dict)
    _logged: dict[str, int] = field(default_factory=dict)
    # (stage, partition) -> key -> unsettled send: an event settles only its own partition's sends
    pending: dict[tuple[str, int], dict[str, "Pending"]] = field(default_factory=dict)
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
    # The inputs a stage's handler has returned from, and the topics the stages read: the consumer
    # commits past an input of those topics only once it is in ``handled`` (app._commit_only_handled).
    handled: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    stage_topics: set[str] = field(default_factory=set)
    # (topic, partition) -> the offset its stage must handle next: the committed offset after each seek
    # (app._commit_only_handled), then one past each input handled. Faust can drop records it fetched and
    # deliver later ones (then commit past the "gap"); the loop reads the dropped ones back (_catch_up).
    next_offset: dict[tuple[str, int], int] = field(default_factory=dict)
    # (topic, partition) -> [offset sought to, ticks since]: input partitions not yet checked for records
    # Faust fetched at the seek and dropped with nothing after them to reveal it (``check_undelivered``).
    unchecked: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    # The tables' changelog records, sent once per commit (streams/changelog.py); None: tables without
    # a changelog (the in-process tests). ``partition``: that of the event being handled, the one its
    # table writes belong to (as Faust's own Table.partition_for_key says).
    changelog: Any = None
    partition: int = 0
    # The judge stage (streams/judge_stage.py) when the config names a judge; None: outcome rewards only.
    judge: Any = None

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

    def agent(self, stage: str, inputs: list[str], ticks: str,
              handle: Callable[[str, bytes, int, int], Awaitable[None]]) -> None:
        """Declare a stage's Faust agent: one loop over its ``inputs`` and ``ticks`` topics (raw bytes)
        that, for each event, first settles the stage's acknowledged sends on that partition (see
        ``settle``), then awaits ``handle(topic, value, partition, offset)``, and counts the time spent
        as ``<stage>.busy_us``. A tick first reads back inputs Faust dropped (``check_undelivered``)."""
        topics = [*inputs, ticks]
        channel = self.app.topic(*topics, key_serializer="raw", value_serializer="raw")
        self.stage_topics.update(topics)

        async def loop(stream):  # noqa: ANN001 - a Faust stream
            async for event in stream.events():
                msg = event.message
                started = time.perf_counter()
                self.partition = msg.partition
                self.settle(stage, msg.partition)
                if msg.topic == ticks:
                    await self.check_undelivered(inputs, msg.partition, handle)
                await self.handle_in_order(msg.topic, event.value, msg.partition, msg.offset, handle)
                self.handled.add(msg)
                self.processed[(msg.topic, msg.partition)] = msg.offset
                self.count(f"{stage}.busy_us", int((time.perf_counter() - started) * 1e6))

        self.app.agent(channel, name=stage)(loop)

    async def handle_in_order(self, topic: str, value: bytes, partition: int, offset: int,
                              handle: Callable[[str, bytes, int, int], Awaitable[None]]) -> None:
        """``handle`` an input, after any inputs before it on its partition that Faust skipped."""
        tp = (topic, partition)
        expected = self.next_offset.get(tp)
        if expected is not None and offset > expected:
            await self._catch_up(topic, partition, expected, offset, handle)
        await handle(topic, value, partition, offset)
        self.next_offset[tp] = max(expected or 0, offset + 1)

    def sought(self, topic: str, partition: int, offset: int) -> None:
        """The consumer was sought to ``offset`` of an input partition (after each rebalance)."""
        self.next_offset[(topic, partition)] = offset
        self.unchecked[(topic, partition)] = [offset, 0]

    async def check_undelivered(self, inputs: list[str], partition: int,
                                handle: Callable[[str, bytes, int, int], Awaitable[None]]) -> None:
        """Handle the inputs of ``partition`` that Faust fetched around a rebalance and dropped, when
        nothing came after them: ``handle_in_order`` catches up on a gap only once a later input is
        delivered, so the last calls of a burst waited for the next session (the bench's streams
        worker stalled on them after a second worker left; the chaos run on its last group).

        At the second tick after a seek, an input partition that has delivered nothing since is read up
        to its end (one broker round trip), and what lies past the sought offset is handled in order.
        Were Faust to deliver it after all, the handlers drop the duplicates."""
        for topic in inputs:
            key = (topic, partition)
            check = self.unchecked.get(key)
            if check is None:
                continue
            if self.next_offset.get(key) != check[0]:  # delivered something: a gap shows on its own
                del self.unchecked[key]
                continue
            check[1] += 1
            if check[1] < 2:  # a fetch in flight at the first tick delivers before the second
                continue
            del self.unchecked[key]
            try:
                end = await self.source.end_offset(topic, partition)
            except TimeoutError as e:
                log.warning("%s: not checked for undelivered inputs", e)
                continue
            if end > check[0]:
                self.count("inputs.undelivered", end - check[0])
                await self._catch_up(topic, partition, check[0], end, handle)
                self.next_offset[key] = max(self.next_offset.get(key, 0), end)

    async def _catch_up(self, topic: str, partition: int, start: int, end: int,
                        handle: Callable[[str, bytes, int, int], Awaitable[None]]) -> None:
        """Handle, in order, the inputs at offsets [start, end) that Faust fetched but never delivered.

        After a rebalance Faust drops the records it fetched for a partition not yet active again, then
        counts the offsets it skipped as a "gap" and commits past them: the join test lost seven groups
        this way. They are read back from the topic instead (an offset with no record, such as
        a transaction marker, is passed over). A broker that does not answer crashes the stage rather
        than skipping: nothing past ``start`` is committed, so a restart reads them again."""
        for _ in range(5):
            try:
                values = await self.source.read(topic, partition, list(range(start, end)))
                break
            except TimeoutError as e:
                log.warning("%s: catching up, retrying", e)
                await asyncio.sleep(1.0)
        else:
            raise RuntimeError(f"{topic}[{partition}]: could not read back offsets {start}..{end - 1}")
        caught = [o for o in range(start, end) if values.get(o) is not None]
        self.count("inputs.caught_up", len(caught))
        log.warning("%s[%d]: %d inputs at %d..%d were fetched but not delivered: read back and handled",
                    topic, partition, len(caught), start, end - 1)
        for offset in caught:
            await handle(topic, values[offset], partition, offset)

    def decode(self, value: bytes, cls: type, topic: str, partition: int, offset: int) -> Any | None:
        """The record, or None for bytes that are not one: counted as ``<record topic>.undecodable``,
        logged with where they sit, and skipped (a bad message must not stop the stage)."""
        try:
            return decode(value, cls)
        except RecordDecodeError as e:
            self.count(f"{cls.TOPIC}.undecodable")
            log.warning("skipping undecodable record at %s[%d]@%d: %s", topic, partition, offset, e)
            return None

    async def read_back(self, topic: str, cls: type, refs: dict[K, dict], counter: str) -> dict[K, Any] | None:
        """The records that table references (``{"e": event id, "at": [partition, offset]}``, by the
        caller's key) point at in ``topic``, read in one pass per partition (streams/source_log.py).
        Those no longer at their offset are left out (``<counter>.gone``, logged); None when the broker
        did not answer in time (``<counter>.read_back_timeout``: the caller retries at a later tick)."""
        by_partition: dict[int, dict[int, tuple[K, str]]] = {}
        for key, held in refs.items():
            by_partition.setdefault(held["at"][0], {})[held["at"][1]] = (key, held["e"])
        out: dict[K, Any] = {}
        for partition, wanted in by_partition.items():
            try:
                values = await self.source.read(topic, partition, list(wanted))
            except TimeoutError as e:
                self.count(f"{counter}.read_back_timeout")
                log.warning("%s: retried at the next tick", e)
                return None
            for offset, (key, event_id) in wanted.items():
                value = values.get(offset)
                record = None if value is None else self.decode(value, cls, topic, partition, offset)
                if record is None or record.event_id != event_id:
                    self.count(f"{counter}.gone")
                    log.error("%s %s is no longer at %s[%d]@%d", cls.__name__, event_id, topic, partition, offset)
                    continue
                self.count(f"{counter}.read_back")
                out[key] = record
        return out

    def get(self, table: str, key: str) -> dict[str, Any] | None:
        raw = self.tables[table].get(key)
        return None if raw is None else orjson.loads(raw)

    def put(self, table: str, key: str, value: dict[str, Any] | bytes) -> None:
        data = value if isinstance(value, bytes) else orjson.dumps(value)
        store = self.tables[table]
        if self.changelog is not None:
            self.changelog.note(table, key, self.partition, data, key in store)
        store[key] = data

    def delete(self, table: str, key: str) -> None:
        store = self.tables[table]
        if key in store:
            del store[key]
            if self.changelog is not None:
                self.changelog.note(table, key, self.partition, None, True)

    async def send_split(self, topic: str, record: Trajectory | TrainingGroup, max_bytes: int,
                         encoded: Iterable[tuple[Record, bytes]] = ()) -> Any | None:
        """Start sending a record, in parts when it is over the topic's limit (schemas/parts.py): one
        future for all of them, or None (counted as ``<topic>.oversized``, logged) when a single trace
        is too large for any part. ``encoded``: records inside it whose bytes are known (``encode``)."""
        records = split_counted(topic, record, max_bytes, self.count, encoded, packed=self.packed)
        if records is None:
            return None
        self.count(f"{topic}.sent", len(records))
        futures = []
        for part, data in records:
            future = await self.topics[topic].send(key=part.key().encode(), value=data)
            if topic == "trajectories":  # to this worker's group stage too, once the broker has it
                future.add_done_callback(partial(self._hand_over, record=part, data=data))
            futures.append(future)
        return futures[0] if len(futures) == 1 else asyncio.gather(*futures)

    def _hand_over(self, future: Any, record: Record, data: bytes) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        sent = future.result()  # RecordMetadata: where the broker put it
        self._outbox().put(f"{sent.partition}@{sent.offset}", "", (record, data), len(data))

    def handed_over(self, partition: int, offset: int) -> tuple[Any, bytes] | None:
        """The trajectory this worker sent to ``partition``@``offset`` of polar.trajectories, as the object
        it built, with its bytes: the group stage reading it back need not decode it, nor its group
        encode it again (each was a tenth of the worker's CPU). None when another worker sent it, or it
        was read before the broker's acknowledgement reached us."""
        return self._outbox().take(f"{partition}@{offset}", "")

    def _outbox(self) -> Recent:
        # Bounded (LRU) for the trajectories whose group another worker's stage reads.
        return self.cache("outbox", self.config.member_cache_bytes)

    def pend(self, stage: str, key: str, partition: int, future: Any, on_ack: Callable[[], None]) -> None:
        """Run ``on_ack`` (in a later event of ``partition``) once ``future`` says the broker has the record."""
        self.pending.setdefault((stage, partition), {})[key] = Pending(partition, future, on_ack)

    def is_pending(self, stage: str, key: str) -> bool:
        return any(key in sends for (s, _), sends in self.pending.items() if s == stage)

    def settle(self, stage: str, partition: int) -> None:
        """Apply the acknowledged sends of this stage's partition; a failed send crashes the worker (the
        inputs were not committed, so a restart replays them)."""
        sends = self.pending.get((stage, partition))
        for key, p in list(sends.items()) if sends else ():
            if p.future.done():
                p.future.result()  # raises the send's error
                p.on_ack()
                del sends[key]

    def write_stats(self) -> None:
        """Log the counters and write them to ``stats_path`` (atomically: a reader never sees half a file)."""
        snapshot = dict(sorted(self.counters.items()))
        events = {k: v for k, v in snapshot.items() if not k.endswith("_us")}  # ticks alone move busy time
        if events != self._logged:  # an idle worker does not repeat itself
            log.info("streams counters: %s", orjson.dumps(snapshot).decode())
            self._logged = events
        if self.stats_path is not None:
            self.stats_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.stats_path.with_suffix(f".{os.getpid()}.tmp")  # workers may share a data dir
            tmp.write_bytes(orjson.dumps({"time": time.time(), "pid": os.getpid(), "counters": snapshot}))
            tmp.replace(self.stats_path)


@dataclass
class Pending:
    partition: int
    future: Any  # faust's FutureMessage (an asyncio future)
    on_ack: Callable[[], None]
