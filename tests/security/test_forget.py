"""polarstream forget: a session's / task's records leave the derived topics; everything else stays."""

from __future__ import annotations

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from typer.testing import CliRunner

from polarstream.cli import app
from polarstream.tools.forget import Target, forget, key_matches, matches, resolve_task
from schemas import CallRecorded, SessionAssigned, TaskRequest, Trace, TrainingGroup, Trajectory, decode
from streams.topology import app_id_for
from tests.streams.helpers import publish


def test_matching_is_by_session_group_task_and_group_members():
    t = Target(sessions=frozenset({"a"}))
    assert matches({"session_id": "a"}, t) and not matches({"session_id": "b"}, t)
    assert matches({"group_id": "g", "trajectories": [{"session_id": "b"}, {"session_id": "a"}]}, t)
    assert not matches({"group_id": "g", "trajectories": [{"session_id": "b"}]}, t)
    assert not matches(None, t) and not matches([1], t)
    task = Target(sessions=frozenset({"a"}), groups=frozenset({"g"}), task="T")
    assert matches({"task_id": "T"}, task) and matches({"group_id": "g"}, task) and not matches({"task_id": "U"}, task)
    assert key_matches("a/3", t) and key_matches("a", t) and not key_matches("ab/3", t)


def test_cli_needs_exactly_one_target():
    result = CliRunner().invoke(app, ["forget"])
    assert result.exit_code == 2 and "--session ID" in result.output


def _traj(sid, gid, task="T1"):
    trace = Trace(call_indices=[0], token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.25])
    return Trajectory(session_id=sid, group_id=gid, task_id=task, reward=1.0, traces=[trace])


def _all(settings, logical=None, topic=None):
    """(key, value) of every record of a topic, in partition/offset order."""
    topic = topic or settings.topic(logical)
    c = Consumer(settings.kafka_config(**{"group.id": "forget-test-read", "enable.auto.commit": False}))
    out = []
    try:
        for p in sorted(c.list_topics(topic, timeout=10).topics[topic].partitions):
            low, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high <= low:
                continue
            c.assign([TopicPartition(topic, p, low)])
            got = []
            while len(got) < high - low:
                got += [m for m in c.consume(min(100, high - low - len(got)), timeout=2) if m.error() is None]
            out += [(m.key(), m.value()) for m in got]
    finally:
        c.close()
    return out


def test_forget_a_session_then_a_task(secure_settings):
    s = secure_settings
    a, b, c = _traj("a", "g1"), _traj("b", "g1"), _traj("c", "g2", task="T2")
    publish(s.model_copy(update={"record_format": "json"}), [a])  # forget finds records in either encoding
    publish(s, [b, c, TrainingGroup(group_id="g1", task_id="T1", trajectories=[a, b], advantages=[0.0, 0.0]),
                TrainingGroup(group_id="g2", task_id="T2", trajectories=[c], advantages=[0.0])])
    calls = [CallRecorded(session_id=sid, call_index=0, provider="engine", prompt_ids=[1], task_id="T1") for sid in "ab"]
    publish(s, calls)
    changelog = f"{app_id_for(s)}-session-calls-changelog"
    admin = AdminClient(s.kafka_config())
    admin.create_topics([NewTopic(changelog, 2, 1, config={"cleanup.policy": "compact"})])[changelog].result()
    p = Producer(s.kafka_config())
    for key in ("a/0", "b/0", "a"):
        p.produce(changelog, b'{"x": 1}', f'"{key}"'.encode(), partition=0)
    assert p.flush(10) == 0

    dry = forget(s, Target(sessions=frozenset({"a"})), dry_run=True)
    assert {t: sum(ps.values()) for t, ps in dry.rewritten.items()} == {s.topic("trajectories"): 1, s.topic("groups"): 1}
    assert dry.tombstones == {changelog: 2}
    assert len(_all(s, "trajectories")) == 3  # a dry run deletes nothing

    report = forget(s, Target(sessions=frozenset({"a"})))
    assert sum(n for ps in report.rewritten.values() for n in ps.values()) == 2 and report.tombstones == {changelog: 2}
    assert sorted(decode(v, Trajectory).session_id for _, v in _all(s, "trajectories")) == ["b", "c"]
    assert [decode(v, TrainingGroup).group_id for _, v in _all(s, "groups")] == ["g2"]
    assert len(_all(s, "calls")) == 2  # the source stays without --include-source
    latest = dict(_all(s, topic=changelog))
    assert latest[b'"a/0"'] is None and latest[b'"a"'] is None and latest[b'"b/0"'] == b'{"x": 1}'

    # A task: found through the topics that carry its ids; with the source topics too.
    task = TaskRequest(task_id="T1", instruction="x", num_samples=2, min_valid=1)
    publish(s, [task, SessionAssigned(session_id="b", group_id="g1", task_id="T1", sample_index=1, session_key="k", task=task)])
    c_ = Consumer(s.kafka_config(**{"group.id": "forget-test-task"}))
    target = resolve_task(s, "T1", c_, 10.0)
    c_.close()
    assert target.sessions == {"b"} and target.groups == {"T1", "g1"}
    forget(s, target, include_source=True)
    assert [decode(v, Trajectory).session_id for _, v in _all(s, "trajectories")] == ["c"]
    assert _all(s, "calls") == [] and _all(s, "sessions") == [] and _all(s, "tasks") == []
