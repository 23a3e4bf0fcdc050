"""What the run's topics say: the Watcher reads polar.tasks, polar.groups and polar.policy, and
``consumer_lag`` how far the components' consumer groups are behind (a figure for the terminal view)."""

from __future__ import annotations

import time
import uuid

from infra.settings import Settings
from schemas import Parts, PolicyVersion, TaskRequest, TrainingGroup

from .processes import ProcessFailed

# The driver's own consumer groups (named when the driver was the demo's): the lag figure leaves them out
OWN_GROUPS = "polar-demo-"


class Watcher:
    """Reads polar.tasks, polar.groups and polar.policy from their beginning as the driver's own consumer
    (deduplicated by event_id): what the run sent out and what came back, so a restarted driver knows where
    its run stands (schedule.py), and which policy version the trainer published last (serving.py)."""

    def __init__(self, settings: Settings):
        from producers.consumer import Deduper, RecordConsumer

        self.settings = settings
        self.consumer = RecordConsumer(settings, topics=["tasks", "groups", "policy"],
                                       group_id=f"{OWN_GROUPS}{uuid.uuid4().hex[:8]}")
        self.dedupe = Deduper()
        self.tasks: dict[str, int] = {}  # group id -> when its task reached polar.tasks (ms)
        self.groups: dict[str, TrainingGroup] = {}
        self.parts = Parts()
        self.policy: PolicyVersion | None = None
        self.policies: dict[int, PolicyVersion] = {}
        self._read: dict[tuple[str, int], int] = {}  # (topic, partition) -> next offset

    @property
    def trained(self) -> int:
        """The newest policy version the trainer published (0: none yet, the starting model)."""
        return self.policy.version if self.policy is not None else 0

    def poll(self, timeout: float = 0.5) -> None:
        for item in self.consumer.poll(timeout):
            self._read[(item.logical_topic, item.partition)] = item.offset + 1
            rec = item.record
            if self.dedupe.seen(rec.event_id):
                continue
            if isinstance(rec, TaskRequest):
                self.tasks.setdefault(rec.group_id, item.timestamp_ms)
            elif isinstance(rec, TrainingGroup):
                whole = self.parts.add(rec)  # a group sent in parts counts once all of them are in
                if whole is not None:
                    self.groups[whole.group_id] = whole
            elif isinstance(rec, PolicyVersion):
                self.policies[rec.version] = rec
                if self.policy is None or rec.version >= self.policy.version:
                    self.policy = rec

    def catch_up(self, timeout: float = 60.0) -> None:
        """Poll until everything on the three topics when this was called has been read."""
        from producers.kafka_read import plan_spans

        ends = {(sp.topic, sp.partition): sp.end for sp in plan_spans(self.settings, ("tasks", "groups", "policy"))}
        deadline = time.monotonic() + timeout
        while True:
            at = self.consumer.positions()  # the position also steps over control records
            at.update({tp: max(o, at.get(tp, 0)) for tp, o in self._read.items()})
            if all(at.get(tp, 0) >= end for tp, end in ends.items() if end > 0):
                return
            if time.monotonic() > deadline:
                raise ProcessFailed(f"could not read the run's topics back within {timeout:.0f}s")
            self.poll()

    def close(self) -> None:
        self.consumer.close()


def consumer_lag(settings: Settings) -> dict[str, int]:
    """Per topic: messages not yet committed by the slowest consumer group that reads it."""
    from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka_config())
    lag: dict[str, int] = {}
    try:
        groups = admin.list_consumer_groups(request_timeout=5).result().valid
        names = [g.group_id for g in groups if not g.group_id.startswith(OWN_GROUPS)]
        meta = admin.list_topics(timeout=5).topics
        ours = {settings.topic(t) for t in ("sessions", "calls", "session-events", "groups")}
        probe = Consumer(settings.kafka_config(**{"group.id": f"{OWN_GROUPS}lag-probe"}))
        try:
            for name in names:
                res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(name)])[name].result()
                for tp in res.topic_partitions:
                    if tp.topic not in ours or tp.offset < 0 or tp.topic not in meta:
                        continue
                    high = probe.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=5)[1]
                    logical = tp.topic.removeprefix(settings.topic_prefix)
                    lag[logical] = max(lag.get(logical, 0), high - tp.offset)
        finally:
            probe.close()
    except Exception:  # lag is a display nicety; never let it stop the run
        pass
    return lag
