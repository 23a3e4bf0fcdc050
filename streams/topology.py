"""What the streams need to know about the broker before Faust starts, read once with the admin client.

Partition counts decide the changelog partitions of the tables (a table's changelog must match its
source topic); the topics' ``max.message.bytes`` bound what the streams may emit. The two tick topics
(one per stage, each co-partitioned with that stage's input) are created here, before the Faust app
subscribes, and so are the tables' changelog topics: Faust creates those itself at start, but its first
rebalance can run before the broker's metadata shows the last one created, and a table whose changelog
was missing from that assignment crashes its agent (PartitionsMismatch) on its first write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from infra.settings import Settings

TICK_RETENTION_MS = 3_600_000  # ticks are only useful while fresh
STATE_MAX_BYTES = 32 * 1024 * 1024  # a changelog message carries one call's tokens or one trajectory


class TopologyError(RuntimeError):
    """The broker's topics cannot carry the streams as configured; the message says what to fix."""


@dataclass(frozen=True)
class Topology:
    app_id: str
    calls: str
    session_events: str
    trajectories: str
    groups: str
    session_ticks: str
    group_ticks: str
    session_partitions: int  # calls = session-events (co-partitioned)
    group_partitions: int  # trajectories
    replication_factor: int
    trajectory_max_bytes: int
    group_max_bytes: int


def app_id_for(settings: Settings) -> str:
    """Faust's app id; its internal topics (changelogs, ticks) are named after it, so a prefix isolates runs."""
    return f"{settings.topic_prefix}polarstream-streams"


def discover(settings: Settings, timeout: float = 30.0, app_id: str | None = None) -> Topology:
    """Read partitions and size limits of the streams' topics, creating the tick topics if missing."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient(settings.kafka_config())
    names = {n: settings.topic(n) for n in ("calls", "session-events", "trajectories", "groups")}
    try:
        md = admin.list_topics(timeout=timeout).topics
    except KafkaException as e:
        raise TopologyError(f"kafka at {settings.kafka_bootstrap} did not answer: {e.args[0]}") from None
    missing = [t for t in names.values() if t not in md]
    if missing:
        raise TopologyError(f"topics {missing} do not exist; create them with `polarstream infra topics`")
    parts = {n: len(md[t].partitions) for n, t in names.items()}
    if parts["calls"] != parts["session-events"]:
        raise TopologyError(
            f"{names['calls']} has {parts['calls']} partitions but {names['session-events']} has "
            f"{parts['session-events']}: they must be co-partitioned (equal counts) so one worker sees a whole session"
        )
    rf = min(len(p.replicas) for p in md[names["calls"]].partitions.values())
    limits = {}
    for n in ("trajectories", "groups"):
        res = ConfigResource(ConfigResource.Type.TOPIC, names[n])
        conf = admin.describe_configs([res], request_timeout=timeout)[res].result()
        limits[n] = int(conf["max.message.bytes"].value)
    app_id = app_id or app_id_for(settings)
    return Topology(
        app_id=app_id, calls=names["calls"], session_events=names["session-events"],
        trajectories=names["trajectories"], groups=names["groups"],
        session_ticks=f"{app_id}-session-ticks", group_ticks=f"{app_id}-group-ticks",
        session_partitions=parts["calls"], group_partitions=parts["trajectories"], replication_factor=rf,
        trajectory_max_bytes=limits["trajectories"], group_max_bytes=limits["groups"],
    )


def changelog_topic(topo: Topology, table: str) -> str:
    """The name Faust gives a table's changelog topic."""
    return f"{topo.app_id}-{table}-changelog"


def ensure_internal_topics(settings: Settings, topo: Topology, changelogs: dict[str, int], timeout: float = 30.0) -> None:
    """Create the tick topics and the tables' changelogs (table name -> partitions) if missing, and wait
    until every partition has a leader; an existing one with the wrong partition count is an error."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(settings.kafka_config())
    ticks = {"retention.ms": str(TICK_RETENTION_MS), "cleanup.policy": "delete"}
    state = {"cleanup.policy": "compact", "max.message.bytes": str(STATE_MAX_BYTES)}
    want = {topo.session_ticks: (topo.session_partitions, ticks), topo.group_ticks: (topo.group_partitions, ticks)}
    want.update({changelog_topic(topo, t): (n, state) for t, n in changelogs.items()})
    md = admin.list_topics(timeout=timeout).topics
    for name, (n, _) in want.items():
        if name in md and len(md[name].partitions) != n:
            raise TopologyError(f"{name} has {len(md[name].partitions)} partitions, expected {n}; "
                                f"delete it (and the app's other internal topics) to recreate")
    new = [NewTopic(t, num_partitions=n, replication_factor=topo.replication_factor, config=conf)
           for t, (n, conf) in want.items() if t not in md]
    for name, fut in (admin.create_topics(new, operation_timeout=timeout).items() if new else []):
        try:
            fut.result()
        except KafkaException as e:
            if e.args[0].name() != "TOPIC_ALREADY_EXISTS":  # another worker created it first
                raise TopologyError(f"creating {name} failed: {e.args[0].str()}") from None
    deadline = time.monotonic() + timeout
    pending = set(want)
    while pending:
        md = admin.list_topics(timeout=timeout).topics
        pending = {t for t in pending if t not in md or md[t].error is not None
                   or any(p.leader < 0 for p in md[t].partitions.values())}
        if pending and time.monotonic() > deadline:
            raise TopologyError(f"topics {sorted(pending)} have no leader after {timeout:.0f}s")
        time.sleep(0.05 if pending else 0)
