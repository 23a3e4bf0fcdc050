"""``polarstream gateway --processes N``: N gateway processes behind the session router (gateway/router.py).

Each worker is a whole gateway (``create_app(settings, config)`` under uvicorn) in its own process,
listening on a unix socket in a private run directory; the parent runs only the router on the public
host:port. The workers are started with the spawn method (the parent may already hold a Kafka client's
threads, which a fork would copy in a broken state) and with PR_SET_PDEATHSIG, so they die with the
parent even when it is killed. A worker that fails to start stops the whole command with one line; a
worker that dies while serving stops it too (its sessions' state is gone with it, so a supervisor
should restart the gateway rather than let the other workers carry on with holes).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from infra.errors import InfraError

# The router is a worker's only client and holds its connections open; uvicorn's 5 s default would
# close them between bursts and cost a reconnect (and a retry) on the next call.
WORKER_KEEP_ALIVE_S = 3600
STARTUP_TIMEOUT_S = 120.0


def run_worker(settings: Any, config: Any, socket_path: str, log_level: str, parent_pid: int) -> None:
    """A worker process: the gateway app on ``socket_path`` until SIGTERM (or its parent's death)."""
    from infra.process import _pdeathsig

    _pdeathsig()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        return
    import uvicorn

    from infra.heap import freeze_startup_heap

    from .app import create_app

    app = create_app(settings, config)
    freeze_startup_heap()  # see infra/heap.py
    uvicorn.run(app, uds=socket_path, log_level=log_level, timeout_keep_alive=WORKER_KEEP_ALIVE_S)


class WorkerProcesses:
    """Start, watch and stop the worker processes; ``sockets`` are their unix socket paths."""

    def __init__(self, settings: Any, config: Any, count: int, log_level: str = "warning"):
        self.run_dir = Path(tempfile.mkdtemp(prefix="polar-gateway-"))
        self.sockets = [str(self.run_dir / f"worker-{i}.sock") for i in range(count)]
        ctx = multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=run_worker, args=(settings, config, path, log_level, os.getpid()),
                                  name=f"polar-gateway-worker-{i}", daemon=True) for i, path in enumerate(self.sockets)]

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start every worker and wait until each answers ``/health``; InfraError (one line) if one does not."""
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for i, (proc, path) in enumerate(zip(self.procs, self.sockets)):
            while not _answers(path):
                if proc.exitcode is not None:
                    self.stop()
                    raise InfraError(f"gateway worker {i} did not start (exit status {proc.exitcode}; its log is above)")
                if time.monotonic() > deadline:
                    self.stop()
                    raise InfraError(f"gateway worker {i} did not answer on {path} within {timeout_s:.0f} s")
                time.sleep(0.05)

    def dead(self) -> str | None:
        """A line naming the first worker that exited, or None while all run."""
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                return f"gateway worker {i} (pid {p.pid}) exited with status {p.exitcode}; stopping the gateway"
        return None

    async def watch(self, stop: asyncio.Event, interval_s: float = 0.5) -> str | None:
        """Return when ``stop`` is set (None) or a worker died (its line)."""
        while not stop.is_set():
            if line := self.dead():
                return line
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
        return None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every worker (uvicorn shuts down gracefully: Kafka flushed), SIGKILL the late ones."""
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.exitcode is None:
                    p.kill()
                    p.join(5)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _answers(socket_path: str) -> bool:
    import httpx

    if not os.path.exists(socket_path):
        return False
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), timeout=2) as client:
            return client.get("http://worker/health").status_code == 200
    except httpx.HTTPError:
        return False


def serve_processes(settings: Any, config: Any, host: str, port: int, count: int, log_level: str = "warning") -> None:
    """Run ``count`` workers and the router on ``host:port`` until SIGINT/SIGTERM or a worker's death."""
    from .router import SessionRouter, event_loop_runner, serve_until

    workers = WorkerProcesses(settings, config, count, log_level)
    workers.start()
    died: list[str] = []
    try:
        router = SessionRouter(workers.sockets, secret=settings.session_secret, open_mode=config.open_mode,
                               max_body_bytes=config.max_body_bytes, body_timeout_s=config.limits.body_timeout_s)

        async def until_stopped() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            if line := await workers.watch(stop):
                died.append(line)

        with event_loop_runner() as runner:
            runner.run(serve_until(router, host, port, until_stopped))
    finally:
        workers.stop()
    if died:
        raise InfraError(died[0])
