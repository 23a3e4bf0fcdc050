"""The official SDKs (anthropic, openai chat + responses, google-genai), streaming and not, through the
gateway to the scripted tiny engine: each runs a two-step tool task, parses the tool call, and the two
calls land in Kafka with the second prompt extending the first prompt + sampled ids exactly.

One engine and one gateway serve the whole module (each test is its own session), to keep it fast.
"""

import json
import uuid

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from infra.topics import ensure_topics
from schemas import resolve_prompt
from tests.plugins.gateway import CallsReader

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}
SYSTEM = "You write files."
TASK = "Create hello.txt containing hi"
FINAL = "Done. hello.txt now contains hi."


@pytest.fixture(scope="module")
def stack(infra, tiny_model_dir, tiny_template, scripted_engine):
    """(settings with their own topics, gateway, calls reader) shared by this module's tests."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.server import ThreadedServer

    settings = infra.settings.model_copy(update={"topic_prefix": f"t{uuid.uuid4().hex[:10]}."})
    ensure_topics(settings)
    app = create_app(settings, GatewayConfig(engine_urls=[scripted_engine.url], model=str(tiny_model_dir)),
                     template=tiny_template)
    reader = CallsReader(settings)
    with ThreadedServer(app) as server:
        yield settings, server, reader
    reader.close()


def _key(settings, sid):
    from gateway.sessions import mint_session_key

    return mint_session_key(sid, settings.session_secret, group_id="g-sdk")


def run_anthropic(url, key, stream):
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    tools = [{"name": "write_file", "description": "Write a file", "input_schema": SCHEMA}]
    messages = [{"role": "user", "content": [{"type": "text", "text": TASK, "cache_control": {"type": "ephemeral"}}]}]

    def ask():
        kw = dict(model="claude-opus-4-8", max_tokens=256, system=SYSTEM, messages=messages, tools=tools)
        if stream:
            with client.messages.stream(**kw) as s:
                return s.get_final_message()
        return client.messages.create(**kw)

    first = ask()
    assert first.model == "claude-opus-4-8" and first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    # Claude Code echoes input keys in schema order and moves cache_control to the newest block.
    messages[0]["content"][0].pop("cache_control")
    messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                       "input": {"path": use.input["path"], "content": use.input["content"]}}]})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "wrote 2 bytes",
                                                  "cache_control": {"type": "ephemeral"}}]})
    second = ask()
    return (use.name, dict(use.input)), "".join(b.text for b in second.content if b.type == "text")


def run_chat(url, key, stream):
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    tools = [{"type": "function", "function": {"name": "write_file", "description": "Write a file", "parameters": SCHEMA}}]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]

    def ask():
        if stream:
            with client.chat.completions.stream(model="gpt-5", messages=messages, tools=tools) as s:
                return s.get_final_completion()
        return client.chat.completions.create(model="gpt-5", messages=messages, tools=tools)

    first = ask().choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    messages.append({"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": json.dumps(json.loads(call.function.arguments), separators=(",", ":"))}}]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "wrote 2 bytes"})
    second = ask().choices[0]
    return (call.function.name, json.loads(call.function.arguments)), second.message.content


def run_responses(url, key, stream):
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    tools = [{"type": "function", "name": "write_file", "description": "Write a file", "parameters": SCHEMA}]
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASK}]}]

    def ask():
        if stream:
            with client.responses.stream(model="gpt-5-codex", input=items, tools=tools) as s:
                return s.get_final_response()
        return client.responses.create(model="gpt-5-codex", input=items, tools=tools)

    first = ask()
    (call,) = [o for o in first.output if o.type == "function_call"]
    # opencode / pi echo the function_call without id and status, arguments compacted
    items.append({"type": "function_call", "call_id": call.call_id, "name": call.name,
                  "arguments": json.dumps(json.loads(call.arguments), separators=(",", ":"))})
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "wrote 2 bytes"})
    return (call.name, json.loads(call.arguments)), ask().output_text


def run_google(url, key, stream):
    client = genai.Client(api_key=key, http_options=types.HttpOptions(base_url=url))
    config = types.GenerateContentConfig(
        system_instruction=SYSTEM,
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(name="write_file", description="Write a file",
                                                                           parameters_json_schema=SCHEMA)])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    contents = [types.Content(role="user", parts=[types.Part(text=TASK)])]

    def ask():
        if stream:
            chunks = list(client.models.generate_content_stream(model="gemini-3-flash", contents=contents, config=config))
            parts = [p for c in chunks for p in (c.candidates[0].content.parts or [])]
            return parts
        return client.models.generate_content(model="gemini-3-flash", contents=contents, config=config).candidates[0].content.parts

    parts = ask()
    (fc,) = [p.function_call for p in parts if p.function_call]
    contents.append(types.Content(role="model", parts=parts))
    contents.append(types.Content(role="user", parts=[types.Part.from_function_response(name=fc.name, response={"output": "wrote 2 bytes"})]))
    return (fc.name, dict(fc.args)), "".join(p.text or "" for p in ask())


RUNNERS = {"anthropic.messages": run_anthropic, "openai.chat": run_chat, "openai.responses": run_responses,
           "google.generate_content": run_google}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("provider", list(RUNNERS))
def test_sdk_two_step_tool_task(stack, provider, stream):
    settings, server, reader = stack
    sid = f"{provider}-{'sse' if stream else 'json'}"
    (name, args), final = RUNNERS[provider](server.url, _key(settings, sid), stream)
    assert (name, args) == ("write_file", {"path": "hello.txt", "content": "hi"})
    assert final == FINAL

    calls = reader.wait(2, session_id=sid)
    assert [c.call_index for c in calls] == [0, 1], [(c.session_id, c.call_index) for c in calls]
    c0, c1 = calls
    assert c0.provider == c1.provider == provider
    assert (c0.chain.break_reason, c1.chain.extends_call_index, c1.chain.break_reason) == ("first_call", 0, "")
    p0 = resolve_prompt(c0, {})
    p1 = resolve_prompt(c1, {0: p0 + c0.completion_ids})
    assert p1[: len(p0) + len(c0.completion_ids)] == p0 + c0.completion_ids
    assert c0.output.tool_calls[0].name == "write_file" and c1.output.text == FINAL
    assert c1.request["stream"] is stream
