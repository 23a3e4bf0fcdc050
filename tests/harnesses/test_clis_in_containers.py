"""Real CLIs in a task's own container (issue 62): pi (Chat Completions) and Claude Code run a shell
task published Harbor-style (environment/Dockerfile FROM debian:bookworm-slim, WORKDIR /app, tests/test.sh)
under the podman runtime of one in-process gateway node, in front of the scripted engine.

Each CLI comes into the container read-only at its host path, with the host's node at /usr/local/bin/node,
and reaches the gateway only through the tunnel. For each session: the calls are in Kafka (0..num_calls-1),
the second main call's prompt ids start with the first call's prompt + sampled ids exactly, and the
verifier (test.sh) scores 1 from the container's final state: answer.txt exists only in the container (an
image task's /app is not a host directory), so a verifier that ran anywhere else would score 0.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config import GatewayConfig
from gateway.harnesses.report import full_prompts, read_calls
from gateway.node.config import NodeConfig
from gateway.node.node import Node
from producers.tasks import load_tasks
from schemas import TaskRequest
from tests.harnesses.test_all_clis import SCRIPT
from tests.rollout.helpers import session_events

pytestmark = [pytest.mark.integration, pytest.mark.harness, pytest.mark.slow]

CLIS = [({"name": "pi", "config": {"api": "chat"}}, "bash"), ({"name": "claude_code"}, "Bash")]
# The image every container test of the suite shares (the same Dockerfile: one build, by content hash).
DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /app\n"
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/answer.txt 2>/dev/null)" = 7 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
echo "verifier saw: $(ls /app)"
"""


def harbor_task_dir(root: Path, memory_mb: int = 512) -> Path:
    """A Harbor-layout task: task.toml, instruction.md, environment/Dockerfile, tests/test.sh."""
    (root / "environment").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "task.toml").write_text(f'version = "1.0"\n[agent]\ntimeout_sec = 120\n[verifier]\ntimeout_sec = 30\n'
                                    f"[environment]\ncpus = 2\nmemory_mb = {memory_mb}\nallow_internet = false\n")
    (root / "instruction.md").write_text("Write the number 7 to answer.txt.\n")
    (root / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (root / "tests" / "test.sh").write_text(TEST_SH)
    return root


async def test_pi_and_claude_code_in_the_tasks_container(polar_settings, tmp_path, harness_cache, podman_base,
                                                         engine_server_factory, tiny_model_dir, rollout_server):
    (base,) = load_tasks(harbor_task_dir(tmp_path / "write-7"), num_samples=1, min_valid=1)
    assert base.workspace.kind == "image" and base.environment is not None
    tasks = [TaskRequest.model_validate({**base.model_dump(), "task_id": f"ctr{i}", "group_id": f"ctr{i}", "harness": spec,
                                         "instruction": f"Write the number 7 to answer.txt using {tool}."})
             for i, (spec, tool) in enumerate(CLIS)]
    script = tmp_path / "script.yaml"
    script.write_text(yaml.safe_dump(SCRIPT))
    engine = engine_server_factory(tiny_model_dir, script=script, script_window=256)
    cfg = NodeConfig(work_dir=tmp_path / "node", cache_dir=harness_cache, runtime="podman", node_id="ctr", run_workers=2,
                     ready_target=1, keep_workdirs=True)
    node = Node(polar_settings, cfg, GatewayConfig(engine_urls=[engine.url], model=str(tiny_model_dir)))
    await node.start()
    try:
        async with httpx.AsyncClient(base_url=rollout_server.url) as client:
            for t in tasks:
                assert (await client.post("/tasks", json=t.model_dump(mode="json"))).status_code == 202
            for _ in range(300):
                done = [(await client.get(f"/tasks/{t.task_id}")).json()["finished"] for t in tasks]
                if sum(done) == len(tasks):
                    break
                await asyncio.sleep(1)
    finally:
        await node.stop(drain=False)
    fin = {e.task_id: e for e in await asyncio.to_thread(session_events, polar_settings) if e.kind == "finished"}
    report = {k: (e.status, e.reward, e.num_calls, round(e.metrics.get("run_s", 0), 1), e.detail[-300:]) for k, e in fin.items()}
    assert set(fin) == {t.task_id for t in tasks}, report
    assert all(e.status == "ok" and e.reward == 1.0 and e.num_calls >= 2 for e in fin.values()), report
    for t in tasks:  # the file was written in the container, never in the host's session directory
        assert not list((tmp_path / "node" / "sessions").glob(f"{t.task_id}.s0/**/answer.txt"))

    calls = await asyncio.to_thread(read_calls, polar_settings)
    for (spec, _), t in zip(CLIS, tasks):
        e = fin[t.task_id]
        mine = sorted({c.call_index: c for c in calls if c.session_id == e.session_id}.values(), key=lambda c: c.call_index)
        assert [c.call_index for c in mine] == list(range(e.num_calls)), (spec, [c.call_index for c in mine])
        main = [c for c in mine if not c.side_call and not c.error]
        story = (spec, [(c.call_index, c.side_call, c.chain.extends_call_index, c.chain.break_reason,
                         c.output.text[:60], [tc.name for tc in c.output.tool_calls]) for c in mine])
        assert len(main) >= 3, story  # write, read back, answer
        prompts = full_prompts(mine)
        first, second = main[0], main[1]
        tip = prompts[first.call_index] + list(first.completion_ids)
        assert prompts[second.call_index][: len(tip)] == tip, story
        assert second.chain.extends_call_index == first.call_index, story
