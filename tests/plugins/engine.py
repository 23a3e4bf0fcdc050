"""Engine fixtures: the tiny model directory and real engine servers on free ports.

- ``tiny_model_dir`` (session): the seeded tiny Qwen3-style model (built once, cached under
  ``~/.cache/polarstream/models``), an HF directory with tokenizer and chat template.
- ``engine_server``: a real engine (uvicorn + the batching thread) serving the tiny model as ``tiny``
  on 127.0.0.1 at a free port, in a background thread of the test process; ``.url``, ``.model``.
- ``engine_server_factory(model_dir=None, script=None, settings=None, name="tiny", **EngineOptions)``:
  more of them, e.g. scripted (``script=path``) or with ``settings=polar_settings`` so weight updates
  can read ``s3://`` checkpoints from the test S3 server. All are stopped when the test ends.
- ``module_engine_server``: one in-process engine shared by a module's tests (weights and version are
  whatever the module's earlier tests left: assert on changes, not on absolute state).
- ``engine_process``: one ``polarstream engine`` *process* per module (to kill or stop), ``POLAR_WEIGHT_TRANSFER_
  TIMEOUT_S`` = ``ENGINE_PROCESS_DEADLINE_S``; ``engine_process.get()`` starts it again only once a test
  killed it. ``serve_on_port(port)``: an in-process engine at that port (a killed process's URL, cheaply).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.local import EngineServer, start_engine_server

__all__ = ["EngineServer", "start_engine_server"]


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model's HF directory (seed 0), built once and cached across test sessions."""
    from infra.models import ensure_model

    return ensure_model("tiny")


@pytest.fixture
def engine_server_factory(tiny_model_dir):
    started: list[EngineServer] = []

    def make(model_dir: str | Path | None = None, **kwargs) -> EngineServer:
        server = start_engine_server(model_dir or tiny_model_dir, **kwargs)
        started.append(server)
        return server

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def engine_server(engine_server_factory) -> EngineServer:
    """A fresh engine serving the tiny model as ``tiny`` (its own weights: updates do not leak)."""
    return engine_server_factory()


@pytest.fixture(scope="module")
def module_engine_server(tiny_model_dir):
    """One in-process engine for the whole module (an engine's start is most of a small test's time)."""
    server = start_engine_server(tiny_model_dir)
    yield server
    server.stop()


ENGINE_PROCESS_DEADLINE_S = 3.0  # the weight-transfer deadline of engine_process's engines


class EngineProcess:
    """``polarstream engine`` serving the tiny model as ``tiny`` in a process of its own: ``.url``,
    ``.port``, ``.proc`` (to SIGKILL or SIGSTOP)."""

    def __init__(self, model_dir: Path, port: int | None = None, env: dict[str, str] | None = None):
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "polarstream", "engine", "--model", str(model_dir), "--port", str(port),
             "--served-model-name", "tiny"], env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float = 180) -> EngineProcess:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine process did not start (exit {self.proc.poll()})")
            time.sleep(0.1)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)


class EngineProcesses:
    """engine_process: the module's engine process, started at the fixture's setup (it boots while the
    test sets up the rest) and again by ``get()`` only after a test killed it."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.env = {"POLAR_WEIGHT_TRANSFER_TIMEOUT_S": str(ENGINE_PROCESS_DEADLINE_S)}
        self.current: EngineProcess | None = EngineProcess(model_dir, env=self.env)
        self.servers: list[EngineServer] = []

    def get(self) -> EngineProcess:
        if self.current is None or not self.current.alive:
            if self.current is not None:
                self.current.stop()
            self.current = EngineProcess(self.model_dir, env=self.env)
        return self.current.wait_ready()

    def serve_on_port(self, port: int, **kwargs) -> EngineServer:
        """An in-process engine listening on ``port`` (e.g. where a killed engine process was)."""
        from engine.app import create_app, make_server
        from engine.models import load_model
        from engine.serving import Engine, EngineOptions

        lm = load_model(str(self.model_dir))
        engine = Engine(lm, str(self.model_dir), EngineOptions(served_model_names=["tiny"], **kwargs))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        server = make_server(create_app(engine), log_level="warning", lifespan="on")
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"engine-{port}", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"engine server on port {port} did not start")
            time.sleep(0.01)
        es = EngineServer(f"http://127.0.0.1:{port}", "tiny", engine, server, thread)
        self.servers.append(es)
        return es

    def close(self) -> None:
        for s in self.servers:
            s.stop()
        if self.current is not None:
            self.current.stop()


@pytest.fixture(scope="module")
def engine_process(tiny_model_dir):
    procs = EngineProcesses(tiny_model_dir)
    yield procs
    procs.close()
