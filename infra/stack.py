"""The whole local stack (Kafka broker, S3 server, topics) as one thing to bring up, down, or ask about."""

from __future__ import annotations

from dataclasses import dataclass, field

from .kafka import KafkaBroker
from .maven import fetch
from .s3 import S3Server
from .settings import Settings
from .topics import TopicReport, ensure_topics


@dataclass
class Stack:
    """Kafka and S3 for one ``Settings``.

    ``ephemeral`` (tests, benchmarks) ties the servers' lifetime to this process and trades peak JIT
    performance for a faster start.
    """

    settings: Settings
    ephemeral: bool = False
    kafka: KafkaBroker = field(init=False)
    s3: S3Server = field(init=False)

    def __post_init__(self) -> None:
        self.kafka = KafkaBroker(self.settings, die_with_parent=self.ephemeral, quick_jit=self.ephemeral)
        self.s3 = S3Server(self.settings, die_with_parent=self.ephemeral, quick_jit=self.ephemeral)

    def up(self, timeout: float = 90.0) -> TopicReport:
        """Start whatever is not running (both JVMs boot side by side), then apply topics.yaml."""
        # Jars first, one Maven run after the other: two Maven processes sharing one local repository
        # can corrupt each other's downloads.
        fetch("kafka", self.settings)
        fetch("s3proxy", self.settings)
        try:
            self.kafka.launch()
            self.s3.launch()
            self.kafka.wait_ready(timeout)
            self.s3.wait_ready(timeout)
        except BaseException:
            if self.ephemeral:  # a test session must not leave half a stack behind
                self.down()
            raise
        return ensure_topics(self.settings)

    def down(self) -> dict[str, bool]:
        """Stop both servers; says which ones were running."""
        return {"kafka": self.kafka.stop(), "storage": self.s3.stop()}

    def status(self) -> dict:
        """Both servers' status plus the topic prefix and data directory."""
        return {"kafka": self.kafka.status(), "storage": self.s3.status(), "topic_prefix": self.settings.topic_prefix,
                "data_dir": str(self.settings.data_dir)}
