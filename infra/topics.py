"""Apply ``infra/topics.yaml`` to the broker: create what is missing, align configs, report drift.

``ensure_topics(settings)`` is idempotent. Topic configs that differ from the file are set back to it
(retention, message size and cleanup policy are safe to change live); partition count and replication
factor are only reported, because changing them by hand is a decision (it remaps keys).

Replication follows the cluster (``replication_factor: auto`` in topics.yaml): factor min(3, brokers),
and ``min.insync.replicas=2`` from 3 brokers on, so an acknowledged (acks=all) record is on two brokers.
One broker keeps factor 1 and the broker's default minimum of one in-sync replica.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from .discovery import read_brokers_state
from .errors import InfraError
from .settings import TOPICS, Settings

TOPICS_FILE = Path(__file__).with_name("topics.yaml")


@dataclass(frozen=True)
class TopicSpec:
    """One logical topic as declared in topics.yaml."""

    name: str  # logical name: "calls"
    partitions: int
    replication_factor: int | None  # None: "auto", from the number of brokers (for_brokers)
    config: dict[str, str]

    def for_brokers(self, brokers: int) -> "TopicSpec":
        """This spec on a cluster of ``brokers``: an auto factor resolved, min.insync.replicas set from 3 on."""
        rf = self.replication_factor or replication_for(brokers)[0]
        config = dict(self.config)
        if rf >= 3:  # acks=all then means two copies: one broker may die without losing an acknowledged record
            config.setdefault("min.insync.replicas", "2")
        return TopicSpec(self.name, self.partitions, rf, config)


def replication_for(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of an auto topic on ``brokers`` brokers."""
    rf = min(3, max(1, brokers))
    return rf, 2 if rf >= 3 else 1


def _factor(value, where: str) -> int | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise InfraError(f"{where} must be 'auto' or an integer of at least 1, got {value!r}")


@lru_cache(maxsize=8)
def load_specs(path: Path = TOPICS_FILE) -> dict[str, TopicSpec]:
    """Logical name -> TopicSpec, validated: every topic of the blueprint, no others, co-partitioning holds."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    topics = data.get("topics") or {}
    missing, unknown = set(TOPICS) - set(topics), set(topics) - set(TOPICS)
    if missing or unknown:
        raise InfraError(f"{path}: topics missing {sorted(missing)}, unknown {sorted(unknown)}")
    rf = _factor(data.get("replication_factor", "auto"), f"{path}: replication_factor")
    specs = {}
    for name, body in topics.items():
        partitions = body.get("partitions")
        if not isinstance(partitions, int) or partitions < 1:
            raise InfraError(f"{path}: topics.{name}.partitions must be an integer of at least 1, got {partitions!r}")
        config = {k: str(v) for k, v in (body.get("config") or {}).items()}
        own = _factor(body["replication_factor"], f"{path}: topics.{name}.replication_factor") \
            if "replication_factor" in body else rf
        specs[name] = TopicSpec(name, partitions, own, config)
    for group in data.get("co_partitioned") or []:
        counts = {n: specs[n].partitions for n in group}
        if len(set(counts.values())) != 1:
            raise InfraError(f"{path}: co-partitioned topics need equal partition counts, got {counts}")
    return specs


def largest_message_bytes(path: Path = TOPICS_FILE) -> int:
    """The largest max.message.bytes of any topic (the broker and the publisher must allow it)."""
    return max(int(s.config.get("max.message.bytes", 1048588)) for s in load_specs(path).values())


@dataclass
class TopicReport:
    """What ensure_topics did. ``drift`` lists differences it left alone on purpose."""

    created: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    altered: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # topic -> key -> [was, now]
    drift: dict[str, list[str]] = field(default_factory=dict)  # topic -> human-readable differences

    @property
    def ok(self) -> bool:
        """True when nothing drifted from topics.yaml."""
        return not self.drift

    def to_dict(self) -> dict:
        """JSON-ready form, for ``infra topics --json``."""
        return asdict(self)

    def lines(self) -> list[str]:
        """One human-readable line per topic action or difference."""
        out = [f"created {t}" for t in self.created]
        out += [f"altered {t}: {k} {v[0]} -> {v[1]}" for t, kv in self.altered.items() for k, v in kv.items()]
        out += [f"DRIFT {t}: {d}" for t, ds in self.drift.items() for d in ds]
        out += [f"ok {t}" for t in self.unchanged]
        return out


def _admin(settings: Settings):
    from confluent_kafka.admin import AdminClient

    return AdminClient(settings.kafka_config(logger=logging.getLogger("librdkafka")))


def ensure_topics(settings: Settings, specs: dict[str, TopicSpec] | None = None, timeout: float = 30.0,
                  brokers: int | None = None) -> TopicReport:
    """Create missing topics (with ``settings.topic_prefix``), align configs, report drift.

    ``brokers`` sizes the replication of ``auto`` topics; None: what a local replicated cluster under
    ``settings.data_dir`` remembers when the settings point at it, else the brokers the cluster reports."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import NewTopic

    specs = specs or load_specs()
    admin = _admin(settings)
    try:
        md = admin.list_topics(timeout=timeout)
    except KafkaException as e:
        raise InfraError(f"kafka at {settings.kafka_bootstrap} did not answer: {e.args[0]}") from None
    existing = md.topics
    brokers = brokers or _known_brokers(settings) or len(md.brokers)
    specs = {n: s.for_brokers(brokers) for n, s in specs.items()}
    report = TopicReport()
    full = {settings.topic(n): s for n, s in specs.items()}
    to_create = [NewTopic(t, num_partitions=s.partitions, replication_factor=s.replication_factor, config=s.config)
                 for t, s in full.items() if t not in existing]
    if to_create:
        for topic, fut in admin.create_topics(to_create, operation_timeout=timeout, request_timeout=timeout).items():
            try:
                fut.result()
                report.created.append(topic)
            except KafkaException as e:
                if e.args[0].name() != "TOPIC_ALREADY_EXISTS":  # a concurrent creator won the race
                    raise InfraError(f"creating topic {topic} failed: {e.args[0].str()}") from None
        _wait_for_leaders(admin, report.created, timeout)
    for topic, spec in full.items():
        if topic in existing:
            _reconcile(admin, topic, spec, existing[topic], report, timeout)
    return report


def _known_brokers(settings: Settings) -> int | None:
    """The size of the local replicated cluster these settings reach, if they reach one (a broker that
    is down for a moment must not make topics.yaml look like it asks for fewer replicas)."""
    state = read_brokers_state(settings.data_dir)
    if not state:
        return None
    ours = {f"127.0.0.1:{n['port']}" for n in state["nodes"]}
    given = {a.strip() for a in settings.kafka_bootstrap.split(",") if a.strip()}
    return int(state["brokers"]) if given and given <= ours else None


def _reconcile(admin, topic: str, spec: TopicSpec, meta, report: TopicReport, timeout: float) -> None:
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    drift = []
    if len(meta.partitions) != spec.partitions:
        drift.append(f"partitions {len(meta.partitions)}, topics.yaml says {spec.partitions} (change by hand: it remaps keys)")
    rf = min((len(p.replicas) for p in meta.partitions.values()), default=0)
    if rf != spec.replication_factor:
        drift.append(f"replication factor {rf}, topics.yaml says {spec.replication_factor}")
    if drift:
        report.drift[topic] = drift
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    current = admin.describe_configs([resource], request_timeout=timeout)[resource].result()
    changes = {k: [current[k].value if k in current else None, v] for k, v in spec.config.items()
               if k not in current or current[k].value != v}
    if not changes:
        if not drift:
            report.unchanged.append(topic)
        return
    entries = [ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, (_, v) in changes.items()]
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=entries)
    admin.incremental_alter_configs([resource], request_timeout=timeout)[resource].result()
    report.altered[topic] = {k: [str(was), now] for k, (was, now) in changes.items()}
    # The controller has committed the change; the broker applies it from the metadata log a moment
    # later. Wait for that, so "ensure_topics returned" means "the configs are in force".
    wanted = {k: now for k, (_, now) in changes.items()}
    probe = ConfigResource(ConfigResource.Type.TOPIC, topic)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = admin.describe_configs([probe], request_timeout=timeout)[probe].result()
        if all(k in current and current[k].value == v for k, v in wanted.items()):
            return
        time.sleep(0.05)


def _wait_for_leaders(admin, topics: list[str], timeout: float) -> None:
    # CreateTopics returns once the controller has the topic; producers that start right after want
    # every partition to have a leader in the broker's metadata, or their first sends wait on retries.
    deadline = time.monotonic() + timeout
    pending = set(topics)
    while pending and time.monotonic() < deadline:
        md = admin.list_topics(timeout=timeout).topics
        pending = {t for t in pending if t not in md or md[t].error is not None
                   or any(p.leader < 0 for p in md[t].partitions.values())}
        if pending:
            time.sleep(0.05)


def delete_topics(settings: Settings, timeout: float = 30.0) -> list[str]:
    """Delete this prefix's topics (tests and `infra topics --delete`); returns the names deleted."""
    admin = _admin(settings)
    existing = admin.list_topics(timeout=timeout).topics
    names = [settings.topic(n) for n in TOPICS if settings.topic(n) in existing]
    for fut in (admin.delete_topics(names, operation_timeout=timeout).values() if names else []):
        fut.result()
    return names
