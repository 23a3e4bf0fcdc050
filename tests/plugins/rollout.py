"""Fixtures for rollout and node tests: gateway nodes as child processes, an in-process rollout server.

- ``node_factory(engine_url, model_dir, **flags)`` -> ``NodeProcess``: ``polarstream node`` in its own
  process (so a test can SIGKILL it), with the test's Kafka settings; ``.kill()``, ``.stop()``, ``.log_text()``.
- ``rollout_server``: the rollout API on a free port in a background thread of the test process; ``.url``.
- ``cluster`` (module scope): everything at once, started once for a test module: its own topic prefix,
  a scripted engine (``CLUSTER_SCRIPT``), the rollout server, two bwrap nodes and a streams worker.
- ``harness_cache``: the npm cache with the six CLIs, or a clean skip naming how to install them.
- ``write_script(path, turns)``: a scripted-engine file.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.streams.helpers import PolarProcess


REPO = Path(__file__).resolve().parents[2]


def settings_env(settings) -> dict[str, str]:
    """Environment that gives a child process the test's Settings."""
    return {**os.environ, "POLAR_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "POLAR_TOPIC_PREFIX": settings.topic_prefix,
            "POLAR_DATA_DIR": str(settings.data_dir), "POLAR_SESSION_SECRET": settings.session_secret,
            "POLAR_CACHE_DIR": str(settings.cache_dir), "PYTHONPATH": str(REPO)}


class NodeProcess(PolarProcess):
    """``polarstream node`` as a child process (start/stop/kill/log_text come from PolarProcess)."""

    def __init__(self, node_id: str, args: list[str], env: dict[str, str], log_path: Path):
        self.node_id, self.args = node_id, list(args)
        super().__init__(["node", "--node-id", node_id, *self.args], env, log_path, stop_timeout_s=60)

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f"node {self.node_id} ready" in self.log_text():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"node {self.node_id} exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"node {self.node_id} not ready after {timeout}s:\n{self.log_text()[-3000:]}")


def start_node(settings, base: Path, engine_url: str, model_dir: Path, node_id: str, runtime: str = "bwrap", **flags) -> NodeProcess:
    """``polarstream node`` as a child process (logs and work dir under ``base``)."""
    args = ["--engine-url", engine_url, "--model", str(model_dir), "--runtime", runtime,
            "--work-dir", str(base / node_id), "--session-timeout-ms", "6000"]
    for k, v in flags.items():
        flag = "--" + k.replace("_", "-")
        args += [flag] if v is True else [flag, str(v)]
    return NodeProcess(node_id, args, settings_env(settings), base / f"{node_id}.log").start()


@pytest.fixture
def node_factory(polar_settings, tmp_path):
    """``node_factory(engine_url, model_dir, node_id=..., runtime=..., **flags)`` starts a node process."""
    nodes: list[NodeProcess] = []

    def make(engine_url: str, model_dir: Path, *, node_id: str | None = None, runtime: str = "bwrap", **flags) -> NodeProcess:
        n = start_node(polar_settings, tmp_path, engine_url, model_dir, node_id or f"n{len(nodes) + 1}", runtime, **flags)
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        n.stop()


@dataclass
class RolloutServer:
    url: str
    app: object
    _server: object
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def start_rollout_server(settings) -> RolloutServer:
    """The rollout API (real Kafka) on a free port in a background thread."""
    import uvicorn

    from producers.rollout.server import create_rollout_app

    app = create_rollout_app(settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "rollout server did not start"
        time.sleep(0.02)
    return RolloutServer(f"http://127.0.0.1:{sock.getsockname()[1]}", app, server, thread)


@pytest.fixture
def rollout_server(polar_settings):
    srv = start_rollout_server(polar_settings)
    yield srv
    srv.stop()


# One engine script for every cluster test; the first turn whose `match` is found in the last
# non-assistant message wins (Claude Code puts a system message after the user's, hence its alternative).
SHELL = "echo 7 > answer.txt"
CLUSTER_SCRIPT = {
    "turns": [
        # failover test (builtin harness): a slow tool call keeps sessions mid-run while a node is killed
        {"match": "Slowly write 7", "tool_calls": [{"name": "run_shell", "arguments": {"command": "sleep 6; " + SHELL}}]},
        # any real CLI: the shell tool under each CLI's own name; each runs the one it has, errors the rest
        {"match": "Write the number 7|Available agent types",
         "tool_calls": [{"name": n, "arguments": {"command": SHELL, "description": "write the answer"}}
                        for n in ("Bash", "run_shell_command", "bash")] + [{"name": "exec_command", "arguments": {"cmd": SHELL}}]},
    ],
    "fallback": {"text": "Done."},  # tool results, side requests (titles, memory extraction)
}


@dataclass
class Cluster:
    settings: object
    engine: object
    rollout: RolloutServer
    nodes: dict[str, NodeProcess]
    worker: object
    base: Path


@pytest.fixture(scope="module")
def cluster(infra, tiny_model_dir, tmp_path_factory):
    """A whole rollout cluster for one test module (started once: node start-up dominates these tests)."""
    import uuid

    from infra.topics import ensure_topics
    from tests.plugins.engine import start_engine_server
    from tests.plugins.infra import drop_topics
    from tests.streams.helpers import WorkerProcess

    base = tmp_path_factory.mktemp("cluster")
    tag = uuid.uuid4().hex[:10]
    settings = infra.settings.model_copy(update={"topic_prefix": f"c{tag}.", "data_dir": base / "polar"})
    settings.data_dir.mkdir(parents=True)
    ensure_topics(settings)
    script = base / "script.yaml"
    script.write_text(yaml.safe_dump(CLUSTER_SCRIPT))
    engine = start_engine_server(tiny_model_dir, script=script)
    rollout = start_rollout_server(settings)
    nodes = {n: start_node(settings, base, engine.url, tiny_model_dir, n, run_workers=2, ready_target=1) for n in ("n1", "n2")}
    worker = WorkerProcess(settings, base / "worker.log", ["--missing-calls-grace", "5"]).start()
    try:
        for n in nodes.values():
            n.wait_ready()
        yield Cluster(settings, engine, rollout, nodes, worker, base)
    finally:
        for n in nodes.values():
            n.stop()
        worker.stop()
        rollout.stop()
        engine.stop()
        drop_topics(settings)


@pytest.fixture(scope="session")
def harness_cache() -> Path:
    """The cache dir holding the npm harness CLIs; skips (with the fix) when they are not installed."""
    from gateway.harnesses.install import NPM_HARNESSES, installed_version
    from infra.settings import CACHE_DIR

    missing = [n for n, h in NPM_HARNESSES.items() if installed_version(n, CACHE_DIR) != h.version]
    if missing:
        pytest.skip(f"harness CLIs not installed in {CACHE_DIR}/npm ({', '.join(missing)}): run `make harnesses` "
                    "or `polarstream harness install`")
    return CACHE_DIR


def write_script(path: Path, turns: list[dict], fallback: dict | None = None) -> Path:
    """A scripted-engine file (see docs/engine.md)."""
    data: dict = {"turns": turns}
    if fallback:
        data["fallback"] = fallback
    path.write_text(yaml.safe_dump(data))
    return path
