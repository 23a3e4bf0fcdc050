"""A real worker process on the real broker: recorded sessions in, the expected groups out.

Sessions are tokenized with the tiny model's real tokenizer (ChatML turns with tool calls, token-in/
token-out like the gateway records them) and published with the project's Publisher, shuffled and
with noise: duplicates, an undecodable record, a non-finished session event, an orphan call, a
session missing a call, an incomplete group that must emit at its deadline. The groups on
polar.groups, deduplicated by event_id, must equal byte for byte what the pure functions compute
from the same inputs, and the trace structure must match the sessions' hand-declared shape.
"""

from __future__ import annotations

import random
from functools import partial

import orjson
import pytest

from schemas import SessionEvent, TrainingGroup, decode, encode
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.groups import build_group
from streams.synthetic import Recorded, SessionSpec, record_group, record_session
from streams.trajectory import build_trajectory
from tests.streams.helpers import dedupe, publish, publish_raw, read_topic

# The missing call's session gives up (3 s) before its group's deadline (6 s), as with the defaults.
WORKER_ARGS = ["--group-deadline", "6", "--missing-calls-grace", "2", "--missing-calls-timeout", "3",
               "--tick-interval", "0.5", "--stats-interval", "1"]


@pytest.fixture(scope="module")
def chat_tokenize(tiny_model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def scenario(tokenize) -> tuple[list, dict[str, list[tuple[Recorded, int]]]]:
    """(records to publish, in order) and group_id -> [(session as published, calls missing)]."""
    groups: dict[str, list[tuple[Recorded, int]]] = {}
    # Two full groups with a side call, a compaction and an undeclared re-tokenization in them.
    for g, rewards in (("g0", [1.0, 0.0, 0.0, 1.0]), ("g1", [0.0, 0.5, 1.0, 1.0])):
        sessions = record_group(g, rewards, seed=1, tokenize=tokenize, turns=4, min_valid=2)
        sessions[1] = record_session(SessionSpec(f"{g}-s1", g, 1, num_samples=4, min_valid=2, reward=rewards[1],
                                                 turns=4, side_call_at=2), 1, tokenize)
        sessions[2] = record_session(SessionSpec(f"{g}-s2", g, 2, num_samples=4, min_valid=2, reward=rewards[2],
                                                 turns=4, compaction_at=2), 1, tokenize)
        sessions[3] = record_session(SessionSpec(f"{g}-s3", g, 3, num_samples=4, min_valid=2, reward=rewards[3],
                                                 turns=4, retokenize_at=3), 1, tokenize)
        groups[g] = [(s, 0) for s in sessions]
    # A failed sample: masked, the other three still train.
    failed = record_group("gf", [1.0, None, 0.0, 0.0], seed=2, tokenize=tokenize, statuses=["ok", "infra_error", "ok", "ok"],
                          min_valid=2)
    groups["gf"] = [(s, 0) for s in failed]
    # Three samples expected, two ever finish: emitted at the deadline.
    deadline = record_group("gd", [1.0, 0.0, 0.0], seed=3, tokenize=tokenize, min_valid=2)[:2]
    groups["gd"] = [(s, 0) for s in deadline]
    # One session loses a call (the finished event says 4, 3 arrive): assembled after the grace, masked.
    missing = record_group("gm", [1.0, 0.0, 1.0], seed=4, tokenize=tokenize, min_valid=2)
    lost = missing[0].calls.pop(2)
    groups["gm"] = [(missing[0], 1), (missing[1], 0), (missing[2], 0)]

    records = [r for sessions in groups.values() for s, _ in sessions for r in s.records]
    rng = random.Random(7)
    rng.shuffle(records)  # out of order across and within sessions, finished events before calls
    noise = [
        *records[:5],  # duplicates
        SessionEvent(session_id="g0-s0", group_id="g0", kind="started"),
        record_session(SessionSpec("orphan", "go", turns=1), 5, tokenize).calls[0],  # never finishes
    ]
    assert lost not in records
    return records + noise, groups


def expected_groups(groups, cfg: StreamsConfig) -> dict[str, TrainingGroup]:
    out = {}
    for gid, sessions in groups.items():
        trajs = [build_trajectory(s.finished, [CallTokens.from_record(c) for c in s.calls], cfg, missing_calls=m)
                 for s, m in sessions]
        group = build_group(gid, trajs, cfg)
        out[group.event_id] = group
    return out


@pytest.mark.parametrize("builder, written", [("prefix_merging", "packed"), ("per_request", "json")])
def test_worker_builds_the_expected_groups(polar_settings, streams_worker, chat_tokenize, builder, written):
    """``written``: the worker's record format; its inputs are published in the other one."""
    records, groups = scenario(chat_tokenize)
    cfg = StreamsConfig(builder=builder)  # deadlines do not change output bytes
    expected = expected_groups(groups, cfg)
    assert len(expected) == 5
    publish_raw(polar_settings, "calls", b"g0-s0", b"\x00 not json")
    other = "json" if written == "packed" else "packed"
    publish(polar_settings.model_copy(update={"record_format": other}), records)

    worker = streams_worker("--builder", builder, *WORKER_ARGS,
                            settings=polar_settings.model_copy(update={"record_format": written}))
    msgs = read_topic(polar_settings, "groups", until=lambda m: len({x.key for x in m}) >= 5, timeout=90, idle=1.5)
    got, duplicates = dedupe(msgs, TrainingGroup)
    assert worker.alive(), worker.log_text()[-3000:]
    assert set(got) == set(expected), worker.log_text()[-3000:]
    for event_id, group in expected.items():
        assert got[event_id] == encode(group, packed=written == "packed")  # byte for byte
    assert duplicates == 0  # an uninterrupted run re-sends nothing

    by_gid = {g.group_id: g for g in expected.values()}
    # The shape the sessions were built with, seen in the worker's output.
    g0 = by_gid["g0"]
    reasons = {t.sample_index: [tr.break_reason for tr in t.traces] for t in g0.trajectories}
    calls = {t.sample_index: sum(len(tr.call_indices) for tr in t.traces) for t in g0.trajectories}
    if builder == "prefix_merging":
        assert reasons == {0: ["first_call"], 1: ["first_call", "side_call"], 2: ["first_call", "compaction"],
                           3: ["first_call", "retokenized"]}
    else:
        assert [len(reasons[i]) for i in range(4)] == [calls[i] for i in range(4)] == [4, 5, 4, 4]
    assert g0.advantages == pytest.approx([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6)])
    assert by_gid["gf"].masked == ["gf-s1"] and [t.sample_index for t in by_gid["gf"].trajectories] == [0, 2, 3]
    assert [t.sample_index for t in by_gid["gd"].trajectories] == [0, 1]
    assert by_gid["gm"].masked == ["gm-s0"]

    stats = worker.stats()
    assert stats.get("calls.undecodable") == 1 and stats.get("session_events.started.ignored") == 1
    # The five re-sent records were dropped, as duplicates or (session already assembled) as late.
    assert sum(stats.get(f"{k}.{o}", 0) for k in ("calls", "finished") for o in ("duplicate", "late")) == 5
    assert stats.get("sessions.missing_calls") == 1


def test_changelogs_get_the_last_writes_and_a_restart_recovers_them(polar_settings, streams_worker, chat_tokenize):
    """The tables' changelog records go out compacted, once per commit (streams/changelog.py): after a
    clean stop the changelogs hold fewer records than the calls that came in (one each was three),
    every session's last record is its done marker, no reference to a call of an assembled session is
    live, and a restarted worker recovers all that: a call sent again is counted late, not assembled."""
    import time

    from streams.sessions import SessionState
    from streams.topology import app_id_for

    sessions = record_group("cl", [1.0, 0.0, 0.5, 0.0], seed=6, tokenize=chat_tokenize, turns=6, min_valid=2)
    n_calls = sum(len(s.calls) for s in sessions)
    publish(polar_settings, [r for s in sessions for r in s.records])
    worker = streams_worker("--builder", "prefix_merging", *WORKER_ARGS)
    assert read_topic(polar_settings, "groups", until=bool, timeout=90), worker.log_text()[-3000:]
    time.sleep(2.0)  # sessions are marked done at their partition's next event or tick (every 0.5 s)
    assert worker.stop() == 0, worker.log_text()[-3000:]

    def changelog(table: str) -> tuple[int, dict[str, bytes | None]]:
        msgs = read_topic(polar_settings, f"{app_id_for(polar_settings)}-{table}-changelog", until=bool,
                          timeout=20, idle=2.0, full_name=True)
        return len(msgs), {orjson.loads(m.key): m.value for m in msgs}  # the last value of each key

    n, calls = changelog("session-calls")
    assert n < n_calls and not [k for k, v in calls.items() if v is not None]
    n, states = changelog("sessions")
    assert n < n_calls and sorted(states) == sorted(s.finished.session_id for s in sessions)
    assert all(SessionState.from_json(orjson.loads(v)).done for v in states.values())
    _, groups = changelog("groups")
    assert orjson.loads(groups["cl"])["emitted"]

    worker.start()  # recovers the tables from their changelogs
    publish(polar_settings, [sessions[0].calls[0]])
    deadline = time.monotonic() + 90
    while worker.stats().get("calls.late", 0) < 1:
        assert time.monotonic() < deadline and worker.alive(), worker.log_text()[-3000:]
        time.sleep(0.5)
    assert not worker.stats().get("sessions.assembled")


def test_records_past_the_topic_limits_arrive_in_parts(polar_settings, streams_worker, chat_tokenize):
    """With polar.trajectories and polar.groups allowing less than a session's trajectory and a group,
    the worker sends both in parts (nothing dropped): the group stage gathers a trajectory's parts
    before counting the sample in, each part is under its limit, and joined they are byte for byte
    what the pure functions build; the group's parts are exactly what split_record makes."""
    import dataclasses
    import time

    from confluent_kafka.admin import AdminClient, ConfigResource

    from infra.topics import ensure_topics, load_specs
    from schemas import Parts, Trajectory, split_record
    from streams.runtime import BATCH_OVERHEAD

    sessions = record_group("big", [1.0, 0.0, 0.5, 0.0], seed=5, tokenize=chat_tokenize, turns=8, min_valid=2)
    cfg = StreamsConfig(builder="per_request")
    trajs = [build_trajectory(s.finished, [CallTokens.from_record(c) for c in s.calls], cfg) for s in sessions]
    want = build_group("big", trajs, cfg)
    wire = partial(encode, packed=True)  # what the worker writes (the default record format)
    limits = {"trajectories": 2 * max(len(wire(tr)) for t in trajs for tr in t.traces) + BATCH_OVERHEAD + 512,
              "groups": 2 * max(len(wire(t)) for t in trajs) + BATCH_OVERHEAD + 1024}
    assert len(wire(want)) > limits["groups"] and max(len(wire(t)) for t in trajs) > limits["trajectories"]
    specs = dict(load_specs())  # a copy: load_specs is cached for every later caller
    for name, limit in limits.items():
        specs[name] = dataclasses.replace(specs[name], config={**specs[name].config, "max.message.bytes": str(limit)})
    ensure_topics(polar_settings, specs)
    admin = AdminClient(polar_settings.kafka_config())
    for name, limit in limits.items():  # the broker applies a config change asynchronously
        res, deadline = ConfigResource(ConfigResource.Type.TOPIC, polar_settings.topic(name)), time.monotonic() + 20
        while admin.describe_configs([res])[res].result()["max.message.bytes"].value != str(limit):
            assert time.monotonic() < deadline, f"the broker did not apply the new limit of {name}"
            time.sleep(0.2)

    publish(polar_settings, [r for s in sessions for r in s.records])
    worker = streams_worker("--builder", "per_request", *WORKER_ARGS)
    parts = split_record(want, limits["groups"] - BATCH_OVERHEAD, packed=True)
    msgs = read_topic(polar_settings, "groups", until=lambda m: len(m) >= len(parts), timeout=90, idle=1.5)
    got, duplicates = dedupe(msgs, TrainingGroup)
    assert worker.alive(), worker.log_text()[-3000:]
    assert got == {p.event_id: data for p, data in parts} and duplicates == 0
    joiner = Parts()
    (whole,) = [w for w in (joiner.add(decode(d, TrainingGroup)) for d in got.values()) if w is not None]
    assert encode(whole) == encode(want)
    on_topic = [decode(m.value, Trajectory) for m in read_topic(polar_settings, "trajectories", until=bool, idle=2.0)]
    assert all(len(wire(t)) <= limits["trajectories"] - BATCH_OVERHEAD for t in on_topic)
    assert sorted(encode(w) for w in map(joiner.add, on_topic) if w is not None) == sorted(encode(t) for t in trajs)
    stats = worker.stats()
    assert stats.get("groups.split") == 1 and stats.get("groups.parts") == len(parts) > 1
    assert stats.get("trajectories.split", 0) >= 1 and stats.get("members.added") == 4
    assert not stats.get("groups.oversized") and not stats.get("trajectories.oversized")


def test_trajectories_carry_token_faithful_traces(polar_settings, streams_worker, chat_tokenize):
    """Every trace on polar.trajectories holds each sampled id and logprob of its calls in place."""
    from schemas import Trajectory
    from streams.builders import verify_trace

    rec = record_session(SessionSpec("solo", "solo", turns=5, side_call_at=1, compaction_at=3), 9, chat_tokenize)
    publish(polar_settings, rec.records)
    streams_worker("--builder", "prefix_merging", *WORKER_ARGS)
    msgs = read_topic(polar_settings, "trajectories", until=lambda m: len(m) >= 1, timeout=60)
    got, _ = dedupe(msgs, Trajectory)
    (raw,) = got.values()
    traj = decode(raw, Trajectory)
    by_index = {c.call_index: CallTokens.from_record(c) for c in rec.calls}
    assert [t.call_indices for t in traj.traces] == [[0, 2, 3], [1], [4, 5]]
    for trace in traj.traces:
        assert verify_trace(trace, by_index) == ""
    # The merged trace is exactly the last call's prompt followed by its sampled ids.
    last = rec.calls[-1]
    assert traj.traces[-1].token_ids[-len(last.completion_ids):] == last.completion_ids
