"""A node in-process (bwrap, scripted engine): a cancel marker stops a task's sessions in RUN, in READY and
not yet admitted; an agent timeout keeps the calls captured so far and finishes as `timeout`."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.node.config import NodeConfig
from gateway.node.node import Node
from tests.plugins.rollout import CLUSTER_SCRIPT, write_script
from tests.rollout.helpers import session_events

pytestmark = pytest.mark.integration


async def test_cancel_and_agent_timeout(polar_settings, tmp_path, engine_server_factory, tiny_model_dir, rollout_server):
    engine = engine_server_factory(script=write_script(tmp_path / "script.yaml", CLUSTER_SCRIPT["turns"], CLUSTER_SCRIPT["fallback"]))
    cfg = NodeConfig(work_dir=tmp_path / "node", cache_dir=tmp_path, runtime="bwrap", node_id="nc", run_workers=1, ready_target=1)
    node = Node(polar_settings, cfg, GatewayConfig(engine_urls=[engine.url], model=str(tiny_model_dir)))
    await node.start()
    try:
        task = {"task_id": "cx", "instruction": "wait", "num_samples": 3, "min_valid": 1,
                "harness": {"name": "command", "command": ["sleep", "60"]}}
        async with httpx.AsyncClient(base_url=rollout_server.url) as client:
            assert (await client.post("/tasks", json=task)).status_code == 202
            for _ in range(300):
                if node.pipeline.stage["run"] == 1 and node.pipeline.stage["ready"] == 1:
                    break
                await asyncio.sleep(0.1)
            assert node.pipeline.stage["run"] == 1 and node.pipeline.stage["ready"] == 1 and node.pipeline.admitted == 2
            assert (await client.delete("/tasks/cx", params={"reason": "operator"})).status_code == 200
            for _ in range(300):
                status = (await client.get("/tasks/cx")).json()
                if status["finished"] == 3:
                    break
                await asyncio.sleep(0.1)
        assert status["statuses"] == {"cancelled": 3}, status
        fin = [e for e in await asyncio.to_thread(session_events, polar_settings) if e.kind == "finished"]
        assert sorted(e.session_id for e in fin) == ["cx.s0", "cx.s1", "cx.s2"]
        assert all(e.detail == "nc: operator" and e.num_calls == 0 for e in fin)
        started = [e for e in await asyncio.to_thread(session_events, polar_settings) if e.kind == "started"]
        assert len(started) == 1  # only the running one had started; the others never ran

        # agent timeout mid-session: the builtin agent's tool sleeps 6 s, the budget is 3 s
        slow = {"task_id": "slow", "instruction": "Slowly write 7 to answer.txt.", "num_samples": 1, "min_valid": 1,
                "harness": {"name": "builtin"}, "timeouts": {"agent_s": 3}}
        async with httpx.AsyncClient(base_url=rollout_server.url) as client:
            assert (await client.post("/tasks", json=slow)).status_code == 202
            for _ in range(300):
                if (await client.get("/tasks/slow")).json()["finished"] == 1:
                    break
                await asyncio.sleep(0.1)
        fin = [e for e in await asyncio.to_thread(session_events, polar_settings) if e.kind == "finished" and e.task_id == "slow"]
        assert [(e.status, e.reward, e.num_calls) for e in fin] == [("timeout", 0.0, 1)]  # the call made before the timeout
        assert fin[0].metrics["run_s"] < 10 and fin[0].metrics["open_s"] < 10
        # the node's stage times, by sandbox: every session that reached INIT opened one and closed it
        for _ in range(100):  # the close comes after the finished event
            if node.pipeline.stage_seconds.get(("bwrap", "close"), [0, 0])[1] >= 2:
                break
            await asyncio.sleep(0.1)
        totals = node.pipeline.stage_seconds
        assert totals[("bwrap", "close")][1] >= 2 and totals[("bwrap", "open")][1] >= 2 and totals[("bwrap", "run")][1] >= 2
    finally:
        await node.stop(drain=False)
