"""The official ``google-genai`` SDK against the generateContent adapter, streaming and not."""

import pytest
from google import genai
from google.genai import errors, types

from gateway.canonical import ContextLengthError, RequestError

from .helpers import tool_response

BASH = types.FunctionDeclaration(
    name="Bash", description="Run a command.",
    parameters_json_schema={"type": "object", "properties": {"command": {"type": "string"}}},
)  # fmt: skip
CONFIG = types.GenerateContentConfig(
    tools=[types.Tool(function_declarations=[BASH])],
    thinking_config=types.ThinkingConfig(include_thoughts=True),
    automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
)


@pytest.fixture
def client(server):
    options = types.HttpOptions(base_url=server.url, retry_options=types.HttpRetryOptions(attempts=1))
    return genai.Client(api_key="test-key", http_options=options)


def test_generate_content_with_function_calls(client, server):
    out = client.models.generate_content(model="gemini-3.8-flash", contents="Create hello.txt containing hi", config=CONFIG)
    parts = out.candidates[0].content.parts
    assert parts[0].thought and parts[0].text == "The user wants hello.txt."
    assert out.text == "I'll write the file."
    calls = out.function_calls
    assert [(c.id, c.name) for c in calls] == [("call_1", "Bash"), ("call_2", "Read")]
    assert calls[0].args == {"description": "Write hi", "command": "echo hi > hello.txt"}
    assert parts[2].thought_signature and not parts[3].thought_signature  # only a turn's first call is signed
    assert out.usage_metadata.prompt_token_count == 120 and out.usage_metadata.candidates_token_count == 42
    assert out.candidates[0].finish_reason == types.FinishReason.STOP
    req = server.state.requests[0]
    assert req.model == "gemini-3.8-flash" and not req.stream and req.reasoning and req.tools[0].name == "Bash"
    assert server.state.paths[0].endswith("/models/gemini-3.8-flash:generateContent")


def test_stream_generate_content(client, server):
    chunks = list(client.models.generate_content_stream(model="gemini-3.8-flash", contents="hi", config=CONFIG))
    text = "".join(p.text for c in chunks for p in c.candidates[0].content.parts if p.text and not p.thought)
    thoughts = "".join(p.text for c in chunks for p in c.candidates[0].content.parts if p.text and p.thought)
    calls = [p.function_call for c in chunks for p in c.candidates[0].content.parts if p.function_call]
    assert text == "I'll write the file." and thoughts == "The user wants hello.txt."
    assert [c.name for c in calls] == ["Bash", "Read"] and calls[1].args == {"file_path": "/tmp/hello.txt"}
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    assert chunks[-1].usage_metadata.total_token_count == 162
    assert server.state.requests[0].stream and server.state.paths[0].endswith("/models/gemini-3.8-flash:streamGenerateContent")


def test_truncated_answer_finishes_with_max_tokens(client, server):
    server.state.response = tool_response(tool_calls=[], reasoning="", finish_reason="length")
    out = client.models.generate_content(model="m", contents="hi")
    assert out.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS


def test_count_tokens(client, server):
    server.state.count = 1234
    assert client.models.count_tokens(model="m", contents="hello").total_tokens == 1234


@pytest.mark.parametrize(
    "err, exc, status",
    [
        (RequestError(400, "contents: Field required"), errors.ClientError, "INVALID_ARGUMENT"),
        (RequestError(401, "unknown session key"), errors.ClientError, "UNAUTHENTICATED"),
        (RequestError(503, "recording unavailable"), errors.ServerError, "UNAVAILABLE"),
        (ContextLengthError(1_100_000, 1_048_576), errors.ClientError, "INVALID_ARGUMENT"),
    ],
)
def test_errors_become_sdk_exceptions(client, server, err, exc, status):
    server.state.error = err
    with pytest.raises(exc) as e:
        client.models.generate_content(model="m", contents="hi")
    assert e.value.code == err.status and e.value.status == status
    if isinstance(err, ContextLengthError):
        assert "input token count (1100000) exceeds the maximum number of tokens allowed (1048576)" in e.value.message


def test_mid_stream_error_chunk_raises(client, server):
    server.state.stream_error = RequestError(500, "engine crashed")
    with pytest.raises(errors.ServerError) as e:
        list(client.models.generate_content_stream(model="m", contents="hi"))
    assert e.value.code == 500 and "engine crashed" in e.value.message
