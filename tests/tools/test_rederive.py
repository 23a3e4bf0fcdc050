"""The replay's stage driver against the streams' pure functions, without Kafka."""

from __future__ import annotations

import random
from functools import partial

import pytest

from polarstream.tools.rederive import Limits, Rederiver
from schemas import CallRecorded, SessionEvent, encode
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.groups import build_group
from streams.synthetic import SessionSpec, record_group, record_session
from streams.trajectory import build_trajectory

BIG = Limits(32 << 20, 64 << 20)


def scenario():
    """(records, {group_id: [(session, calls missing)]}) with the twists the live worker handles."""
    groups = {}
    g0 = record_group("g0", [1.0, 0.0, 0.0, 1.0], seed=1, min_valid=2)
    g0[1] = record_session(SessionSpec("g0-s1", "g0", 1, num_samples=4, min_valid=2, reward=0.0, side_call_at=2), 1)
    g0[2] = record_session(SessionSpec("g0-s2", "g0", 2, num_samples=4, min_valid=2, reward=0.0, compaction_at=2), 1)
    g0[3] = record_session(SessionSpec("g0-s3", "g0", 3, num_samples=4, min_valid=2, reward=1.0, retokenize_at=3), 1)
    groups["g0"] = [(s, 0) for s in g0]
    groups["gf"] = [(s, 0) for s in record_group("gf", [1.0, None, 0.0], seed=2, statuses=["ok", "infra_error", "ok"], min_valid=2)]
    groups["gd"] = [(s, 0) for s in record_group("gd", [1.0, 0.0, 0.0], seed=3, min_valid=2)[:2]]  # one never finishes
    gm = record_group("gm", [1.0, 0.0, 1.0], seed=4, min_valid=2)
    gm[0].calls.pop(2)  # lost: the finished event says 4 calls, 3 arrive
    groups["gm"] = [(gm[0], 1), (gm[1], 0), (gm[2], 0)]
    records = [r for sessions in groups.values() for s, _ in sessions for r in s.records]
    records += [records[0], records[3], SessionEvent(session_id="g0-s0", group_id="g0", kind="started"),
                record_session(SessionSpec("orphan", "go", turns=1), 5).calls[0]]
    return records, groups


def expected(groups, cfg, late=()):
    """{group_id: (trajectories, group)} by the pure functions; sessions in ``late`` are assembled after
    their group emitted, so they have a trajectory but are not in the group."""
    out = {}
    for gid, sessions in groups.items():
        trajs = [build_trajectory(s.finished, [CallTokens.from_record(c) for c in s.calls], cfg, missing_calls=m)
                 for s, m in sessions]
        out[gid] = (trajs, build_group(gid, [t for t in trajs if t.session_id not in late], cfg))
    return out


def feed(stages: Rederiver, records, t0: float = 1000.0, step: float = 0.001):
    out = []
    for i, rec in enumerate(records):
        handle = stages.on_call if isinstance(rec, CallRecorded) else stages.on_session_event
        out += handle(rec, t0 + i * step)
    return out


@pytest.mark.parametrize("timeout, late", [(3, ()), (300, ("gm-s0",))])
@pytest.mark.parametrize("builder", ["prefix_merging", "per_request"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_records_as_the_pure_functions_in_any_arrival_order(builder, seed, timeout, late):
    records, groups = scenario()
    random.Random(seed).shuffle(records)  # finished events before calls, sessions interleaved
    # gm-s0 waits for its lost call until the timeout (the newest call is 1.9 s past its finished event,
    # short of the 2 s grace): 3 s is before gm's 4 s deadline, so gm waits for it and masks it; after 300 s gm
    # has emitted without it at its deadline, and gm-s0's trajectory comes late, as a live worker does.
    cfg = StreamsConfig(builder=builder, group_deadline_s=4, missing_calls_grace_s=2, missing_calls_timeout_s=timeout)
    stages = Rederiver(cfg, BIG)
    out = feed(stages, records) + stages.drain()
    want = expected(groups, cfg, late)
    got_groups = {r.group_id: encode(r) for r in out if r.TOPIC == "groups"}
    assert got_groups == {gid: encode(g) for gid, (_, g) in want.items()}  # byte for byte
    got_trajs = sorted(encode(r) for r in out if r.TOPIC == "trajectories")
    assert got_trajs == sorted(encode(t) for trajs, _ in want.values() for t in trajs)
    assert stages.counters["calls.undecodable"] == 0 and stages.counters["session_events.started.ignored"] == 1
    assert stages.counters["sessions.dropped_no_finished"] == 1  # the orphan call
    assert stages.counters["sessions.missing_calls"] == 1
    assert stages.counters["members.late"] == len(late)
    assert stages.pending() == {"sessions_open": 0, "groups_open": 0}


def test_without_drain_what_waits_on_a_deadline_stays_open():
    records, groups = scenario()
    stages = Rederiver(StreamsConfig(group_deadline_s=4, missing_calls_grace_s=2), BIG)
    out = feed(stages, records)
    assert sorted(r.group_id for r in out if r.TOPIC == "groups") == ["g0", "gf"]
    # gm-s0 waits for its lost call, the orphan for its finished event; gd for its third sample, gm for gm-s0.
    assert stages.pending() == {"sessions_open": 2, "groups_open": 2}


def test_deadlines_run_on_event_time():
    records, groups = scenario()
    records = [r for r in records if not r.session_id.startswith("gm")]
    cfg = StreamsConfig(group_deadline_s=4, missing_calls_grace_s=2, tick_interval_s=1)
    stages = Rederiver(cfg, BIG)
    feed(stages, records)
    assert not [r for r in stages.sweep(1003.0) if r.TOPIC == "groups"]  # 3 s after gd opened: still waiting
    later = stages.on_session_event(SessionEvent(session_id="x", kind="started"), 1010.0)
    assert [encode(r) for r in later if r.TOPIC == "groups"] == [encode(expected(groups, cfg)["gd"][1])]


def test_a_trace_too_large_for_any_part_is_counted_not_emitted():
    records, _ = scenario()
    stages = Rederiver(StreamsConfig(), Limits(trajectory_bytes=5000, group_bytes=5000))
    out = feed(stages, records) + stages.drain()
    assert not [r for r in out if r.TOPIC == "trajectories"]
    assert stages.counters["trajectories.oversized"] == 12


@pytest.mark.parametrize("packed", [False, True], ids=["json", "packed"])
def test_records_past_the_limits_go_out_in_parts_that_join_to_them(packed):
    from schemas import Parts

    wire = partial(encode, packed=packed)  # the encoding written, which the parts are sized in
    records, groups = scenario()
    cfg = StreamsConfig(builder="per_request", group_deadline_s=4, missing_calls_grace_s=2, missing_calls_timeout_s=3)
    want = expected(groups, cfg)
    trajs = [t for ts, _ in want.values() for t in ts]
    trace = max(len(wire(tr)) for t in trajs for tr in t.traces)
    traj_limit = 3 * trace + 4096 + 1000  # a few traces a part: per_request trajectories split
    group_limit = max(len(wire(t)) for t in trajs) + 4096 + 1000  # about one member a part
    stages = Rederiver(cfg, Limits(traj_limit, group_limit), packed=packed)
    out = feed(stages, records) + stages.drain()
    joiner, got_groups, got_trajs = Parts(), {}, []
    for r in out:
        assert len(wire(r)) <= (group_limit if r.TOPIC == "groups" else traj_limit) - 4096
        if (whole := joiner.add(r)) is not None:
            if r.TOPIC == "groups":
                got_groups[whole.group_id] = encode(whole)
            else:
                got_trajs.append(encode(whole))
    assert got_groups == {gid: encode(g) for gid, (_, g) in want.items()}  # nothing dropped, byte for byte
    assert sorted(got_trajs) == sorted(encode(t) for t in trajs)
    assert stages.counters["trajectories.split"] > 0 and stages.counters["groups.split"] == len(want)
    assert not stages.counters["trajectories.oversized"] and not stages.counters["groups.oversized"]
