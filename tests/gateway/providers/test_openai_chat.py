"""Chat Completions adapter: Qwen Code / opencode request shapes in, JSON and SSE chunks out."""

import json

import pytest

from gateway.canonical import RequestError
from gateway.providers import OpenAIChat, same_arguments

from .helpers import body, events, tool_response

C = OpenAIChat()


def test_qwen_code_tool_turn():
    req = C.parse_request(body("qwen_code_tool_turn"))
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "user", "assistant", "tool"]
    call = req.messages[4].tool_calls[0]
    assert (call.id, call.name) == ("call_1795984918000002", "run_shell_command")
    # compact echo re-rendered in the one fixed form
    assert call.arguments == '{"description": "Write hi to hello.txt", "command": "echo hi > hello.txt && cat hello.txt"}'
    tool = req.messages[5]
    assert tool.content.startswith("Command: echo hi") and tool.name == "run_shell_command" and tool.tool_call_id == call.id
    assert req.messages[4].content == ""  # content: null
    assert req.sampling.max_tokens == 8000 and req.stream and req.extras["include_usage"] is True
    assert len(req.tools) == 8 and req.tools[6].name == "run_shell_command" and not req.side_call


def test_opencode_title_is_a_side_call():
    assert C.parse_request(body("opencode_title")).side_call


def test_roles_parts_reasoning_and_sampling():
    req = C.parse_request({
        "model": "m", "max_completion_tokens": 50, "max_tokens": 999, "temperature": 0.2, "top_p": 0.9, "stop": "END",
        "seed": 7, "reasoning_effort": "high", "tool_choice": {"type": "function", "function": {"name": "Bash"}},
        "response_format": {"type": "text"}, "frequency_penalty": 0.5,
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:"}}]},
            {"role": "assistant", "content": "", "reasoning_content": "thinking...", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": "{\"a\":1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
    })
    system, user, assistant, tool = req.messages
    assert system.role == "system" and user.content == "look\n[image]"
    assert assistant.reasoning == "thinking..." and assistant.tool_calls[0].arguments == '{"a": 1}'
    assert tool.name == "Bash"
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.stop, s.seed) == (50, 0.2, 0.9, ["END"], 7)
    assert req.reasoning and req.tool_choice == "Bash"
    assert req.extras["ignored_fields"] == ["frequency_penalty"]


def test_reasoning_field_echo_and_unparseable_arguments_kept():
    req = C.parse_request({"model": "m", "messages": [
        {"role": "assistant", "content": "x", "reasoning": "r", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]})
    msg = req.messages[0]
    assert msg.reasoning == "r" and msg.tool_calls[0].arguments == "{not json"


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"messages": None}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content.0.type"),
        ({"n": 3}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"tool_choice": "maybe"}, "tool_choice"),
        ({"stop": [1]}, "stop.0"),
    ],
)
def test_bad_requests_name_the_field(patch, field):
    b = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **patch}
    b = {k: v for k, v in b.items() if v is not None}
    with pytest.raises(RequestError) as e:
        C.parse_request(b)
    assert e.value.status == 400 and e.value.message.startswith(field + ":")


def test_response_json():
    req = C.parse_request(body("qwen_code_tool_turn"))
    out = C.render_response(req, tool_response())
    msg = out["choices"][0]["message"]
    assert out["object"] == "chat.completion" and out["id"] == "chatcmpl-abc123" and out["model"] == "stub-model"
    assert msg["tool_calls"][0] == {"id": "call_1", "type": "function",
                                    "function": {"name": "Bash", "arguments": '{"description": "Write hi", "command": "echo hi > hello.txt"}'}}
    assert msg["reasoning_content"] == "The user wants hello.txt." and out["choices"][0]["finish_reason"] == "tool_calls"
    only_calls = C.render_response(req, tool_response(text=""))["choices"][0]["message"]
    assert only_calls["content"] is None


def test_stream_chunks_in_order_with_usage_and_done():
    req = C.parse_request(body("qwen_code_tool_turn"))
    evs = events(b"".join(OpenAIChat(chunk_chars=10).render_stream(req, tool_response())))
    assert evs[-1] == (None, "[DONE]")
    chunks = [d for _, d in evs[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 162
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    first_call = next(d["tool_calls"][0] for d in deltas if "tool_calls" in d)
    assert first_call["id"] == "call_1" and first_call["function"] == {"name": "Bash", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d and d["tool_calls"][0]["index"] == 0)
    assert args == '{"description": "Write hi", "command": "echo hi > hello.txt"}'


def test_stream_without_include_usage_has_no_usage_chunk():
    req = C.parse_request({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    chunks = [d for _, d in events(b"".join(C.render_stream(req, tool_response(tool_calls=[]))))][:-1]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_compact_echo_matches_generated_call():
    """Qwen Code echoes arguments compacted; ids match and canonical arguments compare equal."""
    resp = tool_response()
    b = body("qwen_code_tool_turn")
    msg = C.render_response(C.parse_request(b), resp)["choices"][0]["message"]
    for c in msg["tool_calls"]:
        c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":"))
    b["messages"] += [{**msg, "content": ""}, {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    echoed = C.parse_request(b).messages[-2]
    assert [c.id for c in echoed.tool_calls] == ["call_1", "call_2"]
    assert all(same_arguments(e.arguments, g.arguments) for e, g in zip(echoed.tool_calls, resp.tool_calls))
    assert echoed.tool_calls[0].arguments == resp.tool_calls[0].arguments  # re-rendered to the same bytes
    assert echoed.reasoning == resp.reasoning


def test_errors():
    err = C.render_error(RequestError(400, "messages: Field required"))
    assert err == {"error": {"message": "messages: Field required", "type": "invalid_request_error", "param": None, "code": None}}
    assert C.render_error(RequestError(504, "engine timed out"))["error"]["type"] == "timeout"
    (name, data), = events(C.render_stream_error(RequestError(502, "engine unreachable")))
    assert name is None and data["error"]["message"] == "engine unreachable"
