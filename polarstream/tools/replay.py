"""Re-derive trajectories and groups from recorded calls into a new topic namespace.

Kafka keeps every call, so training data can be rebuilt under other choices (builder, advantage,
side calls, deadlines...) without re-running a single agent. A replay reads ``polar.calls`` and
``polar.session-events`` of the source prefix in the deterministic order of ``kafka_read.merged``,
drives both stream stages with ``rederive.Rederiver`` (the streams' own pure functions) and publishes
the results under ``<name>.<source prefix>polar.trajectories`` / ``.groups``. It never writes to the
source namespace and never commits offsets, so it runs beside live collection without touching it.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from infra.settings import Settings
from schemas import CallRecorded, Record, RecordDecodeError, SessionEvent, TrainingGroup, Trajectory, decode, encode
from streams.config import StreamsConfig

from producers.kafka_read import RawMessage, fresh_group, merged, watermarks
from producers.positions import Span, offsets_of
from .rederive import Limits, Rederiver

SOURCES = ("calls", "session-events")
OUTPUTS = ("trajectories", "groups")
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")
_IN_FLIGHT = 2_000  # published records awaiting their ack before the replay waits for the oldest


class ReplayError(RuntimeError):
    """A replay that cannot start or finish; the message says what to change."""


def target_settings(source: Settings, name: str) -> Settings:
    """Settings for the replay namespace: topic prefix ``<name>.`` + the source prefix
    (``abl`` on prefix ``exp1.`` writes ``abl.exp1.polar.groups``; on no prefix, ``abl.polar.groups``)."""
    name = name.strip().rstrip(".")
    if not _NAME.match(name) or ".." in name:
        raise ReplayError(f"--to-prefix {name!r}: use letters, digits, '.', '_' and '-' (a Kafka topic name part)")
    return source.model_copy(update={"topic_prefix": f"{name}.{source.topic_prefix}"})


def prepare_target(target: Settings, allow_existing: bool = False, timeout: float = 15.0, judged: bool = False) -> list[str]:
    """Create the namespace's output topics (as topics.yaml declares them; ``judged``: its polar.judgements
    too); refuse to mix a new replay into topics that already hold records unless ``allow_existing``.
    Returns the topics created."""
    from confluent_kafka import Consumer

    from infra.topics import ensure_topics, load_specs

    specs = load_specs()
    report = ensure_topics(target, {n: specs[n] for n in (*OUTPUTS, *(("judgements",) if judged else ()))}, timeout=timeout)
    if allow_existing:
        return report.created
    c = Consumer(target.kafka_config(**{"group.id": fresh_group("check")}))
    try:
        for topic in OUTPUTS:
            full = target.topic(topic)
            parts = c.list_topics(full, timeout=timeout).topics[full].partitions
            held = sum(h - lo for lo, h in (watermarks(c, full, p, timeout) for p in parts))
            if held:
                raise ReplayError(f"{full} already holds {held} records; pick another --to-prefix, or pass "
                                  f"--allow-existing to add to them (readers drop repeats by event_id)")
    finally:
        c.close()
    return report.created


def output_limits() -> Limits:
    """The output topics' max.message.bytes, from topics.yaml (which the target topics are created from)."""
    from infra.topics import load_specs

    specs = load_specs()
    size = lambda n: int(specs[n].config.get("max.message.bytes", 1048588))  # noqa: E731
    return Limits(size("trajectories"), size("groups"))


@dataclass
class ReplayResult:
    """What a replay read and wrote; ``to_dict`` is the command's JSON output."""

    source_prefix: str
    target_prefix: str
    config: dict
    spans: list[Span]
    read: Counter = field(default_factory=Counter)
    written: Counter = field(default_factory=Counter)
    counters: Counter = field(default_factory=Counter)
    pending: dict[str, int] = field(default_factory=dict)
    digest: str = ""  # sha256 of every output record's bytes, in order: equal digests, equal output

    def to_dict(self) -> dict:
        return {
            "source_prefix": self.source_prefix, "target_prefix": self.target_prefix,
            "topics": {t: f"{self.target_prefix}polar.{t}" for t in OUTPUTS},
            "config": self.config, "read": dict(self.read), "written": dict(self.written),
            "counters": dict(sorted(self.counters.items())), "pending": self.pending, "digest": self.digest,
            "start_offsets": offsets_of(self.spans, "start"), "end_offsets": offsets_of(self.spans, "end"),
        }


def _tally(written: Counter, record: Record) -> None:
    if isinstance(record, Trajectory):
        written["trajectories"] += record.part == 0  # one sent in parts counts once
        if record.parts > 1:
            written["trajectory_parts"] += 1
        written["usable_trajectories"] += record.usable
        written["traces"] += len(record.traces)
        written["tokens"] += sum(len(t.token_ids) for t in record.traces)
        written["trainable_tokens"] += sum(sum(t.loss_mask) for t in record.traces)
    elif isinstance(record, TrainingGroup):
        written["groups"] += record.part == 0  # a group sent in parts counts once
        if record.parts > 1:
            written["group_parts"] += 1
        written["group_trajectories"] += len(record.trajectories)
        written["group_traces"] += sum(len(t.traces) for t in record.trajectories)
        written["group_tokens"] += sum(len(tr.token_ids) for t in record.trajectories for tr in t.traces)


def derive_records(messages, stages: Rederiver, drain: bool = True, on_message: Callable[[RawMessage], None] | None = None):
    """Yield the records ``stages`` derive from ``messages`` (RawMessages in order), then those the end
    of input releases (``drain``). Undecodable messages are counted and skipped, as the live workers do."""
    for msg in messages:
        cls = CallRecorded if msg.topic == "calls" else SessionEvent
        try:
            record = decode(msg.value, cls)
        except RecordDecodeError:
            stages.counters[f"{cls.TOPIC}.undecodable"] += 1
        else:
            handle = stages.on_call if msg.topic == "calls" else stages.on_session_event
            yield from handle(record, msg.timestamp_ms / 1000.0, msg.partition)
        if on_message:
            on_message(msg)
    if drain:
        yield from stages.drain()


def replay(source: Settings, target: Settings, spans: list[Span], config: StreamsConfig, *, drain: bool = True,
           on_message: Callable[[RawMessage], None] | None = None, judge_failed_only: bool = False) -> ReplayResult:
    """Read ``spans`` of the source, re-derive, publish to the target namespace; wait for every ack.

    With ``config.judge``, each group's members are judged before its advantages, as the live stage does:
    a verdict of that judge recorded in the target namespace or the run's is reused (so the run's own
    judge gives back its rewards bit for bit), any other is asked for and recorded in the target's
    polar.judgements; ``judge_failed_only`` asks again where the recorded verdict is a failure."""
    from producers.publisher import Publisher, PublishError

    if target.topic_prefix == source.topic_prefix:
        raise ReplayError("the target namespace must differ from the source (a replay never writes into live topics)")
    result = ReplayResult(source.topic_prefix, target.topic_prefix, config.model_dump(mode="json"), spans)
    digest = hashlib.sha256()
    inflight: deque = deque()

    def count_read(msg: RawMessage) -> None:
        result.read[msg.topic] += 1
        if on_message:
            on_message(msg)

    packed = target.packed
    stages = Rederiver(config, output_limits(), packed=packed)
    stream = merged(source, spans, fresh_group("replay"))
    with Publisher(target, client_id="polarstream-replay") as pub, _judging(source, target, config, pub, stages,
                                                                             judge_failed_only, result.written):
        try:
            for record in derive_records(stream, stages, drain, count_read):
                digest.update(encode(record, packed=packed))  # the bytes the publisher writes
                _tally(result.written, record)
                inflight.append(pub.submit(record))
                while len(inflight) > _IN_FLIGHT:
                    inflight.popleft().result(pub.delivery_timeout_s + 5)
            for fut in inflight:
                fut.result(pub.delivery_timeout_s + 5)
        except PublishError as e:
            raise ReplayError(f"publishing to {target.topic_prefix}polar.*: {e}; what was acknowledged stays, "
                              f"rerun with --allow-existing to complete it (repeats are dropped by event_id)") from None
    result.counters, result.pending = stages.counters, stages.pending()
    result.digest = digest.hexdigest()
    return result


@contextmanager
def _judging(source: Settings, target: Settings, config: StreamsConfig, pub, stages: Rederiver, failed_only: bool,
             written: Counter) -> Iterator[None]:
    """Give ``stages`` the replay's judge stage (config.judge) for the block: verdicts recorded with ``pub``."""
    if config.judge is None:
        if failed_only:
            raise ReplayError("--judge-failed-only: name the judge with --judge (the run's judge YAML)")
        yield
        return
    import asyncio

    from streams.judge_stage import JudgeStage

    loop = asyncio.new_event_loop()

    async def record(verdict) -> None:
        fut = pub.submit(verdict)
        await asyncio.to_thread(fut.result, pub.delivery_timeout_s + 5)
        written["judgements"] += 1

    stage = JudgeStage(target, config.judge, record, lambda name, n: stages.counters.update({name: n}),
                       sources=[target, source], retry_failed=failed_only)
    stages.judge = lambda members: loop.run_until_complete(stage.judge_members(members))
    try:
        yield
    finally:
        loop.run_until_complete(stage.close())
        loop.close()
