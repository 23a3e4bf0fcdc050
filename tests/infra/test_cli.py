"""`polarstream infra up | status --json | topics | down` on non-default ports leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.process import free_port, pid_alive

pytestmark = pytest.mark.integration


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from polarstream.cli import main; main()", "infra", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def test_up_status_down(tmp_path: Path):
    env = {**os.environ, "POLAR_DATA_DIR": str(tmp_path / "polar"), "POLAR_KAFKA_PORT": str(free_port()),
           "POLAR_KAFKA_CONTROLLER_PORT": str(free_port()), "POLAR_S3_PORT": str(free_port()),
           "POLAR_TOPIC_PREFIX": "cli."}
    env.pop("POLAR_KAFKA_BOOTSTRAP", None)  # follows POLAR_KAFKA_PORT
    try:
        up = _cli(env, "up")
        assert up.returncode == 0, up.stderr
        assert "topic   created cli.polar.calls" in up.stdout

        st = json.loads(_cli(env, "status", "--json").stdout)
        assert st["kafka"]["up"] and st["storage"]["up"]
        assert st["kafka"]["port"] == int(env["POLAR_KAFKA_PORT"])
        assert st["storage"]["endpoint"] == f"http://127.0.0.1:{env['POLAR_S3_PORT']}"
        assert st["topic_prefix"] == "cli."
        pids = {st["kafka"]["pid"], st["storage"]["pid"]}

        again = _cli(env, "up")  # harmless: same processes, topics unchanged
        assert again.returncode == 0, again.stderr
        assert "topic   ok cli.polar.calls" in again.stdout
        st2 = json.loads(_cli(env, "status", "--json").stdout)
        assert {st2["kafka"]["pid"], st2["storage"]["pid"]} == pids

        topics = _cli(env, "topics", "--json")
        assert topics.returncode == 0 and json.loads(topics.stdout)["drift"] == {}
    finally:
        down = _cli(env, "down")
    assert down.returncode == 0 and "kafka   stopped" in down.stdout and "storage stopped" in down.stdout
    markers = {"kafka": str(tmp_path / "polar" / "kafka" / "server.properties"),
               "storage": str(tmp_path / "polar" / "s3" / "s3proxy.properties")}
    assert not any(pid_alive(st[k]["pid"], markers[k]) for k in ("kafka", "storage"))
    st = json.loads(_cli(env, "status", "--json").stdout)
    assert not st["kafka"]["up"] and not st["storage"]["up"]
    assert "was not running" in _cli(env, "down").stdout


def test_port_in_use_fails_with_one_line(tmp_path: Path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = {**os.environ, "POLAR_DATA_DIR": str(tmp_path), "POLAR_KAFKA_PORT": str(busy.getsockname()[1]),
               "POLAR_KAFKA_CONTROLLER_PORT": str(free_port()), "POLAR_S3_PORT": str(free_port())}
        env.pop("POLAR_KAFKA_BOOTSTRAP", None)
        res = _cli(env, "up")
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"error: kafka: port {env['POLAR_KAFKA_PORT']} (kafka_port) is already in use; stop what holds it or choose another port"]
