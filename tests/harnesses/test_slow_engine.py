"""Google's streamed answers through a slow engine: past the gateway's KEEPALIVE_AFTER_S (2 s), which a
real model passes on nearly every call, while the scripted engine answers at once unless told otherwise.

Issue 52: the gateway's keep-alive was an SSE comment, which no Google SDK accepts. Gemini CLI (its bundled
@google/genai 1.30 matches only ``^\\s*data: `` at its buffer's start) recorded 3 calls and hung until its
timeout; pi over ``google`` retried. Here both, and Claude Code, run a three-call tool task (write, read back, answer)
against an engine that answers every call 3 s late, with the gateway's real keep-alive timings; and the
JS SDK as pi installs it streams the same answer as the fast path, and raises its own ApiError for a
failure after the keep-alive.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from gateway.harnesses.report import read_calls
from gateway.server import ThreadedServer
from tests.harnesses.test_all_clis import SCRIPT, run_write_tasks
from tests.plugins.gateway import TOOL_SCRIPT, slow_front
from tests.rollout.helpers import session_events

pytestmark = [pytest.mark.integration, pytest.mark.harness, pytest.mark.slow]

DELAY_S = 3.0  # > gateway.routes.KEEPALIVE_AFTER_S (2 s): every call takes the keep-alive path
# Claude Code rides along for Anthropic's keep-alive, an `event: ping` before `message_start`.
CLIS = [({"name": "gemini_cli"}, "run_shell_command"), ({"name": "pi", "config": {"api": "google"}}, "bash"),
        ({"name": "claude_code"}, "Bash")]


async def test_gemini_cli_and_pi_over_google_run_their_tools_through_a_slow_engine(
        polar_settings, tmp_path, harness_cache, engine_server_factory, tiny_model_dir, rollout_server):
    await run_write_tasks(polar_settings, {**SCRIPT, "delay_s": DELAY_S}, engine_server_factory, tiny_model_dir,
                          rollout_server.url, tmp_path / "node", harness_cache, CLIS, "slow", agent_s=120, polls=400)
    fin = {int(e.task_id[4:]): e for e in await asyncio.to_thread(session_events, polar_settings) if e.kind == "finished"}
    report = {i: (CLIS[i][0], e.status, e.reward, e.num_calls, round(e.metrics.get("run_s", 0)), e.detail[-300:])
              for i, e in fin.items()}
    assert sorted(fin) == list(range(len(CLIS))), report
    assert all(e.status == "ok" and e.reward == 1.0 for e in fin.values()), report  # the tool ran: answer.txt holds 7

    calls = await asyncio.to_thread(read_calls, polar_settings)
    for i, e in fin.items():
        mine = sorted({c.call_index: c for c in calls if c.session_id == e.session_id}.values(), key=lambda c: c.call_index)
        main = [c for c in mine if not c.side_call]
        story = (CLIS[i][0], [(c.call_index, c.side_call, c.error, c.output.text[:40], [t.name for t in c.output.tool_calls])
                             for c in mine])
        assert not any(c.error for c in mine), story
        # write, read back, answer: no call asked again because its streamed answer was lost
        assert len(main) == 3 and [c.output.tool_calls[0].name for c in main[:2]] == [CLIS[i][1]] * 2, story
        assert all(c.timings.upstream_ms >= DELAY_S * 1000 for c in main), story


JS_STREAM = """
const {GoogleGenAI} = require(process.argv[2]);
const ai = new GoogleGenAI({apiKey: process.argv[4], httpOptions: {baseUrl: process.argv[3]}});
const tools = [{functionDeclarations: [{name: "write_file", description: "Write a file", parametersJsonSchema:
  {type: "object", properties: {path: {type: "string"}, content: {type: "string"}}, required: ["path", "content"]}}]}];
(async () => {
  try {
    const stream = await ai.models.generateContentStream({model: "gemini-x", contents: "Create hello.txt containing hi",
                                                           config: {tools}});
    const calls = [];
    for await (const chunk of stream) for (const c of chunk.functionCalls || []) calls.push([c.name, c.args]);
    console.log(JSON.stringify({calls}));
  } catch (e) {
    console.log(JSON.stringify({error: e.name, status: e.status, message: String(e.message)}));
  }
})();
"""


def test_googles_js_sdk_streams_through_keepalives_and_raises_its_own_error(
        polar_settings, tmp_path, harness_cache, engine_server_factory, tiny_model_dir, gateway_factory, monkeypatch):
    import gateway.routes as routes

    monkeypatch.setattr(routes, "KEEPALIVE_AFTER_S", 0.2)
    monkeypatch.setattr(routes, "KEEPALIVE_EVERY_S", 0.3)
    sdk = harness_cache / "npm" / "pi" / "node_modules" / "@google" / "genai"
    js = tmp_path / "stream.cjs"
    js.write_text(JS_STREAM)

    def stream(gw) -> dict:
        out = subprocess.run(["node", str(js), str(sdk), gw.url, gw.key("js")], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    fast_script, slow_script = tmp_path / "fast.yaml", tmp_path / "slow.yaml"
    fast_script.write_text(TOOL_SCRIPT)
    slow_script.write_text(TOOL_SCRIPT + "delay_s: 1.0\n")
    fast = stream(gateway_factory(polar_settings, engine_server_factory(script=fast_script).url))
    slow = stream(gateway_factory(polar_settings, engine_server_factory(script=slow_script).url))
    assert slow == fast == {"calls": [["write_file", {"path": "hello.txt", "content": "hi"}]]}, (slow, fast)

    with ThreadedServer(slow_front(engine_server_factory(script=fast_script).url, 0.8, fail=True)) as up:
        failed = stream(gateway_factory(polar_settings, up.url))
    assert failed["error"] == "ApiError" and failed["status"] == 500 and "engine fell over" in failed["message"], failed
