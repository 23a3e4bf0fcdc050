"""The judge stage: a group's members get their verdicts before the group's advantages are computed.

The group stage (group_agent.py) calls ``judge_members`` when a group is ready. Verdicts are records on
polar.judgements (schemas JudgeVerdict), one id per (trajectory, judge): before asking, the stage reads
that topic up to its end, so a verdict recorded once, by this worker or one before a restart, is reused
and never asked for again; a verdict is recorded (acknowledged by the broker) before its group is built
from it. The task's rubric comes from polar.tasks, read the same way. A failure masks its member (or, by
setting, the group) with its class; it is counted as ``judge.<class>`` (the worker's counters, and so
its metrics and stats file), never turned into a score.

The stage awaits the judge inside the group stage's handler: the groups of that worker wait while a
group is judged (its requests go out concurrently, under the client's limits).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from infra.settings import Settings
from schemas import JudgeVerdict, RecordDecodeError, TaskRequest, Trajectory, decode, encode

from .judge import JudgeConfig, Judged, apply_verdicts, task_rubric, verdict_id
from .judge_client import JudgeClient

log = logging.getLogger("streams.judge")


def client_for(config: JudgeConfig) -> JudgeClient:
    """The judge client the stage asks with: transcripts decoded, and requests counted, with the policy's
    tokenizer (``config.tokenizer``), special tokens shown as the model saw them."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(config.tokenizer)
    return JudgeClient(config, lambda ids: tok.decode(ids, skip_special_tokens=False),
                       lambda text: len(tok.encode(text, add_special_tokens=False).ids))


class TopicTail:
    """A topic read from its beginning, every partition, a little further at each ``catch_up`` (blocking:
    run it in a thread). Commits nothing: each worker reads the whole topic for itself."""

    def __init__(self, settings: Settings, topic: str, on_value: Callable[[bytes], None], timeout: float = 15.0):
        self.settings, self.topic, self.on_value, self.timeout = settings, topic, on_value, timeout
        self.consumer: Any = None
        self.partitions: list[int] = []

    def _open(self) -> None:
        import os
        import time

        from confluent_kafka import Consumer, TopicPartition

        self.consumer = Consumer(self.settings.kafka_config(**{
            "group.id": f"polar-judge-{os.getpid()}-{time.monotonic_ns()}", "enable.auto.commit": False,
            "auto.offset.reset": "earliest"}))
        md = self.consumer.list_topics(self.topic, timeout=self.timeout).topics[self.topic]
        if md.error is not None:
            raise RuntimeError(f"{self.topic}: {md.error.str()}; create it with `polarstream infra topics`")
        self.partitions = sorted(md.partitions)
        self.consumer.assign([TopicPartition(self.topic, p, 0) for p in self.partitions])

    def catch_up(self) -> None:
        """Read every record up to the partitions' ends as of now."""
        import time

        from confluent_kafka import TopicPartition

        if self.consumer is None:
            self._open()
        marks = {p: self.consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=self.timeout)
                 for p in self.partitions}
        ends = {p: hi for p, (lo, hi) in marks.items() if hi > lo}  # an empty partition is read already
        deadline = time.monotonic() + self.timeout
        while True:
            positions = {tp.partition: tp.offset for tp in self.consumer.position(
                [TopicPartition(self.topic, p) for p in self.partitions])}
            if all(positions[p] >= end for p, end in ends.items()):  # unread: a negative position
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.topic}: not read to its end within {self.timeout:g} s")
            for msg in self.consumer.consume(500, 0.2):
                if msg.error() is None and msg.value() is not None:
                    self.on_value(msg.value())

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()


class JudgeStage:
    """One worker's judge: its client (and limits), the recorded verdicts and the tasks' rubrics.

    ``record(verdict)`` records a new verdict (awaits the broker's ack). ``sources``: the namespaces whose
    polar.judgements hold verdicts to reuse, in order of precedence (the worker: its own; a replay: its
    target's, then the run's). ``retry_failed``: ask again where the verdict recorded is a failure (a
    replay's --judge-failed-only); the new one then counts."""

    def __init__(self, settings: Settings, config: JudgeConfig, record: Callable[[JudgeVerdict], Awaitable[None]],
                 count: Callable[[str, int], None], *, sources: Sequence[Settings] = (), retry_failed: bool = False):
        self.config, self.record, self.count, self.retry_failed = config, record, count, retry_failed
        self.client = client_for(config)
        self.verdicts: dict[str, JudgeVerdict] = {}  # event id -> the first one recorded
        self.tasks: dict[str, tuple[str, str]] = {}  # task id -> (rubric, instruction)
        self.recorded = [TopicTail(s, s.topic("judgements"), self._on_verdict) for s in (sources or [settings])]
        run = (sources or [settings])[-1]  # the namespace the tasks were submitted in
        self.task_log = TopicTail(run, run.topic("tasks"), self._on_task)

    def _on_verdict(self, value: bytes) -> None:
        try:
            v = decode(value, JudgeVerdict)
        except RecordDecodeError:
            self.count("judge.undecodable", 1)
            return
        self.verdicts.setdefault(v.event_id, v)

    def _on_task(self, value: bytes) -> None:
        try:
            t = decode(value, TaskRequest)
        except RecordDecodeError:
            return
        if not t.cancelled:
            self.tasks[t.task_id] = (task_rubric(t), t.instruction)

    async def judge_members(self, members: Sequence[Trajectory]) -> Judged:
        """The members with their rewards combined with their verdicts (asked for where none is recorded)."""
        for tail in self.recorded:
            await asyncio.to_thread(tail.catch_up)
        fp = self.client.fingerprint
        need = [t for t in members if t.usable and self._ask(verdict_id(t.event_id, fp))]
        self.count("judge.reused", sum(t.usable for t in members) - len(need))
        if need:
            if any(t.task_id not in self.tasks for t in need):
                await asyncio.to_thread(self.task_log.catch_up)
            asked = await asyncio.gather(*(self.client.judge(t, *self.tasks.get(t.task_id, ("", ""))) for t in need))
            await asyncio.gather(*(self.record(v) for v in asked))  # recorded before any group is built from them
            for v in asked:
                if self._ask(v.event_id):  # none yet, or (failed-only) a failure this one replaces
                    self.verdicts[v.event_id] = v
                self.count("judge.asked", 1)
                self.count(f"judge.{v.failure or 'scored'}", 1)
                self.count("judge.attempts", v.attempts)
                if v.failure:
                    log.warning("judge: %s for session %s (group %s): %s", v.failure, v.session_id, v.group_id, v.detail)
        verdicts = {t.event_id: self.verdicts[verdict_id(t.event_id, fp)] for t in members if t.usable}
        return apply_verdicts(members, verdicts, self.config)

    def _ask(self, event_id: str) -> bool:
        held = self.verdicts.get(event_id)
        return held is None or (self.retry_failed and held.failure is not None)

    async def close(self) -> None:
        await self.client.close()
        for tail in [*self.recorded, self.task_log]:
            tail.close()


def faust_recorder(topic, packed: bool) -> Callable[[JudgeVerdict], Awaitable[None]]:
    """Record verdicts on a Faust topic (the worker's producer), returning once the broker has each."""

    async def record(v: JudgeVerdict) -> None:
        await (await topic.send(key=v.key().encode(), value=encode(v, packed=packed)))

    return record
