"""Each family's answer through the gateway, streamed and not (issue 51): the scripted engine serves the
family fixture and writes, in that family's markup, reasoning and then two tool calls; OpenAI Chat
(non-streaming and streamed chunks) and Anthropic Messages (streamed) carry both calls (gpt-oss: one, see
TWO_CALLS) and the reasoning,
the same in every form, and the call is recorded with them."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.server import ThreadedServer
from gateway.template import ChatTemplate
from schemas.session_keys import mint_session_key
from tests.gateway.families import FAMILIES, family_dir
from tests.plugins.gateway import read_calls

pytestmark = pytest.mark.integration

CALLS = [("bash", {"command": "ls"}), ("read", {"path": "a.txt"})]
THOUGHT = "look first"


def _j(args: dict) -> str:
    return json.dumps(args)


# reasoning, then two calls, as each family's model writes them (None: the family has no reasoning markup)
TWO_CALLS = {
    # harmony: generation stops at a call's <|call|>, so a gpt-oss turn holds one call (the recipient
    # before the channel, as the template renders past calls)
    "harmony": (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant to=functions.{CALLS[0][0]}"
                f"<|channel|>commentary <|constrain|>json<|message|>{_j(CALLS[0][1])}<|call|>"),
    "llama3": "; ".join('{"name": "%s", "parameters": %s}' % (n, _j(a)) for n, a in CALLS),
    "glm45": f"\n<think>{THOUGHT}</think>\n" + "\n".join(
        f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in a.items())
        + "</tool_call>" for n, a in CALLS) + "<|observation|>",
    "deepseek": "<｜tool▁calls▁begin｜>" + "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{_j(a)}<｜tool▁call▁end｜>"
                                                 for n, a in CALLS) + "<｜tool▁calls▁end｜>",
    "kimi_k2": "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_j(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(CALLS)) + "<|tool_calls_section_end|>",
    "mistral": f"[THINK]{THOUGHT}[/THINK]" + "".join(f"[TOOL_CALLS]{n}[ARGS]{_j(a)}" for n, a in CALLS),
    "minimax_m2": f"{THOUGHT}\n</think>\n\n<minimax:tool_call>\n" + "".join(
        f'<invoke name="{n}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in a.items())
        + "</invoke>\n" for n, a in CALLS) + "</minimax:tool_call>",
}
REASONS = {"llama3": "", "deepseek": "", "kimi_k2": ""}  # no reasoning written for these
ONE_CALL = {"harmony"}
TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": {
    "type": "object", "properties": {k: {"type": "string"} for k in a}}}} for n, a in CALLS]


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_calls_and_reasoning_in_each_familys_markup_reach_chat_and_anthropic_streamed_and_not(
        family, polar_settings, engine_server_factory, tmp_path):
    script = tmp_path / "script.yaml"
    script.write_text(json.dumps({"turns": [{"raw": TWO_CALLS[family]}], "fallback": {"raw": TWO_CALLS[family]}}))
    model = family_dir(family)
    engine = engine_server_factory(model, script=script)
    app = create_app(polar_settings, GatewayConfig(engine_urls=[engine.url], model=str(model)),
                     template=ChatTemplate.load(str(model)))
    want_calls = CALLS[:1] if family in ONE_CALL else CALLS
    want_thought = REASONS.get(family, THOUGHT)
    with ThreadedServer(app) as gw:
        def post(path: str, sid: str, body: dict, header: str) -> httpx.Response:
            key = mint_session_key(sid, polar_settings.session_secret)
            auth = {"x-api-key": key} if header == "anthropic" else {"authorization": f"Bearer {key}"}
            r = httpx.post(gw.url + path, json=body, headers=auth, timeout=60)
            assert r.status_code == 200, r.text[:500]
            return r

        ask = {"model": "m", "messages": [{"role": "user", "content": "look around"}], "tools": TOOLS}
        whole = post("/v1/chat/completions", f"{family}-chat", ask, "openai").json()["choices"][0]
        msg = whole["message"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == want_calls
        assert (msg.get("reasoning_content") or "") == want_thought and not msg.get("content")
        assert whole["finish_reason"] == "tool_calls"

        chunks = _sse(post("/v1/chat/completions", f"{family}-stream", {**ask, "stream": True}, "openai").text)
        calls: dict[int, list] = {}
        for d in (c["choices"][0]["delta"] for c in chunks if c.get("choices")):
            for tc in d.get("tool_calls") or []:
                got = calls.setdefault(tc["index"], ["", ""])
                got[0] += tc.get("function", {}).get("name") or ""
                got[1] += tc.get("function", {}).get("arguments") or ""
        assert [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))] == want_calls
        streamed_thought = "".join(c["choices"][0]["delta"].get("reasoning_content") or ""
                                   for c in chunks if c.get("choices"))
        assert streamed_thought == want_thought

        anthropic = {"model": "m", "max_tokens": 256, "stream": True, "messages": [{"role": "user", "content": "look"}],
                     "tools": [{"name": t["function"]["name"], "description": "x", "input_schema": t["function"]["parameters"]}
                               for t in TOOLS]}
        events = _sse(post("/v1/messages", f"{family}-anthropic", anthropic, "anthropic").text)
        blocks: dict[int, dict] = {}
        for e in events:
            if e["type"] == "content_block_start":
                blocks[e["index"]] = {**e["content_block"], "json": "", "thinking": ""}
            elif e["type"] == "content_block_delta":
                d = e["delta"]
                blocks[e["index"]]["json"] += d.get("partial_json", "")
                blocks[e["index"]]["thinking"] += d.get("thinking", "")
        uses = [(b["name"], json.loads(b["json"])) for b in blocks.values() if b["type"] == "tool_use"]
        assert uses == want_calls
        assert "".join(b["thinking"] for b in blocks.values() if b["type"] == "thinking") == want_thought

    recorded = read_calls(polar_settings, 1, session_id=f"{family}-chat")[0]
    assert [(c.name, json.loads(c.arguments)) for c in recorded.output.tool_calls] == want_calls
    assert recorded.output.parse_error == "" and recorded.output.reasoning == want_thought
