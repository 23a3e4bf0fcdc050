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


def test_a_component_waits_for_what_comes_up_late_and_says_what_it_waits_for(dead_port, capsys):
    """A deployment starts its parts in any order: with ``wait_s`` the check waits (one line on stderr)
    and passes once the service listens; what never comes up fails after the wait, saying how long."""
    import socket
    import threading

    late = socket.socket()
    late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def come_up():
        time.sleep(1.5)
        late.bind(("127.0.0.1", dead_port))
        late.listen(8)

    threading.Thread(target=come_up, daemon=True).start()
    t0 = time.monotonic()
    try:
        require_kafka(Settings(kafka_bootstrap=f"127.0.0.1:{dead_port}"), wait_s=20)
        took = time.monotonic() - t0
    finally:
        late.close()
    assert 1.0 < took < 10, took
    err = capsys.readouterr().err.splitlines()
    assert err == [f"waiting up to 20s: cannot reach Kafka at 127.0.0.1:{dead_port} (connection refused); "
                   "is it running? `polarstream infra up` starts the local one"]
    t0 = time.monotonic()
    with pytest.raises(InfraError, match=rf"cannot reach the engine at http://127.0.0.1:{dead_port} .*\(waited 1s\)"):
        require_url(f"http://127.0.0.1:{dead_port}", "the engine", "start one", wait_s=1)
    assert 0.9 < time.monotonic() - t0 < 5


def test_the_trainer_waits_for_its_engine_then_gives_up_in_one_line(dead_port, tmp_path, tiny_model_dir):
    """The wiring, in a real component: ``polarstream train`` with its engine not there waits
    POLAR_WAIT_FOR_S, says so, and stops with one error line (before torch loads)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "POLAR_CONFIG"} | {"POLAR_WAIT_FOR_S": "2", "POLAR_DATA_DIR": str(tmp_path)}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "polarstream", "train", "--model", str(tiny_model_dir), "--engine",
                        f"polar=http://127.0.0.1:{dead_port}", "--run-dir", str(tmp_path / "run")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and 1.5 < time.monotonic() - t0 < 40, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith(f"waiting up to 2s: cannot reach the engine at http://127.0.0.1:{dead_port}"), lines
    assert lines[-1].startswith("error: cannot reach the engine") and lines[-1].endswith("(waited 2s)") and len(lines) == 2, lines
