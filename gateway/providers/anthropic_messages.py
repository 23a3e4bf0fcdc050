"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``).

Spoken by Claude Code, opencode's and pi's anthropic providers. What Claude Code sends that the API
reference does not show (shared/docs/harnesses.md): a ``role: "system"`` message inside ``messages``,
a per-prompt ``x-anthropic-billing-header`` line as the first system block (stripped by default: it
changes with every prompt and would break prefix merging), and top-level ``thinking``,
``output_config``, ``context_management`` and ``metadata``, which are recorded in extras.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.canonical import ChatRequest, ChatResponse, ContextLengthError, Message, RequestError, Sampling, Tool, ToolCall
from gateway.providers.arguments import arguments_object, arguments_text, normalize_arguments
from gateway.providers.common import (
    IMAGE_PLACEHOLDER,
    TEXT_JOIN,
    bad,
    error_type,
    get,
    items,
    nonempty_items,
    note_ignored,
    obj,
    pieces,
    positive_int,
    preamble,
    prefixed,
    signature,
    sse,
    stop_list,
    tool_names_by_id,
)
from gateway.providers.side_calls import DEFAULT_MARKERS, is_side_call

BILLING_HEADER = "x-anthropic-billing-header:"
_RECORDED = ("thinking", "output_config", "context_management", "metadata", "service_tier")
_KNOWN = {
    "model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
    "tools", "tool_choice", *_RECORDED,
}  # fmt: skip
_STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "error": "end_turn"}
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
    504: "timeout_error", 529: "overloaded_error",
}  # fmt: skip


@dataclass(frozen=True)
class AnthropicMessages:
    """The Anthropic Messages wire format (see module docstring)."""

    name: str = "anthropic.messages"
    strip_billing_header: bool = True  # Claude Code's per-prompt billing line in the system prompt
    chunk_chars: int = 0  # size of synthesized stream deltas; 0 sends each block in one delta
    side_call_markers: tuple[str, ...] = DEFAULT_MARKERS

    # ------------------------------------------------------------------------------------ parse

    def parse_request(self, body: dict[str, Any], *, model: str | None = None, stream: bool | None = None) -> ChatRequest:
        """Messages request -> ChatRequest; a 400 names the first bad field."""
        return self._parse(body, count_only=False, stream=stream)

    def parse_count_tokens(self, body: dict[str, Any], *, model: str | None = None) -> ChatRequest:
        """``/v1/messages/count_tokens`` body (like a request, without ``max_tokens``) -> ChatRequest."""
        return self._parse(body, count_only=True, stream=False)

    def _parse(self, body: dict[str, Any], *, count_only: bool, stream: bool | None) -> ChatRequest:
        body, extras = preamble(body, _RECORDED)
        system, billing = _system_text(body.get("system"), self.strip_billing_header)
        if billing:
            extras["billing_header"] = billing
        messages = [Message("system", system)] if system else []
        for i, m in enumerate(nonempty_items(body, "messages", "message")):
            messages.extend(_message(obj(m, f"messages.{i}"), f"messages.{i}", messages))
        tools, skipped = _tools(get(body, "tools", list, default=[]))
        if skipped:
            extras["skipped_tools"] = skipped  # server / Anthropic-defined tools the served model cannot run
        output_config = get(body, "output_config", dict, default={})
        thinking = get(body, "thinking", dict, default={})
        structured = isinstance(output_config.get("format"), dict)
        note_ignored(body, _KNOWN, extras)
        sampling = Sampling(
            max_tokens=positive_int(body, "max_tokens", required=not count_only),
            temperature=get(body, "temperature", float),
            top_p=get(body, "top_p", float),
            top_k=get(body, "top_k", int),
            stop=stop_list(body.get("stop_sequences"), "stop_sequences"),
        )
        return ChatRequest(
            provider=self.name,
            model=get(body, "model", str, required=True),
            messages=messages,
            tools=tools,
            sampling=sampling,
            stream=bool(get(body, "stream", bool, default=False)) if stream is None else stream,
            tool_choice=_tool_choice(body.get("tool_choice")),
            reasoning=thinking.get("type") in ("enabled", "adaptive"),
            side_call=is_side_call(
                system=system,
                has_tools=bool(tools),
                structured_output=structured,
                only_server_tools=bool(skipped) and not tools,
                markers=self.side_call_markers,
            ),
            extras=extras,
        )

    # ------------------------------------------------------------------------------------ render

    def render_response(self, req: ChatRequest, resp: ChatResponse) -> dict[str, Any]:
        """A complete ``type: message`` body."""
        stop_reason = _stop_reason(resp)
        return {
            "id": prefixed(resp.id, "msg_"),
            "type": "message",
            "role": "assistant",
            "model": req.model or resp.model,
            "content": _blocks(resp),
            "stop_reason": stop_reason,
            "stop_sequence": resp.matched_stop if stop_reason == "stop_sequence" else None,
            "usage": _usage(resp),
        }

    def render_stream(self, req: ChatRequest, resp: ChatResponse) -> Iterator[bytes]:
        """The event sequence the API streams: message_start, blocks with deltas, message_delta, message_stop."""
        message = self.render_response(req, resp)
        blocks = message["content"]
        start = {**message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**message["usage"], "output_tokens": 0}}
        yield sse({"type": "message_start", "message": start}, "message_start")
        if not blocks:
            yield sse({"type": "ping"}, "ping")
        calls = iter(resp.tool_calls)  # tool_use blocks come last, in call order
        for index, block in enumerate(blocks):
            yield sse({"type": "content_block_start", "index": index, "content_block": _empty(block)}, "content_block_start")
            if index == 0:
                yield sse({"type": "ping"}, "ping")  # where the API sends its first keep-alive
            for delta in self._deltas(block, calls):
                yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
            yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        yield sse({"type": "message_delta", "delta": delta, "usage": message["usage"]}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")

    def _deltas(self, block: dict[str, Any], calls: Iterator[ToolCall]) -> Iterator[dict[str, Any]]:
        if block["type"] == "thinking":
            for p in pieces(block["thinking"], self.chunk_chars):
                yield {"type": "thinking_delta", "thinking": p}
            yield {"type": "signature_delta", "signature": block["signature"]}
        elif block["type"] == "text":
            for p in pieces(block["text"], self.chunk_chars):
                yield {"type": "text_delta", "text": p}
        else:  # tool_use: stream the model's own arguments text, so key order and spacing survive
            for p in pieces(arguments_text(next(calls).arguments), self.chunk_chars):
                yield {"type": "input_json_delta", "partial_json": p}

    def render_error(self, err: RequestError) -> dict[str, Any]:
        """``{"type": "error", "error": {"type", "message"}}``; context overflow worded as the API does."""
        kind = error_type(err, _ERROR_TYPES, "api_error")
        message = err.message
        if isinstance(err, ContextLengthError):
            # Claude Code compacts on exactly this wording.
            kind, message = "invalid_request_error", f"prompt is too long: {err.prompt_tokens} tokens > {err.limit} maximum"
        return {"type": "error", "error": {"type": kind, "message": message}}

    def render_stream_error(self, err: RequestError) -> bytes:
        """An ``event: error`` SSE event (the SDKs raise on it)."""
        return sse(self.render_error(err), "error")

    def render_keepalive(self) -> bytes:
        """The API's own ``ping`` event: the SDKs drop pings before they fold events into a message."""
        return sse({"type": "ping"}, "ping")

    def render_count_tokens(self, n: int) -> dict[str, Any]:
        """``/v1/messages/count_tokens`` answer."""
        return {"input_tokens": n}


# ---------------------------------------------------------------------------------------- parsing


def _system_text(value: Any, strip_billing: bool) -> tuple[str, str]:
    """System prompt (string or text blocks) -> (text, the billing-header line that was removed)."""
    if value is None:
        return "", ""
    if isinstance(value, str):
        texts = [value]
    else:
        texts = []
        for j, block in enumerate(items(value, "system")):
            block = obj(block, f"system.{j}")
            texts.append(get(block, "text", str, f"system.{j}.text", required=True))
    billing: list[str] = []
    if strip_billing:
        kept = []
        for text in texts:
            lines = text.split("\n")
            billing += [ln for ln in lines if ln.startswith(BILLING_HEADER)]
            rest = "\n".join(ln for ln in lines if not ln.startswith(BILLING_HEADER))
            if rest.strip() or not any(ln.startswith(BILLING_HEADER) for ln in lines):
                kept.append(rest)
        texts = kept
    return TEXT_JOIN.join(texts), "\n".join(billing)


def _message(m: dict[str, Any], field: str, history: list[Message]) -> list[Message]:
    """One wire message -> canonical messages (a user turn with tool results becomes tool messages)."""
    role = get(m, "role", str, f"{field}.role", required=True)
    content = m.get("content")
    if role == "system":  # Claude Code's mid-conversation system message; kept where it was
        return [Message("system", _plain_text(content, f"{field}.content"))]
    if role == "user":
        return _user_blocks(content, f"{field}.content", tool_names_by_id(history))
    if role == "assistant":
        return [_assistant(content, f"{field}.content")]
    raise bad(f"{field}.role", f"expected 'user', 'assistant' or 'system', got {role!r}")


def _plain_text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    return TEXT_JOIN.join(_block_text(obj(b, f"{field}.{j}"), f"{field}.{j}") for j, b in enumerate(items(content, field)))


def _block_text(block: dict[str, Any], field: str) -> str:
    """Text of a non-tool block: text as is, images and documents as placeholders, others named."""
    kind = get(block, "type", str, f"{field}.type", required=True)
    if kind == "text":
        return get(block, "text", str, f"{field}.text", required=True)
    if kind == "image":
        return IMAGE_PLACEHOLDER
    return f"[{kind}]"  # document, search_result, server tool results...: visible, not silently dropped


def _user_blocks(content: Any, field: str, names: dict[str, str]) -> list[Message]:
    if isinstance(content, str):
        return [Message("user", content)]
    out: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(items(content, field)):
        block = obj(block, f"{field}.{j}")
        if block.get("type") == "tool_result":
            if texts:
                out.append(Message("user", TEXT_JOIN.join(texts)))
                texts = []
            call_id = get(block, "tool_use_id", str, f"{field}.{j}.tool_use_id", required=True)
            result = block.get("content")
            text = "" if result is None else _plain_text(result, f"{field}.{j}.content")
            out.append(Message("tool", text, tool_call_id=call_id, name=names.get(call_id, ""), is_error=block.get("is_error") is True))
        elif block.get("type") not in ("thinking", "redacted_thinking"):
            texts.append(_block_text(block, f"{field}.{j}"))
    if texts or not out:
        out.append(Message("user", TEXT_JOIN.join(texts)))
    return out


def _assistant(content: Any, field: str) -> Message:
    if isinstance(content, str):
        return Message("assistant", content)
    msg = Message("assistant")
    texts: list[str] = []
    thoughts: list[str] = []
    for j, block in enumerate(items(content, field)):
        block = obj(block, f"{field}.{j}")
        kind = block.get("type")
        if kind == "thinking":
            thoughts.append(get(block, "thinking", str, f"{field}.{j}.thinking", default=""))
        elif kind == "redacted_thinking":
            continue  # opaque to us; the signature-bearing block carries no text to template
        elif kind == "tool_use":
            call_id = get(block, "id", str, f"{field}.{j}.id", required=True)
            name = get(block, "name", str, f"{field}.{j}.name", required=True)
            args = get(block, "input", dict, f"{field}.{j}.input", default={})
            msg.tool_calls.append(ToolCall(call_id, name, normalize_arguments(args)))
        else:
            texts.append(_block_text(block, f"{field}.{j}"))
    msg.content, msg.reasoning = TEXT_JOIN.join(texts), TEXT_JOIN.join(thoughts)
    return msg


def _tools(raw: list[Any]) -> tuple[list[Tool], list[str]]:
    """Custom tools -> Tool; server and Anthropic-defined tools (no input_schema) are skipped and named."""
    tools, skipped = [], []
    for i, t in enumerate(raw):
        t = obj(t, f"tools.{i}")
        if "input_schema" not in t:
            skipped.append(str(t.get("name") or t.get("type")))
            continue
        tools.append(
            Tool(
                name=get(t, "name", str, f"tools.{i}.name", required=True),
                description=get(t, "description", str, f"tools.{i}.description", default=""),
                parameters=get(t, "input_schema", dict, f"tools.{i}.input_schema", required=True),
            )
        )
    return tools, skipped


def _tool_choice(value: Any) -> str:
    if value is None:
        return "auto"
    choice = obj(value, "tool_choice")
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return get(choice, "name", str, "tool_choice.name", required=True)
    raise bad("tool_choice.type", f"expected 'auto', 'any', 'tool' or 'none', got {kind!r}")


# ---------------------------------------------------------------------------------------- rendering


def _blocks(resp: ChatResponse) -> list[dict[str, Any]]:
    """Content blocks in the order the API emits them: thinking, text, tool_use."""
    blocks: list[dict[str, Any]] = []
    if resp.reasoning:
        blocks.append({"type": "thinking", "thinking": resp.reasoning, "signature": signature(resp.id, resp.reasoning)})
    if resp.text:
        blocks.append({"type": "text", "text": resp.text})
    for call in resp.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments_object(call.arguments)})
    return blocks


def _empty(block: dict[str, Any]) -> dict[str, Any]:
    """The block as content_block_start announces it, before any delta."""
    if block["type"] == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if block["type"] == "text":
        return {"type": "text", "text": ""}
    return {**block, "input": {}}


def _stop_reason(resp: ChatResponse) -> str:
    if resp.finish_reason == "stop" and resp.matched_stop:
        return "stop_sequence"
    return _STOP_REASON[resp.finish_reason]


def _usage(resp: ChatResponse) -> dict[str, int]:
    return {
        "input_tokens": resp.prompt_tokens,
        "output_tokens": resp.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
