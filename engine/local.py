"""Run an engine server inside the current process: uvicorn in a background thread on a free port.

Used by the test fixtures (tests/plugins/engine.py), the benchmark and anything else that wants a
real engine without a subprocess: ``server = start_engine_server(model_dir)``, ``server.url``,
``server.stop()``.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class EngineServer:
    url: str  # http://127.0.0.1:PORT (no trailing slash; the OpenAI base URL is url + "/v1")
    model: str  # the served model name
    engine: Any  # engine.serving.Engine, for white-box checks
    _server: Any
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def start_engine_server(model_dir: str | Path, *, script: str | Path | None = None, settings=None,
                        name: str = "tiny", dtype: str = "float32", **options) -> EngineServer:
    """Serve ``model_dir`` on a free port in a background thread; returns once it accepts requests.

    ``options`` are ``engine.serving.EngineOptions`` fields (max_model_len, logprobs_mode, threads...).
    """
    import asyncio

    from engine.app import create_app, make_server
    from engine.models import load_model
    from engine.script import Script
    from engine.serving import Engine, EngineOptions
    from infra.settings import Settings

    lm = load_model(str(model_dir), dtype=dtype)
    engine = Engine(lm, str(model_dir), EngineOptions(served_model_names=[name], **options),
                    Script.load(script, lm.tokenizer) if script else None)
    if engine.options.lora_modules:
        asyncio.run(engine.load_static_adapters(settings or Settings()))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the OS picks the port and we hold it: no race with other tests
    port = sock.getsockname()[1]
    server = make_server(create_app(engine, settings), log_level="warning", lifespan="on")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"engine-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("engine server did not start")
        time.sleep(0.01)
    return EngineServer(f"http://127.0.0.1:{port}", name, engine, server, thread)
