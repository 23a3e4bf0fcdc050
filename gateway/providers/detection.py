"""Which provider API a request speaks: the path first, then headers, then the body's shape.

The order follows Polar's gateway (shared/docs/polar-reference.md §2). Paths may carry any base
prefix (``/gw/v1/messages``, ``/s/<session>/v1beta/models/...``), so they are matched by suffix.
``parse_route`` also says which action the route asks for and, for Google, the model and streaming
flag that live in the URL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

ANTHROPIC, CHAT, RESPONSES, GOOGLE = "anthropic.messages", "openai.chat", "openai.responses", "google.generate_content"
Action = Literal["generate", "count_tokens"]

_GOOGLE_PATH = re.compile(r"/models/(?P<model>[^/:]+):(?P<method>generateContent|streamGenerateContent|countTokens)$")


@dataclass(frozen=True)
class Route:
    """What a request asks for: the provider, generate or count tokens, and URL-borne model/stream."""

    provider: str
    action: Action = "generate"
    model: str | None = None  # Google only: the model named in the URL
    stream: bool | None = None  # Google only: streamGenerateContent


def parse_route(path: str, headers: Mapping[str, str] | None = None, body: Any = None) -> Route:
    """Route of a request (see module docstring); falls back to Chat Completions like Polar."""
    path = path.split("?", 1)[0].rstrip("/")
    if m := _GOOGLE_PATH.search(path):
        method = m["method"]
        action: Action = "count_tokens" if method == "countTokens" else "generate"
        return Route(GOOGLE, action, model=m["model"], stream=method == "streamGenerateContent")
    if path.endswith("/messages/count_tokens"):
        return Route(ANTHROPIC, "count_tokens")
    if path.endswith("/messages"):
        return Route(ANTHROPIC)
    if path.endswith("/chat/completions"):
        return Route(CHAT)
    if path.endswith("/responses/input_tokens"):
        return Route(RESPONSES, "count_tokens")
    if path.endswith("/responses"):
        return Route(RESPONSES)
    return Route(_by_headers(headers or {}) or _by_body(body))


def detect_provider(path: str, headers: Mapping[str, str] | None = None, body: Any = None) -> str:
    """Provider name (a key of ``ADAPTERS``) for a request: path, then headers, then body shape."""
    return parse_route(path, headers, body).provider


def _by_headers(headers: Mapping[str, str]) -> str | None:
    names = {k.lower() for k in headers}
    if "anthropic-version" in names:
        return ANTHROPIC
    if "x-goog-api-key" in names or "x-goog-api-client" in names:
        return GOOGLE
    return None


def _by_body(body: Any) -> str:
    if isinstance(body, Mapping):
        if "contents" in body:
            return GOOGLE
        if "input" in body:  # Codex sends no ``instructions``, so ``input`` alone decides
            return RESPONSES
    return CHAT
