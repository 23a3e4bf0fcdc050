"""The example Harbor tasks (examples/coding) through a real CLI: pi, in the bwrap sandbox of one node,
in front of the scripted engine. Each task's session applies the task's own solution with pi's bash tool
(the workspace is at the task's working dir, /app) and scores 1; one more session of a task answers
without touching anything and scores 0. The rewards come from the tasks' Terminal-Bench-shaped test.sh
(it writes /logs/verifier/reward.txt and exits 0 either way)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config import GatewayConfig
from gateway.node.config import NodeConfig
from gateway.node.node import Node
from producers.tasks import load_tasks
from tests.rollout.helpers import session_events

pytestmark = [pytest.mark.integration, pytest.mark.harness, pytest.mark.slow]

EXAMPLES = Path(__file__).parents[2] / "examples" / "coding"


def _script(tasks) -> dict:
    """Per task: its instruction's first words -> pi's bash runs the task's solve.sh, then "Done."."""
    turns = [{"match": "solved-", "text": "Done."}]
    for t in tasks:
        solve = (Path(t.metadata["solution"]) / "solve.sh").read_text()
        turns.append({"match": _key(t), "tool_calls": [{"name": "bash", "arguments": {
            "command": solve + f"echo solved-{t.task_id}"}}]})
    return {"turns": turns, "fallback": {"text": "Done."}}


def _key(task) -> str:
    import re

    return re.escape(task.instruction.split(".")[0][:60])


async def test_each_example_task_through_pi_scores_its_solution_1_and_nothing_0(
        polar_settings, tmp_path, harness_cache, engine_server_factory, tiny_model_dir, rollout_server):
    tasks = load_tasks(EXAMPLES, harness={"name": "pi", "config": {"api": "chat"}}, num_samples=1, min_valid=1)
    script = tmp_path / "script.yaml"
    script.write_text(yaml.safe_dump(_script(tasks)))
    engine = engine_server_factory(script=script, script_window=256)
    cfg = NodeConfig(work_dir=tmp_path / "node", cache_dir=harness_cache, runtime="bwrap", node_id="harbor", run_workers=3,
                     ready_target=2)
    node = Node(polar_settings, cfg, GatewayConfig(engine_urls=[engine.url], model=str(tiny_model_dir)))
    # The untouched control: the first task again, with an instruction no scripted turn matches.
    control = tasks[0].model_copy(update={"task_id": "untouched", "group_id": "", "instruction": "Look around, then stop."})
    control.group_id = control.task_id
    submitted = [*tasks, control]
    await node.start()
    try:
        async with httpx.AsyncClient(base_url=rollout_server.url) as client:
            for t in submitted:
                assert (await client.post("/tasks", json=t.model_dump(mode="json"))).status_code == 202
            for _ in range(600):
                done = [(await client.get(f"/tasks/{t.task_id}")).json()["finished"] for t in submitted]
                if sum(done) == len(submitted):
                    break
                await asyncio.sleep(1)
    finally:
        await node.stop(drain=False)
    fin = {e.task_id: e for e in await asyncio.to_thread(session_events, polar_settings) if e.kind == "finished"}
    report = {k: (e.status, e.reward, e.num_calls, e.detail[-200:]) for k, e in fin.items()}
    assert set(fin) >= {t.task_id for t in submitted}, report
    for t in tasks:
        e = fin[t.task_id]
        assert e.status == "ok" and e.reward == 1.0 and e.num_calls >= 2, (t.task_id, report)
    assert fin["untouched"].status == "ok" and fin["untouched"].reward == 0.0, report
