"""The Faust app of the stream processors: two stages, their tables, ticks and counters.

``create_app(settings, config)`` builds a fresh app (no module-level app: two apps can live in one
process, e.g. in tests). Run it with ``polarstream streams worker``; several workers with the same
topic prefix form one consumer group and split the partitions between them.

Choices, and why:
- at-least-once: Faust flushes table changelogs before committing offsets (made reliable below; the
  stages' table writes go out there, compacted: streams/changelog.py), so
  state is never behind the committed input; every derived record has a deterministic id and nothing
  is marked done before the broker acknowledged it (runtime.py), so the worst a crash does is a
  byte-identical re-send that readers drop by event_id. Faust's ``exactly_once`` is not offered: in
  the kill test it lost data, and even with the fixes below it still let duplicates through to
  read_committed consumers (docs/streams.md).
- ``memory://`` store: state is rebuilt from the changelog topics on start. No native RocksDB binding
  is needed, and the state is small: bookkeeping, and references to the inputs on their topics
  (streams/source_log.py), whose data a bounded cache holds.
- A crashing agent crashes the worker (CrashingSupervisor) and exceptions are not acked, so an event
  that hit a bug is re-processed after restart instead of being skipped silently.
- Deadlines need events in a stream's context (tables may only change there), so each worker sends a
  tick to each tick-topic partition it owns; the stage's agent then acts on that partition's sessions
  or groups whose deadline has come (an in-memory heap per partition, rebuilt from the tables after
  each rebalance: streams/deadlines.py), without reading the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from infra.security import faust_credentials
from infra.settings import Settings

from . import group_agent, metrics, session_agent
from .config import StreamsConfig
from .changelog import Changelog
from .runtime import Runtime
from .source_log import SourceLog
from .topology import STATE_MAX_BYTES, Topology, discover, ensure_internal_topics

log = logging.getLogger("streams")


def create_app(
    settings: Settings,
    config: StreamsConfig,
    topo: Topology | None = None,
    *,
    session_timeout_s: float = 10.0,
    stats_interval_s: float = 10.0,
) -> Any:
    """A configured faust.App with both stages registered (not started)."""
    import faust
    import mode

    topo = topo or discover(settings)
    ensure_internal_topics(settings, topo, {
        session_agent.SESSIONS: topo.session_partitions, session_agent.CALLS: topo.session_partitions,
        group_agent.GROUPS: topo.group_partitions, group_agent.MEMBERS: topo.group_partitions,
    })
    datadir = settings.data_dir / "streams" / topo.app_id
    datadir.mkdir(parents=True, exist_ok=True)
    max_out = max(topo.trajectory_max_bytes, topo.group_max_bytes) + 64 * 1024
    app = faust.App(
        topo.app_id,
        broker=[f"kafka://{b.strip()}" for b in settings.kafka_bootstrap.split(",")],
        broker_credentials=faust_credentials(settings),  # SASL/TLS on a secured cluster (docs/security.md)
        store="memory://",
        datadir=str(datadir),
        processing_guarantee="at_least_once",  # exactly_once lost data in our kill test: docs/streams.md
        topic_partitions=topo.session_partitions,
        topic_replication_factor=topo.replication_factor,
        topic_disable_leader=True,
        table_standby_replicas=0,
        consumer_auto_offset_reset="earliest",
        consumer_max_fetch_size=max_out,
        producer_max_request_size=max_out,
        producer_acks=-1,
        # The worker writes each session's tokens twice (trajectory, group; its tables keep references)
        # as JSON text, which zstd shrinks 3x (random ids) to 7x (the bench's sessions) on the wire and
        # on the brokers' disks; the worker's CPU per call did not change measurably.
        producer_compression_type="zstd",
        # Sent as they come (Faust's default: linger 0, 16 KB batches), a burst's records went out in
        # many small produce requests, each built in Python by aiokafka and handled by the broker.
        # Waiting up to 10 ms for more cut the worker's CPU per call by about a tenth and the broker's by
        # a third, back when every table write was its own changelog record (bench/streams.py burst,
        # interleaved runs); a group waits at most some tens of ms more.
        producer_linger=0.010,
        producer_max_batch_size=1024 * 1024,
        key_serializer="raw",
        value_serializer="raw",
        broker_session_timeout=session_timeout_s,
        broker_heartbeat_interval=max(1.0, session_timeout_s / 4),
        agent_supervisor=mode.CrashingSupervisor,
        stream_ack_exceptions=False,
        web_enabled=False,
        autodiscover=False,
    )
    # key_type/value_type, not a Schema: Faust derives the changelog's serializers from these two (str
    # keys as JSON, bytes values raw), so a value read back on recovery is the bytes that were written.
    table_kw = dict(key_type=str, value_type=bytes, extra_topic_configs={"max.message.bytes": str(STATE_MAX_BYTES)})
    tables = {
        session_agent.SESSIONS: app.Table(session_agent.SESSIONS, partitions=topo.session_partitions, **table_kw),
        session_agent.CALLS: app.Table(session_agent.CALLS, partitions=topo.session_partitions, **table_kw),
        group_agent.GROUPS: app.Table(group_agent.GROUPS, partitions=topo.group_partitions, **table_kw),
        group_agent.MEMBERS: app.Table(group_agent.MEMBERS, partitions=topo.group_partitions, **table_kw),
    }
    send = dict(key_serializer="raw", value_serializer="raw")
    topics = {
        "trajectories": app.topic(topo.trajectories, **send),
        "groups": app.topic(topo.groups, **send),
        topo.session_ticks: app.topic(topo.session_ticks, **send),
        topo.group_ticks: app.topic(topo.group_ticks, **send),
    }
    if config.judge is not None:
        topics["judgements"] = app.topic(settings.topic("judgements"), **send)
    stats_path = settings.data_dir / "streams" / f"{topo.app_id}.stats.json"
    # The stages write the tables' stores, and their changelog goes out compacted at each commit.
    stores = {name: table.data for name, table in tables.items()}
    rt = Runtime(app, topo, config, stores, topics, stats_path, source=SourceLog(settings), changelog=Changelog(tables),
                 packed=settings.packed)
    if config.judge is not None:
        from .judge_stage import JudgeStage, faust_recorder  # loads the tokenizer the transcripts are decoded with

        rt.judge = JudgeStage(settings, config.judge, faust_recorder(topics["judgements"], settings.packed), rt.count)
    for table in tables.values():
        table.on_recover(rt.recovered)  # in-memory deadlines are rebuilt from the recovered tables
    session_agent.register(rt)
    group_agent.register(rt)
    _register_timers(rt, stats_interval_s)
    metrics.watch(rt)
    _commit_only_handled(app.consumer, rt)
    _flush_means_flushed(app.producer.buffer, rt)
    _without_faust_monitor(app)
    _zstd_level(1)
    _reseek_stalled_recovery(app, rt)
    app.polar_runtime = rt  # for tests and the bench: counters of this worker
    return app


def _register_timers(rt: Runtime, stats_interval_s: float) -> None:
    app, topo = rt.app, rt.topo

    @app.timer(interval=rt.config.tick_interval_s, name="ticks")
    async def ticks() -> None:
        # Only partitions this worker owns: the sweep must run where the partition's state lives.
        for tp in app.assignor.assigned_actives():
            if tp.topic in (topo.session_ticks, topo.group_ticks):
                await rt.topics[tp.topic].send(value=b"", partition=tp.partition)

    @app.timer(interval=stats_interval_s, name="stats")
    async def stats() -> None:
        rt.write_stats()
        await metrics.refresh(rt, session_agent.SESSIONS, group_agent.GROUPS)


def _commit_only_handled(consumer: Any, rt: Runtime) -> None:
    """Commit a stage's input partition only past inputs its handler returned from, and start each
    partition, after every rebalance, where its committed offset says (tests/streams/test_commits.py).

    Faust's commit bookkeeping loses inputs in three ways around a rebalance. The kill test lost a third
    of its sessions' calls in CI to one of them (their finished events got in, so those sessions were
    assembled masked), the join test (tests/streams/test_kill.py) seven groups to another:

    - Its stream skips the events already queued for an agent (the flow is stopped, or their generation
      is stale) but acks them, "so the lag does not grow", and the commit made as partitions are revoked
      moves past them. Here such an input is not acked, and its partition commits nothing until the
      input comes again (the seek after the rebalance delivers it) and is handled. Holding the commit,
      not only the ack, is needed: Faust's ``_new_offset`` commits past a single unacked offset at the
      head, and past any when the partition has no committed offset yet.
    - It drops records fetched for a partition that is not active yet, then counts the offsets it
      skipped as a "gap" and commits past them. After each seek every stage learns the offset its
      partitions resume at; a stage handed a later one reads the skipped inputs back first
      (``Runtime._catch_up``).
    - After restoring the tables it seeks every partition to its committed offset, but aiokafka seeks
      only those whose committed offset is > 0, so a partition nobody has committed yet kept the fetch
      position that dropped records left behind (the two-worker kill test: sessions stuck waiting for
      calls never delivered). Such a partition is sought to its beginning (0 and "none" both mean the
      start here: auto_offset_reset is earliest).
    """
    skipped: dict[Any, set[int]] = defaultdict(set)  # TP -> offsets skipped and not handled since
    ack, new_offset, seek_to_committed = consumer.ack, consumer._new_offset, consumer.seek_to_committed

    def ack_if_handled(message: Any) -> bool:
        if message.topic in rt.stage_topics:
            if message not in rt.handled:
                skipped[message.tp].add(message.offset)
                consumer._unacked_messages.discard(message)  # or the next rebalance's wait_empty waits on it
                rt.count("inputs.skipped_by_rebalance")
                return False
            skipped[message.tp].discard(message.offset)
        return ack(message)

    def new_offset_below_skipped(tp: Any) -> int | None:
        return None if skipped.get(tp) else new_offset(tp)

    async def seek_and_expect() -> Any:
        committed = await seek_to_committed()
        rt.next_offset.clear()  # what this worker expected of partitions before the rebalance is void
        rt.unchecked.clear()
        for tp, offset in committed.items():
            if not offset and not tp.topic.endswith("-changelog"):
                await consumer.seek(tp, 0)
            if tp.topic in rt.stage_topics:
                rt.sought(tp.topic, tp.partition, max(offset or 0, 0))
            if skipped.get(tp):  # below its committed offset, someone handled it
                skipped[tp] = {o for o in skipped[tp] if offset is None or o >= offset}
        return committed

    consumer.ack = ack_if_handled
    consumer._new_offset = new_offset_below_skipped
    consumer.seek_to_committed = seek_and_expect


def _without_faust_monitor(app: Any) -> None:
    """Keep Faust's Monitor out of the sensors every event passes through.

    It keeps per-event statistics for Faust's web views, which are off here (the worker's own counters
    and metrics are streams/runtime.py's and streams/metrics.py's); on the bench's burst its hooks were
    about 3% of the worker's event loop (py-spy). Faust adds it as the app starts, hence the wrapper. A
    sensor that does nothing takes its place: Faust warns at every rebalance when no sensor kept state."""
    import faust

    add_dependencies = app.on_init_dependencies

    def on_init_dependencies() -> Any:
        dependencies = add_dependencies()
        app.sensors.remove(app.monitor)
        app.sensors.add(faust.Sensor())
        return dependencies

    app.on_init_dependencies = on_init_dependencies


def _reseek_stalled_recovery(app: Any, rt: Runtime, stall_s: float = 10.0) -> None:
    """Fetch a changelog partition again when table recovery has read nothing from it for ``stall_s``.

    After a rebalance, aiokafka can drop records it had fetched for a partition (the drop the stages
    read back for their inputs: ``Runtime.check_undelivered``). Faust's recovery then waits forever
    for changelog records below the partition's end ("No event received for active tp ... since
    recovery start"), and the worker never gets past recovery: about one ``bench/streams.py --quick``
    run in four hung there when a second worker joined. Seeking the partition to the offset recovery
    has reached makes the fetcher read it again; re-applying a changelog record already applied sets
    the same key to the same value, so a needless seek costs a re-read, nothing else.
    """
    import time

    async def watch() -> None:
        recovery, seen = app.tables.recovery, {}
        while True:
            await asyncio.sleep(stall_s / 4)
            if not recovery.in_recovery:
                seen.clear()
                continue
            now = time.monotonic()
            for tp, offset in stalled_partitions(recovery.active_highwaters, recovery.active_offsets, seen, now, stall_s):
                log.warning("recovery read nothing from %s[%d] for %.0f s (at %d of %d): fetching it again",
                            tp.topic, tp.partition, stall_s, offset, recovery.active_highwaters[tp])
                rt.count("recovery.reseeks")
                try:
                    await app.consumer.seek(tp, max(offset, 0))
                except Exception:  # the partition moved meanwhile: the next recovery seeks its own
                    log.exception("seeking %s[%d] failed", tp.topic, tp.partition)

    app.task(watch)


def stalled_partitions(highwaters: dict, offsets: dict, seen: dict, now: float, stall_s: float) -> list[tuple[Any, int]]:
    """(partition, offset) of each partition whose recovery offset has not moved for ``stall_s`` while
    below its highwater (its last offset). ``seen`` maps a partition to (offset, since) across calls;
    a partition returned starts a new wait."""
    out = []
    for tp, highwater in list(highwaters.items()):
        offset = offsets.get(tp)
        if highwater is None or offset is None or offset >= highwater:
            seen.pop(tp, None)  # nothing (more) to read
        elif tp not in seen or seen[tp][0] != offset:
            seen[tp] = (offset, now)  # progress
        elif now - seen[tp][1] >= stall_s:
            out.append((tp, offset))
            seen[tp] = (offset, now)
    return out


def _zstd_level(level: int) -> None:
    """Compress the worker's batches at zstd ``level``, the publisher's, not aiokafka's fixed 3.

    aiokafka takes no compression level (nor does Faust), and its level 3 wrote the bench's
    trajectories and groups about a tenth larger than level 1 does, at more CPU: zstd's faster levels
    suit JSON digits of random token ids better. Process-wide: every aiokafka producer here is Faust's."""
    from functools import partial

    from aiokafka import codec
    from aiokafka.record import default_records

    encode = partial(codec.zstd_encode, level=level)
    default_records.zstd_encode = encode  # the pure-Python batch builder
    try:
        from aiokafka.record._crecords import default_records as compiled
    except ImportError:  # no C extension: the pure-Python builder is the one in use
        return
    compiled.zstd_encode = encode  # looked up as a module global at each batch


def _flush_means_flushed(buffer: Any, rt: Runtime) -> None:
    """Make the producer buffer's flush send the tables' pending changelog records, then wait until it
    is empty.

    Faust's at-least-once commit flushes the producer first, so that table changelog messages are
    written before the offsets of the events that caused them are committed. But faust-streaming 0.15's
    ProducerBuffer.flush gives up after 0.1 s without progress and returns with messages still queued;
    under load (its "producer buffer full" warnings) the commit can then overtake changelog writes, and a
    SIGKILL right after would lose state for inputs that are never replayed. Found reading Faust's code
    while chasing a kill-test failure; this keeps Faust's own ordering but makes flush really flush.
    Every commit, rebalance and stop flushes the producer first, so that is where the changelog records
    the stages held back (streams/changelog.py) go out.
    """
    original = buffer.flush

    async def flush() -> None:
        rt.count("changelog.records", rt.changelog.flush())
        while True:
            await original()
            if not buffer.size:
                return
            await asyncio.sleep(0.005)

    buffer.flush = flush
