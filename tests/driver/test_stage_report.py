"""The run's report of session stage times: the node's totals read from its /metrics at the loop's start and
end (polarstream/driver/serving.py), their difference a mean per session and stage, by sandbox."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import REGISTRY, generate_latest

from gateway.node import metrics as node_metrics
from gateway.node.config import NodeConfig
from gateway.node.pipeline import Pipeline
from gateway.runtimes import SubprocessRuntime
from polarstream.driver.results import session_stages
from polarstream.driver.serving import node_stage_totals


class Metrics(BaseHTTPRequestHandler):
    def do_GET(self):
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


async def test_stage_means_over_the_loop_come_from_the_nodes_metrics(tmp_path):
    async def nothing(*_):
        return 0

    p = Pipeline(NodeConfig(work_dir=tmp_path, cache_dir=tmp_path, node_id="report-node"), SubprocessRuntime(), 1,
                 nothing, nothing)
    node_metrics.watch(p)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        # other pipelines this worker process watched in earlier tests are in the same registry: count from here
        base = node_stage_totals(url).get("podman.open", [0.0, 0.0])
        p.stage_seconds = {("podman", "open"): [3.0, 10], ("podman", "verify"): [5.0, 10], ("bwrap", "run"): [1.0, 4]}
        start = node_stage_totals(url)
        p.stage_seconds = {("podman", "open"): [4.0, 20], ("podman", "verify"): [7.0, 14], ("bwrap", "run"): [1.0, 4]}
        end = node_stage_totals(url)
    finally:
        server.shutdown()
    assert [round(a - b, 6) for a, b in zip(start["podman.open"], base)] == [3.0, 10.0]
    # over the loop: 10 opens in 1 s, 4 verifications in 2 s; bwrap ran nothing in it
    assert session_stages(start, end) == {"session_stage_s": {"podman.open": 0.1, "podman.verify": 0.5}}
    assert session_stages(None, end) == {} and node_stage_totals("http://127.0.0.1:1") is None
