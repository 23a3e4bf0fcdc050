"""The whole local stack (Kafka broker, S3 server, topics) as one thing to bring up, down, or ask about.

Kafka is one broker by default, or a replicated local cluster (``brokers=3``, infra/kafka_cluster.py),
which the data directory then remembers."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InfraError
from .kafka import KafkaBroker
from .kafka_cluster import KafkaCluster, resolve_brokers
from .maven import fetch
from .s3 import S3ReadServer, S3Server
from .settings import Settings
from .topics import TopicReport, ensure_topics


@dataclass
class Stack:
    """Kafka and S3 for one ``Settings``.

    ``ephemeral`` (tests, benchmarks) ties the servers' lifetime to this process and trades peak JIT
    performance for a faster start. ``brokers`` (None: what the data directory remembers, else 1) runs
    that many Kafka nodes (infra/kafka_cluster.py); ``heap_mb`` is each node's heap there (None: the
    default; the single broker keeps its own).
    """

    settings: Settings
    ephemeral: bool = False
    brokers: int | None = None
    heap_mb: int | None = None
    kafka: KafkaBroker | KafkaCluster = field(init=False)
    s3: S3Server = field(init=False)
    s3_read: S3ReadServer | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.settings.secure:  # docs/security.md: the stack itself acts as Kafka admin and S3 writer
            from .security import admin_view, s3_settings

            self.settings = admin_view(self.settings)
            reader = s3_settings(self.settings, "reader").model_copy(update={"s3_port": self.settings.s3_read_port})
            self.s3_read = S3ReadServer(reader, die_with_parent=self.ephemeral, quick_jit=self.ephemeral)
        self.brokers = resolve_brokers(self.settings, self.brokers)
        if self.brokers > 1:
            heap = {"heap_mb": self.heap_mb} if self.heap_mb else {}
            self.kafka = KafkaCluster(self.settings, self.brokers, die_with_parent=self.ephemeral,
                                      quick_jit=self.ephemeral, **heap)
            # The stack's own clients (topics, status) reach every node, whatever bootstrap it was given.
            self.settings = self.settings.model_copy(update={"kafka_bootstrap": self.kafka.bootstrap})
        else:
            self.kafka = KafkaBroker(self.settings, die_with_parent=self.ephemeral, quick_jit=self.ephemeral)
        self.s3 = S3Server(self.settings, die_with_parent=self.ephemeral, quick_jit=self.ephemeral)

    def up(self, timeout: float = 90.0) -> TopicReport:
        """Start whatever is not running (both JVMs boot side by side), then apply topics.yaml."""
        # Jars first, one Maven run after the other: two Maven processes sharing one local repository
        # can corrupt each other's downloads.
        if not self.settings.secure and (self.settings.data_dir / "security" / "credentials.yaml").exists():
            # Starting it plaintext would serve its data without authentication or ACLs.
            raise InfraError(f"{self.settings.data_dir} holds a secured stack: start it with --secure (or POLAR_SECURE=1)")
        fetch("kafka", self.settings)
        fetch("s3proxy", self.settings)
        try:
            self.kafka.launch()
            self.s3.launch()
            if self.s3_read is not None:
                self.s3_read.launch()
            self.kafka.wait_ready(timeout)
            self.s3.wait_ready(timeout)
            if self.s3_read is not None:
                self.s3_read.wait_ready(timeout)
        except BaseException:
            if self.ephemeral:  # a test session must not leave half a stack behind
                self.down()
            raise
        report = ensure_topics(self.settings, brokers=self.brokers)
        if self.settings.secure:
            from .acls import apply_acls

            apply_acls(self.settings)
        return report

    def down(self) -> dict[str, bool]:
        """Stop both servers; says which ones were running."""
        out = {"kafka": self.kafka.stop(), "storage": self.s3.stop()}
        # A read-only S3 server that `up --secure` started goes too, even when `down` forgot --secure.
        read = self.s3_read or S3ReadServer(self.settings.model_copy(update={"s3_port": self.settings.s3_read_port}))
        if self.s3_read is not None or read.pid() is not None:
            out["storage-read"] = read.stop()
        return out

    def status(self) -> dict:
        """Both servers' status plus the topic prefix and data directory."""
        out = {"kafka": self.kafka.status(), "storage": self.s3.status(), "topic_prefix": self.settings.topic_prefix,
               "data_dir": str(self.settings.data_dir), "secure": self.settings.secure}
        if self.s3_read is not None:
            out["storage_read"] = self.s3_read.status()
        return out
