"""The official ``openai`` SDK against the Chat Completions and Responses adapters."""

import json

import openai
import pytest

from gateway.canonical import ContextLengthError, RequestError

from .helpers import tool_response

CHAT_TOOLS = [
    {"type": "function", "function": {"name": "Bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "Read", "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}}}}},
]
RESP_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in CHAT_TOOLS]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Create hello.txt containing hi"}]


@pytest.fixture
def client(server):
    return openai.OpenAI(api_key="sk-test", base_url=server.url + "/v1", max_retries=0)


# ---------------------------------------------------------------------------------- chat completions


def test_chat_create_with_tool_calls(client, server):
    out = client.chat.completions.create(model="stub-model", messages=MESSAGES, tools=CHAT_TOOLS, max_tokens=100)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I'll write the file."
    assert [c.function.name for c in choice.message.tool_calls] == ["Bash", "Read"]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"description": "Write hi", "command": "echo hi > hello.txt"}
    assert out.usage.total_tokens == 162 and out.model == "stub-model"
    assert choice.message.model_extra["reasoning_content"] == "The user wants hello.txt."


def test_chat_stream_accumulates_tool_call_arguments(client, server):
    stream = client.chat.completions.create(model="stub-model", messages=MESSAGES, tools=CHAT_TOOLS, stream=True,
                                            stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                c["id"] = tc.id or c["id"]
                c["name"] = (tc.function.name if tc.function else None) or c["name"]
                c["arguments"] += (tc.function.arguments if tc.function else None) or ""
    assert text == "I'll write the file." and finish == "tool_calls" and usage.completion_tokens == 42
    assert calls[0] == {"id": "call_1", "name": "Bash", "arguments": '{"description": "Write hi", "command": "echo hi > hello.txt"}'}
    assert calls[1]["name"] == "Read" and json.loads(calls[1]["arguments"]) == {"file_path": "/tmp/hello.txt"}


def test_chat_stream_helper_final_completion(client, server):
    with client.chat.completions.stream(model="stub-model", messages=MESSAGES, tools=CHAT_TOOLS) as stream:
        final = stream.get_final_completion()
    assert [c.function.name for c in final.choices[0].message.tool_calls] == ["Bash", "Read"]
    assert final.choices[0].message.content == "I'll write the file."


def test_chat_context_overflow_error(client, server):
    server.state.error = ContextLengthError(40_000, 32_768)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert e.value.code == "context_length_exceeded" and "maximum context length is 32768 tokens" in e.value.message


@pytest.mark.parametrize(
    "err, exc",
    [
        (RequestError(401, "unknown session key", "authentication_error"), openai.AuthenticationError),
        (RequestError(429, "slow down"), openai.RateLimitError),
        (RequestError(503, "recording unavailable", headers={"retry-after": "1"}), openai.InternalServerError),
    ],
)
def test_chat_http_errors(client, server, err, exc):
    server.state.error = err
    with pytest.raises(exc) as e:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert e.value.status_code == err.status and e.value.body["message"] == err.message


def test_chat_mid_stream_error_raises(client, server):
    server.state.stream_error = RequestError(502, "engine went away")
    with pytest.raises(openai.APIError, match="engine went away"):
        list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))


# ---------------------------------------------------------------------------------- responses


def test_responses_create_with_function_calls(client, server):
    out = client.responses.create(model="stub-model", input="Create hello.txt containing hi", tools=RESP_TOOLS,
                                  reasoning={"effort": "high"})
    assert out.status == "completed" and [i.type for i in out.output] == ["reasoning", "message", "function_call", "function_call"]
    assert out.output_text == "I'll write the file."
    call = out.output[2]
    assert (call.call_id, call.name, call.id) == ("call_1", "Bash", "fc_1")
    assert json.loads(call.arguments) == {"description": "Write hi", "command": "echo hi > hello.txt"}
    assert out.usage.input_tokens == 120 and out.usage.output_tokens == 42
    assert server.state.requests[0].reasoning


def test_responses_stream_final_response(client, server):
    deltas = []
    with client.responses.stream(model="stub-model", input="Create hello.txt containing hi", tools=RESP_TOOLS) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output_text == "I'll write the file."
    assert final.output[0].content[0].text == "The user wants hello.txt."
    assert "".join(deltas) == final.output[2].arguments + final.output[3].arguments
    assert final.output[3].name == "Read" and json.loads(final.output[3].arguments) == {"file_path": "/tmp/hello.txt"}


def test_responses_raw_stream_sequence_numbers(client, server):
    evs = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[0].type == "response.created" and evs[-1].type == "response.completed"


def test_responses_truncated_answer_is_incomplete(client, server):
    server.state.response = tool_response(tool_calls=[], finish_reason="length")
    out = client.responses.create(model="m", input="hi")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    evs = list(client.responses.create(model="m", input="hi", stream=True))
    assert evs[-1].type == "response.incomplete"


def test_responses_errors(client, server):
    server.state.error = ContextLengthError(300_000, 272_000)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi")
    assert e.value.code == "context_length_exceeded" and e.value.param == "input"
    server.state.error = None
    server.state.stream_error = ContextLengthError(300_000, 272_000)
    evs = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in evs] == ["response.created", "error", "response.failed"]
    assert evs[-1].response.error.code == "context_length_exceeded"
    with pytest.raises(RuntimeError, match="response.completed"):  # the stream helper reports the failed turn
        with client.responses.stream(model="m", input="hi") as stream:
            stream.get_final_response()


def test_responses_input_tokens(client, server):
    server.state.count = 99
    assert client.responses.input_tokens.count(model="m", input="hi").input_tokens == 99
