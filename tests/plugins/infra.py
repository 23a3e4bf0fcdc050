"""Real infrastructure for integration tests: one Kafka 4 broker and one s3proxy per test session.

- ``infra`` (session): both servers on free ports under a temp dir; ``.bootstrap``, ``.s3_endpoint``,
  ``.kafka`` (``stop()/start()/restart()``), ``.s3``, ``.settings`` (base Settings, empty prefix).
- ``polar_settings`` (function): Settings for one test: a unique ``topic_prefix`` whose topics exist
  (from infra/topics.yaml), a unique ``storage_url`` under ``s3://polarstream/``, ``data_dir`` in tmp_path.
  The prefix's topics are deleted after the test.

Tests that use ``infra`` (directly or through ``polar_settings``) are marked ``integration``.
The servers are started with PR_SET_PDEATHSIG, so even a killed test session leaves no JVM behind.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from infra.errors import InfraError
from infra.kafka import KafkaBroker
from infra.process import free_port
from infra.s3 import S3Server
from infra.settings import Settings
from infra.stack import Stack
from infra.topics import delete_topics, ensure_topics


@dataclass
class Infra:
    """Handle on the session's running servers."""

    stack: Stack

    @property
    def settings(self) -> Settings:
        return self.stack.settings

    @property
    def bootstrap(self) -> str:
        return self.stack.kafka.bootstrap

    @property
    def s3_endpoint(self) -> str:
        return self.stack.s3.endpoint

    @property
    def kafka(self) -> KafkaBroker:
        return self.stack.kafka

    @property
    def s3(self) -> S3Server:
        return self.stack.s3


def start_test_stack(base_dir, attempts: int = 3, secure: bool = False) -> Stack:
    """A stack on fresh free ports under ``base_dir``; retries when a port was taken in between.

    ``secure``: SASL_SSL/SCRAM Kafka with ACLs plus the read-only S3 server (tests/plugins/security.py)."""
    for attempt in range(attempts):
        kafka_port = free_port()
        extra = {"secure": True, "s3_read_port": free_port()} if secure else {}
        settings = Settings(
            data_dir=base_dir / f"run{attempt}", kafka_port=kafka_port, kafka_controller_port=free_port(),
            kafka_bootstrap=f"127.0.0.1:{kafka_port}", s3_port=free_port(), s3_endpoint="", topic_prefix="",
            storage_url="s3://polarstream/tests", **extra,
        )
        stack = Stack(settings, ephemeral=True)
        try:
            stack.up()
            return stack
        except InfraError as e:
            if "already in use" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@contextmanager
def running_stack(base_dir, secure: bool = False) -> Iterator[Stack]:
    """``start_test_stack``, stopped when the block ends (a session fixture's whole life)."""
    stack = start_test_stack(base_dir, secure=secure)
    try:
        yield stack
    finally:
        stack.down()


@pytest.fixture(scope="session")
def infra(tmp_path_factory) -> Infra:
    """A running Kafka broker and S3 server for the whole test session, stopped at its end."""
    with running_stack(tmp_path_factory.mktemp("infra")) as stack:
        yield Infra(stack)


@pytest.fixture
def polar_settings(infra: Infra, tmp_path) -> Settings:
    """Settings for one test: its own topic prefix (topics created), storage prefix and data dir."""
    if infra.kafka.pid() is None:  # an earlier test stopped the broker and failed before restarting it
        infra.kafka.start()
    tag = uuid.uuid4().hex[:10]
    settings = infra.settings.model_copy(update={
        "topic_prefix": f"t{tag}.",
        "storage_url": f"s3://{infra.settings.s3_bucket}/tests/{tag}",
        "data_dir": tmp_path / "polar",
    })
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    ensure_topics(settings)
    yield settings
    # Keeps a long session's broker small; a broker a test left stopped has nothing to delete from.
    if infra.kafka.pid() is not None:
        drop_topics(settings)


def drop_topics(settings: Settings) -> None:
    """Delete a test's topics, never failing: cleanup must not turn a passing test into an error."""
    try:
        delete_topics(settings, timeout=10)
    except Exception:  # cleanup only
        pass


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "infra" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
