"""Taking sessions from Kafka: polar.sessions as one consumer group, cancel markers from polar.tasks.

All consumer calls run on one dedicated thread (confluent-kafka consumers are not thread-safe, and
rebalance callbacks fire inside ``poll``), so the partition ledgers are only ever touched there. The
event loop hands work over with ``_call``.

Flow control: while the pipeline has no room the assigned partitions are paused, but ``poll`` keeps
being called, so the node stays in the group however long its sessions run. A session is committed
as *live* (ledger metadata) before it starts and as *done* after its finished event is acknowledged.

librdkafka keeps a partition's pause flag across a revoke and a later re-assignment, and a pause right
after an assignment can drop the assignment's start offset (librdkafka#1849, #2190): a partition paused
when it left would never be fetched again. So the intake pauses only partitions it holds a ledger for,
resumes each one before it leaves, and seeks every partition it resumes to the next offset it expects.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from infra.settings import Settings
from producers.consumer import RecordConsumer
from schemas import RecordDecodeError, SessionAssigned, TaskRequest, decode
from schemas.session_keys import mint_session_key

from .config import NodeConfig
from .ledger import PartitionLedger
from .pipeline import Pipeline
from .session import Job, run_session_id

log = logging.getLogger("polarstream.node")

# How often a pending partition's commit is asked for again: each ask can block the intake thread for
# up to its 10 s timeout while the broker does not answer, so not once per record fetched.
RESUME_RETRY_S = 1.0
# How long the intake waits after a session's live mark could not be committed before it asks again.
COMMIT_RETRY_S = 0.5


class SessionIntake:
    """Feeds a Pipeline from polar.sessions and commits what it finished."""

    def __init__(self, settings: Settings, cfg: NodeConfig, pipeline: Pipeline, *, session_timeout_ms: int = 10_000):
        self.settings, self.cfg, self.pipeline = settings, cfg, pipeline
        self.topic = settings.topic("sessions")
        self.ledgers: dict[int, PartitionLedger] = {}
        self._pending: set[int] = set()  # assigned, ledger not resumed yet (see _resume)
        self._resume_after = 0.0  # monotonic time of the next ask for pending partitions' commits
        self.cancelled: dict[str, str] = {}  # task_id -> reason (filled by TaskWatcher)
        self.skipped = 0
        self._paused = False
        self._paused_parts: set[int] = set()  # partitions paused in the consumer (see the module docstring)
        self._next: dict[int, int] = {}  # partition -> offset of the next record to take
        self._admitting = True
        self._stopping = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"intake-{cfg.node_id}")
        self._consumer = Consumer(settings.kafka_config(**{
            "group.id": cfg.consumer_group,
            "client.id": f"polar-node-{cfg.node_id}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",  # a joining node moves only some partitions
            "session.timeout.ms": session_timeout_ms,  # how fast a dead node's sessions move elsewhere
            "heartbeat.interval.ms": max(500, session_timeout_ms // 5),
            "max.poll.interval.ms": max(300_000, session_timeout_ms + 1000),
            "reconnect.backoff.max.ms": 1000,
        }))

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- consumer thread -------------------------------------------------------------------------

    def _subscribe(self) -> None:
        self._consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._pending.update(tp.partition for tp in partitions)
        if partitions:
            self._resume([tp.partition for tp in partitions])
        # Not paused here even when the pipeline is full: the next loop pauses it (a record fetched before
        # then is sought back).
        log.info("node %s: assigned partitions %s", self.cfg.node_id, sorted(tp.partition for tp in partitions))

    def _resume(self, partitions: list[int]) -> None:
        """Ledgers for assigned partitions from their committed offsets and metadata.

        A partition whose commit cannot be read now (the coordinator is moving, the broker restarting)
        stays pending: its records are sought back until it can, since taking a session without knowing
        what was live before would run an attempt twice or skip one.
        """
        try:
            committed = self._consumer.committed([TopicPartition(self.topic, p) for p in partitions], timeout=10)
        except KafkaException as e:
            log.warning("node %s: committed offsets of partitions %s not readable yet (%s)", self.cfg.node_id, partitions, e)
            committed = []
        for tp in committed:
            if tp.error is None and tp.partition in self._pending:
                ledger = PartitionLedger.resume(self.cfg.node_id, max(tp.offset, 0), tp.metadata)
                self.ledgers[tp.partition] = ledger
                self._next[tp.partition] = ledger.committed
                self._pending.discard(tp.partition)
        if self._pending:  # whatever kept them pending (the call failed, or a partition's answer did)
            self._resume_after = time.monotonic() + RESUME_RETRY_S

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Commit what we know (live sessions included, so the next owner re-runs them as a new attempt),
        # then stop those sessions: two nodes must never run the same attempt.
        log.info("node %s: revoked partitions %s", self.cfg.node_id, sorted(tp.partition for tp in partitions))
        owned = [tp for tp in partitions if tp.partition in self.ledgers]
        if owned and not self._stopping:
            self._commit_now([tp.partition for tp in owned])
        self._drop(partitions, "partition revoked; its new owner re-runs the session")

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The group fenced us (a broker restart, or polls too far apart): no commit is possible any more.
        log.warning("node %s: lost partitions %s", self.cfg.node_id, sorted(tp.partition for tp in partitions))
        self._drop(partitions, "partition lost; its new owner re-runs the session")

    def _drop(self, partitions: list[TopicPartition], reason: str) -> None:
        gone = {tp.partition for tp in partitions}
        paused = sorted(gone & self._paused_parts)
        if paused:  # it would come back paused if it were ever assigned here again
            try:
                self._consumer.resume([TopicPartition(self.topic, p) for p in paused])
            except KafkaException as e:
                log.warning("node %s: resuming partitions %s before they leave failed (%s)", self.cfg.node_id, paused, e)
        for p in gone:
            self.ledgers.pop(p, None)
            self._pending.discard(p)
            self._paused_parts.discard(p)
            self._next.pop(p, None)
        if self._stopping or self._loop is None:
            return
        for job in list(self.pipeline.jobs.values()):
            if job.partition in gone:
                self._loop.call_soon_threadsafe(self.pipeline.abandon, job, reason)

    def _commit_now(self, partitions: list[int]) -> bool:
        """Commit the partitions' ledgers; False when the broker refused or could not be reached."""
        if self._closed:
            return False
        offsets = [TopicPartition(self.topic, p, self.ledgers[p].lowest_open(), metadata=self.ledgers[p].metadata())
                   for p in partitions if p in self.ledgers]
        if not offsets:
            return True
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:
            log.warning("node %s: commit failed (%s); the sessions may be re-run after a rebalance", self.cfg.node_id, e)
            return False
        return True

    def _read_again(self, partition: int, offset: int) -> None:
        """Not ours to take yet: the next polls fetch this record again."""
        if partition in self._next:
            self._next[partition] = offset
        self._consumer.seek(TopicPartition(self.topic, partition, offset))

    def _poll_one(self, timeout: float):
        """One delivered session as (record, partition, offset, Delivery), or None."""
        if self._closed:
            return None
        msg = self._consumer.poll(timeout)
        if msg is None:
            return None
        err = msg.error()
        if err is not None:
            if err.fatal():
                raise KafkaException(err)
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("node %s: %s", self.cfg.node_id, err.str())
            return None
        p, off = msg.partition(), msg.offset()
        if p in self._pending and time.monotonic() >= self._resume_after:
            self._resume(sorted(self._pending))
        ledger = self.ledgers.get(p)
        if ledger is None:
            if p in self._pending:  # assigned, but its commit is not known yet
                self._read_again(p, off)
            return None  # revoked between fetch and now
        if self._paused or not (self._admitting and self.pipeline.has_room()):
            self._read_again(p, off)
            return None
        self._next[p] = off + 1
        try:
            record = decode(msg.value() or b"", SessionAssigned)
        except RecordDecodeError as e:
            log.warning("node %s: skipping undecodable session at %s[%d]@%d: %s", self.cfg.node_id, self.topic, p, off, e)
            ledger.skip(off)
            self._commit_now([p])
            self.skipped += 1
            return None
        delivery = ledger.deliver(off, record.attempt)
        if delivery.skip:
            self.skipped += 1
            self._commit_now([p])
            return None
        if not self._commit_now([p]):
            # Not on record as live here: if the partition moved now, its next owner would run the same
            # attempt again beside this one. Taken again once a commit goes through.
            ledger.undeliver(off, delivery)
            self._read_again(p, off)
            time.sleep(COMMIT_RETRY_S)  # the next poll fetches it again at once: not a tight loop of failing commits
            return None
        return record, p, off, delivery

    def _set_paused(self, paused: bool) -> None:
        """While ``paused``, every partition with a ledger is paused (one assigned meanwhile on the next
        call); on resuming, each is sought to its next offset (librdkafka#2190)."""
        if self._closed:
            return
        self._paused = paused
        if paused:
            new = [p for p in self.ledgers if p not in self._paused_parts]
            if new:
                self._consumer.pause([TopicPartition(self.topic, p) for p in new])
                self._paused_parts.update(new)
        elif self._paused_parts:
            parts = sorted(self._paused_parts)
            self._paused_parts.clear()
            self._consumer.resume([TopicPartition(self.topic, p) for p in parts])
            for p in parts:  # each has a ledger, so a next offset (both are set in _resume, dropped in _drop)
                try:
                    self._consumer.seek(TopicPartition(self.topic, p, self._next[p]))
                except KafkaException as e:  # fetched from where it was; only #2190's case stays unfetched
                    log.warning("node %s: seeking partition %d to %d failed (%s)", self.cfg.node_id, p, self._next[p], e)

    def _finish(self, partition: int, offset: int) -> None:
        ledger = self.ledgers.get(partition)
        if ledger is None:
            return  # the partition moved meanwhile: its new owner's ledger already knows
        ledger.finish(offset)
        self._commit_now([partition])

    # -- event loop -------------------------------------------------------------------------------

    def job_for(self, record: SessionAssigned, partition: int, offset: int, attempt: int, lost: int | None) -> Job:
        """A pipeline Job; re-runs get a key minted for their own attempt (and session id). The re-minted
        key keeps the run claim: the node takes sessions from its run's topics, so the run is its topic
        prefix, as the rollout producer's fan-out put it in the original key."""
        key = record.session_key
        if attempt != record.attempt:
            key = mint_session_key(run_session_id(record.session_id, attempt), self.settings.session_secret,
                                   group_id=record.group_id, task_id=record.task_id, sample_index=record.sample_index,
                                   attempt=attempt, harness=record.task.harness.name,
                                   ttl_s=self.settings.session_key_ttl_s, run=self.settings.topic_prefix)
        job = Job(assigned=record, attempt=attempt, key=key, partition=partition, offset=offset, lost_attempt=lost)
        reason = self.cancelled.get(record.task_id) or record.task.cancelled
        if reason:
            job.cancel_reason = reason
            job.cancel.set()
        return job

    async def run(self) -> None:
        """Consume until ``stop``; each delivered session is admitted to the pipeline."""
        self._loop = asyncio.get_running_loop()
        await self._call(self._subscribe)
        while not self._stopping:
            room = self._admitting and self.pipeline.has_room()
            try:
                await self._call(self._set_paused, not room)
                got = await self._call(self._poll_one, 0.2 if room else 0.5)
            except KafkaException as e:  # a rebalance callback's or a seek's error: the next poll retries
                if e.args[0].fatal():
                    raise
                log.warning("node %s: %s", self.cfg.node_id, e)
                await asyncio.sleep(0.5)
                continue
            if got is None:
                continue
            record, p, off, d = got
            self.pipeline.admit(self.job_for(record, p, off, d.attempt, d.lost_attempt))

    async def on_done(self, job: Job) -> None:
        """Pipeline callback: the job's finished event is acknowledged, so its offset may be committed."""
        if job.partition >= 0:
            await self._call(self._finish, job.partition, job.offset)

    def assigned(self) -> list[int]:
        """Partitions of polar.sessions this node owns now."""
        return sorted(self.ledgers)

    def stop_admitting(self) -> None:
        """Take no new sessions (partitions stay assigned and polled while the running ones finish)."""
        self._admitting = False

    def _close(self) -> None:
        self._closed = True
        self._consumer.close()

    async def stop(self) -> None:
        """Leave the group (uncommitted sessions go to the other nodes)."""
        self._stopping = True
        await self._call(self._close)
        self._thread.shutdown(wait=False)


class TaskWatcher:
    """Reads polar.tasks (from the start, in its own group) for cancel markers and applies them."""

    def __init__(self, settings: Settings, node_id: str, intake: SessionIntake, pipeline: Pipeline):
        self.intake, self.pipeline = intake, pipeline
        self._stopping = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"tasks-{node_id}")
        self._consumer = RecordConsumer(settings, topics=["tasks"], group_id=f"polar-node-{node_id}-tasks-{uuid.uuid4().hex[:6]}",
                                        from_beginning=True)

    async def run(self) -> None:
        """Poll polar.tasks until ``stop``; cancel markers stop the task's sessions here."""
        loop = asyncio.get_running_loop()
        while not self._stopping:
            items = await loop.run_in_executor(self._thread, self._consumer.poll, 0.5)
            for item in items:
                task = item.record
                if isinstance(task, TaskRequest) and task.cancelled:
                    self.intake.cancelled[task.task_id] = task.cancelled
                    n = self.pipeline.cancel_task(task.task_id, task.cancelled)
                    log.info("task %s cancelled (%s): %d sessions stopped here", task.task_id, task.cancelled, n)

    async def stop(self) -> None:
        """Close the tasks consumer."""
        self._stopping = True
        await asyncio.get_running_loop().run_in_executor(self._thread, self._consumer.close)
        self._thread.shutdown(wait=False)
