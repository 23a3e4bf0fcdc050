"""The group stage with trajectories that arrive in parts: gathered, joined, read back after a restart.

The stage's handler runs in-process on plain dict tables; its source log (what it reads inputs back
from) serves the bytes "published" here. The live worker path is tested on the broker in
test_worker.py; this covers what that cannot time: a restart between a member's parts, and replays.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from schemas import Parts, TrainingGroup, decode, encode, split_record
from streams import group_agent
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.groups import build_group
from streams.runtime import Runtime
from streams.synthetic import record_group
from streams.trajectory import build_trajectory

CFG = StreamsConfig(builder="per_request")


class Log:
    """polar.trajectories, one partition: what the stage reads, and reads back by offset."""

    def __init__(self):
        self.values: list[bytes] = []

    def append(self, value: bytes) -> int:
        self.values.append(value)
        return len(self.values) - 1

    async def read(self, topic, partition, offsets):
        return {o: self.values[o] if o < len(self.values) else None for o in offsets}


class Sent:
    """polar.groups: what the stage sends (acknowledged at once)."""

    def __init__(self):
        self.values: list[bytes] = []

    async def send(self, key, value):
        self.values.append(value)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def runtime(tables, log, sent) -> Runtime:
    topo = SimpleNamespace(trajectories="t", group_ticks="gt", trajectory_max_bytes=32 << 20, group_max_bytes=64 << 20)
    return Runtime(app=None, topo=topo, config=CFG, tables=tables, topics={"groups": sent}, source=log)


def scenario():
    sessions = record_group("g", [1.0, 0.0, 0.5], seed=3, turns=6)
    trajs = [build_trajectory(s.finished, [CallTokens.from_record(c) for c in s.calls], CFG) for s in sessions]
    limit = max(len(encode(tr)) for t in trajs for tr in t.traces) * 2 + 600
    parts = [[p for p, _ in split_record(t, limit)] for t in trajs]
    assert all(len(ps) > 1 for ps in parts)
    return trajs, parts, build_group("g", trajs, CFG)


def arrival(parts, seed):
    """Members' parts interleaved, each member's in order (one key, one partition, one producer)."""
    queues, out, rng = [list(ps) for ps in parts], [], random.Random(seed)
    while any(queues):
        out.append(rng.choice([q for q in queues if q]).pop(0))
    return out


async def feed(rt, log, records):
    for rec in records:
        rt.settle("groups", 0)
        data = encode(rec)
        await group_agent.on_trajectory(rt, data, 0, log.append(data))
    rt.settle("groups", 0)


def emitted(sent) -> list[TrainingGroup]:
    joiner = Parts()
    return [w for w in (joiner.add(decode(v, TrainingGroup)) for v in sent.values) if w is not None]


@pytest.mark.parametrize("seed", [0, 1])
def test_members_sent_in_parts_are_gathered_and_joined(seed):
    trajs, parts, want = scenario()
    tables = {"groups": {}, "group-members": {}}
    log, sent = Log(), Sent()
    rt = runtime(tables, log, sent)
    asyncio.run(feed(rt, log, arrival(parts, seed)))
    assert [encode(g) for g in emitted(sent)] == [encode(want)]
    assert rt.counters["members.added"] == 3 and rt.counters["members.parts_held"] == sum(len(p) - 1 for p in parts)
    assert list(tables["group-members"]) == []  # every member and gathering entry deleted once emitted


def test_a_restart_between_parts_reads_the_held_ones_back():
    trajs, parts, want = scenario()
    order = arrival(parts, 2)
    tables = {"groups": {}, "group-members": {}}
    log, sent = Log(), Sent()
    asyncio.run(feed(runtime(tables, log, sent), log, order[:-1]))
    assert sent.values == []
    fresh = runtime(tables, log, sent)  # a restarted worker: tables recovered, nothing in memory
    asyncio.run(feed(fresh, log, order[-1:]))
    assert [encode(g) for g in emitted(sent)] == [encode(want)]
    assert fresh.counters["members.read_back"] == sum(len(p) for p in parts) - 1  # all but the part just handled


def test_a_part_replayed_after_its_member_is_in_changes_nothing():
    trajs, parts, want = scenario()
    tables = {"groups": {}, "group-members": {}}
    log, sent = Log(), Sent()
    rt = runtime(tables, log, sent)
    first, rest = parts[0], [p for ps in parts[1:] for p in ps]
    asyncio.run(feed(rt, log, [*first, first[-1], first[0]]))  # complete, then two of its parts again
    assert rt.counters["members.added"] == 1 and rt.counters["members.duplicate"] == 2
    assert sorted(tables["group-members"]) == ["g/0"]  # no gathering left behind by the replays
    asyncio.run(feed(rt, log, rest))
    assert [encode(g) for g in emitted(sent)] == [encode(want)]
