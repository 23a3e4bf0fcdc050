"""MirrorMaker 2 between a regional cluster and the central one, as one detached process per pair.

``polarstream infra mirror --from eu --to center`` writes ``<data_dir>/mirror/eu-center.properties``
(a plain MM2 file: take it to real clusters by editing the two ``bootstrap.servers`` lines) and runs
``org.apache.kafka.connect.mirror.MirrorMaker`` on it. Choices, and why (docs/multi-dc.md):

- IdentityReplicationPolicy: topic names stay the same, so the central stream workers read one
  ``polar.calls`` that holds every region's calls and the local ones. Cycles are impossible because
  each topic flows one way only: calls and session events region -> center, tasks and policy
  versions center -> region. Heartbeats are off (with identity names their topics would loop).
- Partitions are preserved (MM2 copies partition p to partition p and every cluster gets the same
  topics.yaml), so calls and session events stay co-partitioned at the center.
- At-least-once: a mirror that dies re-sends what it had not committed; every reader dedupes by
  event_id, so a duplicate is never counted twice.
- Offset translation only where it is well defined: center -> region (one source per target topic)
  emits checkpoints and syncs consumer-group offsets, so a group reading polar.tasks can move from the
  center to a region and resume there. Region -> center is off: several regions merge into one central
  topic, so a region's offsets have no single central equivalent (replays are deduped instead).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .process import JavaServer, render_log4j, render_properties
from .security import mirror_client_properties
from .settings import Settings
from .topics import largest_message_bytes

UPSTREAM = ("calls", "session-events")  # region -> center
DOWNSTREAM = ("tasks", "policy")  # center -> region
MAIN_CLASS = "org.apache.kafka.connect.mirror.MirrorMaker"
STARTED = "Kafka MirrorMaker started"


def topics_regex(settings: Settings, logical: tuple[str, ...]) -> str:
    """MM2 topic filter (a regex) matching exactly these topics under settings' prefix."""
    return "|".join(re.escape(settings.topic(t)) for t in logical)


def mirror_properties(region: str, region_bootstrap: str, center: str, center_bootstrap: str,
                      settings: Settings, refresh_s: int = 10, flush_ms: int = 1000,
                      clients: dict[str, Settings] | None = None) -> dict[str, str]:
    """The MM2 properties for one region <-> center pair (both directions in one process).

    ``clients``: alias -> Settings carrying the credentials MM2 uses on that (secured) cluster; its
    links then run SASL_SSL (infra/security.py ``mirror_client_properties``)."""
    big = str(largest_message_bytes() + 64 * 1024)  # a mirrored call may be as large as the topic allows
    up, down = f"{region}->{center}", f"{center}->{region}"
    props = {
        "clusters": f"{region}, {center}",
        f"{region}.bootstrap.servers": region_bootstrap,
        f"{center}.bootstrap.servers": center_bootstrap,
        "replication.policy.class": "org.apache.kafka.connect.mirror.IdentityReplicationPolicy",
        f"{up}.enabled": "true",
        f"{up}.topics": topics_regex(settings, UPSTREAM),
        f"{up}.sync.group.offsets.enabled": "false",
        f"{up}.groups.exclude": ".*",  # no group's offsets are translated upstream (see above)
        f"{down}.enabled": "true",
        f"{down}.topics": topics_regex(settings, DOWNSTREAM),
        f"{down}.emit.checkpoints.enabled": "true",
        f"{down}.sync.group.offsets.enabled": "true",
        f"{down}.emit.checkpoints.interval.seconds": str(refresh_s),
        f"{down}.sync.group.offsets.interval.seconds": str(refresh_s),
        "groups.exclude": "console-consumer-.*, connect-.*, __.*, .*-mm2",
        "emit.heartbeats.enabled": "false",
        "heartbeats.replication.enabled": "false",
        # topics.yaml owns topic configs and there is no authorizer locally: MM2 must not fight either.
        "sync.topic.configs.enabled": "false",
        "sync.topic.acls.enabled": "false",
        "refresh.topics.interval.seconds": str(refresh_s),
        "refresh.groups.interval.seconds": str(refresh_s),
        "tasks.max": "1",
        # Replication factor 1 everywhere: single-node local clusters (raise to 3 on real ones).
        "replication.factor": "1",
        "checkpoints.topic.replication.factor": "1",
        "heartbeats.topic.replication.factor": "1",
        "offset-syncs.topic.replication.factor": "1",
        "config.storage.replication.factor": "1",
        "offset.storage.replication.factor": "1",
        "status.storage.replication.factor": "1",
        "offset.storage.partitions": "2",
        "status.storage.partitions": "1",
        # One node, no REST port to open; multi-node MM2 clusters need it (KIP-710).
        "dedicated.mode.enable.internal.rest": "false",
        # Find Connect plugins from their ServiceLoader manifests instead of scanning every jar's classes
        # (KIP-898): the scan took most of MM2's startup, once per herder.
        "plugin.discovery": "service_load",
    }
    for alias in (region, center):
        props[f"{alias}.plugin.discovery"] = "service_load"  # the per-herder worker configs
        # Commit mirrored positions every second: a restart re-sends less, and status reads them.
        props[f"{alias}.offset.flush.interval.ms"] = str(flush_ms)
        props[f"{alias}.producer.max.request.size"] = big
        props[f"{alias}.consumer.max.partition.fetch.bytes"] = big
    for alias, client in (clients or {}).items():  # secured clusters: TLS + SASL on every MM2 client
        props.update(mirror_client_properties(alias, client))
    return props


FILE_PROVIDER = "org.apache.kafka.common.config.provider.FileConfigProvider"
_SECRET_SUFFIXES = ("sasl.jaas.config", "password")  # .password covers ssl.key/keystore/truststore.password


def externalize_secrets(props: dict[str, str], secrets_file: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Move secret values out of MM2 properties: ``(props with ${file:...} references, the secrets)``.

    Kafka's FileConfigProvider resolves ``${file:<path>:<key>}`` when MM2 loads the file (workers and
    connectors alike), so the properties file users read, print and carry holds no literal secret;
    the secrets file beside it (mode 0600) does. Without secrets nothing changes.
    """
    secrets = {k: v for k, v in props.items() if k.endswith(_SECRET_SUFFIXES) and not v.startswith("${")}
    if not secrets:
        return props, {}
    out = {k: (f"${{file:{secrets_file}:{k}}}" if k in secrets else v) for k, v in props.items()}
    out.update({"config.providers": "file", "config.providers.file.class": FILE_PROVIDER})
    return out, secrets


# Connect logs every client's whole config at INFO; WARN keeps the log readable, but MirrorMaker's own
# lifecycle lines stay (readiness is read from "Kafka MirrorMaker started").
_MIRROR_LOGGERS = {"org.apache.kafka.connect.mirror.MirrorMaker": "INFO"}


@dataclass
class MirrorMaker(JavaServer):
    """One MM2 process for the pair ``region`` <-> ``center``; ``settings`` is the base (its data_dir)."""

    region: str = ""
    center: str = ""
    props: dict[str, str] | None = None  # the properties to run (None: start an already written file)
    secrets: dict[str, str] | None = None  # values the props reference through ${file:...} (externalize_secrets)

    kind: ClassVar[str] = "mirror"
    profile: ClassVar[str] = "mirror"

    def __post_init__(self) -> None:
        self.config_name = f"{self.name}.properties"
        self.log_name = f"{self.name}.log"
        self.pid_name = f"{self.name}.pid"
        super().__post_init__()

    @property
    def name(self) -> str:
        """'<region>-<center>': the file names and the flow's label."""
        return f"{self.region}-{self.center}"

    def label(self) -> str:
        return f"mirrormaker {self.region}<->{self.center}"

    @property
    def secrets_file(self) -> Path:
        """Where the secured links' passwords live, referenced from the properties file (0600)."""
        return self.root / f"{self.name}.secrets.properties"

    def prepare(self) -> list[str]:
        if self.secrets:
            # Created 0600 before anything is written into it: a password is never readable by others.
            fd = os.open(self.secrets_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("# secrets of " + self.config_file.name + " (FileConfigProvider)\n" + render_properties(self.secrets))
        if self.props is not None:
            self.config_file.write_text(f"# MirrorMaker 2: {self.region} <-> {self.center} (docs/multi-dc.md)\n"
                                        + render_properties(self.props))
            self.config_file.chmod(0o600)  # literal SASL passwords may be in it when not externalized
        (self.root / f"{self.name}.log4j2.properties").write_text(render_log4j(self.log_file, "WARN", _MIRROR_LOGGERS))
        return [MAIN_CLASS, str(self.config_file)]

    def jvm_properties(self) -> list[str]:
        # Restrict the config providers a config may name (CVE-2024-31141) to the one the secured file
        # uses; MM2 4.3 allows every provider without it (tested), so this only narrows.
        return [f"-Dlog4j2.configurationFile={self.root / f'{self.name}.log4j2.properties'}",
                f"-Dorg.apache.kafka.automatic.config.providers={FILE_PROVIDER}"]

    def launch(self) -> bool:
        # Where this run's log starts, so readiness is judged on this run's lines only.
        self._log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        return super().launch()

    def run_info(self) -> dict:
        return {"log_start": getattr(self, "_log_start", 0)}

    def answers(self) -> bool:
        start = (self.service.info() or {}).get("log_start", 0)
        try:
            with open(self.log_file, "rb") as f:
                f.seek(start)
                return STARTED.encode() in f.read()
        except OSError:
            return False

    def status(self) -> dict:
        """Running or not, pid, config and log file."""
        pid = self.pid()
        return {"name": self.name, "running": pid is not None, "pid": pid,
                "config": str(self.config_file), "log": str(self.log_file)}


def mirrors_dir(base: Settings) -> Path:
    """Where the MM2 properties, logs and pid files live."""
    return base.data_dir / "mirror"


def known_mirrors(base: Settings) -> list[MirrorMaker]:
    """A handle on every pair that has a properties file (running or not)."""
    out = []
    for path in sorted(mirrors_dir(base).glob("*.properties")):
        if path.name.endswith((".log4j2.properties", ".secrets.properties")):
            continue
        names = [c.strip() for c in parse_properties(path.read_text()).get("clusters", "").split(",")]
        if len(names) == 2 and path.stem == f"{names[0]}-{names[1]}":  # ours: <region>-<center>.properties
            out.append(MirrorMaker(base, region=names[0], center=names[1]))
    return out


def parse_properties(text: str) -> dict[str, str]:
    """A Java properties file's key=value lines (comments and blanks skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "!")) and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


# ------------------------------------------------------------------------------- lag and throughput


@dataclass(frozen=True)
class Flow:
    """One direction of a mirror: which topics go from ``source`` to ``target``."""

    source: str
    target: str
    source_bootstrap: str
    target_bootstrap: str
    topics: str  # MM2's topic filter regex
    offsets_topic: str  # where MM2 keeps its mirrored positions, on the target


def flows_of(props: dict[str, str]) -> list[Flow]:
    """The enabled flows an MM2 properties file describes."""
    out = []
    for key, value in props.items():
        m = re.fullmatch(r"([^.]+)->([^.]+)\.enabled", key)
        if m and value.lower() == "true":
            src, tgt = m.groups()
            out.append(Flow(src, tgt, props[f"{src}.bootstrap.servers"], props[f"{tgt}.bootstrap.servers"],
                            props.get(f"{src}->{tgt}.topics", ".*"),
                            props.get(f"{tgt}.offset.storage.topic", f"mm2-offsets.{src}.internal")))
    return out


def end_offsets(client: dict, regex: str, timeout: float = 10.0) -> dict[tuple[str, int], int]:
    """High watermark of every partition of the topics matching ``regex`` (fullmatch)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({**client, "group.id": "polar-mirror-status", "enable.auto.commit": False})
    try:
        md = c.list_topics(timeout=timeout).topics
        tps = [TopicPartition(t, p) for t, meta in md.items() if re.fullmatch(regex, t) for p in meta.partitions]
        return {(tp.topic, tp.partition): c.get_watermark_offsets(tp, timeout=timeout)[1] for tp in tps}
    finally:
        c.close()


def mirrored_positions(client: dict, offsets_topic: str, source: str, timeout: float = 10.0) -> dict[tuple[str, int], int]:
    """Next source offset MM2 will copy, per (topic, partition), from its committed Connect offsets.

    Connect stores them on the target as key ``["MirrorSourceConnector", {"cluster", "partition",
    "topic"}]`` and value ``{"offset": last copied}``; a compacted topic, so the last record per key wins.
    """
    import time

    import orjson
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer({**client, "group.id": "polar-mirror-status", "enable.auto.commit": False})
    out: dict[tuple[str, int], int] = {}
    try:
        meta = c.list_topics(offsets_topic, timeout=timeout).topics.get(offsets_topic)
        if meta is None or meta.error is not None:
            return out
        ends = {p: c.get_watermark_offsets(TopicPartition(offsets_topic, p), timeout=timeout)[1] for p in meta.partitions}
        pending = {p for p, end in ends.items() if end > 0}
        c.assign([TopicPartition(offsets_topic, p, OFFSET_BEGINNING) for p in pending])
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None or m.error():
                continue
            if m.offset() + 1 >= ends[m.partition()]:
                pending.discard(m.partition())
            try:
                connector, part = orjson.loads(m.key())
                value = orjson.loads(m.value()) if m.value() else None
            except (orjson.JSONDecodeError, TypeError, ValueError):
                continue
            if connector != "MirrorSourceConnector" or part.get("cluster") != source:
                continue
            key = (part["topic"], int(part["partition"]))
            if value is None:
                out.pop(key, None)
            else:
                out[key] = int(value["offset"]) + 1
        return out
    finally:
        c.close()


def reachable(bootstrap: str, timeout: float = 1.0) -> bool:
    """True when any broker of a ``host:port[,host:port]`` list accepts TCP connections."""
    import socket

    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                return True
        except (OSError, ValueError):
            continue
    return False


def flow_metrics(flow: Flow, client_extra: dict | None = None, window_s: float = 2.0,
                 clients: dict[str, dict] | None = None) -> dict:
    """Lag and events/s of one flow (see ``flows_metrics``)."""
    return flows_metrics([flow], client_extra, window_s, clients)[0]


def flows_metrics(flows: list[Flow], client_extra: dict | None = None, window_s: float = 2.0,
                  clients: dict[str, dict] | None = None) -> list[dict]:
    """Per flow: lag (events not yet mirrored, per topic and total) and events/s over ``window_s``.

    Computed from offsets only: source end offsets against the positions MM2 committed (every
    flush interval, so the lag is an upper bound by at most one interval of traffic). All flows share
    one measuring window. A flow whose cluster is down gets an ``error`` instead of numbers.
    ``clients``: cluster alias -> librdkafka security settings for that cluster (secured clusters
    each have their own CA and users); other aliases use ``client_extra``.
    """
    import time

    def extra_of(alias: str) -> dict:
        return (clients or {}).get(alias, client_extra or {})
    out: list[dict] = [{"source": f.source, "target": f.target} for f in flows]
    live: dict[int, dict] = {}
    for i, f in enumerate(flows):
        down = [(n, b) for n, b in ((f.source, f.source_bootstrap), (f.target, f.target_bootstrap)) if not reachable(b)]
        if down:  # fail fast: the Kafka clients would wait out their timeouts
            out[i]["error"] = f"cluster {down[0][0]} ({down[0][1]}) is not reachable"
        else:
            live[i] = {"tgt": {**extra_of(f.target), "bootstrap.servers": f.target_bootstrap}}

    def positions(key: str) -> None:
        for i, st in list(live.items()):
            try:
                st[key] = mirrored_positions(st["tgt"], flows[i].offsets_topic, flows[i].source)
            except Exception as e:  # it went down meanwhile: say so instead of failing the whole status
                out[i]["error"] = str(e)
                del live[i]

    positions("before")
    t0 = time.monotonic()
    time.sleep(max(0.0, window_s))
    positions("after")
    elapsed = max(time.monotonic() - t0, 1e-6)
    for i, st in live.items():
        try:
            ends = end_offsets({**extra_of(flows[i].source), "bootstrap.servers": flows[i].source_bootstrap}, flows[i].topics)
        except Exception as e:
            out[i]["error"] = str(e)
            continue
        topics: dict[str, dict] = {}
        for (topic, part), end in sorted(ends.items()):
            t = topics.setdefault(topic, {"source_end": 0, "mirrored": 0, "lag": 0})
            pos = min(st["after"].get((topic, part), 0), end)
            t["source_end"] += end
            t["mirrored"] += pos
            t["lag"] += end - pos
        moved = sum(st["after"].values()) - sum(v for k, v in st["before"].items() if k in st["after"])
        out[i].update(topics=topics, lag=sum(t["lag"] for t in topics.values()), events_per_s=round(moved / elapsed, 1))
    return out
