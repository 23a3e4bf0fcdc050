"""Session bookkeeping in O(1) per call, and deadlines from a heap: pure functions and the session
stage's handlers on in-memory tables (no Kafka, no Faust).

The handlers are driven the way the agent loop drives them (settle, then handle), with dict tables and
a send that is acknowledged at once. Crashes are simulated the way they can really look: one table's
changelog behind the other, then the uncommitted inputs replayed.
"""

from __future__ import annotations

import asyncio
from functools import partial
import random
from types import SimpleNamespace

import orjson
import pytest

from schemas import Trajectory, decode, encode

# What the worker writes (Settings.record_format's default): its outputs are compared with these bytes.
# Its inputs alternate between the two encodings, as on a topic written by old and new producers.
wire = partial(encode, packed=True)
from streams import group_agent, session_agent
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.deadlines import Wakeups
from streams.runtime import Runtime
from streams.sessions import CallIndices, SessionState, add_call, new_session
from streams.synthetic import SessionSpec, record_session
from streams.topology import Topology
from streams.trajectory import build_trajectory

# ---------------------------------------------------------------- pure


def test_call_indices_is_a_set_kept_as_ranges():
    rng = random.Random(3)
    for _ in range(200):
        xs = [rng.randrange(40) for _ in range(rng.randrange(60))]
        held = CallIndices()
        added = [held.add(x) for x in xs]
        assert added == [x not in xs[:i] for i, x in enumerate(xs)]
        assert list(held) == sorted(set(xs)) and len(held) == len(set(xs))
        assert all((i in held) == (i in xs) for i in range(-2, 45))
        ranges = held.to_json()
        assert all(a < b for a, b in ranges) and all(ranges[k][1] < ranges[k + 1][0] for k in range(len(ranges) - 1))
        assert CallIndices(ranges) == held


def test_state_size_does_not_grow_with_the_calls():
    state = new_session("s", 1.0, 0)
    sizes = []
    for i in range(500):
        add_call(state, i, f"e{i}", 2.0, lambda _: None)
        sizes.append(len(orjson.dumps(state.to_json())))
    assert sizes[-1] - sizes[0] <= 4  # only the digits of the range's end grow
    assert state.to_json()["calls"] == [[0, 500]]


def test_old_state_with_a_call_map_still_loads():
    old = {"session_id": "s", "partition": 2, "first_seen": 1.0, "last_seen": 2.0,
           "calls": {"0": "e0", "2": "e2", "1": "e1", "5": "e5"},
           "finished": None, "finished_at": 0.0, "done": "", "done_at": 0.0}
    state = SessionState.from_json(orjson.loads(orjson.dumps(old)))
    assert list(state.calls) == [0, 1, 2, 5] and len(state.calls) == 4
    assert state.to_json()["calls"] == [[0, 3], [5, 6]]
    assert SessionState.from_json(orjson.loads(orjson.dumps(state.to_json()))).calls == state.calls


def test_duplicate_and_conflict_come_from_the_stored_event_id():
    state = new_session("s", 1.0, 0)
    stored = {}
    lookup = stored.get
    assert add_call(state, 0, "a", 1.0, lookup) == "added"
    stored[0] = "a"
    assert add_call(state, 0, "a", 1.0, lookup) == "duplicate"
    assert add_call(state, 0, "b", 1.0, lookup) == "conflict"
    del stored[0]  # the data was lost in a crash: the replayed call puts it back
    assert add_call(state, 0, "a", 1.0, lookup) == "duplicate"
    assert len(state.calls) == 1


def test_wakeups_pop_only_what_is_due_and_keep_the_earliest():
    w = Wakeups()
    w.wake_by(0, "a", 10.0)
    w.wake_by(0, "a", 20.0)  # later: the earlier wake-up stays (it reschedules itself then)
    w.wake_by(0, "b", 5.0)
    w.wake_by(1, "c", 1.0)
    w.wake_by(0, "d", float("inf"))  # never
    assert w.pop_due(0, 4.0) == []
    assert w.pop_due(0, 10.0) == ["b", "a"]
    assert w.pop_due(0, 100.0) == [] and w.pop_due(1, 100.0) == ["c"]
    w.wake_by(0, "a", 50.0)
    w.wake_by(0, "a", float("-inf"))  # earlier: a new entry, the old one is skipped
    assert w.pop_due(0, 0.0) == ["a"] and w.pop_due(0, 100.0) == []
    for i in range(1000):  # superseded entries are compacted away
        w.wake_by(0, "x", 1000.0 - i)
    assert len(w._heaps[0]) < 100 and w.pop_due(0, 1.0) == ["x"]


# ---------------------------------------------------------------- the session stage on dict tables


class _Topic:
    def __init__(self):
        self.sent: list[tuple[bytes, bytes]] = []

    async def send(self, key, value):
        """Acknowledged at once, where Faust's RecordMetadata would say: one partition, in order."""
        self.sent.append((key, value))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(SimpleNamespace(partition=0, offset=len(self.sent) - 1))
        return fut


class _Log:
    """The input topics by (topic, partition, offset), as the stages read them back (the real reads are
    tested on the broker in test_source_log.py)."""

    def __init__(self):
        self.records: dict[tuple[str, int, int], bytes] = {}

    def append(self, topic: str, partition: int, value: bytes) -> int:
        offset = sum(1 for t, p, _ in self.records if (t, p) == (topic, partition))
        self.records[(topic, partition, offset)] = value
        return offset

    async def read(self, topic: str, partition: int, offsets: list[int]) -> dict[int, bytes | None]:
        return {o: self.records.get((topic, partition, o)) for o in offsets}

    async def end_offset(self, topic: str, partition: int) -> int:
        return 1 + max((o for t, p, o in self.records if (t, p) == (topic, partition)), default=-1)


def _runtime(config: StreamsConfig) -> Runtime:
    topo = Topology("t", "calls", "session-events", "trajectories", "groups", "session-ticks", "group-ticks",
                    4, 4, 1, 8 << 20, 8 << 20)
    tables = {n: {} for n in (session_agent.SESSIONS, session_agent.CALLS, group_agent.GROUPS, group_agent.MEMBERS)}
    return Runtime(None, topo, config, tables, {"trajectories": _Topic(), "groups": _Topic()}, source=_Log())


async def _feed(rt: Runtime, records, partition: int = 0) -> None:
    for r in records:
        rt.settle(session_agent.STAGE, partition)
        value = encode(r, packed=len(rt.source.records) % 2 == 1)
        offset = rt.source.append(r.TOPIC, partition, value)
        if r.TOPIC == "calls":
            await session_agent.on_call(rt, value, partition, offset)
        else:
            await session_agent.on_session_event(rt, value, partition, offset)


async def _tick(rt: Runtime, partition: int = 0) -> None:
    rt.settle(session_agent.STAGE, partition)
    await session_agent.on_tick(rt, partition)


def _sent(rt: Runtime) -> dict[str, bytes]:
    return {decode(v, Trajectory).event_id: v for _, v in rt.topics["trajectories"].sent}


def _expected(rec, config, missing=0) -> bytes:
    return wire(build_trajectory(rec.finished, [CallTokens.from_record(c) for c in rec.calls], config, missing_calls=missing))


def test_stage_assembles_once_with_constant_size_state():
    config = StreamsConfig()
    rec = record_session(SessionSpec("s", "g", turns=12, side_call_at=3), 1)
    rt = _runtime(config)

    async def run():
        sizes = []
        for c in rec.calls:
            await _feed(rt, [c])
            # clock readings' repr varies in length (1764630000.1 vs ...0.1234567): sized without them
            state = orjson.loads(rt.tables[session_agent.SESSIONS]["s"])
            sizes.append(len(orjson.dumps({**state, "first_seen": 0, "last_seen": 0})))
        await _feed(rt, [rec.finished, *rec.calls[:3]])  # duplicates after the session was assembled
        await _tick(rt)
        return sizes

    sizes = asyncio.run(run())
    assert max(sizes) - min(sizes) <= 2
    assert list(_sent(rt).values()) == [_expected(rec, config)]
    state = SessionState.from_json(orjson.loads(rt.tables[session_agent.SESSIONS]["s"]))
    assert state.done and not any(k.startswith("s/") for k in rt.tables[session_agent.CALLS])
    assert rt.counters["calls.added"] == len(rec.calls) and rt.counters["calls.late"] == 3


@pytest.mark.parametrize("lost", ["state", "calls"])
def test_a_table_behind_the_other_after_a_crash_neither_hangs_nor_double_counts(lost):
    """The changelog of one table lost the writes of the last calls; those calls (uncommitted) are
    replayed: the session assembles exactly as without the crash."""
    config = StreamsConfig()
    rec = record_session(SessionSpec("s", "g", turns=6), 2)
    rt = _runtime(config)

    async def run():
        await _feed(rt, rec.calls[:3])
        before = {n: dict(t) for n, t in rt.tables.items()}
        await _feed(rt, rec.calls[3:5])
        # crash: one table is restored as it was before calls 3-4
        name = session_agent.SESSIONS if lost == "state" else session_agent.CALLS
        rt.tables[name].clear()
        rt.tables[name].update(before[name])
        await rt.recovered()
        await _feed(rt, rec.calls[3:])  # the replay, then the rest
        await _feed(rt, [rec.finished])
        await _tick(rt)

    asyncio.run(run())
    assert list(_sent(rt).values()) == [_expected(rec, config)]
    if lost == "calls":
        assert rt.counters["calls.restored"] == 2
    else:
        assert rt.counters["calls.added"] == len(rec.calls) + 2  # re-added (a set: counted once in the state)


def test_old_state_is_converted_and_assembles():
    config = StreamsConfig()
    rec = record_session(SessionSpec("s", "g", turns=4), 3)
    rt = _runtime(config)

    async def run():
        await _feed(rt, rec.calls)
        state = orjson.loads(rt.tables[session_agent.SESSIONS]["s"])
        state["calls"] = {str(c.call_index): c.event_id for c in rec.calls}  # as the previous version wrote it
        rt.tables[session_agent.SESSIONS]["s"] = orjson.dumps(state)
        await rt.recovered()
        await _feed(rt, [rec.calls[1], rec.finished])

    asyncio.run(run())
    assert list(_sent(rt).values()) == [_expected(rec, config)]
    assert rt.counters["calls.duplicate"] == 1


def test_a_tick_reads_only_the_due_sessions(monkeypatch):
    """Many open sessions, one finished with a call missing: ticks read nothing until its deadline, which
    comes when the partition's calls watermark passes its grace (then the wall clock does it)."""
    config = StreamsConfig(missing_calls_grace_s=0.0, missing_calls_timeout_s=3600.0)
    rt = _runtime(config)
    open_ = [record_session(SessionSpec(f"o{i}", "go", turns=2), 10 + i) for i in range(50)]
    rec = record_session(SessionSpec("m", "gm", turns=4), 4)
    lost = rec.calls.pop(2)
    loads = []
    real = SessionState.from_json
    monkeypatch.setattr(SessionState, "from_json", classmethod(lambda cls, o: loads.append(o["session_id"]) or real(o)))

    async def run():
        for r in open_:
            await _feed(rt, r.calls)
        await _feed(rt, [*rec.calls, rec.finished])
        loads.clear()
        await _tick(rt)
        first = list(loads)
        await rt.recovered()  # a rebalance: the wake-ups are rebuilt from the table (reading every session once)
        await _tick(rt)
        assert len(loads) == 51 and rt.counters["sessions.index_rebuilt"] == 2  # 50 open + 1 finished, none due
        # a later call of another session moves the watermark past the finished event
        late = record_session(SessionSpec("w", "gw", turns=1), 99, t0=rec.finished.created_at + 10).calls
        await _feed(rt, late)
        loads.clear()
        await _tick(rt)
        return first, list(loads)

    first, second = asyncio.run(run())
    assert first == []  # nothing due: no session read
    assert "m" in second and len(second) <= 3
    assert list(_sent(rt).values()) == [_expected(rec, config, missing=1)]
    assert lost.event_id not in str(rt.tables[session_agent.CALLS].keys())


@pytest.mark.parametrize("gone", [0, 1])
def test_calls_are_read_back_from_their_topic_after_a_restart(gone):
    """The table holds references; with the cache lost (a restart) the calls come back from polar.calls
    by offset, and the trajectory is the same bytes. A call no longer at its offset masks the session."""
    config = StreamsConfig()
    rec = record_session(SessionSpec("s", "g", turns=5), 5)
    rt = _runtime(config)

    async def run():
        await _feed(rt, rec.calls)
        held = orjson.loads(rt.tables[session_agent.CALLS]["s/1"])
        assert set(held) == {"e", "at"}  # a reference, not the tokens
        rt.caches.clear()
        if gone:
            del rt.source.records[("calls", 0, 2)]
        await _feed(rt, [rec.finished])

    asyncio.run(run())
    if gone:
        (sent,) = _sent(rt).values()
        assert decode(sent, Trajectory).usable is False and rt.counters["calls.gone"] == 1
        assert rt.counters["calls.read_back"] == len(rec.calls) - 1
    else:
        assert list(_sent(rt).values()) == [_expected(rec, config)]
        assert rt.counters["calls.read_back"] == len(rec.calls)


def test_calls_kept_as_data_by_the_previous_version_still_assemble():
    config = StreamsConfig()
    rec = record_session(SessionSpec("s", "g", turns=4), 6)
    rt = _runtime(config)

    async def run():
        await _feed(rt, rec.calls)
        for c in rec.calls:  # as the previous version wrote the table
            rt.tables[session_agent.CALLS][f"s/{c.call_index}"] = orjson.dumps(CallTokens.from_record(c).to_json())
        rt.caches.clear()
        rt.source.records.clear()
        await _feed(rt, [rec.finished])

    asyncio.run(run())
    assert list(_sent(rt).values()) == [_expected(rec, config)]
    assert rt.counters["calls.read_back"] == 0


async def _feed_members(rt: Runtime, trajs, partition: int = 0) -> None:
    for t in trajs:
        rt.settle(group_agent.STAGE, partition)
        value = encode(t, packed=len(rt.source.records) % 2 == 1)
        await group_agent.on_trajectory(rt, value, partition, rt.source.append("trajectories", partition, value))


def test_the_group_stage_takes_this_workers_trajectories_without_decoding_them():
    """A trajectory the session stage sent is handed to the group stage as the object it built, found
    by where the broker put it; the group is the same bytes as from decoded members, and a record at
    another offset (another worker's) is decoded as before. The group writes the bytes the first two
    were sent as."""
    from streams.groups import build_group

    config = StreamsConfig()
    recs = [record_session(SessionSpec(f"s{i}", "g", sample_index=i, num_samples=3, reward=float(i), turns=3), 3 + i)
            for i in range(3)]
    rt = _runtime(config)

    async def run():
        for r in recs:
            await _feed(rt, r.records)
        await asyncio.sleep(0)  # the acknowledgements' callbacks
        sent = rt.topics["trajectories"].sent
        for offset, (_, value) in enumerate(sent[:2]):
            await group_agent.on_trajectory(rt, value, 0, offset)
        await group_agent.on_trajectory(rt, sent[2][1], 0, 99)  # not where this worker's send went

    asyncio.run(run())
    assert rt.counters["trajectories.handed_over"] == rt.counters["members.bytes_reused"] == 2
    trajs = [decode(v, Trajectory) for _, v in rt.topics["trajectories"].sent]
    (group,) = [v for _, v in rt.topics["groups"].sent]
    assert group == wire(build_group("g", trajs, config))


@pytest.mark.parametrize("legacy", [False, True])
def test_group_members_are_read_back_after_a_restart(legacy):
    """The members table holds references; a group emitted after the cache is lost is the same bytes,
    and so is one whose members were stored as bytes by the previous version."""
    from streams.groups import build_group

    config = StreamsConfig()
    recs = [record_session(SessionSpec(f"s{i}", "g", sample_index=i, num_samples=3, reward=float(i), turns=2), 7 + i)
            for i in range(3)]
    trajs = [build_trajectory(r.finished, [CallTokens.from_record(c) for c in r.calls], config) for r in recs]
    rt = _runtime(config)

    async def run():
        await _feed_members(rt, trajs[:2])
        assert set(orjson.loads(rt.tables[group_agent.MEMBERS]["g/0"])) == {"e", "at"}
        if legacy:
            for t in trajs[:2]:
                rt.tables[group_agent.MEMBERS][f"g/{t.sample_index}"] = encode(t)
            rt.source.records.clear()
        rt.caches.clear()
        await _feed_members(rt, trajs[2:])

    asyncio.run(run())
    (sent,) = [v for _, v in rt.topics["groups"].sent]
    assert sent == wire(build_group("g", [decode(encode(t), Trajectory) for t in trajs], config))
    assert rt.counters["members.read_back"] == (0 if legacy else 2)


async def test_inputs_faust_skipped_are_read_back_and_handled_in_order():
    """After a seek the stage expects its partition's committed offset; handed a later input (Faust
    dropped the fetched ones between and would commit past them), it reads the skipped ones back first.
    An offset with no record (a transaction marker) is passed over."""
    rt = _runtime(StreamsConfig())
    rt.source.records.update({("calls", 1, i): f"v{i}".encode() for i in range(6) if i != 3})
    seen = []

    async def handle(topic, value, partition, offset):
        seen.append((offset, value))

    await rt.handle_in_order("calls", b"v0", 1, 0, handle)  # no expectation yet: taken as it comes
    rt.next_offset[("calls", 1)] = 1  # what the seek after a rebalance sets: the committed offset
    await rt.handle_in_order("calls", b"v5", 1, 5, handle)
    assert seen == [(0, b"v0"), (1, b"v1"), (2, b"v2"), (4, b"v4"), (5, b"v5")]
    assert rt.counters["inputs.caught_up"] == 3 and rt.next_offset[("calls", 1)] == 6
    await rt.handle_in_order("calls", b"v4", 1, 4, handle)  # a late re-delivery: handled, no step back
    assert rt.next_offset[("calls", 1)] == 6 and rt.counters["inputs.caught_up"] == 3


async def test_inputs_faust_dropped_with_nothing_after_them_are_read_back_at_the_second_tick():
    """Faust fetched a partition's last inputs around a rebalance and dropped them; no later input comes
    to show the gap. The second tick after the seek reads them back and handles them in order; a
    partition that delivered something since its seek is left to handle_in_order."""
    rt = _runtime(StreamsConfig())
    rt.source.records.update({("calls", 1, i): f"v{i}".encode() for i in range(5)})
    rt.source.records.update({("session-events", 1, i): b"e" for i in range(3)})
    seen = []

    async def handle(topic, value, partition, offset):
        seen.append((topic, offset, value))

    rt.sought("calls", 1, 2)  # committed offset 2: inputs 2..4 were fetched, then dropped
    rt.sought("session-events", 1, 1)
    await rt.handle_in_order("session-events", b"e", 1, 1, handle)  # this one delivered its next input
    await rt.check_undelivered(["calls", "session-events"], 1, handle)
    assert seen == [("session-events", 1, b"e")]  # the first tick gives a fetch in flight its time
    await rt.check_undelivered(["calls", "session-events"], 1, handle)
    assert seen[1:] == [("calls", 2, b"v2"), ("calls", 3, b"v3"), ("calls", 4, b"v4")]
    assert rt.counters["inputs.undelivered"] == 3 and rt.next_offset[("calls", 1)] == 5
    await rt.check_undelivered(["calls", "session-events"], 1, handle)  # checked once per seek
    assert len(seen) == 4


async def test_a_broker_that_does_not_tell_the_end_leaves_the_partition_to_later_inputs(caplog):
    """The end offset is asked once per seek: a timeout is logged and nothing is read back or skipped."""
    rt = _runtime(StreamsConfig())
    rt.source.records.update({("calls", 1, i): b"v" for i in range(3)})

    async def no_answer(topic, partition):
        raise TimeoutError(f"end of {topic}[{partition}]: timed out")

    rt.source.end_offset = no_answer
    seen = []

    async def handle(topic, value, partition, offset):
        seen.append(offset)

    rt.sought("calls", 1, 0)
    for _ in range(3):
        await rt.check_undelivered(["calls"], 1, handle)
    assert seen == [] and rt.next_offset[("calls", 1)] == 0 and "inputs.undelivered" not in rt.counters
    assert "end of calls[1]: timed out: not checked for undelivered inputs" in caplog.text
    await rt.handle_in_order("calls", b"v", 1, 2, handle)  # a later input still reveals the gap
    assert seen == [0, 1, 2]
