"""infra/reach.py: a service that is not there fails in one line, at once, naming what was tried."""

from __future__ import annotations

import time

import pytest

from infra.errors import InfraError
from infra.reach import require_free_port, require_kafka, require_storage, require_url
from infra.settings import Settings


def test_kafka_needs_one_bootstrap_server_that_answers(dead_port, silent_port):
    t0 = time.monotonic()
    with pytest.raises(InfraError, match=rf"cannot reach Kafka at 127.0.0.1:{dead_port} \(connection refused\).*infra up"):
        require_kafka(Settings(kafka_bootstrap=f"127.0.0.1:{dead_port}"))
    assert time.monotonic() - t0 < 2
    require_kafka(Settings(kafka_bootstrap=f"127.0.0.1:{dead_port},PLAINTEXT://127.0.0.1:{silent_port}"))
    with pytest.raises(InfraError, match="expected host:port"):
        require_kafka(Settings(kafka_bootstrap="localhost"))


def test_urls_storage_and_ports(dead_port, silent_port):
    require_url(f"http://127.0.0.1:{silent_port}/v1", "the engine", "start one")
    with pytest.raises(InfraError, match=rf"cannot reach the engine at http://127.0.0.1:{dead_port} .*; start one"):
        require_url(f"http://127.0.0.1:{dead_port}", "the engine", "start one")
    with pytest.raises(InfraError, match="expected http://host:port"):
        require_url("127.0.0.1", "the engine", "start one")
    settings = Settings(s3_endpoint=f"http://127.0.0.1:{dead_port}")
    require_storage(settings, "file:///tmp/x")  # nothing to reach
    with pytest.raises(InfraError, match=rf"cannot reach S3 at http://127.0.0.1:{dead_port}"):
        require_storage(settings, "s3://polarstream/x")
    with pytest.raises(InfraError, match=rf"port {silent_port} on 127.0.0.1 is already in use"):
        require_free_port(silent_port)
    require_free_port(dead_port)
    require_free_port(0)  # 0: the server picks a free one
