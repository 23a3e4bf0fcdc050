"""The official SDKs (anthropic, openai chat + responses, google-genai), streaming and not, through the
gateway to the scripted tiny engine: each runs a two-step tool task, parses the tool call, and the two
calls land in Kafka with the second prompt extending the first prompt + sampled ids exactly.

One engine and one gateway serve the whole module (each test is its own session), to keep it fast.
"""

import json
import uuid

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from infra.topics import ensure_topics
from schemas import resolve_prompt
from tests.plugins.gateway import TOOL_SCRIPT, CallsReader

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}
SYSTEM = "You write files."
TASK = "Create hello.txt containing hi"
FINAL = "Done. hello.txt now contains hi."
SLOW_S = 1.0  # engine delay in the slow stack, past the KEEPALIVE_AFTER_S the slow tests set


def _serve(infra, engine_url, model_dir, template):
    """(settings with their own topics, gateway server, calls reader) in front of ``engine_url``."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.server import ThreadedServer

    settings = infra.settings.model_copy(update={"topic_prefix": f"t{uuid.uuid4().hex[:10]}."})
    ensure_topics(settings)
    app = create_app(settings, GatewayConfig(engine_urls=[engine_url], model=str(model_dir)), template=template)
    reader = CallsReader(settings)
    with ThreadedServer(app) as server:
        yield settings, server, reader
    reader.close()


@pytest.fixture(scope="module")
def stack(infra, tiny_model_dir, tiny_template, scripted_engine):
    """(settings, gateway, calls reader) shared by this module's tests."""
    yield from _serve(infra, scripted_engine.url, tiny_model_dir, tiny_template)


@pytest.fixture(scope="module")
def slow_stack(infra, tiny_model_dir, tiny_template, tmp_path_factory):
    """The same in front of the scripted engine answering SLOW_S late (the gateway's keep-alive path)."""
    from tests.plugins.engine import start_engine_server

    script = tmp_path_factory.mktemp("slow-script") / "tool-script.yaml"
    script.write_text(TOOL_SCRIPT + f"delay_s: {SLOW_S}\n")
    engine = start_engine_server(tiny_model_dir, script=script)
    yield from _serve(infra, engine.url, tiny_model_dir, tiny_template)
    engine.stop()


def _key(settings, sid):
    from schemas.session_keys import mint_session_key

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


# The streamed path past KEEPALIVE_AFTER_S: each SDK must read the dialect's keep-alives (several here:
# every 0.3 s of a 1 s answer) and then the same answer as the fast path. Google's comment-free keep-alive
# is issue 52: google-genai failed on `: polarstream: generating` with "Failed to parse response as JSON".
KEEPALIVE_FIRST = {"anthropic.messages": b"event: ping\n", "openai.chat": b": keep-alive\n\n",
                   "openai.responses": b": keep-alive\n\n", "google.generate_content": b"\n"}
RAW = {"anthropic.messages": ("/v1/messages", {"model": "c", "max_tokens": 16, "stream": True,
                                               "messages": [{"role": "user", "content": TASK}]}),
       "openai.chat": ("/v1/chat/completions", {"model": "g", "stream": True, "messages": [{"role": "user", "content": TASK}]}),
       "openai.responses": ("/v1/responses", {"model": "g", "stream": True, "input": TASK}),
       "google.generate_content": ("/v1beta/models/g:streamGenerateContent?alt=sse",
                                  {"contents": [{"role": "user", "parts": [{"text": TASK}]}]})}


@pytest.fixture
def quick_keepalive(monkeypatch):
    import gateway.routes as routes

    monkeypatch.setattr(routes, "KEEPALIVE_AFTER_S", 0.2)
    monkeypatch.setattr(routes, "KEEPALIVE_EVERY_S", 0.3)


@pytest.mark.parametrize("provider", list(RUNNERS))
def test_sdk_streams_a_slow_answer_through_keepalives(stack, slow_stack, provider, quick_keepalive):
    fast_settings, fast, _ = stack
    settings, server, reader = slow_stack
    path, body = RAW[provider]
    raw = httpx.post(server.url + path, json=body, headers={"x-api-key": _key(settings, f"{provider}-raw")}, timeout=30)
    assert raw.status_code == 200 and raw.content.startswith(KEEPALIVE_FIRST[provider]), raw.content[:80]
    keepalives = raw.content.count(KEEPALIVE_FIRST[provider]) - (provider == "anthropic.messages")  # its own ping
    assert keepalives >= 2, raw.content[:200]

    sid = f"{provider}-slow"
    slow = RUNNERS[provider](server.url, _key(settings, sid), True)
    assert slow == RUNNERS[provider](fast.url, _key(fast_settings, f"{provider}-fast-twin"), True)
    assert slow == (("write_file", {"path": "hello.txt", "content": "hi"}), FINAL)
    assert [c.call_index for c in reader.wait(2, session_id=sid)] == [0, 1]


def _raises_provider_error(provider, url, key):
    """The provider SDK's own error for a stream that fails after its keep-alives (not a parse failure).

    The OpenAI SDK does not raise on a failed Responses stream: it yields the API's ``error`` and
    ``response.failed`` events, as it does for OpenAI's own, and the error is the failed response's."""
    if provider == "openai.responses":
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        events = list(client.responses.create(model="gpt-5-codex", input=TASK, stream=True))
        assert [e.type for e in events] == ["response.created", "error", "response.failed"], events
        return openai.APIError(events[-1].response.error.message, request=httpx.Request("POST", url), body=None)
    try:
        RUNNERS[provider](url, key, True)
    except (anthropic.APIError, openai.APIError, genai_errors.APIError) as e:
        return e
    raise AssertionError(f"{provider}: the SDK did not raise")


@pytest.mark.parametrize("provider", list(RUNNERS))
def test_an_error_after_the_keepalive_is_the_sdks_own_error(polar_settings, scripted_engine, gateway_factory, provider,
                                                             quick_keepalive):
    from gateway.server import ThreadedServer
    from tests.plugins.gateway import slow_front

    own = {"anthropic.messages": anthropic.APIStatusError, "openai.chat": openai.APIError,
           "openai.responses": openai.APIError, "google.generate_content": genai_errors.ServerError}
    with ThreadedServer(slow_front(scripted_engine.url, 0.8, fail=True)) as up:
        gw = gateway_factory(polar_settings, up.url)
        err = _raises_provider_error(provider, gw.url, gw.key(f"{provider}-fails"))
    assert isinstance(err, own[provider]) and "engine fell over" in str(err), repr(err)
