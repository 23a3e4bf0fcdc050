"""OpenAI Responses (``POST /v1/responses``, ``/v1/responses/input_tokens``), as Codex uses it.

Codex streams always and accepts the event sequence below (checked against its SSE parser): it builds
its history from ``response.output_item.done`` items and ends the turn on ``response.completed``;
``response.failed`` with ``code: "context_length_exceeded"`` makes it compact. Codex echoes our
``function_call`` items byte for byte, so their ids are derived from the call id (a re-render of the
same answer is identical). Reasoning goes out as ``reasoning_text`` content, as vLLM does.
The parsing half lives in ``responses_input.py``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.canonical import ChatRequest, ChatResponse, Message, RequestError, Sampling, ToolCall
from gateway.providers.common import bad, get, items, note_ignored, pieces, positive_int, preamble, prefixed, sse
from gateway.providers.openai_chat import openai_error
from gateway.providers.responses_input import custom_input, parse_input, parse_tools, tool_choice
from gateway.providers.side_calls import DEFAULT_MARKERS, is_side_call

_RECORDED = (
    "store", "include", "reasoning", "parallel_tool_calls", "prompt_cache_key", "client_metadata", "metadata",
    "text", "truncation", "service_tier", "user", "safety_identifier",
)  # fmt: skip
_KNOWN = {
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p", "stream",
    "previous_response_id", *_RECORDED,
}  # fmt: skip


@dataclass(frozen=True)
class OpenAIResponses:
    """The Responses wire format (see module docstring)."""

    name: str = "openai.responses"
    chunk_chars: int = 0  # size of synthesized stream deltas; 0 sends each part in one delta
    side_call_markers: tuple[str, ...] = DEFAULT_MARKERS

    def parse_request(self, body: dict[str, Any], *, model: str | None = None, stream: bool | None = None) -> ChatRequest:
        """Responses request -> ChatRequest; a 400 names the first bad field."""
        return self._parse(body, stream=stream)

    def parse_count_tokens(self, body: dict[str, Any], *, model: str | None = None) -> ChatRequest:
        """``/v1/responses/input_tokens`` body -> ChatRequest."""
        return self._parse(body, stream=False)

    def _parse(self, body: dict[str, Any], *, stream: bool | None) -> ChatRequest:
        body, extras = preamble(body, _RECORDED)
        if body.get("previous_response_id"):
            raise bad("previous_response_id", "this gateway stores no responses: send the whole conversation in input")
        instructions = get(body, "instructions", str, default="")
        messages = [Message("system", instructions)] if instructions else []
        if body.get("input") is None:
            raise bad("input", "Field required")
        messages += parse_input(body["input"], extras)
        tools = parse_tools(items(get(body, "tools", list, default=[]), "tools"), extras)
        note_ignored(body, _KNOWN, extras)
        reasoning = get(body, "reasoning", dict, default=None)
        text_format = get(body, "text", dict, default={}).get("format") or {}
        system = "\n".join(m.content for m in messages if m.role == "system")
        return ChatRequest(
            provider=self.name,
            model=get(body, "model", str, required=True),
            messages=messages,
            tools=tools,
            sampling=Sampling(
                max_tokens=positive_int(body, "max_output_tokens"),
                temperature=get(body, "temperature", float),
                top_p=get(body, "top_p", float),
            ),
            stream=bool(get(body, "stream", bool, default=False)) if stream is None else stream,
            tool_choice=tool_choice(body.get("tool_choice")),
            reasoning=reasoning is not None and reasoning.get("effort") != "none",
            side_call=is_side_call(
                system=system,
                has_tools=bool(tools),
                structured_output=isinstance(text_format, dict) and text_format.get("type") in ("json_schema", "json_object"),
                markers=self.side_call_markers,
            ),
            extras=extras,
        )

    # ------------------------------------------------------------------------------------ render

    def render_response(self, req: ChatRequest, resp: ChatResponse) -> dict[str, Any]:
        """A complete ``object: response`` body (status ``incomplete`` when the token limit hit)."""
        incomplete = resp.finish_reason == "length"
        return {
            "id": prefixed(resp.id, "resp_"),
            "object": "response",
            "created_at": int(resp.created or time.time()),
            "status": "incomplete" if incomplete else "completed",
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": None,
            "max_output_tokens": req.sampling.max_tokens,
            "model": req.model or resp.model,
            "output": output_items(req, resp),
            "parallel_tool_calls": req.extras.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": {"effort": (req.extras.get("reasoning") or {}).get("effort"), "summary": None},
            "store": False,
            "temperature": req.sampling.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice in ("auto", "none", "required") else "auto",
            "tools": [],  # the request's tools are not echoed: Codex does not read them and they are large
            "top_p": req.sampling.top_p,
            "truncation": "disabled",
            "usage": {
                "input_tokens": resp.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": resp.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": resp.prompt_tokens + resp.completion_tokens,
            },
            "user": None,
            "metadata": {},
        }

    def render_stream(self, req: ChatRequest, resp: ChatResponse) -> Iterator[bytes]:
        """created, in_progress, each output item with its deltas, then completed (or incomplete)."""
        final = self.render_response(req, resp)
        seq = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            return sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

        start = {**final, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        for index, item in enumerate(final["output"]):
            yield from self._item_events(event, index, item)
        yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)

    def _item_events(self, event: Any, index: int, item: dict[str, Any]) -> Iterator[bytes]:
        where = {"item_id": item["id"], "output_index": index}
        kind = item["type"]
        if kind == "message":
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            yield event("response.content_part.added", **where, content_index=0, part={**part, "text": ""})
            for p in pieces(part["text"], self.chunk_chars):
                yield event("response.output_text.delta", **where, content_index=0, delta=p, logprobs=[])
            yield event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **where, content_index=0, part=part)
        elif kind == "reasoning":
            yield event("response.output_item.added", output_index=index, item={**item, "content": []})
            part = item["content"][0]
            yield event("response.content_part.added", **where, content_index=0, part={**part, "text": ""})
            for p in pieces(part["text"], self.chunk_chars):
                yield event("response.reasoning_text.delta", **where, content_index=0, delta=p)
            yield event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            yield event("response.content_part.done", **where, content_index=0, part=part)
        elif kind == "function_call":
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""})
            for p in pieces(item["arguments"], self.chunk_chars):
                yield event("response.function_call_arguments.delta", **where, delta=p)
            yield event("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
        else:  # custom_tool_call
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "input": ""})
            for p in pieces(item["input"], self.chunk_chars):
                yield event("response.custom_tool_call_input.delta", **where, delta=p)
            yield event("response.custom_tool_call_input.done", **where, input=item["input"])
        yield event("response.output_item.done", output_index=index, item=item)

    def render_error(self, err: RequestError) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``; context overflow carries its code."""
        return {"error": openai_error(err, param="input")}

    def render_stream_error(self, err: RequestError) -> bytes:
        """A failed stream: ``response.created``, an ``error`` event, then ``response.failed``.

        Self-contained (it opens its own response), so it replaces ``render_stream`` rather than
        following part of it. Codex acts on ``response.failed``: it compacts on
        ``context_length_exceeded`` and retries other codes; the SDKs need ``response.created`` first.
        """
        error = openai_error(err, param="input")
        code = error["code"] or error["type"]
        now = time.time()
        response = {
            "id": f"resp_failed_{int(now * 1000)}",
            "object": "response",
            "created_at": int(now),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "output": [],
            "usage": None,
        }
        failed = {**response, "status": "failed", "error": {"code": code, "message": error["message"]}}
        return b"".join(
            [
                sse({"type": "response.created", "sequence_number": 0, "response": response}, "response.created"),
                sse({"type": "error", "sequence_number": 1, "code": code, "message": error["message"], "param": error["param"]}, "error"),
                sse({"type": "response.failed", "sequence_number": 2, "response": failed}, "response.failed"),
            ]
        )

    def render_keepalive(self) -> bytes:
        """An SSE comment: the OpenAI SDKs (Python, JS, Codex's Rust client) skip lines starting with ':'."""
        return b": keep-alive\n\n"

    def render_count_tokens(self, n: int) -> dict[str, Any]:
        """``/v1/responses/input_tokens`` answer."""
        return {"object": "response.input_tokens", "input_tokens": n}


def output_items(req: ChatRequest, resp: ChatResponse) -> list[dict[str, Any]]:
    """The response's output: reasoning, message, then one item per tool call (ids derived, not random)."""
    base = resp.id.removeprefix("resp_")
    out: list[dict[str, Any]] = []
    if resp.reasoning:
        part = {"type": "reasoning_text", "text": resp.reasoning}
        out.append({"type": "reasoning", "id": f"rs_{base}", "summary": [], "content": [part]})
    if resp.text:
        part = {"type": "output_text", "text": resp.text, "annotations": [], "logprobs": []}
        out.append({"type": "message", "id": f"msg_{base}", "status": "completed", "role": "assistant", "content": [part]})
    for call in resp.tool_calls:
        out.append(_call_item(req, call))
    return out


def _call_item(req: ChatRequest, call: ToolCall) -> dict[str, Any]:
    suffix = call.id.removeprefix("call_")
    name, namespace = _split(req, call.name)
    if call.name in req.extras.get("custom_tools", ()):
        item = {"type": "custom_tool_call", "id": f"ctc_{suffix}", "call_id": call.id, "name": name, "input": custom_input(call.arguments)}
    else:
        item = {"type": "function_call", "id": f"fc_{suffix}", "call_id": call.id, "name": name, "arguments": call.arguments}
    item["status"] = "completed"
    if namespace:
        item["namespace"] = namespace
    return item


def _split(req: ChatRequest, name: str) -> tuple[str, str]:
    """Canonical tool name -> (name, namespace) as Codex declared it."""
    ns_name = req.extras.get("namespaced_tools", {}).get(name)
    return (ns_name[1], ns_name[0]) if ns_name else (name, "")
