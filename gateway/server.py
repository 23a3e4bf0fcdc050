"""Run an ASGI app (the gateway) with uvicorn in a background thread, for in-process callers.

Tests, benches and a gateway node embed the gateway this way: the socket is bound before the thread
starts (port 0 = a free port, no race), and ``stop()`` shuts it down cleanly, running the lifespan's
exit (engine client and Kafka publisher closed).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class ThreadedServer:
    """``with ThreadedServer(app) as s: s.url`` -- uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 startup_timeout_s: float = 60.0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5))
        self.startup_timeout_s = startup_timeout_s
        self.thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # surfaced by start()
            self.error = e

    def start(self) -> "ThreadedServer":
        """Start serving; returns once the app's lifespan startup finished (raises if it failed)."""
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server on port {self.port} did not start: {self.error or 'startup failed (see log)'}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Shut down gracefully (lifespan exit runs) and wait for the thread."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> "ThreadedServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
