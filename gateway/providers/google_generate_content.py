"""Google ``generateContent`` / ``streamGenerateContent`` (``?alt=sse``) / ``countTokens``.

Spoken by Gemini CLI (streaming for its agent loop, plain JSON for its model router) and pi. The model
and the streaming flag come from the URL. Gemini function calls carry no ids on the wire unless the
server sends some: we send the core's call ids (Gemini CLI then echoes them instead of inventing
``name_<ms>_<n>``), keep any id a harness sends, and mint position-based ids otherwise, so the same
history always parses to the same ids. The first function call of a turn carries a ``thoughtSignature``
as Gemini's API does; without it Gemini CLI echoes ``skip_thought_signature_validator`` instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.canonical import ChatRequest, ChatResponse, ContextLengthError, Message, RequestError, Sampling, Tool, ToolCall
from gateway.providers.arguments import arguments_object, normalize_arguments
from gateway.providers.common import (
    IMAGE_PLACEHOLDER,
    TEXT_JOIN,
    bad,
    error_status,
    get,
    ignored_fields,
    items,
    nonempty_items,
    obj,
    pieces,
    positive_int,
    signature,
    sse,
    stop_list,
)
from gateway.providers.side_calls import DEFAULT_MARKERS, is_side_call

_RECORDED = ("toolConfig", "safetySettings", "cachedContent", "labels")
_KNOWN = {"contents", "systemInstruction", "tools", "generationConfig", "model", *_RECORDED}
_FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP", "error": "OTHER"}
_STATUS = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    409: "ABORTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 501: "UNIMPLEMENTED",
    502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}  # fmt: skip
_RESULT_KEYS = ("output", "result", "content")  # a functionResponse.response holding only text under one of these


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", camel).lower()


def _k(d: Mapping[str, Any], camel: str) -> str:
    """The key ``d`` uses for a field: Google's JSON accepts lowerCamelCase and the proto's snake_case.

    google-genai itself mixes them (``thinkingConfig: {"include_thoughts": ...}``,
    ``parameters_json_schema``), so every field is looked up both ways; user data (args, schemas) is
    never renamed.
    """
    if camel in d:
        return camel
    snake = _snake(camel)
    return snake if snake in d else camel


def _v(d: Mapping[str, Any], camel: str) -> Any:
    return d.get(_k(d, camel))


@dataclass(frozen=True)
class GoogleGenerateContent:
    """The Gemini API wire format (see module docstring)."""

    name: str = "google.generate_content"
    chunk_chars: int = 0  # size of synthesized stream deltas; 0 sends each part in one chunk
    sign_function_calls: bool = True  # thoughtSignature on the first functionCall part of a turn
    side_call_markers: tuple[str, ...] = DEFAULT_MARKERS

    def parse_request(self, body: dict[str, Any], *, model: str | None = None, stream: bool | None = None) -> ChatRequest:
        """GenerateContentRequest -> ChatRequest; ``model``/``stream`` come from the URL."""
        return self._parse(obj(body, "body"), model=model, stream=bool(stream))

    def parse_count_tokens(self, body: dict[str, Any], *, model: str | None = None) -> ChatRequest:
        """CountTokensRequest (``contents`` or a whole ``generateContentRequest``) -> ChatRequest."""
        body = obj(body, "body")
        if _v(body, "generateContentRequest") is not None:
            body = obj(_v(body, "generateContentRequest"), "generateContentRequest")
        return self._parse(body, model=model, stream=False)

    def _parse(self, body: dict[str, Any], *, model: str | None, stream: bool) -> ChatRequest:
        model = (model or get(body, "model", str, default="")).removeprefix("models/")
        if not model:
            raise bad("model", "missing: put it in the URL (/v1beta/models/{model}:generateContent)")
        extras: dict[str, Any] = {k: _v(body, k) for k in _RECORDED if _v(body, k) is not None}
        system = _system(_v(body, "systemInstruction"))
        messages = [Message("system", system)] if system else []
        messages += _contents(nonempty_items(body, "contents", "content"))
        tools, dropped = _tools(get(body, "tools", list, default=[]))
        if dropped:
            extras["dropped_tools"] = dropped  # googleSearch, codeExecution...: run on Google's servers
        config = get(body, _k(body, "generationConfig"), dict, "generationConfig", default={})
        if get(config, _k(config, "candidateCount"), int, "generationConfig.candidateCount", default=1) != 1:
            raise bad("generationConfig.candidateCount", "only 1 candidate is supported")
        thinking = get(config, _k(config, "thinkingConfig"), dict, "generationConfig.thinkingConfig", default={})
        for key in ("thinkingConfig", "responseMimeType", "responseJsonSchema", "responseSchema"):
            if _v(config, key) is not None:
                extras[f"generationConfig.{key}"] = _v(config, key)
        if ignored := ignored_fields(body, _KNOWN | {_snake(k) for k in _KNOWN}):
            extras["ignored_fields"] = ignored
        schema_keys = ("responseSchema", "responseJsonSchema", "_responseJsonSchema")
        structured = _v(config, "responseMimeType") == "application/json" or any(_v(config, k) is not None for k in schema_keys)
        budget = _v(thinking, "thinkingBudget")
        return ChatRequest(
            provider=self.name,
            model=model,
            messages=messages,
            tools=tools,
            sampling=Sampling(
                max_tokens=positive_int(config, _k(config, "maxOutputTokens"), "generationConfig.maxOutputTokens"),
                temperature=get(config, "temperature", float, "generationConfig.temperature"),
                top_p=get(config, _k(config, "topP"), float, "generationConfig.topP"),
                top_k=get(config, _k(config, "topK"), int, "generationConfig.topK"),
                stop=stop_list(_v(config, "stopSequences"), "generationConfig.stopSequences"),
                seed=get(config, "seed", int, "generationConfig.seed"),
            ),
            stream=stream,
            tool_choice=_tool_choice(get(body, _k(body, "toolConfig"), dict, "toolConfig", default={})),
            reasoning=_v(thinking, "includeThoughts") is True or budget not in (None, 0) or _v(thinking, "thinkingLevel") is not None,
            side_call=is_side_call(system=system, has_tools=bool(tools), structured_output=structured, markers=self.side_call_markers),
            extras=extras,
        )

    # ------------------------------------------------------------------------------------ render

    def render_response(self, req: ChatRequest, resp: ChatResponse) -> dict[str, Any]:
        """A complete GenerateContentResponse."""
        return self._chunk(req, resp, self._parts(resp), final=True)

    def render_stream(self, req: ChatRequest, resp: ChatResponse) -> Iterator[bytes]:
        """``alt=sse``: each ``data:`` a GenerateContentResponse; the last carries finishReason and usage."""
        groups: list[list[dict[str, Any]]] = []
        if resp.reasoning:
            groups += [[{"text": p, "thought": True}] for p in pieces(resp.reasoning, self.chunk_chars)]
        if resp.text:
            groups += [[{"text": p}] for p in pieces(resp.text, self.chunk_chars)]
        calls = [p for p in self._parts(resp) if "functionCall" in p]
        if calls:
            groups.append(calls)  # the API sends a turn's calls together
        groups = groups or [[{"text": ""}]]
        for i, parts in enumerate(groups):
            yield sse(self._chunk(req, resp, parts, final=i == len(groups) - 1))

    def _parts(self, resp: ChatResponse) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if resp.reasoning:
            parts.append({"text": resp.reasoning, "thought": True})
        if resp.text:
            parts.append({"text": resp.text})
        for k, call in enumerate(resp.tool_calls):
            part: dict[str, Any] = {"functionCall": {"id": call.id, "name": call.name, "args": arguments_object(call.arguments)}}
            if k == 0 and self.sign_function_calls:
                part["thoughtSignature"] = signature(resp.id, call.id)
            parts.append(part)
        return parts or [{"text": ""}]

    def _chunk(self, req: ChatRequest, resp: ChatResponse, parts: list[dict[str, Any]], *, final: bool) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
        body: dict[str, Any] = {"candidates": [candidate]}
        if final:
            candidate["finishReason"] = _FINISH[resp.finish_reason]
            body["usageMetadata"] = {
                "promptTokenCount": resp.prompt_tokens,
                "candidatesTokenCount": resp.completion_tokens,
                "totalTokenCount": resp.prompt_tokens + resp.completion_tokens,
            }
        body["modelVersion"] = req.model or resp.model
        body["responseId"] = resp.id
        return body

    def render_error(self, err: RequestError) -> dict[str, Any]:
        """``{"error": {"code", "message", "status"}}``."""
        message = err.message
        if isinstance(err, ContextLengthError):
            message = f"The input token count ({err.prompt_tokens}) exceeds the maximum number of tokens allowed ({err.limit})."
        return {"error": {"code": err.status, "message": message, "status": error_status(err.status, _STATUS, "INTERNAL")}}

    def render_stream_error(self, err: RequestError) -> bytes:
        """The error object as a bare JSON line, not a ``data:`` event (docs/gateway.md, keep-alives).

        Every google-genai raises on it: Python on a non-``data:`` line whose JSON starts ``{"error":``,
        JS (1.x, bundled by Gemini CLI and pi) only when a whole network chunk parses as such JSON. A
        ``data:`` error reaches JS 1.x as an empty answer instead.
        """
        return orjson.dumps(self.render_error(err)) + b"\n"

    def render_keepalive(self) -> bytes:
        """A blank line. Google sends no keep-alive, and its SDKs read any other line as JSON: Python
        parses each non-``data:`` line, JS 1.30 (Gemini CLI) matches only ``^\\s*data: `` at the buffer's
        start. Both skip whitespace."""
        return b"\n"

    def render_count_tokens(self, n: int) -> dict[str, Any]:
        """``:countTokens`` answer."""
        return {"totalTokens": n}


# ---------------------------------------------------------------------------------------- parsing


def _system(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    content = obj(value, "systemInstruction")
    parts = items(content.get("parts", []), "systemInstruction.parts")
    field = "systemInstruction.parts"
    return TEXT_JOIN.join(get(obj(p, f"{field}.{j}"), "text", str, f"{field}.{j}.text", default="") for j, p in enumerate(parts))


def _contents(contents: list[Any]) -> list[Message]:
    """Contents -> messages; calls get ids (sent, or minted from position) and results are matched to them."""
    messages: list[Message] = []
    pending: list[ToolCall] = []  # calls of the latest model turn not answered yet
    for i, raw in enumerate(contents):
        field = f"contents.{i}"
        content = obj(raw, field)
        role = get(content, "role", str, f"{field}.role", default="user")
        parts = [obj(p, f"{field}.parts.{j}") for j, p in enumerate(items(content.get("parts", []), f"{field}.parts"))]
        if role == "model":
            msg = _model_turn(parts, field, i)
            pending = list(msg.tool_calls)
            messages.append(msg)
        elif role in ("user", "function"):
            messages += _user_turn(parts, field, i, pending)
        else:
            raise bad(f"{field}.role", f"expected 'user' or 'model', got {role!r}")
    return messages


def _model_turn(parts: list[dict[str, Any]], field: str, i: int) -> Message:
    texts, thoughts, calls = [], [], []
    for j, part in enumerate(parts):
        if _v(part, "functionCall") is not None:
            fc = obj(_v(part, "functionCall"), f"{field}.parts.{j}.functionCall")
            name = get(fc, "name", str, f"{field}.parts.{j}.functionCall.name", required=True)
            call_id = get(fc, "id", str, f"{field}.parts.{j}.functionCall.id", default="") or f"call_{i}_{len(calls)}_{name}"
            args = get(fc, "args", dict, f"{field}.parts.{j}.functionCall.args", default={})
            calls.append(ToolCall(call_id, name, normalize_arguments(args)))
        elif "text" in part:
            text = get(part, "text", str, f"{field}.parts.{j}.text", default="")
            (thoughts if part.get("thought") is True else texts).append(text)
        else:
            texts.append(_other_part(part))
    return Message("assistant", TEXT_JOIN.join(texts), tool_calls=calls, reasoning=TEXT_JOIN.join(thoughts))


def _user_turn(parts: list[dict[str, Any]], field: str, i: int, pending: list[ToolCall]) -> list[Message]:
    out: list[Message] = []
    texts: list[str] = []
    for j, part in enumerate(parts):
        if _v(part, "functionResponse") is not None:
            if texts:
                out.append(Message("user", TEXT_JOIN.join(texts)))
                texts = []
            fr = obj(_v(part, "functionResponse"), f"{field}.parts.{j}.functionResponse")
            name = get(fr, "name", str, f"{field}.parts.{j}.functionResponse.name", required=True)
            call_id = get(fr, "id", str, f"{field}.parts.{j}.functionResponse.id", default="")
            match = next((c for c in pending if (c.id == call_id if call_id else c.name == name)), None)
            if match:
                pending.remove(match)
            call_id = call_id or (match.id if match else f"call_{i}_{j}_{name}")
            text, is_error = _result_text(get(fr, "response", dict, f"{field}.parts.{j}.functionResponse.response", default={}))
            out.append(Message("tool", text, tool_call_id=call_id, name=name, is_error=is_error))
        elif "text" in part:
            texts.append(get(part, "text", str, f"{field}.parts.{j}.text", default=""))
        else:
            texts.append(_other_part(part))
    if texts or not out:
        out.append(Message("user", TEXT_JOIN.join(texts)))
    return out


def _other_part(part: dict[str, Any]) -> str:
    """Parts without text: images and files as placeholders, others named."""
    if _v(part, "inlineData") is not None or _v(part, "fileData") is not None:
        return IMAGE_PLACEHOLDER
    meta = {"thoughtSignature", "thought", "partMetadata", "videoMetadata"}
    kinds = [k for k in part if k not in meta | {_snake(m) for m in meta}]
    return f"[{kinds[0]}]" if kinds else ""


def _result_text(response: dict[str, Any]) -> tuple[str, bool]:
    """A functionResponse.response as tool text: ``{"output": "..."}`` is its text, anything else JSON."""
    if len(response) == 1:
        ((key, value),) = response.items()
        if isinstance(value, str) and key in (*_RESULT_KEYS, "error"):
            return value, key == "error"
    return json.dumps(response, ensure_ascii=False), False


def _tools(raw: list[Any]) -> tuple[list[Tool], list[str]]:
    tools, dropped = [], []
    for i, entry in enumerate(raw):
        entry = obj(entry, f"tools.{i}")
        decls_key = _k(entry, "functionDeclarations")
        dropped += [key for key in entry if key != decls_key]
        for j, decl in enumerate(get(entry, decls_key, list, f"tools.{i}.functionDeclarations", default=[])):
            field = f"tools.{i}.functionDeclarations.{j}"
            decl = obj(decl, field)
            params = _v(decl, "parametersJsonSchema")
            if params is None:
                params = _json_schema(get(decl, "parameters", dict, f"{field}.parameters", default={"type": "OBJECT", "properties": {}}))
            name = get(decl, "name", str, f"{field}.name", required=True)
            description = get(decl, "description", str, f"{field}.description", default="")
            tools.append(Tool(name, description, obj(params, f"{field}.parametersJsonSchema")))
    return tools, dropped


def _json_schema(schema: Any) -> Any:
    """Gemini's OpenAPI-style ``parameters`` (types in capitals) as JSON schema (types in lower case)."""
    if isinstance(schema, dict):
        return {k: v.lower() if k == "type" and isinstance(v, str) else _json_schema(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_json_schema(v) for v in schema]
    return schema


def _tool_choice(tool_config: dict[str, Any]) -> str:
    field = "toolConfig.functionCallingConfig"
    fcc = get(tool_config, _k(tool_config, "functionCallingConfig"), dict, field, default={})
    mode = (get(fcc, "mode", str, f"{field}.mode") or "AUTO").upper()
    # A dict or a string here once reached allowed[0] (KeyError, a 500): found by tests/fuzz.
    allowed = stop_list(get(fcc, _k(fcc, "allowedFunctionNames"), list, f"{field}.allowedFunctionNames"),
                        f"{field}.allowedFunctionNames")
    if mode == "NONE":
        return "none"
    if mode == "ANY":
        return allowed[0] if len(allowed) == 1 else "required"
    return "auto"
