"""The node's Kafka intake on the real broker: a partition whose commit cannot be read when it is assigned
is not taken from until it can be (nothing skipped, nothing run twice), and a node whose intake dies
exits instead of serving on without taking sessions."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

from gateway.config import GatewayConfig
from gateway.node.config import NodeConfig
from gateway.node.intake import RESUME_RETRY_S, SessionIntake
from gateway.node.node import Node
from producers.publisher import Publisher
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
