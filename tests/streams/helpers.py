"""Helpers for tests and benches of the streams: publish records, read a topic, run a worker.

They talk to a real broker (no fakes): ``publish`` uses the project's durable Publisher, ``read_topic``
reads a topic from offset 0 with a throwaway consumer, and ``PolarProcess`` runs a ``polarstream``
command as a child process that can be stopped or SIGKILLed (``WorkerProcess``: a streams worker).
Benches import them too (bench/streams.py, bench/chaos.py), as they import other test code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from schemas import Record

REPO = Path(__file__).resolve().parents[2]


def publish(settings, records: list[Record]) -> None:
    """Publish records with the project's durable Publisher (zstd, idempotent, acks=all), in order."""
    from producers.publisher import Publisher

    with Publisher(settings) as pub:
        futures = [pub.submit(r) for r in records]
        for f in futures:
            f.result(60)


def publish_raw(settings, topic: str, key: bytes, value: bytes) -> None:
    """Publish bytes that are not a valid record (what a buggy or foreign producer might send)."""
    from confluent_kafka import Producer

    p = Producer(settings.kafka_config(**{"acks": "all"}))
    p.produce(settings.topic(topic), key=key, value=value)
    assert p.flush(30) == 0


@dataclass
class Message:
    key: bytes
    value: bytes
    partition: int
    offset: int
    timestamp_ms: int


def topic_consumer(settings, name: str):
    """A confluent consumer of every partition of topic ``name`` from its beginning, in a group of its
    own that commits nothing."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(settings.kafka_config(**{"group.id": f"read-{os.getpid()}-{time.monotonic_ns()}",
                                          "enable.auto.commit": False, "auto.offset.reset": "earliest"}))
    try:
        partitions = c.list_topics(name, timeout=10).topics[name].partitions
        c.assign([TopicPartition(name, p, 0) for p in partitions])  # offset 0: the beginning, always
    except BaseException:
        c.close()
        raise
    return c


def read_topic(settings, topic: str, until=lambda msgs: False, timeout: float = 60.0, idle: float = 0.0,
               full_name: bool = False) -> list[Message]:
    """Every message of a topic (a logical name such as ``calls``, or with ``full_name`` the topic's
    own, e.g. a table's changelog) from the beginning, polling until ``until(msgs)`` holds (then
    ``idle`` more seconds, to catch late duplicates) or ``timeout`` passes."""
    c = topic_consumer(settings, topic if full_name else settings.topic(topic))
    try:
        msgs: list[Message] = []
        deadline, done_at = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and not m.error():
                msgs.append(Message(m.key(), m.value(), m.partition(), m.offset(), m.timestamp()[1]))
            if done_at is None and until(msgs):
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at >= idle:
                break
        return msgs
    finally:
        c.close()


def dedupe(msgs: list[Message], cls):
    """Records by event_id, first copy wins (what every consumer does), plus the raw duplicate count."""
    from schemas import decode

    seen: dict[str, bytes] = {}
    for m in msgs:
        rec = decode(m.value, cls)
        if rec.event_id in seen:
            assert seen[rec.event_id] == m.value, f"{rec.event_id}: a re-emission with different bytes"
        else:
            seen[rec.event_id] = m.value
    return seen, len(msgs) - len(seen)


class PolarProcess:
    """A ``polarstream <command ...>`` child process that logs to a file and can be stopped (SIGTERM,
    then SIGKILL after ``stop_timeout_s``) or SIGKILLed. The one child-process helper of the tests
    and benches: ``WorkerProcess`` below and the rollout tests' ``NodeProcess`` build on it."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, stop_timeout_s: float = 30.0):
        self.command, self.env, self.log_path = list(command), env, Path(log_path)
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self):
        """Start (or restart) the process; its output is appended to the log after a header line."""
        cmd = [sys.executable, "-c", "from polarstream.cli import main; main()", *self.command]
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {self.starts}: {' '.join(self.command)}\n".encode())
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final commit, no flush."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class WorkerProcess(PolarProcess):
    """``polarstream streams worker`` as a child process with the test's settings (and the rest of
    this process's environment, e.g. credentials)."""

    def __init__(self, settings, log_path: Path, args: list[str] | None = None):
        self.settings, self.args = settings, list(args or [])
        env = {**os.environ, "POLAR_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
               "POLAR_TOPIC_PREFIX": settings.topic_prefix, "POLAR_DATA_DIR": str(settings.data_dir),
               "POLAR_RECORD_FORMAT": settings.record_format, "PYTHONPATH": str(REPO)}
        super().__init__(["streams", "worker", *self.args], env, log_path)

    def stats(self) -> dict:
        import orjson

        from streams.topology import app_id_for

        path = self.settings.data_dir / "streams" / f"{app_id_for(self.settings)}.stats.json"
        return orjson.loads(path.read_bytes())["counters"] if path.exists() else {}
