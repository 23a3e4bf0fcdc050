"""OpenAI Chat Completions (``POST /v1/chat/completions``).

Spoken by Qwen Code, opencode's openai-compatible provider and pi. Qwen Code sends tool results as a
list of text parts and echoes ``arguments`` re-serialized compactly; opencode echoes ``content: ""``
instead of null. Reasoning goes out as ``reasoning_content`` (what vLLM emits and these harnesses
read) and is accepted back as ``reasoning_content`` or ``reasoning``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.canonical import ChatRequest, ChatResponse, ContextLengthError, Message, RequestError, Sampling, Tool, ToolCall
from gateway.providers.common import (
    TEXT_JOIN,
    bad,
    error_type,
    function_call,
    function_tool,
    get,
    nonempty_items,
    note_ignored,
    obj,
    parts_text,
    pieces,
    positive_int,
    preamble,
    prefixed,
    sse,
    stop_list,
    tool_choice_mode,
    tool_names_by_id,
)
from gateway.providers.side_calls import DEFAULT_MARKERS, is_side_call

_RECORDED = ("response_format", "parallel_tool_calls", "user", "metadata", "reasoning_effort", "stream_options")
_KNOWN = {
    "model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "stop", "seed", "stream", "n", "top_k", *_RECORDED,
}  # fmt: skip
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error", 504: "timeout",
}  # fmt: skip
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "error": "stop"}


@dataclass(frozen=True)
class OpenAIChat:
    """The Chat Completions wire format (see module docstring)."""

    name: str = "openai.chat"
    chunk_chars: int = 0  # size of synthesized stream deltas; 0 sends each field in one delta
    side_call_markers: tuple[str, ...] = DEFAULT_MARKERS

    def parse_request(self, body: dict[str, Any], *, model: str | None = None, stream: bool | None = None) -> ChatRequest:
        """Chat Completions request -> ChatRequest; a 400 names the first bad field."""
        return self._parse(body, stream=stream)

    def parse_count_tokens(self, body: dict[str, Any], *, model: str | None = None) -> ChatRequest:
        """Chat has no count route of its own; the core's ``/tokenize`` takes a chat body."""
        return self._parse(body, stream=False)

    def _parse(self, body: dict[str, Any], *, stream: bool | None) -> ChatRequest:
        body, extras = preamble(body, _RECORDED)
        messages: list[Message] = []
        for i, m in enumerate(nonempty_items(body, "messages", "message")):
            messages.append(_message(obj(m, f"messages.{i}"), f"messages.{i}", messages))
        tools, skipped = _tools(get(body, "tools", list, default=[]))
        if skipped:
            extras["skipped_tools"] = skipped
        if get(body, "n", int, default=1) != 1:
            raise bad("n", "only n=1 is supported")
        stream_options = get(body, "stream_options", dict, default={})
        extras["include_usage"] = stream_options.get("include_usage") is True  # read by render_stream
        note_ignored(body, _KNOWN, extras)
        max_tokens = positive_int(body, "max_completion_tokens") or positive_int(body, "max_tokens")
        effort = get(body, "reasoning_effort", str)
        response_format = get(body, "response_format", dict, default={})
        system = TEXT_JOIN.join(m.content for m in messages if m.role == "system")
        return ChatRequest(
            provider=self.name,
            model=get(body, "model", str, required=True),
            messages=messages,
            tools=tools,
            sampling=Sampling(
                max_tokens=max_tokens,
                temperature=get(body, "temperature", float),
                top_p=get(body, "top_p", float),
                top_k=get(body, "top_k", int),
                stop=stop_list(body.get("stop"), "stop"),
                seed=get(body, "seed", int),
            ),
            stream=bool(get(body, "stream", bool, default=False)) if stream is None else stream,
            tool_choice=_tool_choice(body.get("tool_choice")),
            reasoning=effort is not None and effort != "none",
            side_call=is_side_call(
                system=system,
                has_tools=bool(tools),
                structured_output=response_format.get("type") in ("json_schema", "json_object"),
                markers=self.side_call_markers,
            ),
            extras=extras,
        )

    # ------------------------------------------------------------------------------------ render

    def render_response(self, req: ChatRequest, resp: ChatResponse) -> dict[str, Any]:
        """A complete ``chat.completion`` body."""
        message: dict[str, Any] = {"role": "assistant", "content": resp.text or (None if resp.tool_calls else "")}
        if resp.reasoning:
            message["reasoning_content"] = resp.reasoning
        if resp.tool_calls:
            message["tool_calls"] = [_call(c) for c in resp.tool_calls]
        return {
            **self._head(req, resp, "chat.completion"),
            "choices": [{"index": 0, "message": message, "finish_reason": _FINISH[resp.finish_reason], "logprobs": None}],
            "usage": _usage(resp),
        }

    def render_stream(self, req: ChatRequest, resp: ChatResponse) -> Iterator[bytes]:
        """Chunks: role, reasoning, content, each tool call (id+name, then arguments), finish, usage, [DONE]."""
        head = self._head(req, resp, "chat.completion.chunk")
        with_usage = req.extras.get("include_usage") is True

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            body = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            if with_usage:
                body["usage"] = None  # the API sends null on every chunk but the last when usage is asked for
            return sse(body)

        yield chunk({"role": "assistant", "content": ""})
        if resp.reasoning:
            for p in pieces(resp.reasoning, self.chunk_chars):
                yield chunk({"reasoning_content": p})
        if resp.text:
            for p in pieces(resp.text, self.chunk_chars):
                yield chunk({"content": p})
        for index, call in enumerate(resp.tool_calls):
            start = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            yield chunk({"tool_calls": [start]})
            for p in pieces(call.arguments, self.chunk_chars):
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": p}}]})
        yield chunk({}, _FINISH[resp.finish_reason])
        if with_usage:
            yield sse({**head, "choices": [], "usage": _usage(resp)})
        yield b"data: [DONE]\n\n"

    def _head(self, req: ChatRequest, resp: ChatResponse, kind: str) -> dict[str, Any]:
        return {
            "id": prefixed(resp.id, "chatcmpl-"),
            "object": kind,
            "created": int(resp.created or time.time()),
            "model": req.model or resp.model,
            "system_fingerprint": None,
        }

    def render_error(self, err: RequestError) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``; context overflow carries its code."""
        return {"error": openai_error(err, param="messages")}

    def render_stream_error(self, err: RequestError) -> bytes:
        """An error as the API sends it mid-stream: a ``data:`` line with an ``error`` object."""
        return sse(self.render_error(err))

    def render_keepalive(self) -> bytes:
        """An SSE comment: the OpenAI SDKs (Python, JS, Codex's Rust client) skip lines starting with ':'."""
        return b": keep-alive\n\n"

    def render_count_tokens(self, n: int) -> dict[str, Any]:
        """vLLM's ``/tokenize`` count shape (Chat Completions has no count route)."""
        return {"count": n}


def openai_error(err: RequestError, *, param: str) -> dict[str, Any]:
    """OpenAI's error object, shared by Chat Completions and Responses."""
    if isinstance(err, ContextLengthError):
        message = (
            f"This model's maximum context length is {err.limit} tokens. However, your messages resulted in "
            f"{err.prompt_tokens} tokens. Please reduce the length of the messages."
        )
        return {"message": message, "type": "invalid_request_error", "param": param, "code": "context_length_exceeded"}
    kind = error_type(err, _ERROR_TYPES, "server_error")
    return {"message": err.message, "type": kind, "param": None, "code": None}


# ---------------------------------------------------------------------------------------- parsing


def _content(value: Any, field: str) -> str:
    """String content or a list of parts (text, refusal; images and files as placeholders)."""
    return parts_text(value, field, text_kinds=("text",), image_kinds=("image_url",))


def _message(m: dict[str, Any], field: str, history: list[Message]) -> Message:
    role = get(m, "role", str, f"{field}.role", required=True)
    content = _content(m.get("content"), f"{field}.content")
    if role in ("system", "developer"):
        return Message("system", content)
    if role == "user":
        return Message("user", content)
    if role in ("tool", "function"):  # "function": the legacy single-call form, answered by name
        call_id = get(m, "tool_call_id", str, f"{field}.tool_call_id", required=role == "tool", default="")
        name = get(m, "name", str, f"{field}.name", default="") or tool_names_by_id(history).get(call_id, "")
        return Message("tool", content, tool_call_id=call_id, name=name)
    if role != "assistant":
        raise bad(f"{field}.role", f"expected 'system', 'developer', 'user', 'assistant' or 'tool', got {role!r}")
    reasoning = get(m, "reasoning_content", str, f"{field}.reasoning_content") or get(m, "reasoning", str, f"{field}.reasoning") or ""
    msg = Message("assistant", content, reasoning=reasoning)
    for j, call in enumerate(get(m, "tool_calls", list, f"{field}.tool_calls", default=[])):
        call = obj(call, f"{field}.tool_calls.{j}")
        call_id = get(call, "id", str, f"{field}.tool_calls.{j}.id", required=True)
        fn_field = f"{field}.tool_calls.{j}.function"
        msg.tool_calls.append(function_call(call_id, obj(call.get("function"), fn_field), fn_field))
    return msg


def _tools(raw: list[Any]) -> tuple[list[Tool], list[str]]:
    """Function tools -> Tool; other kinds (custom grammars...) are skipped and named."""
    tools, skipped = [], []
    for i, t in enumerate(raw):
        t = obj(t, f"tools.{i}")
        if t.get("type", "function") != "function":
            skipped.append(str(t.get("name") or t.get("type")))
            continue
        tools.append(function_tool(obj(t.get("function"), f"tools.{i}.function"), f"tools.{i}.function"))
    return tools, skipped


def _tool_choice(value: Any) -> str:
    if mode := tool_choice_mode(value):
        return mode
    choice = obj(value, "tool_choice")
    fn = obj(choice.get("function"), "tool_choice.function")
    return get(fn, "name", str, "tool_choice.function.name", required=True)


# ---------------------------------------------------------------------------------------- rendering


def _call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _usage(resp: ChatResponse) -> dict[str, int]:
    return {
        "prompt_tokens": resp.prompt_tokens,
        "completion_tokens": resp.completion_tokens,
        "total_tokens": resp.prompt_tokens + resp.completion_tokens,
    }
