"""`polarstream infra up | status | down --cluster NAME` as a user runs them, on remembered ports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from infra.clusters import cluster_settings
from infra.discovery import read_cluster_state
from infra.process import pid_alive
from infra.settings import Settings

pytestmark = pytest.mark.integration


def _cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "POLAR_DATA_DIR": str(tmp_path), "POLAR_TOPIC_PREFIX": "cl."}
    cmd = [sys.executable, "-c", "from polarstream.cli import main; main()", "infra", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def test_cluster_up_takes_fresh_ports_when_remembered_ones_are_taken_then_down_leaves_nothing(tmp_path):
    base = Settings(data_dir=tmp_path)
    stale = cluster_settings(base, "ap", create=True)  # remembered by an `up` that never got to start
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", stale.kafka_port))
        busy.listen()
        try:
            up = _cli(tmp_path, "up", "--cluster", "ap")
            assert up.returncode == 0, up.stderr
        finally:
            st = json.loads(_cli(tmp_path, "status", "--cluster", "ap", "--json").stdout)
            down = _cli(tmp_path, "down", "--cluster", "ap")
    port = read_cluster_state(base.data_dir, "ap")["kafka_port"]
    assert port != stale.kafka_port and st["kafka"]["port"] == port and st["kafka"]["up"]
    assert "topic   created cl.polar.calls" in up.stdout and f"127.0.0.1:{port}" in up.stdout
    assert down.returncode == 0 and "kafka   stopped" in down.stdout
    assert not pid_alive(st["kafka"]["pid"], str(tmp_path / "clusters" / "ap" / "kafka" / "server.properties"))
    assert "was not running" in _cli(tmp_path, "down", "--cluster", "ap").stdout
