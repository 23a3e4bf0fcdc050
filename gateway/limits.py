"""Request limits: what one request, one session and one API key may ask of the gateway.

Each limit answers with a ``RequestError`` that the caller's adapter renders in its provider's shape
(400 naming the field, 408 for a body that never finishes, 429 with Retry-After for concurrency), so a
harness sees an error it understands instead of a slow or dying gateway. The body-size limit stays in
``GatewayConfig.max_body_bytes`` (checked while the body is read, before any of these).

Why each exists (found by tests/fuzz): JSON nested deeper than ``max_json_depth`` cannot be recorded
(orjson encodes at most 254 levels, and Python's own recursion stops near 1,000), thousands of messages
or tools make the chat template render for seconds, an absurd ``max_tokens`` is a client bug better
refused than clamped, and one key opening sessions without end would hold memory and engine slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .canonical import ChatRequest, RequestError


@dataclass(frozen=True)
class Limits:
    """Per-request and per-key limits (``GatewayConfig.limits``; ``polarstream gateway --max-*`` flags)."""

    max_json_depth: int = 64  # objects/arrays inside one another; records nest the request ~4 levels deeper
    max_messages: int = 10_000  # canonical messages in one request
    max_tools: int = 1_024  # tool definitions in one request
    max_output_tokens: int = 1_048_576  # the most a request may ask for; smaller asks are clamped to the context
    max_stop_sequences: int = 64
    max_sessions_per_key: int = 256  # sessions one credential may have calls in flight for at once (open mode)
    max_inflight_per_session: int = 32  # calls of one session waiting or running (they run one at a time)
    body_timeout_s: float = 120.0  # a request body must arrive within this (slow or stalled clients)
    retry_after_s: int = 1  # Retry-After on the 429s above


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, counting stops once ``limit`` is passed (iterative: no recursion)."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        children = node.values() if type(node) is dict else node
        # Only containers are pushed: most nodes of a chat body are strings, which cannot nest.
        stack.extend([(c, depth + 1) for c in children if type(c) is dict or type(c) is list])
    return deepest


def check_body(body: dict[str, Any], limits: Limits) -> None:
    """Refuse a decoded body nested deeper than the gateway can record (400)."""
    if json_depth(body, limits.max_json_depth) > limits.max_json_depth:
        raise RequestError(400, f"body: JSON nested deeper than the gateway's limit of {limits.max_json_depth} levels")


def check_request(req: ChatRequest, limits: Limits) -> None:
    """Refuse a parsed request over the count limits or with out-of-range sampling values (400, field named)."""
    s, n_msgs, n_tools = req.sampling, len(req.messages), len(req.tools)
    problems = [
        (n_msgs > limits.max_messages, "messages", f"{n_msgs} messages exceed the gateway's limit of {limits.max_messages}"),
        (n_tools > limits.max_tools, "tools", f"{n_tools} tools exceed the gateway's limit of {limits.max_tools}"),
        (s.max_tokens is not None and s.max_tokens > limits.max_output_tokens, "max_tokens",
         f"{s.max_tokens} exceeds the gateway's limit of {limits.max_output_tokens}"),
        (len(s.stop) > limits.max_stop_sequences, "stop",
         f"{len(s.stop)} stop sequences exceed the limit of {limits.max_stop_sequences}"),
        (s.temperature is not None and not 0 <= s.temperature <= 100, "temperature",
         f"must be between 0 and 100, got {s.temperature}"),
        (s.top_p is not None and not 0 <= s.top_p <= 1, "top_p", f"must be between 0 and 1, got {s.top_p}"),
        (s.top_k is not None and not -1 <= s.top_k <= 1 << 31, "top_k", f"must be -1 (off) or more, got {s.top_k}"),
        (s.seed is not None and not -(1 << 63) <= s.seed < 1 << 63, "seed", f"must fit in 64 bits, got {s.seed}"),
    ]
    for failed, field, problem in problems:
        if failed:
            raise RequestError(400, f"{field}: {problem}")


class KeyLimiter:
    """Counts calls in flight per API key and per session, refusing (429) past the limits.

    The key is kept only as a hash: what this holds never names a credential. In closed mode a key is
    scoped to one session, so only ``max_inflight_per_session`` can bite; in open mode one key may name
    many sessions (``/s/{name}``, ``x-session-id``) and ``max_sessions_per_key`` bounds them.
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self._inflight: dict[str, dict[str, int]] = {}  # key hash -> session id -> calls in flight

    @contextmanager
    def hold(self, key: str, session_id: str) -> Iterator[None]:
        """Count one call of ``session_id`` under ``key`` for the duration of the block."""
        kh = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        sessions = self._inflight.setdefault(kh, {})
        n = sessions.get(session_id, 0)
        if n == 0 and len(sessions) >= self.limits.max_sessions_per_key:
            raise self._refuse(f"this API key already has calls in flight in {len(sessions)} sessions "
                               f"(limit {self.limits.max_sessions_per_key}); retry when some finish")
        if n >= self.limits.max_inflight_per_session:
            raise self._refuse(f"session {session_id!r} already has {n} calls in flight "
                               f"(limit {self.limits.max_inflight_per_session}); calls of a session run one at a time")
        sessions[session_id] = n + 1
        try:
            yield
        finally:
            if sessions[session_id] <= 1:
                del sessions[session_id]
            else:
                sessions[session_id] -= 1
            if not sessions:
                self._inflight.pop(kh, None)

    def _refuse(self, message: str) -> RequestError:
        return RequestError(429, message, "rate_limit_error", headers={"Retry-After": str(self.limits.retry_after_s)})

    def in_flight(self) -> int:
        """Calls currently counted (for tests and /health)."""
        return sum(sum(s.values()) for s in self._inflight.values())
