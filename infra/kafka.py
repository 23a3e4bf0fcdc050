# lifecycle: infra.process.Service
# (the shared server base is infra.process.JavaServer, built on that Service handle)
"""A single-node Apache Kafka 4 broker in KRaft combined mode (broker + controller), on 127.0.0.1.

Runs ``java -cp <maven jars> kafka.Kafka server.properties`` from the jars ``infra/maven.py`` caches.
Storage is formatted on first start; the config file is rewritten on every start so port changes apply.
Everything lives under ``<data_dir>/kafka``: ``server.properties``, ``log4j2.properties``, ``server.log``,
``kafka.pid`` and the log directory ``data/``.

The same class runs one node of a replicated local cluster (``member``, infra/kafka_cluster.py): then its
files live under ``<data_dir>/kafka/broker-<node id>`` and it joins a static quorum of every node.
"""

from __future__ import annotations

import base64
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from . import security
from .errors import InfraError
from .process import JavaServer, render_log4j, render_properties, tcp_open
from .settings import Settings
from .topics import largest_message_bytes, replication_for

# Tuned for one node on a small machine: every internal topic has replication 1, consumer groups
# start without the 3 s rebalance delay, and the compaction buffer (128 MB by default, allocated up
# front) shrinks so a 512 MB heap is plenty. A short broker session matters after a crash: the
# restarted broker cannot register until its previous incarnation's session expires (9 s by default). Topic creation stays open to the admin API (Faust creates
# its changelog topics that way) while auto-creation on produce is off, so a typo fails loudly.
_BROKER_DEFAULTS = {
    "process.roles": "broker,controller",
    "node.id": "1",
    "controller.listener.names": "CONTROLLER",
    "inter.broker.listener.name": "PLAINTEXT",
    "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    "num.network.threads": "2",
    "num.io.threads": "4",
    "num.partitions": "1",
    "default.replication.factor": "1",
    "min.insync.replicas": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "8",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "4",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    "broker.heartbeat.interval.ms": "500",
    "broker.session.timeout.ms": "3000",
    "auto.create.topics.enable": "false",
    "auto.leader.rebalance.enable": "false",
    "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
}


def cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, base64url without padding (what kafka-storage random-uuid prints)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        # One id in 64 starts with "-", which kafka-storage's argument parser takes for an option
        # ("--cluster-id: expected one argument"); Kafka's own Uuid.randomUuid() skips those too.
        if not cid.startswith("-"):
            return cid


def replication_defaults(brokers: int) -> dict[str, str]:
    """Replication of a cluster of ``brokers`` nodes: factor min(3, brokers) everywhere (internal topics
    too, so consumer offsets and transactions outlive a broker), and two in-sync replicas from 3 on, so
    an ``acks=all`` write is on two brokers before it is acknowledged."""
    rf, isr = map(str, replication_for(brokers))
    return {"default.replication.factor": rf, "min.insync.replicas": isr,
            "offsets.topic.replication.factor": rf,
            "transaction.state.log.replication.factor": rf, "transaction.state.log.min.isr": isr,
            "share.coordinator.state.topic.replication.factor": rf, "share.coordinator.state.topic.min.isr": isr}


@dataclass(frozen=True)
class ClusterMember:
    """This node's place in a replicated local cluster (infra/kafka_cluster.py)."""

    node_id: int
    brokers: int
    voters: str  # controller.quorum.voters: "1@127.0.0.1:9093,2@127.0.0.1:9095,..."
    cluster_id: str  # one id, formatted into every node's storage


def broker_properties(settings: Settings, log_dir: Path, member: ClusterMember | None = None,
                      advertise: str = "") -> dict[str, str]:
    """server.properties for a combined-mode node listening on settings' ports (alone, or as ``member``):
    on loopback, or (``advertise``: the name other hosts reach it by) on every interface, announcing that name."""
    port, cport = settings.kafka_port, settings.kafka_controller_port
    # The broker must accept the largest message any topic allows, plus batch framing overhead.
    max_bytes = largest_message_bytes() + 64 * 1024
    bind = "0.0.0.0" if advertise else "127.0.0.1"
    props = {
        **_BROKER_DEFAULTS,
        "listeners": f"PLAINTEXT://{bind}:{port},CONTROLLER://{bind}:{cport}",
        "advertised.listeners": f"PLAINTEXT://{advertise or '127.0.0.1'}:{port}",
        "controller.quorum.voters": f"1@127.0.0.1:{cport}",
        "log.dirs": str(log_dir),
        "message.max.bytes": str(max_bytes),
        "replica.fetch.max.bytes": str(max_bytes),
    }
    if member is not None:
        props.update(replication_defaults(member.brokers))
        props.update({"node.id": str(member.node_id), "controller.quorum.voters": member.voters})
    return props


@dataclass
class KafkaBroker(JavaServer):
    """The project's broker for one ``Settings`` (its ports and data_dir)."""

    heap_mb: int = 512
    member: ClusterMember | None = None  # None: the single broker
    advertise: str = ""  # '' : loopback only; else the host name the other hosts reach this node by

    kind: ClassVar[str] = "kafka"
    profile: ClassVar[str] = "kafka"
    config_name: ClassVar[str] = "server.properties"
    log_name: ClassVar[str] = "server.log"
    pid_name: ClassVar[str] = "kafka.pid"
    xms_mb: ClassVar[int | None] = 128

    def label(self) -> str:
        node = f" (node {self.member.node_id} of {self.member.brokers})" if self.member else ""
        return f"kafka broker on 127.0.0.1:{self.settings.kafka_port}{node}"

    def root_dir(self) -> Path:
        base = self.settings.data_dir / self.kind
        return base / f"broker-{self.member.node_id}" if self.member else base

    @property
    def log_dir(self) -> Path:
        """Kafka's log.dirs: the topic data."""
        return self.root / "data"

    @property
    def bootstrap(self) -> str:
        """host:port for clients."""
        return f"127.0.0.1:{self.settings.kafka_port}"

    def ports(self) -> dict[str, int]:
        return {"kafka_port": self.settings.kafka_port, "kafka_controller_port": self.settings.kafka_controller_port}

    def identity(self) -> dict:
        return {"port": self.settings.kafka_port}

    def prepare(self) -> list[str]:
        # Rewritten on every start so port changes apply.
        props = broker_properties(self.settings, self.log_dir, self.member, self.advertise)
        if self.settings.secure:  # SASL_SSL + mutual-TLS controller + ACLs (infra/security.py)
            props.update(security.broker_overrides(self.settings))
        self.config_file.write_text(render_properties(props))
        self.config_file.chmod(0o600)  # a secured broker's file holds its inter-broker SCRAM password
        (self.root / "log4j2.properties").write_text(render_log4j(self.log_file, "INFO", {"state.change.logger": "WARN"}))
        return ["kafka.Kafka", str(self.config_file)]

    def jvm_properties(self) -> list[str]:
        return [f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}", f"-Dkafka.logs.dir={self.root}"]

    def before_spawn(self, jvm: list[str]) -> None:
        # Storage is formatted on first start only (a formatted log dir has meta.properties).
        if (self.log_dir / "meta.properties").exists():
            return
        cmd = [jvm[0], *self.service.cds_flags(record=False), *jvm[1:],
               "kafka.tools.StorageTool", "format", "-t", self.member.cluster_id if self.member else cluster_id(),
               "-c", str(self.config_file),
               *(security.format_args(self.settings) if self.settings.secure else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            # Format echoes the SCRAM records it writes: keep them out of the error text.
            lines = [ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if "scram" not in ln.lower()]
            out = "\n".join(lines[-10:])
            raise InfraError(f"kafka: formatting {self.log_dir} failed (exit {proc.returncode}):\n{out}")

    def answers(self) -> bool:
        # A TCP probe first keeps librdkafka from logging a refused connection every 50 ms while the
        # JVM boots; the admin call then proves the broker serves metadata (it is registered and unfenced).
        if not tcp_open(self.settings.kafka_port):
            return False
        from confluent_kafka.admin import AdminClient

        # A secured broker only answers an authenticated client: ask as its admin.
        who = security.admin_view(self.settings) if self.settings.secure and not self.settings.kafka_username else self.settings
        admin = AdminClient(who.kafka_config(**{"bootstrap.servers": self.bootstrap, "log_level": 0}))
        try:
            return len(admin.list_topics(timeout=2).brokers) > 0
        except Exception:  # KafkaException while it is still starting
            return False

    def status(self) -> dict:
        """Up/down, pid, ports, data directory and log file, for ``infra status``."""
        pid = self.pid()
        return {
            "up": pid is not None and tcp_open(self.settings.kafka_port),
            "pid": pid,
            "bootstrap": self.bootstrap,
            "port": self.settings.kafka_port,
            "controller_port": self.settings.kafka_controller_port,
            "data_dir": str(self.log_dir),
            "log": str(self.log_file),
        }
