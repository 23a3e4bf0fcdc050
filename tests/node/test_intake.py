"""The node's Kafka intake on the real broker: a partition whose commit cannot be read when it is assigned
is not taken from until it can be (nothing skipped, nothing run twice), and a node whose intake dies
exits instead of serving on without taking sessions."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from gateway.config import GatewayConfig
from gateway.node.config import NodeConfig
from gateway.node.intake import RESUME_RETRY_S, SessionIntake
from gateway.node.node import Node
from producers.publisher import Publisher
from producers.rollout.fanout import fan_out
from schemas import TaskRequest
from schemas.session_keys import verify_session_key
from tests.node.test_pipeline import job, pipeline

pytestmark = pytest.mark.integration


class CommitUnreadable:
    """The intake's consumer, whose ``committed`` fails (as while the group coordinator moves) until
    ``readable``: the call raises, or (``per_partition``) it answers each partition with an error."""

    def __init__(self, consumer, per_partition: bool = False):
        self._consumer, self.per_partition, self.readable, self.failed = consumer, per_partition, False, 0

    def committed(self, partitions, timeout=None):
        if not self.readable:
            self.failed += 1
            if not self.per_partition:
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
            # confluent-kafka's TopicPartition.error is read-only: an answer with the fields the intake reads
            error = KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS)
            return [SimpleNamespace(topic=tp.topic, partition=tp.partition, offset=-1001, metadata=None, error=error)
                    for tp in partitions]
        return self._consumer.committed(partitions, timeout=timeout)

    def __getattr__(self, name):
        return getattr(self._consumer, name)


def poll_for(intake: SessionIntake, seconds: float) -> list[tuple[int, int]]:
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        one = intake._poll_one(0.2)
        if one is not None:
            got.append((one[1], one[2]))
    return got


def test_a_rerun_key_keeps_its_run(polar_settings, tmp_path):
    """A re-run's key, minted on the node, names the same run as the rollout producer's key: on a gateway
    shared by several runs its calls still land in this run's topics."""
    task = TaskRequest(task_id="t", instruction="do", num_samples=2, min_valid=1)
    (s0, _) = fan_out(task, polar_settings.session_secret, run=polar_settings.topic_prefix)
    cfg = NodeConfig(work_dir=tmp_path, cache_dir=tmp_path, runtime="subprocess", node_id="n1")
    intake = SessionIntake(polar_settings, cfg, pipeline(tmp_path, []))
    try:
        assert intake.job_for(s0, 0, 0, 0, None).key == s0.session_key  # attempt 0: the producer's key as is
        claims = verify_session_key(intake.job_for(s0, 0, 0, 1, 0).key, polar_settings.session_secret)
        assert (claims.session_id, claims.attempt, claims.run) == ("t.s0.a1", 1, polar_settings.topic_prefix)
    finally:
        intake._close()


@pytest.mark.parametrize("per_partition", [False, True], ids=["call-fails", "partition-errors"])
def test_a_partition_whose_commit_is_unreadable_is_not_taken_from_until_it_is(polar_settings, tmp_path, per_partition):
    pub = Publisher(polar_settings)
    try:
        for i in range(6):
            pub.publish_sync(job(i, command=["true"], task_id=f"t{i}").assigned, timeout=30)
    finally:
        pub.close()
    cfg = NodeConfig(work_dir=tmp_path, cache_dir=tmp_path, runtime="subprocess", node_id="n1", run_workers=8)
    intake = SessionIntake(polar_settings, cfg, pipeline(tmp_path, [], run_workers=8), session_timeout_ms=6000)
    intake._consumer = consumer = CommitUnreadable(intake._consumer, per_partition)
    try:
        intake._subscribe()
        assert poll_for(intake, 6) == []  # the records were fetched and sought back, not taken
        assert consumer.failed >= 2 and intake._pending and not intake.ledgers
        # asked again on a timer, not once per record fetched (each ask can block for its timeout)
        assert consumer.failed <= 6 / RESUME_RETRY_S + 2, consumer.failed
        consumer.readable = True
        got = poll_for(intake, 6)
        assert len(got) == 6 == len(set(got)), got  # every session taken once
        by_partition: dict[int, list[int]] = {}
        for p, off in got:
            by_partition.setdefault(p, []).append(off)
        assert all(offs == list(range(len(offs))) for offs in by_partition.values()), by_partition
        assert not intake._pending and set(by_partition) <= set(intake.ledgers)
    finally:
        intake._close()


async def test_a_node_whose_intake_dies_exits_nonzero(polar_settings, tmp_path, tiny_model_dir):
    cfg = NodeConfig(work_dir=tmp_path / "node", cache_dir=tmp_path, runtime="subprocess", node_id="nx", run_workers=1)
    node = Node(polar_settings, cfg, GatewayConfig(engine_urls=["http://127.0.0.1:9"], model=str(tiny_model_dir)))
    serving = asyncio.ensure_future(node.serve())
    for _ in range(300):
        if node.intake is not None and node.intake.assigned():
            break
        await asyncio.sleep(0.1)
    assert node.intake is not None and node.intake.assigned()
    node.pipeline.has_room = lambda: 1 / 0  # a bug in the intake's loop
    assert await asyncio.wait_for(serving, 30) == 1


def drive(intakes: list[SessionIntake], seconds: float, room: dict[str, bool]) -> list[tuple[str, int, int]]:
    """Each intake's run loop, in turns: pause or resume as its pipeline has room, then poll once."""
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        for intake in intakes:
            intake._set_paused(not room[intake.cfg.node_id])
            one = intake._poll_one(0.1)
            if one is not None:
                got.append((intake.cfg.node_id, one[1], one[2]))
    return got


def test_partitions_that_leave_a_paused_node_are_fetched_when_they_come_back(polar_settings, tmp_path):
    """librdkafka keeps a partition's pause across a revoke and a later assignment: a node that was full
    when a partition left, and has room when it comes back, must take that partition's sessions."""
    def intake(node_id: str) -> SessionIntake:
        cfg = NodeConfig(work_dir=tmp_path / node_id, cache_dir=tmp_path, runtime="subprocess", node_id=node_id, run_workers=8)
        return SessionIntake(polar_settings, cfg, pipeline(tmp_path / node_id, [], run_workers=8), session_timeout_ms=6000)

    a, b = intake("a"), intake("b")
    room = {"a": True, "b": False}  # no sessions are published until the end
    t0 = time.monotonic()
    try:
        a._subscribe()
        while len(a.ledgers) < 4 and time.monotonic() - t0 < 60:  # a owns every partition
            drive([a], 0.3, room)
        assert len(a.ledgers) == 4, a.ledgers
        room["a"] = False  # then a is full: its partitions are paused
        drive([a], 0.5, room)
        b._subscribe()
        while not (b.ledgers and len(a.ledgers) + len(b.ledgers) == 4) and time.monotonic() - t0 < 120:
            drive([a, b], 0.3, room)  # b joins: some partitions leave a while a is paused
        moved = set(b.ledgers)
        assert moved and not moved & set(a.ledgers), (a.ledgers, b.ledgers)
        room["a"] = True  # a has room again, then b leaves: its partitions come back to a
        drive([a], 0.5, room)
        b._close()
        while len(a.ledgers) < 4 and time.monotonic() - t0 < 180:
            drive([a], 0.3, room)
        assert set(a.ledgers) == {0, 1, 2, 3}
        pub = Publisher(polar_settings)
        try:
            for i in range(16):
                pub.publish_sync(job(i, command=["true"], task_id=f"t{i}").assigned, timeout=30)
        finally:
            pub.close()
        got = drive([a], 8, room)
        assert len(got) == 16 == len(set(got)), (moved, got)  # every session taken, once, by a
        assert {p for _, p, _ in got} >= moved, (moved, got)  # the partitions that left while a was paused too
    finally:
        a._close()
        if not b._closed:
            b._close()


class CommitRefused:
    """The intake's consumer, whose ``commit`` fails (as in a rebalance) while ``refusing``."""

    def __init__(self, consumer):
        self._consumer, self.refusing, self.refused = consumer, True, 0

    def commit(self, *args, **kwargs):
        if self.refusing:
            self.refused += 1
            raise KafkaException(KafkaError(KafkaError.ILLEGAL_GENERATION))
        return self._consumer.commit(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._consumer, name)


def test_a_session_whose_live_mark_cannot_be_committed_is_not_run_until_it_can(polar_settings, tmp_path):
    """Run without its live mark on record, a session would be run again as the same attempt by the
    partition's next owner: it is taken only once the mark is committed."""
    pub = Publisher(polar_settings)
    try:
        for i in range(4):
            pub.publish_sync(job(i, command=["true"], task_id=f"t{i}").assigned, timeout=30)
    finally:
        pub.close()
    cfg = NodeConfig(work_dir=tmp_path, cache_dir=tmp_path, runtime="subprocess", node_id="n1", run_workers=8)
    intake = SessionIntake(polar_settings, cfg, pipeline(tmp_path, [], run_workers=8), session_timeout_ms=6000)
    intake._consumer = consumer = CommitRefused(intake._consumer)
    try:
        intake._subscribe()
        assert poll_for(intake, 8) == []  # fetched, refused, sought back
        assert consumer.refused >= 2 and all(not led.live for led in intake.ledgers.values()), intake.ledgers
        consumer.refusing = False
        got = poll_for(intake, 6)
        assert len(got) == 4 == len(set(got)), got
        committed = intake._consumer.committed([TopicPartition(intake.topic, p) for p in intake.ledgers], timeout=10)
        live = {(tp.partition, int(off)) for tp in committed if tp.metadata for off in json.loads(tp.metadata)["live"]}
        assert live == set(got)  # each one on record as live here before it was handed over
    finally:
        intake._close()
