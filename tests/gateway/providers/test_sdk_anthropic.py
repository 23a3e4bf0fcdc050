"""The official ``anthropic`` SDK against the Anthropic adapter, streaming and not, with tool calls."""

import anthropic
import pytest

from gateway.canonical import ContextLengthError, RequestError

from .helpers import tool_response

TOOLS = [
    {"name": "Bash", "description": "Run a command.", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
    {"name": "Read", "description": "Read a file.", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}},
]
MESSAGES = [{"role": "user", "content": "Create hello.txt containing hi"}]


@pytest.fixture
def client(server):
    return anthropic.Anthropic(api_key="sk-test", base_url=server.url, max_retries=0)


def test_create_returns_thinking_text_and_tool_use(client, server):
    msg = client.messages.create(model="claude-opus-4-8", max_tokens=256, messages=MESSAGES, tools=TOOLS)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg.content[2].input == {"description": "Write hi", "command": "echo hi > hello.txt"}
    assert (msg.content[2].id, msg.content[3].name) == ("call_1", "Read")
    assert msg.stop_reason == "tool_use" and msg.usage.input_tokens == 120 and msg.usage.output_tokens == 42
    assert msg.model == "claude-opus-4-8"
    assert server.state.requests[0].tools[0].name == "Bash" and not server.state.requests[0].stream


def test_stream_final_message_has_tool_input(client, server):
    with client.messages.stream(model="claude-opus-4-8", max_tokens=256, messages=MESSAGES, tools=TOOLS,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "I'll write the file."
    assert final.content[0].thinking == "The user wants hello.txt." and final.content[0].signature
    assert final.content[2].input == {"description": "Write hi", "command": "echo hi > hello.txt"}
    assert final.content[3].input == {"file_path": "/tmp/hello.txt"}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 42
    assert server.state.requests[0].stream and server.state.requests[0].reasoning


def test_plain_text_stream_with_stop_sequence(client, server):
    server.state.response = tool_response(tool_calls=[], reasoning="", finish_reason="stop", matched_stop="###")
    with client.messages.stream(model="m", max_tokens=64, messages=MESSAGES, stop_sequences=["###"]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text"]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "###")


def test_count_tokens(client, server):
    server.state.count = 321
    assert client.messages.count_tokens(model="m", messages=MESSAGES).input_tokens == 321


@pytest.mark.parametrize(
    "err, exc",
    [
        (RequestError(400, "messages: bad"), anthropic.BadRequestError),
        (RequestError(401, "unknown session key", "authentication_error"), anthropic.AuthenticationError),
        (RequestError(413, "request body too large"), anthropic.APIStatusError),
        (RequestError(503, "recording unavailable", headers={"retry-after": "1"}), anthropic.InternalServerError),
    ],
)
def test_http_errors_become_sdk_exceptions(client, server, err, exc):
    server.state.error = err
    with pytest.raises(exc) as e:
        client.messages.create(model="m", max_tokens=8, messages=MESSAGES)
    assert e.value.status_code == err.status and e.value.body["error"]["message"] == err.message


def test_context_overflow_is_worded_like_anthropic(client, server):
    server.state.error = ContextLengthError(250_000, 200_000)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=8, messages=MESSAGES)
    assert "prompt is too long: 250000 tokens > 200000 maximum" in str(e.value)


def test_mid_stream_error_event_raises(client, server):
    server.state.stream_error = RequestError(529, "engine overloaded", "overloaded_error")
    with pytest.raises(anthropic.APIStatusError) as e:
        with client.messages.stream(model="m", max_tokens=8, messages=MESSAGES) as stream:
            stream.get_final_message()
    assert e.value.body["error"]["type"] == "overloaded_error"
