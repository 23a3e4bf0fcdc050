"""Every real CLI from its adapter, in the bwrap sandbox of one node: nine sessions of a tool task.

Claude Code, Codex, Gemini CLI, Qwen Code, opencode (Responses) and pi on each of its four APIs write 7
to answer.txt with their shell tool, read it back with it, then answer (three main calls), through one
gateway node and the scripted engine.
Each session is its own task, whose instruction names that CLI's own shell tool (SCRIPT below). Their
prompts are 40-80 KB (24, 9, 15 and 15 tools); a full prefill of those on the tiny CPU engine took
20-60 s per session on 2 busy cores, so the engine runs with ``script_window`` (scripted turns scored
over the prompt's last 256 tokens: same ids and wire fields, logprobs over the window only; see
docs/engine.md) and the node runs three sessions at once. For each session: the file the tool wrote is
there (the evaluator), every call is in Kafka (0..num_calls-1), and the second main call's prompt ids
start with the first call's prompt + sampled ids exactly. The merge rate per harness/API
(gateway/harnesses/report.py) must be 1.0; POLAR_MERGE_REPORT=path writes the JSON report
(docs/harness-merge-rates.json), POLAR_CLIS=name,... runs a subset.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config import GatewayConfig
from gateway.harnesses.report import full_prompts, markdown_table, merge_report, read_calls
from gateway.node.config import NodeConfig
from gateway.node.node import Node
from tests.rollout.helpers import session_events

pytestmark = [pytest.mark.integration, pytest.mark.harness, pytest.mark.slow]

SHELL = "echo 7 > answer.txt"
# harness spec -> the name (and arguments) of its own shell tool
HARNESSES = [({"name": "claude_code"}, "Bash"), ({"name": "codex"}, "exec_command"), ({"name": "gemini_cli"}, "run_shell_command"),
             ({"name": "qwen_code"}, "run_shell_command"), ({"name": "opencode", "config": {"api": "responses"}}, "bash")] + [
    ({"name": "pi", "config": {"api": api}}, "bash") for api in ("chat", "responses", "anthropic", "google")]
if os.environ.get("POLAR_CLIS"):  # a comma-separated subset of harness names, to iterate on one CLI
    HARNESSES = [h for h in HARNESSES if h[0]["name"] in os.environ["POLAR_CLIS"].split(",")]
TOOLS = ("Bash", "exec_command", "run_shell_command", "bash")


def shell_call(tool: str, command: str) -> dict:
    args = {"cmd": command} if tool == "exec_command" else {"command": command, "description": "run it"}
    return {"name": tool, "arguments": args}


# Three steps per session, each chosen by the last user/tool message (the first matching turn wins):
# 1. the instruction names the tool (Claude Code puts a system message after the user's: matched too):
#    write the file and print "wrote-by-<tool>";
# 2. that output is in the tool result: read the file back, printing "read-by-<tool>";
# 3. anything else (that result, side requests such as titles): the final answer.
SCRIPT = {
    "turns": [{"match": f"wrote-by-{tool}", "tool_calls": [shell_call(tool, f"cat answer.txt; echo read-by-{tool}")]}
              for tool in TOOLS]
    + [{"match": ("Available agent types|" if tool == "Bash" else "") + f"using {tool}\\.",
        "tool_calls": [shell_call(tool, f"{SHELL}; echo wrote-by-{tool}")]} for tool in TOOLS],
    "fallback": {"text": "Done."},
}
# Measurement mode (POLAR_CLIS_SCRIPT=all_tools): one turn calls every CLI's shell tool at once, as the
# cluster tests do, then the answer; the report is written, but chains broken by harness rewrites are
# expected there (opencode rewrites the calls it does not know: docs/gateway.md, merge rates).
ALL_TOOLS = os.environ.get("POLAR_CLIS_SCRIPT") == "all_tools"
if ALL_TOOLS:
    SCRIPT = {"turns": [{"match": "Write the number 7|Available agent types",
                         "tool_calls": [shell_call(tool, SHELL) for tool in TOOLS]}], "fallback": SCRIPT["fallback"]}
# harness/provider rows of the merge report, one per entry above
ROWS = {"claude_code/anthropic.messages", "codex/openai.responses", "gemini_cli/google.generate_content",
        "qwen_code/openai.chat", "opencode/openai.responses", "pi/openai.chat", "pi/openai.responses",
        "pi/anthropic.messages", "pi/google.generate_content"}


async def run_write_tasks(settings, script: dict, engine_server_factory, model_dir: Path, rollout_url: str, node_dir: Path,
                          cache: Path, clis: list[tuple[dict, str]], prefix: str, agent_s: int, polls: int) -> None:
    """One task per (harness spec, shell tool) through one in-process bwrap node and the scripted engine:
    "Write the number 7 to answer.txt using <tool>." (task ids ``<prefix><i>``), until all have finished."""
    script_path = node_dir.with_name(node_dir.name + "-script.yaml")
    script_path.write_text(yaml.safe_dump(script))
    engine = engine_server_factory(model_dir, script=script_path, script_window=256)
    cfg = NodeConfig(work_dir=node_dir, cache_dir=cache, runtime="bwrap", node_id=prefix, run_workers=3, ready_target=2)
    node = Node(settings, cfg, GatewayConfig(engine_urls=[engine.url], model=str(model_dir)))
    await node.start()
    try:
        async with httpx.AsyncClient(base_url=rollout_url) as client:
            for i, (spec, tool) in enumerate(clis):
                task = {"task_id": f"{prefix}{i}", "instruction": f"Write the number 7 to answer.txt using {tool}.",
                        "num_samples": 1, "min_valid": 1, "harness": spec, "timeouts": {"agent_s": agent_s},
                        "evaluator": {"kind": "command", "command": "test \"$(cat answer.txt)\" = 7"}}
                assert (await client.post("/tasks", json=task)).status_code == 202
            for _ in range(polls):
                done = [(await client.get(f"/tasks/{prefix}{i}")).json()["finished"] for i in range(len(clis))]
                if sum(done) == len(clis):
                    break
                await asyncio.sleep(1)
    finally:
        await node.stop(drain=False)


async def test_every_cli_in_the_sandbox(polar_settings, tmp_path, harness_cache, engine_server_factory, tiny_model_dir,
                                        rollout_server):
    await run_write_tasks(polar_settings, SCRIPT, engine_server_factory, tiny_model_dir, rollout_server.url,
                          tmp_path / "node", harness_cache, HARNESSES, "cli", agent_s=240, polls=900)
    fin = {int(e.task_id[3:]): e for e in await asyncio.to_thread(session_events, polar_settings) if e.kind == "finished"}
    report = {i: (HARNESSES[i][0], e.status, e.reward, e.num_calls, round(e.metrics.get("run_s", 0)), e.detail[-200:])
              for i, e in fin.items()}
    assert sorted(fin) == list(range(len(HARNESSES))), report
    # the file the tool wrote exists with the right content (the evaluator), after at least two calls
    assert all(e.status == "ok" and e.reward == 1.0 and e.num_calls >= 2 for e in fin.values()), report

    calls = await asyncio.to_thread(read_calls, polar_settings)
    by_session: dict[str, list] = {}
    for c in calls:
        by_session.setdefault(c.session_id, []).append(c)
    for i, e in fin.items():
        mine = sorted({c.call_index: c for c in by_session.get(e.session_id, [])}.values(), key=lambda c: c.call_index)
        assert [c.call_index for c in mine] == list(range(e.num_calls)), (HARNESSES[i][0], [c.call_index for c in mine])
        main = [c for c in mine if not c.side_call and not c.error]
        assert len(main) >= (2 if ALL_TOOLS else 3), (HARNESSES[i][0], [(c.call_index, c.side_call, c.error) for c in mine])
        if ALL_TOOLS:
            continue
        prompts = full_prompts(mine)
        first, second = main[0], main[1]
        tip = prompts[first.call_index] + list(first.completion_ids)
        story = (HARNESSES[i][0], [(c.call_index, c.side_call, c.chain.extends_call_index, c.chain.break_reason,
                                 c.request.get("messages_offset"), len(c.request.get("messages", [])),
                                 c.output.text[:60], [t.name for t in c.output.tool_calls]) for c in mine])
        assert prompts[second.call_index][: len(tip)] == tip, story
        assert second.chain.extends_call_index == first.call_index, story
        # A rollout session samples with the run's settings whatever its CLI asks (gateway/sampling.py);
        # the record keeps both. Gemini CLI asks for its own (temperature 1, top_p 0.95, top_k 64).
        for c in main:
            assert c.sampling is not None and c.sampling.pinned and c.sampling.matches_run, story
            assert (c.sampling.temperature, c.sampling.top_p, c.sampling.top_k) == (1.0, 1.0, 0), story
        if HARNESSES[i][0]["name"] == "gemini_cli":
            asked = main[0].request["sampling"]
            assert (asked["top_p"], asked["top_k"]) == (0.95, 64), asked

    merge = merge_report(calls)
    print("\n" + markdown_table(merge))
    if os.environ.get("POLAR_MERGE_REPORT"):
        Path(os.environ["POLAR_MERGE_REPORT"]).write_text(json.dumps(merge, indent=2) + "\n")
    assert set(merge) == ROWS or os.environ.get("POLAR_CLIS"), sorted(merge)
    assert ALL_TOOLS or all(r["merge_rate"] == 1.0 and r["gateway_agrees"] and not r["breaks"] for r in merge.values()), merge
