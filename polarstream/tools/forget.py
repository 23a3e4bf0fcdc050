"""``polarstream forget --session ID | --task ID``: delete one session's or task's data from the log.

Kafka cannot delete one record from the middle of a partition, so (docs/security.md):

- compacted topics (the stream workers' changelogs, ``<prefix>polarstream-streams-*-changelog``): a
  tombstone (key, null) for every key whose latest value belongs to the target; restores see the
  deletion at once, the bytes go when the log cleaner compacts the segment;
- delete-policy topics (trajectories, groups; with ``--include-source`` also tasks, sessions, calls,
  session-events): every partition holding a target record is *rewritten*: its other records are
  re-appended in their original order (same key, value, timestamp, headers), then DeleteRecords drops
  everything below the old end. Records written meanwhile stay; consumers positioned inside the
  dropped range restart from the copies and see them again (every reader dedupes by event_id).

A group that contains a forgotten session is deleted whole (its other members' trajectories stay).
Run it as a super user (``admin`` on a secured cluster). With ``--gateway URL`` the sessions are first
*closed* on those gateways (``DELETE /admin/sessions/{id}``), so a key still held by a harness cannot
record into a forgotten session again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from infra.settings import Settings
from schemas import document

DERIVED = ("trajectories", "groups")
SOURCE = ("tasks", "sessions", "calls", "session-events")


@dataclass(frozen=True)
class Target:
    """What to forget: sessions (by id), groups (by id) and a task id ('' when forgetting sessions)."""

    sessions: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()
    task: str = ""


def matches(value: Any, target: Target) -> bool:
    """True when a decoded record or table value belongs to the target (pure)."""
    if not isinstance(value, dict):
        return False
    if value.get("session_id") in target.sessions or value.get("group_id") in target.groups:
        return True
    if target.task and value.get("task_id") == target.task:
        return True
    members = value.get("trajectories")
    return isinstance(members, list) and any(matches(m, target) for m in members)


def key_matches(key: str, target: Target) -> bool:
    """Changelog keys: ``sid``, ``sid/<call>``, ``group_id``, ``group_id/<sample>`` (pure)."""
    head = key.split("/", 1)[0]
    return head in target.sessions or head in target.groups


def _loads(raw: bytes | None) -> Any:
    """A record's fields in either encoding (schemas.document), or None for what is neither."""
    try:
        return document(raw) if raw else None
    except ValueError:  # orjson's decode error and a malformed packed container are both ValueErrors
        return None


@dataclass
class Report:
    """What forget did (or, dry run, would do)."""

    rewritten: dict[str, dict[int, int]] = field(default_factory=dict)  # topic -> partition -> records dropped
    tombstones: dict[str, int] = field(default_factory=dict)  # changelog topic -> keys deleted
    kept: int = 0  # records re-appended

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"rewritten": {t: {str(p): n for p, n in ps.items()} for t, ps in self.rewritten.items()},
                "tombstones": self.tombstones, "kept": self.kept}


def read_partition(consumer, topic: str, partition: int, timeout: float) -> tuple[list, int]:
    """Every message of one partition from its low to its high watermark, and that high watermark."""
    from confluent_kafka import TopicPartition

    low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout)
    msgs: list = []
    if high <= low:
        return msgs, high
    consumer.assign([TopicPartition(topic, partition, low)])
    deadline = time.monotonic() + timeout
    while (not msgs or msgs[-1].offset() < high - 1) and time.monotonic() < deadline:
        # consume() returns early only once it has num_messages: ask for no more than can be left.
        left = high - (msgs[-1].offset() + 1 if msgs else low)
        msgs += [m for m in consumer.consume(min(500, left), timeout=0.5) if m.error() is None]
    consumer.unassign()
    if msgs and msgs[-1].offset() < high - 1:
        raise TimeoutError(f"{topic}[{partition}]: read {len(msgs)} records, not up to offset {high - 1}")
    return msgs, high


def _partitions(consumer, topics: Iterable[str], timeout: float) -> list[tuple[str, int]]:
    md = consumer.list_topics(timeout=timeout).topics
    return [(t, p) for t in topics if t in md for p in sorted(md[t].partitions)]


def resolve_task(settings: Settings, task: str, consumer, timeout: float) -> Target:
    """A task's sessions and groups, found in the small topics that carry both ids."""
    sessions, groups = set(), {task}
    names = [settings.topic(t) for t in ("sessions", "session-events", "trajectories")]
    for topic, p in _partitions(consumer, names, timeout):
        for m in read_partition(consumer, topic, p, timeout)[0]:
            v = _loads(m.value())
            if isinstance(v, dict) and v.get("task_id") == task:
                sessions.add(v.get("session_id", ""))
                groups.add(v.get("group_id", ""))
    return Target(frozenset(sessions - {""}), frozenset(groups - {""}), task)


def close_sessions(gateways: Iterable[str], admin_token: str, sessions: Iterable[str], timeout: float = 30.0) -> int:
    """Close ``sessions`` on every gateway (their keys record nothing more); returns how many were closed.

    Raises RuntimeError naming the gateway and session when one refuses or cannot be reached: a
    forget that leaves a session writable must not look done."""
    import httpx

    closed = 0
    headers = {"authorization": f"Bearer {admin_token}"}
    with httpx.Client(timeout=timeout, headers=headers) as client:
        for url in gateways:
            for sid in sorted(sessions):
                try:
                    r = client.delete(f"{url.rstrip('/')}/admin/sessions/{sid}")
                except httpx.HTTPError as e:
                    raise RuntimeError(f"gateway {url} unreachable while closing session {sid!r}: {e}") from None
                if r.status_code != 200:
                    raise RuntimeError(f"gateway {url} refused to close session {sid!r}: {r.status_code} {r.text[:200]}")
                closed += 1
    return closed


def forget(settings: Settings, target: Target, *, include_source: bool = False, dry_run: bool = False,
           timeout: float = 30.0) -> Report:
    """Delete the target's records (see the module docstring); returns what was dropped per topic."""
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient

    from streams.topology import app_id_for

    quiet = {"logger": logging.getLogger("librdkafka")}  # not raw stderr: a retry notice is not the command's output
    consumer = Consumer(settings.kafka_config(**{"group.id": f"polar-forget-{time.time_ns()}", "enable.auto.commit": False,
                                                 "enable.partition.eof": False, **quiet}))
    producer = Producer(settings.kafka_config(**{"acks": "all", "enable.idempotence": True, **quiet}))
    admin = AdminClient(settings.kafka_config(**quiet))
    report = Report()
    try:
        logical = DERIVED + (SOURCE if include_source else ())
        plain = [settings.topic(t) for t in logical]
        changelogs = [t for t in consumer.list_topics(timeout=timeout).topics
                      if t.startswith(app_id_for(settings) + "-") and t.endswith("-changelog")]
        for topic, p in _partitions(consumer, plain, timeout):
            msgs, high = read_partition(consumer, topic, p, timeout)
            drop = [m for m in msgs if matches(_loads(m.value()), target)]
            if not drop:
                continue
            report.rewritten.setdefault(topic, {})[p] = len(drop)
            if dry_run:
                continue
            dropped = {m.offset() for m in drop}
            for m in msgs:
                if m.offset() not in dropped:
                    producer.produce(topic, m.value(), m.key(), partition=p, timestamp=m.timestamp()[1],
                                     headers=m.headers())
                    report.kept += 1
            if producer.flush(timeout) != 0:
                raise RuntimeError(f"{topic}[{p}]: re-appending kept records timed out; nothing was deleted")
            tp = TopicPartition(topic, p, high)
            admin.delete_records([tp], request_timeout=timeout)[tp].result()
        for topic, p in _partitions(consumer, changelogs, timeout):
            latest: dict[bytes, bytes | None] = {}
            for m in read_partition(consumer, topic, p, timeout)[0]:
                latest[m.key()] = m.value()
            keys = [k for k, v in latest.items() if v is not None and k is not None
                    and (key_matches(str(_loads(k)), target) or matches(_loads(v), target))]
            if keys:
                report.tombstones[topic] = report.tombstones.get(topic, 0) + len(keys)
                for k in keys if not dry_run else []:
                    producer.produce(topic, None, k, partition=p)
        if not dry_run and producer.flush(timeout) != 0:
            raise RuntimeError("writing tombstones timed out")
    finally:
        consumer.close()
    return report


def register(app) -> None:
    """Add ``polarstream forget`` to the root command."""
    import typer

    @app.command("forget")
    def forget_command(
        session: list[str] = typer.Option([], "--session", help="session id to forget (repeatable)"),
        task: str = typer.Option("", "--task", help="task id: all its sessions and groups"),
        include_source: bool = typer.Option(False, "--include-source", help="also tasks, sessions, calls, session-events"),
        dry_run: bool = typer.Option(False, "--dry-run", help="report what would be deleted, delete nothing"),
        config: str = typer.Option("", "--config", help="settings YAML (else POLAR_* environment)"),
        gateway: list[str] = typer.Option([], "--gateway", help="gateway URL to close the sessions on first (repeatable)"),
    ) -> None:
        """Delete a session's or a task's records from the derived topics (docs/security.md)."""
        from confluent_kafka import Consumer

        from infra.reach import require_kafka

        if bool(session) == bool(task):
            typer.echo("error: give --session ID (one or more) or --task ID", err=True)
            raise typer.Exit(2)
        settings = Settings(config=config) if config else Settings()
        if settings.secure and not settings.kafka_username:  # the local secured stack: act as its admin
            from infra.security import admin_view

            settings = admin_view(settings)
        require_kafka(settings)
        if task:
            c = Consumer(settings.kafka_config(**{"group.id": f"polar-forget-{time.time_ns()}",
                                                  "logger": logging.getLogger("librdkafka")}))
            try:
                target = resolve_task(settings, task, c, 30.0)
            finally:
                c.close()
        else:
            target = Target(sessions=frozenset(session))
        closed = 0
        if gateway and not dry_run:
            try:
                closed = close_sessions(gateway, settings.admin_token, target.sessions)
            except RuntimeError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(1) from None
        report = forget(settings, target, include_source=include_source, dry_run=dry_run)
        out = {"dry_run": dry_run, **report.to_dict(), "closed_on_gateways": closed}
        typer.echo(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
