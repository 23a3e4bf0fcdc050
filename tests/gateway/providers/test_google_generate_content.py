"""Google adapter: Gemini CLI's request shapes (both key spellings) in, GenerateContentResponse out."""

import json

import orjson
import pytest

from gateway.canonical import RequestError, ToolCall
from gateway.providers import GoogleGenerateContent, same_arguments

from .helpers import body, events, tool_response

G = GoogleGenerateContent()


def test_gemini_cli_tool_turn():
    req = G.parse_request(body("gemini_cli_tool_turn"), model="gemini-3.8-flash", stream=True)
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert req.messages[1].content.endswith("</session_context>\nCreate hello.txt containing hi")
    call = req.messages[2].tool_calls[0]
    assert call.id == "run_shell_command_1795984893368_0"  # the CLI's own id is kept
    assert json.loads(call.arguments) == {"description": "Write hi to hello.txt", "command": "echo hi > hello.txt && cat hello.txt"}
    tool = req.messages[3]
    assert tool.tool_call_id == call.id and tool.content.startswith("<untrusted_context>\nOutput: hi") and not tool.is_error
    assert req.model == "gemini-3.8-flash" and req.stream and req.reasoning
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k) == (1.0, 0.95, 64)
    assert [t.name for t in req.tools][-2:] == ["run_shell_command", "google_web_search"] and not req.side_call


def test_router_request_is_a_side_call():
    req = G.parse_request(body("gemini_cli_router"), model="gemini-3.5-flash-lite", stream=False)
    assert req.side_call and req.extras["generationConfig.responseMimeType"] == "application/json"


def test_calls_without_ids_get_stable_position_ids_and_results_match_them():
    b = {"contents": [
        {"role": "user", "parts": [{"text": "go"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "ls", "args": {}}}, {"functionCall": {"name": "cat", "args": {"f": "a"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "cat", "response": {"output": "A"}}},
                                   {"functionResponse": {"name": "ls", "response": {"error": "denied"}}}]},
    ]}
    first = G.parse_request(b, model="m")
    calls = first.messages[1].tool_calls
    assert [c.id for c in calls] == ["call_1_0_ls", "call_1_1_cat"]
    cat, ls = first.messages[2], first.messages[3]
    assert (cat.tool_call_id, cat.content) == ("call_1_1_cat", "A")
    assert (ls.tool_call_id, ls.content, ls.is_error) == ("call_1_0_ls", "denied", True)
    assert G.parse_request(b, model="m").messages == first.messages  # same history, same ids


def test_snake_case_keys_as_google_genai_sends_them():
    b = {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]},
                     {"role": "model", "parts": [{"function_call": {"name": "f", "args": {"x": 1}}, "thought_signature": "c2ln"}]},
                     {"role": "user", "parts": [{"function_response": {"name": "f", "response": {"result": {"ok": True}}}}]}],
        "system_instruction": {"parts": [{"text": "sys"}]},
        "tools": [{"function_declarations": [{"name": "f", "parameters_json_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}]},
                  {"google_search": {}}],
        "tool_config": {"function_calling_config": {"mode": "ANY", "allowed_function_names": ["f"]}},
        "generation_config": {"max_output_tokens": 99, "top_k": 3.0, "stop_sequences": ["Z"],
                              "thinking_config": {"include_thoughts": True, "thinking_budget": 128}},
    }
    req = G.parse_request(b, model="models/m")
    assert req.model == "m" and req.messages[0].content == "sys"
    assert req.messages[2].tool_calls[0].arguments == '{"x": 1}'
    assert req.messages[3].content == '{"result": {"ok": true}}'
    assert req.tools[0].parameters["properties"]["x"] == {"type": "integer"} and req.extras["dropped_tools"] == ["google_search"]
    assert (req.sampling.max_tokens, req.sampling.top_k, req.sampling.stop) == (99, 3, ["Z"])
    assert req.tool_choice == "f" and req.reasoning


def test_openapi_parameters_become_json_schema():
    b = {"contents": [{"parts": [{"text": "hi"}]}], "tools": [{"functionDeclarations": [
        {"name": "f", "parameters": {"type": "OBJECT", "properties": {"type": {"type": "STRING", "enum": ["A", "B"]}}, "required": ["type"]}}]}]}
    params = G.parse_request(b, model="m").tools[0].parameters
    assert params == {"type": "object", "properties": {"type": {"type": "string", "enum": ["A", "B"]}}, "required": ["type"]}


@pytest.mark.parametrize(
    "b, model, field",
    [
        ({"contents": [{"parts": [{"text": "x"}]}]}, None, "model"),
        ({}, "m", "contents"),
        ({"contents": []}, "m", "contents"),
        ({"contents": [{"role": "system", "parts": []}]}, "m", "contents.0.role"),
        ({"contents": [{"parts": [{"functionCall": {"args": {}}}], "role": "model"}]}, "m", "contents.0.parts.0.functionCall.name"),
        ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"candidateCount": 2}}, "m", "generationConfig.candidateCount"),
        ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"maxOutputTokens": "lots"}}, "m", "generationConfig.maxOutputTokens"),
    ],
)
def test_bad_requests_name_the_field(b, model, field):
    with pytest.raises(RequestError) as e:
        G.parse_request(b, model=model)
    assert e.value.status == 400 and e.value.message.startswith(field + ":")


def test_count_tokens_accepts_a_wrapped_generate_request():
    req = G.parse_count_tokens({"generateContentRequest": {"model": "models/m", "contents": [{"parts": [{"text": "hi"}]}]}})
    assert req.model == "m" and req.messages[0].content == "hi"
    assert G.render_count_tokens(3) == {"totalTokens": 3}


def test_response_and_stream():
    req = G.parse_request(body("gemini_cli_tool_turn"), model="gemini-3.8-flash", stream=True)
    out = G.render_response(req, tool_response())
    parts = out["candidates"][0]["content"]["parts"]
    assert parts[0] == {"text": "The user wants hello.txt.", "thought": True} and parts[1] == {"text": "I'll write the file."}
    assert parts[2]["functionCall"] == {"id": "call_1", "name": "Bash", "args": {"description": "Write hi", "command": "echo hi > hello.txt"}}
    assert parts[2]["thoughtSignature"] and "thoughtSignature" not in parts[3]
    assert out["candidates"][0]["finishReason"] == "STOP" and out["usageMetadata"]["totalTokenCount"] == 162
    chunks = [d for _, d in events(b"".join(GoogleGenerateContent(chunk_chars=8).render_stream(req, tool_response())))]
    assert all("finishReason" not in c["candidates"][0] and "usageMetadata" not in c for c in chunks[:-1])
    assert chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    streamed = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    assert "".join(p["text"] for p in streamed if p.get("thought")) == "The user wants hello.txt."
    assert [p for p in streamed if "functionCall" in p] == parts[2:]
    assert G.render_response(req, tool_response(text="", reasoning="", tool_calls=[]))["candidates"][0]["content"]["parts"] == [{"text": ""}]


def test_echo_with_our_ids_and_signature_matches_generated_calls():
    resp = tool_response(tool_calls=[ToolCall("call_1", "run_shell_command", '{"command": "ls", "description": "list"}')])
    b = body("gemini_cli_tool_turn")
    model_turn = G.render_response(G.parse_request(b, model="m"), resp)["candidates"][0]["content"]
    args = model_turn["parts"][2]["functionCall"]["args"]
    model_turn["parts"][2]["functionCall"]["args"] = dict(reversed(list(args.items())))
    b["contents"] += [model_turn, {"role": "user", "parts": [{"functionResponse": {"id": "call_1", "name": "run_shell_command", "response": {"output": "x"}}}]}]
    echoed = G.parse_request(b, model="m").messages[-2]
    assert echoed.tool_calls[0].id == "call_1" and same_arguments(echoed.tool_calls[0].arguments, resp.tool_calls[0].arguments)
    assert (echoed.reasoning, echoed.content) == (resp.reasoning, resp.text)


def test_errors():
    assert G.render_error(RequestError(429, "slow down")) == {"error": {"code": 429, "message": "slow down", "status": "RESOURCE_EXHAUSTED"}}
    assert G.render_error(RequestError(504, "engine timed out"))["error"]["status"] == "DEADLINE_EXCEEDED"
    # A bare JSON line: google-genai (Python) keys on the '{"error":' prefix, the JS SDK on a chunk that parses.
    assert orjson.loads(G.render_stream_error(RequestError(500, "boom"))) == {
        "error": {"code": 500, "message": "boom", "status": "INTERNAL"}}
    assert G.render_stream_error(RequestError(500, "boom")).startswith(b'{"error":')
    assert G.render_keepalive().strip() == b""  # whitespace: the only keep-alive both Google SDKs skip
