"""The gateway's one canonical chat form.

Every provider adapter parses its wire request into a ``ChatRequest`` and renders a ``ChatResponse``
back into its wire format (JSON or SSE). The core (templating, token-in/token-out, sessions, events)
only ever sees these types, so a fifth provider is one more adapter module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "error"]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text; adapters canonicalise (json.dumps(..., sort_keys=False)) what they parse


@dataclass
class Message:
    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # assistant only
    tool_call_id: str = ""  # tool only: which call this result answers
    name: str = ""  # tool only: the tool's name, where the provider says it
    reasoning: str = ""  # assistant only: thinking text the harness echoed back
    is_error: bool = False  # tool only: the harness marked this result as a failure


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass
class Sampling:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class ChatRequest:
    provider: str  # schemas.records.Provider value
    model: str  # as the harness asked; the gateway serves its own model under any name
    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    stream: bool = False
    tool_choice: str = "auto"  # auto | none | required | <tool name>
    reasoning: bool = False  # the harness asked for thinking
    side_call: bool = False  # title generation, routers, memory extraction...
    extras: dict[str, Any] = field(default_factory=dict)  # provider-only fields worth recording


@dataclass
class ChatResponse:
    id: str
    model: str
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    matched_stop: str = ""  # the stop sequence that ended generation, if one did (Anthropic reports it)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    created: float = 0.0


class RequestError(Exception):
    """A request the gateway refuses; adapters render it in their provider's error shape.

    ``kind`` is a hint in OpenAI's vocabulary (invalid_request_error, authentication_error,
    permission_error, not_found_error, request_too_large, rate_limit_error, api_error, overloaded_error,
    timeout_error); each adapter maps it, or else the status, onto its provider's own error types.
    """

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.headers = headers or {}


class ContextLengthError(RequestError):
    """The prompt does not fit the served model's context.

    Every adapter words this the way its provider does, because harnesses recognise those exact words
    (or codes) and compact their history instead of giving up.
    """

    def __init__(self, prompt_tokens: int, limit: int):
        super().__init__(400, f"prompt is too long: {prompt_tokens} tokens > {limit} maximum", "context_length_exceeded")
        self.prompt_tokens, self.limit = prompt_tokens, limit


class ProviderAdapter(Protocol):
    """One provider's wire format. Pure functions of their inputs: no I/O."""

    name: str

    def parse_request(self, body: dict[str, Any], *, model: str | None = None, stream: bool | None = None) -> ChatRequest:
        """Wire request -> ChatRequest; raises RequestError(400, ...) naming the bad field.

        ``model``/``stream`` come from the URL where the provider puts them there (Google).
        """

    def parse_count_tokens(self, body: dict[str, Any], *, model: str | None = None) -> ChatRequest:
        """The body of the provider's count-tokens route -> ChatRequest (generation fields optional)."""

    def render_response(self, req: ChatRequest, resp: ChatResponse) -> dict[str, Any]:
        """Non-streaming JSON body."""

    def render_stream(self, req: ChatRequest, resp: ChatResponse) -> Iterator[bytes]:
        """SSE byte chunks synthesized from a complete response, exactly as the provider streams."""

    def render_error(self, err: RequestError) -> dict[str, Any]:
        """Error body in the provider's shape (status comes from ``err.status``)."""

    def render_stream_error(self, err: RequestError) -> bytes:
        """An error as the provider sends it mid-stream (SSE event)."""

    def render_keepalive(self) -> bytes:
        """Bytes sent while a streamed answer is still generating, which every SDK of the provider skips."""

    def render_count_tokens(self, n: int) -> dict[str, Any]:
        """Answer to the provider's count-tokens route."""
