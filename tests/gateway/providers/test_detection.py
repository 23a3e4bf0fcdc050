"""Provider detection and routes: path first (any base prefix), then headers, then body shape."""

import pytest

from gateway.providers import ADAPTERS, Route, detect_provider, parse_route

from .helpers import body


@pytest.mark.parametrize(
    "path, expected",
    [
        ("/v1/messages?beta=true", Route("anthropic.messages")),
        ("/gw/v1/messages", Route("anthropic.messages")),
        ("/v1/messages/count_tokens", Route("anthropic.messages", "count_tokens")),
        ("/s/sess-1/v1/chat/completions", Route("openai.chat")),
        ("/v1/responses", Route("openai.responses")),
        ("/v1/responses/input_tokens", Route("openai.responses", "count_tokens")),
        ("/v1beta/models/gemini-3.8-flash:streamGenerateContent?alt=sse", Route("google.generate_content", model="gemini-3.8-flash", stream=True)),
        ("/gw/v1beta/models/gemini-3.5-flash-lite:generateContent", Route("google.generate_content", model="gemini-3.5-flash-lite", stream=False)),
        ("/v1beta/models/m:countTokens", Route("google.generate_content", "count_tokens", model="m", stream=False)),
    ],
)
def test_path_decides_first(path, expected):
    assert parse_route(path) == expected
    # headers and a body that point elsewhere do not override the path
    misleading = {"anthropic-version": "2023-06-01"} if expected.provider != "anthropic.messages" else {"x-goog-api-key": "k"}
    assert parse_route(path, misleading, {"contents": [], "input": "x"}) == expected


def test_headers_then_body_for_unknown_paths():
    assert detect_provider("/proxy", {"Anthropic-Version": "2023-06-01"}, {"input": "x"}) == "anthropic.messages"
    assert detect_provider("/proxy", {"x-goog-api-key": "k"}, {}) == "google.generate_content"
    assert detect_provider("/proxy", {}, body("gemini_cli_tool_turn")) == "google.generate_content"
    assert detect_provider("/proxy", {}, body("codex_tool_turn")) == "openai.responses"
    assert detect_provider("/proxy", {}, body("qwen_code_tool_turn")) == "openai.chat"
    assert detect_provider("/proxy", {}, None) == "openai.chat"


def test_registry_holds_one_adapter_per_provider():
    assert set(ADAPTERS) == {"anthropic.messages", "openai.chat", "openai.responses", "google.generate_content"}
    for name, adapter in ADAPTERS.items():
        assert adapter.name == name
        for method in ("parse_request", "parse_count_tokens", "render_response", "render_stream", "render_error",
                       "render_stream_error", "render_keepalive", "render_count_tokens"):
            assert callable(getattr(adapter, method))
    with pytest.raises(TypeError):
        ADAPTERS["x"] = ADAPTERS["openai.chat"]  # read-only
