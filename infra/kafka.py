"""A single-node Apache Kafka 4 broker in KRaft combined mode (broker + controller), on 127.0.0.1.

Runs ``java -cp <maven jars> kafka.Kafka server.properties`` from the jars ``infra/maven.py`` caches.
Storage is formatted on first start; the config file is rewritten on every start so port changes apply.
Everything lives under ``<data_dir>/kafka``: ``server.properties``, ``log4j2.properties``, ``server.log``,
``kafka.pid`` and the log directory ``data/``.
"""

from __future__ import annotations

import base64
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InfraError
from .maven import classpath, jar_dir
from .process import Service, cds_archive, require_free_ports, require_java, tail, tcp_open
from .settings import Settings
from .topics import largest_message_bytes

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

_LOG4J = """\
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, base64url without padding (what kafka-storage random-uuid prints)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        # One id in 64 starts with "-", which kafka-storage's argument parser takes for an option
        # ("--cluster-id: expected one argument"); Kafka's own Uuid.randomUuid() skips those too.
        if not cid.startswith("-"):
            return cid


def broker_properties(settings: Settings, log_dir: Path) -> dict[str, str]:
    """server.properties for a single combined-mode node listening on settings' ports."""
    port, cport = settings.kafka_port, settings.kafka_controller_port
    # The broker must accept the largest message any topic allows, plus batch framing overhead.
    max_bytes = largest_message_bytes() + 64 * 1024
    return {
        **_BROKER_DEFAULTS,
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.quorum.voters": f"1@127.0.0.1:{cport}",
        "log.dirs": str(log_dir),
        "message.max.bytes": str(max_bytes),
        "replica.fetch.max.bytes": str(max_bytes),
    }


def render_properties(props: dict[str, str]) -> str:
    """Java properties file text."""
    return "".join(f"{k}={v}\n" for k, v in props.items())


@dataclass
class KafkaBroker:
    """The project's broker for one ``Settings`` (its ports and data_dir)."""

    settings: Settings
    heap_mb: int = 512
    die_with_parent: bool = False  # tests set it so a killed test session leaves no broker behind
    quick_jit: bool = False  # C1 only: starts with half the CPU; fine for short-lived test brokers
    root: Path = field(init=False)

    def __post_init__(self) -> None:
        self.root = self.settings.data_dir / "kafka"
        self.service = Service(
            name=f"kafka broker on 127.0.0.1:{self.settings.kafka_port}",
            pid_file=self.root / "kafka.pid",
            log_file=self.root / "server.log",
            marker=str(self.config_file),
            archive=cds_archive(jar_dir("kafka", self.settings)),
        )

    @property
    def config_file(self) -> Path:
        """The broker's server.properties (also the marker that identifies its process)."""
        return self.root / "server.properties"

    @property
    def log_dir(self) -> Path:
        """Kafka's log.dirs: the topic data."""
        return self.root / "data"

    @property
    def bootstrap(self) -> str:
        """host:port for clients."""
        return f"127.0.0.1:{self.settings.kafka_port}"

    def pid(self) -> int | None:
        """Pid of the running broker, or None."""
        return self.service.pid()

    def start(self, timeout: float = 90.0) -> bool:
        """Start the broker unless it runs already and wait until it answers; True when it started one."""
        started = self.launch()
        self.wait_ready(timeout)
        return started

    def launch(self) -> bool:
        """Spawn the broker (formatting storage on first use) without waiting; False when it already runs."""
        if self.pid() is not None:
            running = self.service.info() or {}
            if running.get("port") != self.settings.kafka_port:
                raise InfraError(f"kafka from {self.root} already runs on port {running.get('port')}, not "
                                 f"{self.settings.kafka_port}: run `polarstream infra down` first or use another data_dir")
            return False
        java = require_java()
        require_free_ports("kafka", {"kafka_port": self.settings.kafka_port, "kafka_controller_port": self.settings.kafka_controller_port})
        cp = classpath("kafka", self.settings)
        self.root.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(render_properties(broker_properties(self.settings, self.log_dir)))
        log4j = self.root / "log4j2.properties"
        log4j.write_text(_LOG4J.format(log=self.service.log_file))
        jvm = [java, "-Xms128m", f"-Xmx{self.heap_mb}m", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
               *(["-XX:TieredStopAtLevel=1"] if self.quick_jit else []),
               f"-Dlog4j2.configurationFile={log4j}", f"-Dkafka.logs.dir={self.root}", "-cp", cp]
        if not (self.log_dir / "meta.properties").exists():
            self._format([*jvm[:1], *self.service.cds_flags(record=False), *jvm[1:]])
        self.service.spawn([*jvm[:1], *self.service.cds_flags(), *jvm[1:], "kafka.Kafka", str(self.config_file)],
                           extra={"port": self.settings.kafka_port, "controller_port": self.settings.kafka_controller_port},
                           die_with_parent=self.die_with_parent)
        return True

    def _format(self, jvm: list[str]) -> None:
        cmd = [*jvm, "kafka.tools.StorageTool", "format", "-t", cluster_id(), "-c", str(self.config_file)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            out = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-10:])
            raise InfraError(f"kafka: formatting {self.log_dir} failed (exit {proc.returncode}):\n{out}")

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Block until the broker serves metadata; InfraError with its log's tail if it dies or times out."""
        # A TCP probe first keeps librdkafka from logging a refused connection every 50 ms while the
        # JVM boots; the admin call then proves the broker serves metadata (it is registered and unfenced).
        self.service.wait_ready(lambda: tcp_open(self.settings.kafka_port) and self._answers(), timeout)

    def _answers(self) -> bool:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        try:
            return len(admin.list_topics(timeout=2).brokers) > 0
        except Exception:  # KafkaException while it is still starting
            return False

    def stop(self, timeout: float = 30.0, force: bool = False) -> bool:
        """Stop the broker; True when one was running.

        SIGTERM makes a controlled shutdown; ``force`` sends SIGKILL, as a crash would (tests use it to
        prove acknowledged records survive one).
        """
        return self.service.stop(timeout, force=force)

    def restart(self, timeout: float = 90.0, force: bool = False) -> None:
        """Stop (gracefully, or as a crash with ``force``) and start again on the same data."""
        self.stop(force=force)
        self.start(timeout)

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
            "log": str(self.service.log_file),
        }

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the broker's log."""
        return tail(self.service.log_file, lines)
