"""Anthropic Messages adapter: Claude Code's real request shapes in, the API's JSON and SSE out."""

import json

import pytest

from gateway.canonical import ContextLengthError, RequestError
from gateway.providers import AnthropicMessages, same_arguments

from .helpers import body, events, tool_response

A = AnthropicMessages()


def test_claude_code_tool_turn_parses_to_canonical_messages():
    req = A.parse_request(body("claude_code_tool_turn"))
    roles = [m.role for m in req.messages]
    # system prompt, user turn, Claude Code's mid-conversation system message (kept in place), the call, its result
    assert roles == ["system", "user", "system", "assistant", "tool"]
    system = req.messages[0].content
    assert system.startswith("You are a Claude agent") and "billing-header" not in system
    assert req.extras["billing_header"].startswith("x-anthropic-billing-header: cc_version=2.1.197.2bb")
    assert req.messages[1].content.endswith("\nCreate hello.txt containing hi")
    call = req.messages[3].tool_calls[0]
    assert (call.id, call.name) == ("toolu_1795984795000003", "Bash")
    assert json.loads(call.arguments) == {"command": "echo hi > hello.txt && cat hello.txt", "description": "Write hi to hello.txt"}
    result = req.messages[4]
    assert (result.content, result.tool_call_id, result.name, result.is_error) == ("hi", call.id, "Bash", False)
    assert [t.name for t in req.tools][:2] == ["Agent", "Bash"] and req.tools[1].parameters["required"] == ["command"]
    assert req.sampling.max_tokens == 64000 and req.stream and req.reasoning and not req.side_call
    assert {"thinking", "output_config", "context_management", "metadata"} <= set(req.extras)


def test_billing_header_kept_when_stripping_is_off():
    req = AnthropicMessages(strip_billing_header=False).parse_request(body("claude_code_tool_turn"))
    assert req.messages[0].content.startswith("x-anthropic-billing-header: cc_version=2.1.197.2bb;")
    assert "billing_header" not in req.extras


def test_prompts_differing_only_in_billing_header_parse_identically():
    a, b = body("claude_code_tool_turn"), body("claude_code_tool_turn")
    b["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.6e2; cc_entrypoint=sdk-cli;"
    assert A.parse_request(a).messages == A.parse_request(b).messages


def test_billing_line_inside_a_larger_block_is_cut_out():
    req = A.parse_request({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                           "system": "x-anthropic-billing-header: cc_version=1; cch=ab12;\nYou are helpful."})
    assert req.messages[0].content == "You are helpful."


def test_title_request_is_a_side_call_and_agent_turn_is_not():
    title = A.parse_request(body("claude_code_title"))
    assert title.side_call and not title.reasoning and title.tools == []
    assert not A.parse_request(body("claude_code_tool_turn")).side_call


def test_server_tools_are_skipped_and_named():
    b = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "search"}],
         "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 8}]}
    req = A.parse_request(b)
    assert req.tools == [] and req.extras["skipped_tools"] == ["web_search"] and req.side_call


def test_content_blocks_thinking_images_errors_and_tool_choice():
    b = {
        "model": "m", "max_tokens": 100, "stop_sequences": ["END"], "temperature": 0.5, "top_k": 20,
        "tool_choice": {"type": "any"},
        "tools": [{"name": "Bash", "input_schema": {"type": "object", "properties": {}}}],
        "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}},
                                         {"type": "text", "text": "what is this?"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"},
                                              {"type": "redacted_thinking", "data": "xx"},
                                              {"type": "text", "text": "Let me run it."},
                                              {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "false"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                          "content": [{"type": "text", "text": "exit 1"}, {"type": "image", "source": {}}]},
                                         {"type": "text", "text": "it failed"}]},
        ],
    }
    req = A.parse_request(b)
    user, assistant, result, after = req.messages
    assert user.content == "[image]\nwhat is this?"
    assert (assistant.reasoning, assistant.content) == ("hmm", "Let me run it.")
    assert (result.role, result.content, result.is_error) == ("tool", "exit 1\n[image]", True)
    assert (after.role, after.content) == ("user", "it failed")
    assert req.tool_choice == "required"
    assert (req.sampling.stop, req.sampling.temperature, req.sampling.top_k) == (["END"], 0.5, 20)


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages.0.content.0.tool_use_id"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"model": None}, "model"),
    ],
)
def test_bad_requests_name_the_field(patch, field):
    b = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    b.update(patch)
    b = {k: v for k, v in b.items() if v is not None}
    with pytest.raises(RequestError) as e:
        A.parse_request(b)
    assert e.value.status == 400 and e.value.message.startswith(field + ":")


def test_count_tokens_body_needs_no_max_tokens():
    req = A.parse_count_tokens({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert req.sampling.max_tokens is None and req.messages[0].content == "hi"
    assert A.render_count_tokens(17) == {"input_tokens": 17}


def test_response_json_has_blocks_in_api_order():
    req = A.parse_request(body("claude_code_tool_turn"))
    out = A.render_response(req, tool_response())
    assert [b["type"] for b in out["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert out["id"] == "msg_abc123" and out["model"] == "claude-opus-4-8" and out["stop_reason"] == "tool_use"
    assert out["content"][2]["input"] == {"description": "Write hi", "command": "echo hi > hello.txt"}
    assert out["usage"]["input_tokens"] == 120 and out["usage"]["output_tokens"] == 42


@pytest.mark.parametrize(
    "finish, stop, expected",
    [("stop", "", "end_turn"), ("stop", "END", "stop_sequence"), ("length", "", "max_tokens"), ("tool_calls", "", "tool_use")],
)
def test_stop_reasons(finish, stop, expected):
    req = A.parse_request(body("claude_code_title"))
    out = A.render_response(req, tool_response(finish_reason=finish, matched_stop=stop, tool_calls=[]))
    assert out["stop_reason"] == expected and out["stop_sequence"] == (stop or None)


def test_stream_event_sequence_and_reassembly():
    req = A.parse_request(body("claude_code_tool_turn"))
    resp = tool_response()
    evs = events(b"".join(AnthropicMessages(chunk_chars=5).render_stream(req, resp)))
    names = [n for n, _ in evs]
    assert all(n == d["type"] for n, d in evs)  # every event has its `event:` line
    assert names[:3] == ["message_start", "content_block_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    blocks: dict[int, dict] = {}
    for name, data in evs:
        if name == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"], _json="")
        elif name == "content_block_delta":
            b, d = blocks[data["index"]], data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature", "input_json_delta": "_json"}[d["type"]]
            b[key] = (b.get(key, "") if key != "signature" else "") + d[{"input_json_delta": "partial_json"}.get(d["type"], key)]
    assert blocks[0]["thinking"] == resp.reasoning and blocks[0]["signature"]
    assert blocks[1]["text"] == resp.text
    assert blocks[2]["_json"] == resp.tool_calls[0].arguments  # the model's own bytes, key order kept
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use" and evs[-2][1]["usage"]["output_tokens"] == 42
    assert evs[0][1]["message"]["content"] == [] and evs[0][1]["message"]["usage"]["input_tokens"] == 120


def test_echoed_turn_matches_what_was_generated():
    """Claude Code re-orders input keys; the call id and canonical arguments still match."""
    req = A.parse_request(body("claude_code_tool_turn"))
    resp = tool_response()
    blocks = A.render_response(req, resp)["content"]
    blocks[2]["input"] = dict(reversed(list(blocks[2]["input"].items())))
    nxt = body("claude_code_tool_turn")
    nxt["messages"] += [{"role": "assistant", "content": blocks},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "ok"}]}]
    echoed = A.parse_request(nxt).messages[-2]
    assert [c.id for c in echoed.tool_calls] == ["call_1", "call_2"]
    assert all(same_arguments(e.arguments, g.arguments) for e, g in zip(echoed.tool_calls, resp.tool_calls))
    assert echoed.reasoning == resp.reasoning and echoed.content == resp.text


def test_errors_in_anthropic_shape():
    assert A.render_error(RequestError(400, "messages: Field required")) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "messages: Field required"}}
    assert A.render_error(RequestError(401, "bad key", "authentication_error"))["error"]["type"] == "authentication_error"
    assert A.render_error(RequestError(503, "kafka down"))["error"]["type"] == "overloaded_error"
    assert A.render_error(RequestError(502, "engine unreachable"))["error"]["type"] == "api_error"
    ctx = A.render_error(ContextLengthError(210_000, 200_000))
    assert ctx["error"] == {"type": "invalid_request_error", "message": "prompt is too long: 210000 tokens > 200000 maximum"}
    (name, data), = events(A.render_stream_error(RequestError(500, "boom")))
    assert name == "error" and data["error"]["type"] == "api_error"
