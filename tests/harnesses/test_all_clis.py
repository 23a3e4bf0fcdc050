"""Every real CLI from its adapter, in the bwrap sandbox of one node (opt-in: slow on CPU).

The cluster tests (tests/rollout/test_cluster.py) run pi and opencode on every `make test`. Claude Code,
Codex, Gemini CLI and Qwen Code send 40-80 KB prompts (24, 9, 15 and 15 tools) that the tiny CPU engine
must prefill on one thread: 20-60 s per session on 2 busy cores (3 min in all), so this test is opt-in
(POLAR_ALL_CLIS=1) and runs the sessions one at a time. The shared engine script (CLUSTER_SCRIPT) calls
the shell tool under every CLI's name; each CLI runs its own and reports the others as unknown tools.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import yaml

from gateway.config import GatewayConfig
from gateway.node.config import NodeConfig
from gateway.node.node import Node
from tests.plugins.rollout import CLUSTER_SCRIPT
from tests.rollout.helpers import session_events

pytestmark = [
    pytest.mark.integration, pytest.mark.harness, pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("POLAR_ALL_CLIS") != "1",
                       reason="opt-in (about 3 min on 2 cores: the tiny CPU engine prefills 40-80 KB prompts); set POLAR_ALL_CLIS=1"),
]

HARNESSES = [{"name": "claude_code"}, {"name": "codex"}, {"name": "gemini_cli"}, {"name": "qwen_code"},
             {"name": "opencode", "config": {"api": "responses"}}, {"name": "pi", "config": {"api": "google"}}]


async def test_every_cli_in_the_sandbox(polar_settings, tmp_path, harness_cache, engine_server_factory, tiny_model_dir,
                                        rollout_server):
    script = tmp_path / "script.yaml"
    script.write_text(yaml.safe_dump(CLUSTER_SCRIPT))
    engine = engine_server_factory(script=script)
    cfg = NodeConfig(work_dir=tmp_path / "node", cache_dir=harness_cache, runtime="bwrap", node_id="all", run_workers=1,
                     ready_target=1)
    node = Node(polar_settings, cfg, GatewayConfig(engine_urls=[engine.url], model=str(tiny_model_dir)))
    await node.start()
    try:
        task = {"task_id": "all", "instruction": "Write the number 7 to answer.txt.", "num_samples": len(HARNESSES),
                "min_valid": 1, "harness": {"name": "mix", "config": {"harnesses": HARNESSES}}, "timeouts": {"agent_s": 300},
                "evaluator": {"kind": "command", "command": "test \"$(cat answer.txt)\" = 7"}}
        async with httpx.AsyncClient(base_url=rollout_server.url) as client:
            assert (await client.post("/tasks", json=task)).status_code == 202
            for _ in range(1800):
                if (await client.get("/tasks/all")).json()["finished"] == len(HARNESSES):
                    break
                await asyncio.sleep(1)
        fin = {e.harness: e for e in await asyncio.to_thread(session_events, polar_settings) if e.kind == "finished"}
        report = {h: (e.status, e.reward, e.num_calls, round(e.metrics.get("run_s", 0)), e.detail[-200:]) for h, e in fin.items()}
        assert set(fin) == {h["name"] for h in HARNESSES}, report
        assert all(e.status == "ok" and e.reward == 1.0 and e.num_calls >= 2 for e in fin.values()), report
    finally:
        await node.stop(drain=False)
