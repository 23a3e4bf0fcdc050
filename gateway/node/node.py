"""A gateway node: the gateway in-process, its unix-socket door for sandboxes, the pipeline and intake.

    Node(settings, node_config, gateway_config).serve()     # until SIGTERM/SIGINT, then drain

The gateway runs under uvicorn in this event loop on ``gateway_host:gateway_port`` (0 = a free port);
``serve_unix_to_tcp`` exposes it on ``<socket dir>/gateway.sock`` for sandboxes without a network.
After a harness exits, the node asks the gateway's session store how many calls it recorded for the
session (``num_calls`` on the finished event), once the session's last call has been recorded.
The gateway's ``GET /metrics`` also serves the node's stage gauges (gateway/node/metrics.py).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import socket
import tempfile
from pathlib import Path

from gateway.config import GatewayConfig
from gateway.redact import scrub_session_event
from gateway.runtimes import make_runtime
from gateway.runtimes.tunnel import serve_unix_to_tcp
from infra.heap import freeze_startup_heap
from infra.settings import Settings

from . import metrics
from .config import NodeConfig
from .intake import SessionIntake, TaskWatcher
from .pipeline import Pipeline

log = logging.getLogger("polarstream.node")


def socket_dir(work_dir: Path) -> Path:
    """Where the node's gateway socket lives: in its work dir, or /tmp when that path is too long.

    Unix socket paths are limited to ~107 bytes; the work dir is preferred so the socket lives and dies
    with the node's own files.
    """
    preferred = work_dir / ".gateway"
    if len(str(preferred / "gateway.sock")) < 100:
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred
    return Path(tempfile.mkdtemp(prefix="polar-gw-"))


class Node:
    def __init__(self, settings: Settings, cfg: NodeConfig, gateway_config: GatewayConfig, *, session_timeout_ms: int = 10_000):
        self.settings, self.cfg, self.gateway_config = settings, cfg, gateway_config
        self.session_timeout_ms = session_timeout_ms
        self.gateway_port = 0
        self.app = None
        self.pipeline: Pipeline | None = None
        self.intake: SessionIntake | None = None
        self._tasks: list[asyncio.Task] = []
        self._sock_dir = socket_dir(cfg.work_dir)

    async def start(self) -> None:
        """Start the gateway, the socket relay, the pipeline and the Kafka intake."""
        import uvicorn

        from gateway.app import create_app
        from gateway.exposure import check_exposure
        from producers.publisher import Publisher

        check_exposure(self.cfg.gateway_host, admin_token=self.settings.admin_token,
                       session_secret=self.settings.session_secret, open_mode=self.gateway_config.open_mode)
        self.cfg.work_dir.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.gateway_host, self.cfg.gateway_port))
        self.gateway_port = sock.getsockname()[1]
        self.app = create_app(self.settings, self.gateway_config)
        self._server = uvicorn.Server(uvicorn.Config(self.app, lifespan="on", log_level="warning", access_log=False))
        self._tasks.append(asyncio.ensure_future(self._server.serve(sockets=[sock])))
        while not self._server.started:
            if self._tasks[0].done():
                self._tasks[0].result()  # raises the gateway's start-up error
                raise RuntimeError("gateway stopped during start-up")
            await asyncio.sleep(0.05)
        sock_path = self._sock_dir / "gateway.sock"
        self._relay = await serve_unix_to_tcp(str(sock_path), "127.0.0.1", self.gateway_port)
        runtime = make_runtime(self.cfg.runtime, sock_path, self.cfg.image, owner=str(self.cfg.work_dir.resolve()),
                               site_settings=self.cfg.site_settings, prepared=self.cfg.capacity,
                               max_starting=self.cfg.container_starts, starts_per_s=self.cfg.container_start_rate)
        await self._clean_predecessor(runtime)
        self.publisher = Publisher(self.settings, client_id=f"polar-node-{self.cfg.node_id}")
        self.pipeline = Pipeline(self.cfg, runtime, self.gateway_port, self._publish_event, self.settle_calls)
        metrics.watch(self.pipeline)  # served on the gateway's /metrics: one process, one registry
        self.intake = SessionIntake(self.settings, self.cfg, self.pipeline, session_timeout_ms=self.session_timeout_ms)
        self.pipeline.on_done = self.intake.on_done
        self.watcher = TaskWatcher(self.settings, self.cfg.node_id, self.intake, self.pipeline)
        self._tasks += [asyncio.ensure_future(self.intake.run()), asyncio.ensure_future(self.watcher.run())]
        log.info("node %s: gateway on %s:%d, runtime %s, %d run slots + READY %d", self.cfg.node_id,
                 self.cfg.gateway_host, self.gateway_port, self.cfg.runtime, self.cfg.run_workers, self.cfg.ready_target)

    async def _clean_predecessor(self, runtime) -> None:
        """Remove what a node that died with this work dir left: its containers and session directories
        (their sessions are re-run from Kafka, once, by whichever node owns their partitions now); and the
        containers of any other dead node on this machine (podman.py ``orphaned``)."""
        containers = getattr(runtime, "containers", runtime)
        removed = await containers.cleanup(orphans=True) if hasattr(containers, "cleanup") else 0
        sessions = self.cfg.work_dir / "sessions"
        left = sorted(sessions.iterdir()) if sessions.is_dir() and not self.cfg.keep_workdirs else []
        for d in left:
            shutil.rmtree(d, ignore_errors=True)
        if removed or left:
            log.warning("node %s: removed %d container(s) and %d session dir(s) left by dead nodes (%s)",
                        self.cfg.node_id, removed, len(left), self.cfg.work_dir)

    async def _publish_event(self, event):
        # A harness's output tail or an evaluator's message can quote a credential: scrub like the calls.
        return await self.publisher.publish(scrub_session_event(event, self.app.state.gateway.redactor))

    async def settle_calls(self, session_id: str) -> int | None:
        """Calls the gateway recorded for ``session_id``, after its in-flight call (if any) settled."""
        gw = self.app.state.gateway
        st = gw.sessions.find(session_id)
        if st is None:
            gw.sessions.drop(session_id)  # closed all the same: its key must not start it later
            return 0  # the harness never called the model
        await st.wait_idle(self.cfg.settle_timeout_s)
        n = st.calls
        gw.sessions.drop(session_id)
        return n

    async def stop(self, drain: bool = True) -> None:
        """Stop taking sessions; with ``drain`` let the admitted ones finish (and commit) first."""
        if self.intake is not None:
            self.intake.stop_admitting()
            if drain and self.pipeline is not None:
                await self.pipeline.drain()
            await self.intake.stop()
            await self.watcher.stop()
        if self.pipeline is not None:
            for t in list(self.pipeline.tasks):
                t.cancel()
            await asyncio.gather(*list(self.pipeline.tasks), return_exceptions=True)
            discard = getattr(getattr(self.pipeline.runtime, "containers", self.pipeline.runtime), "discard_prepared", None)
            if discard is not None:  # containers started for sessions that will not come here
                await discard()
        for t in self._tasks[1:]:
            t.cancel()
        if getattr(self, "_relay", None) is not None:
            self._relay.close()
        if getattr(self, "publisher", None) is not None:
            await self.publisher.aclose()
        if getattr(self, "_server", None) is not None:
            self._server.should_exit = True
            await asyncio.gather(self._tasks[0], return_exceptions=True)
        shutil.rmtree(self._sock_dir, ignore_errors=True)

    async def serve(self) -> int:
        """Run until SIGTERM/SIGINT, then drain the admitted sessions and leave the group; the exit status."""
        await self.start()
        freeze_startup_heap()  # the node's own process: see infra/heap.py
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"node {self.cfg.node_id} ready: gateway http://{self.cfg.gateway_host}:{self.gateway_port}", flush=True)
        stopped = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({stopped, *self._tasks}, return_when=asyncio.FIRST_COMPLETED)
        if stopped in done:
            await self.stop(drain=True)
            return 0
        # The gateway, the intake or the task watcher ended on its own: a node that serves but takes no
        # sessions would hold its partitions forever. Exit non-zero; its live sessions re-run elsewhere.
        stopped.cancel()
        failed = next(iter(done))
        error = failed.exception() if not failed.cancelled() else None
        log.error("node %s: a background task ended (%r); exiting so that its sessions move to another node",
                  self.cfg.node_id, error, exc_info=error)
        try:
            await asyncio.wait_for(self.stop(drain=False), 15)
        except Exception:
            log.exception("node %s: stopping after the failure failed too", self.cfg.node_id)
        return 1

    def stats(self) -> dict:
        """Pipeline stats plus the partitions this node owns."""
        out = dict(self.pipeline.stats()) if self.pipeline else {}
        out["partitions"] = self.intake.assigned() if self.intake else []
        return out
