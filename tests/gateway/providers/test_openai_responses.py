"""Responses adapter: Codex's request shape in, response objects and the event stream out."""

import json

import pytest

from gateway.canonical import ContextLengthError, RequestError, ToolCall
from gateway.providers import OpenAIResponses

from .helpers import body, events, tool_response

R = OpenAIResponses()


def test_codex_tool_turn():
    req = R.parse_request(body("codex_tool_turn"))
    assert [m.role for m in req.messages] == ["system", "system", "user", "assistant", "tool"]
    assert req.messages[0].content.startswith("You are a coding agent running in the Codex CLI")
    assert req.messages[1].content == "<skills_instructions>none</skills_instructions>\n<permissions instructions>full access</permissions instructions>"
    call = req.messages[3].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments)) == ("call_1795984842000003", "exec_command", {"cmd": "echo hi > hello.txt && cat hello.txt"})
    assert req.messages[4].tool_call_id == call.id and req.messages[4].name == "exec_command"
    names = [t.name for t in req.tools]
    assert "multi_agent_v1.spawn_agent" in names and "web_search" not in names
    assert req.extras["dropped_tools"] == ["web_search"]
    assert req.extras["namespaced_tools"]["multi_agent_v1.wait_agent"] == ["multi_agent_v1", "wait_agent"]
    assert req.extras["store"] is False and req.extras["prompt_cache_key"].startswith("01a22909")
    assert req.reasoning and req.stream and req.tool_choice == "auto" and not req.side_call


def test_codex_echo_is_the_exact_output_item():
    """Codex appends our function_call item byte for byte: ids derive from the call, so they are stable."""
    resp = tool_response(id="resp_r1", tool_calls=[ToolCall("call_9", "exec_command", '{"cmd": "ls"}')], text="", reasoning="")
    b = body("codex_tool_turn")
    req = R.parse_request(b)
    item = R.render_response(req, resp)["output"][0]
    assert item == {"type": "function_call", "id": "fc_9", "call_id": "call_9", "name": "exec_command", "arguments": '{"cmd": "ls"}', "status": "completed"}
    assert R.render_response(req, resp)["output"][0] == item  # a re-render is identical
    b["input"] += [item, {"type": "function_call_output", "call_id": "call_9", "output": "a.txt"}]
    echoed = R.parse_request(b).messages[-2]
    assert echoed.tool_calls == [ToolCall("call_9", "exec_command", '{"cmd": "ls"}')]


def test_turn_of_reasoning_message_and_calls_becomes_one_assistant_message():
    req = R.parse_request({"model": "m", "instructions": "be good", "input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}], "content": [{"type": "reasoning_text", "text": "long"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running."}]},
        {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "spawned"}]},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "patched"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
    ]})
    system, user, assistant, out1, out2 = req.messages
    assert system.content == "be good" and user.content == "hi"
    assert (assistant.reasoning, assistant.content) == ("long", "Running.")
    assert [(c.id, c.name) for c in assistant.tool_calls] == [("c1", "multi_agent_v1.spawn_agent"), ("c2", "apply_patch")]
    assert json.loads(assistant.tool_calls[1].arguments) == {"input": "*** Begin Patch"}
    assert (out1.content, out1.name, out2.name) == ("spawned", "multi_agent_v1.spawn_agent", "apply_patch")
    assert req.extras["skipped_items"] == ["web_search_call"] and not req.reasoning


def test_custom_and_namespaced_calls_render_back_in_codex_shape():
    req = R.parse_request({"model": "m", "input": "hi", "tools": [
        {"type": "custom", "name": "apply_patch", "description": "Patch files.", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
        {"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "function", "name": "go", "parameters": {"type": "object"}}]},
    ]})
    assert req.tools[0].parameters["required"] == ["input"] and "start: x" in req.tools[0].description
    resp = tool_response(text="", reasoning="", tool_calls=[
        ToolCall("call_a", "apply_patch", '{"input": "*** Begin Patch"}'), ToolCall("call_b", "ns.go", '{"x": 1}')])
    custom, namespaced = R.render_response(req, resp)["output"]
    assert custom == {"type": "custom_tool_call", "id": "ctc_a", "call_id": "call_a", "name": "apply_patch", "input": "*** Begin Patch", "status": "completed"}
    assert (namespaced["name"], namespaced["namespace"], namespaced["arguments"]) == ("go", "ns", '{"x": 1}')
    evs = events(b"".join(R.render_stream(req, resp)))
    assert "response.custom_tool_call_input.delta" in [n for n, _ in evs]


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"input": None}, "input"),
        ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input.0.role"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_bad_requests_name_the_field(patch, field):
    b = {"model": "m", "input": "hi", **patch}
    b = {k: v for k, v in b.items() if v is not None}
    with pytest.raises(RequestError) as e:
        R.parse_request(b)
    assert e.value.status == 400 and e.value.message.startswith(field + ":")


def test_event_stream_order_and_sequence_numbers():
    req = R.parse_request(body("codex_tool_turn"))
    evs = events(b"".join(OpenAIResponses(chunk_chars=6).render_stream(req, tool_response())))
    names = [n for n, _ in evs]
    assert all(n == d["type"] for n, d in evs) and [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-1] == "response.completed"
    message_events = [n for n, d in evs if d.get("output_index") == 1]
    assert message_events[0] == "response.output_item.added" and message_events[-1] == "response.output_item.done"
    assert message_events[1:3] == ["response.content_part.added", "response.output_text.delta"]
    assert {"response.output_text.done", "response.content_part.done"} <= set(message_events)
    args = "".join(d["delta"] for n, d in evs if n == "response.function_call_arguments.delta" and d["output_index"] == 2)
    assert args == tool_response().tool_calls[0].arguments
    done = [d["item"] for n, d in evs if n == "response.output_item.done"]
    assert done == evs[-1][1]["response"]["output"]  # what Codex records equals the final response
    assert evs[0][1]["response"]["status"] == "in_progress" and evs[-1][1]["response"]["usage"]["total_tokens"] == 162


def test_errors_and_mid_stream_failure():
    err = R.render_error(ContextLengthError(300_000, 272_000))["error"]
    assert (err["code"], err["param"], err["type"]) == ("context_length_exceeded", "input", "invalid_request_error")
    evs = events(R.render_stream_error(ContextLengthError(300_000, 272_000)))
    assert [n for n, _ in evs] == ["response.created", "error", "response.failed"]
    assert [d["sequence_number"] for _, d in evs] == [0, 1, 2] and evs[0][1]["response"]["id"] == evs[2][1]["response"]["id"]
    failed = evs[2][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "context_length_exceeded"
    assert evs[1][1]["code"] == "context_length_exceeded"
    *_, (_, other) = events(R.render_stream_error(RequestError(502, "engine unreachable")))
    assert other["response"]["error"] == {"code": "server_error", "message": "engine unreachable"}
    assert R.render_count_tokens(5) == {"object": "response.input_tokens", "input_tokens": 5}
