"""The gateway's OpenAPI 3.1 document: the four provider APIs as this gateway serves them.

The routes themselves are one catch-all (any base prefix, ``/s/{key}``), so FastAPI cannot derive a
document; this one is written by hand from what the adapters actually read (``gateway/providers``) and
the limits they enforce (``gateway/limits.py``), and is served at ``GET /openapi.json``. Bodies allow
unknown fields (the gateway records them as ``ignored_fields``), and ``null`` counts as absent. Ranges
are the gateway's own, not the providers': e.g. temperature up to 100, since the served model is ours.
tests/fuzz/test_gateway_schemathesis.py holds the gateway to this document.
"""

from __future__ import annotations

from typing import Any

from .limits import Limits

S, B, I, N, O = {"type": "string"}, {"type": "boolean"}, {"type": "integer"}, {"type": "number"}, {"type": "object"}
NULL_OR_S = {"type": ["string", "null"]}


def obj(props: dict[str, Any], *required: str, **extra: Any) -> dict[str, Any]:
    """A JSON-schema object with ``props``; unknown fields allowed unless ``extra`` says otherwise."""
    return {"type": "object", "properties": props, **({"required": list(required)} if required else {}), **extra}


def arr(items: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, **extra}


def const(value: str) -> dict[str, Any]:
    return {"const": value}


def either(*schemas: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": list(schemas)}


def _sampling(limits: Limits, max_tokens: str, *, top_k: bool = True) -> dict[str, Any]:
    """The sampling fields every API shares, with the ranges ``check_request`` enforces."""
    props = {
        max_tokens: {"type": "integer", "minimum": 1, "maximum": limits.max_output_tokens},
        "temperature": {"type": "number", "minimum": 0, "maximum": 100},
        ("topP" if max_tokens == "maxOutputTokens" else "top_p"): {"type": "number", "minimum": 0, "maximum": 1},
    }
    if top_k:
        props["topK" if max_tokens == "maxOutputTokens" else "top_k"] = {"type": "integer", "minimum": -1, "maximum": 1 << 31}
    return props


def _stops(limits: Limits) -> dict[str, Any]:
    return either(S, arr(S, maxItems=limits.max_stop_sequences))


# ------------------------------------------------------------------------------ request bodies


def anthropic_body(limits: Limits, *, count_only: bool = False) -> dict[str, Any]:
    """``/v1/messages`` (``count_only``: ``/v1/messages/count_tokens``, no ``max_tokens``)."""
    text = obj({"type": const("text"), "text": S}, "type", "text")
    blocks = either(
        text,
        obj({"type": const("image"), "source": O}, "type"),
        obj({"type": const("tool_use"), "id": S, "name": S, "input": O}, "type", "id", "name"),
        obj({"type": const("tool_result"), "tool_use_id": S, "content": either(S, arr(text)), "is_error": B},
            "type", "tool_use_id"),
        obj({"type": const("thinking"), "thinking": S, "signature": S}, "type"),
        obj({"type": const("redacted_thinking"), "data": S}, "type"),
    )
    message = obj({"role": {"enum": ["user", "assistant", "system"]}, "content": either(S, arr(blocks))}, "role", "content")
    tool = either(obj({"name": S, "description": S, "input_schema": O}, "name", "input_schema"),
                  obj({"type": S, "name": S}, "type"))  # server tools (no input_schema) are skipped, named in extras
    props = {
        "model": S,
        "messages": arr(message, minItems=1, maxItems=limits.max_messages),
        "system": either(S, arr(text)),
        "tools": arr(tool, maxItems=limits.max_tools),
        "tool_choice": either(obj({"type": {"enum": ["auto", "any", "none"]}}, "type"), obj({"type": const("tool"), "name": S}, "type", "name")),
        "stop_sequences": _stops(limits),
        "stream": B,
        "thinking": obj({"type": {"enum": ["enabled", "disabled", "adaptive"]}, "budget_tokens": I}),
        "output_config": O, "metadata": O, "context_management": O, "service_tier": S,
        **_sampling(limits, "max_tokens"),
    }  # fmt: skip
    return obj(props, "model", "messages", *(() if count_only else ("max_tokens",)))


def _openai_parts(*text_kinds: str) -> dict[str, Any]:
    return either(S, {"type": "null"}, arr(obj({"type": S, "text": S, "refusal": S}, "type")),
                  arr(either(*(obj({"type": const(k), "text": S}, "type", "text") for k in text_kinds))))


def chat_body(limits: Limits) -> dict[str, Any]:
    """``/v1/chat/completions``."""
    call = obj({"id": S, "type": const("function"), "function": obj({"name": S, "arguments": S}, "name")}, "id", "function")
    fields = {"content": _openai_parts("text"), "name": S, "tool_call_id": S, "tool_calls": arr(call), "reasoning_content": S,
              "reasoning": S}
    message = either(obj({"role": {"enum": ["system", "developer", "user", "assistant", "function"]}, **fields}, "role"),
                     obj({"role": const("tool"), **fields}, "role", "tool_call_id"))
    function = obj({"name": S, "description": S, "parameters": O}, "name")
    props = {
        "model": S,
        "messages": arr(message, minItems=1, maxItems=limits.max_messages),
        "tools": arr(obj({"type": S, "function": function}, "function"), maxItems=limits.max_tools),
        "tool_choice": either({"enum": ["auto", "none", "required"]},
                              obj({"type": const("function"), "function": obj({"name": S}, "name")}, "function")),
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_output_tokens},
        "stop": _stops(limits),
        "seed": {"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 63) - 1},
        "n": {"enum": [1]},
        "stream": B,
        "stream_options": obj({"include_usage": B}),
        "response_format": obj({"type": {"enum": ["text", "json_object", "json_schema"]}}),
        "reasoning_effort": S, "parallel_tool_calls": B, "user": S, "metadata": O,
        **_sampling(limits, "max_tokens"),
    }  # fmt: skip
    return obj(props, "model", "messages")


def responses_body(limits: Limits) -> dict[str, Any]:
    """``/v1/responses`` and ``/v1/responses/input_tokens`` (the whole conversation: nothing is stored)."""
    content = _openai_parts("input_text", "output_text")
    item = either(
        obj({"type": const("message"), "role": {"enum": ["system", "developer", "user", "assistant"]}, "content": content}, "role"),
        obj({"type": const("function_call"), "call_id": S, "name": S, "arguments": S, "namespace": S}, "type", "call_id", "name"),
        obj({"type": const("custom_tool_call"), "call_id": S, "name": S, "input": S}, "type", "call_id", "name"),
        obj({"type": {"enum": ["function_call_output", "custom_tool_call_output"]}, "call_id": S, "output": content},
            "type", "call_id"),
        obj({"type": const("reasoning"), "summary": arr(obj({"text": S})), "content": arr(obj({"text": S}))}, "type"),
    )
    function = obj({"type": const("function"), "name": S, "description": S, "parameters": O}, "type", "name")
    custom = obj({"type": const("custom"), "name": S, "description": S, "format": O}, "type", "name")
    tool = either(function, custom, obj({"type": const("namespace"), "name": S, "tools": arr(either(function, custom))}, "type", "name"),
                  obj({"type": S}, "type"))  # built-in tools (web_search...) are dropped, named in extras
    props = {
        "model": S,
        "input": either(S, arr(item, minItems=1, maxItems=limits.max_messages)),
        "instructions": S,
        "tools": arr(tool, maxItems=limits.max_tools),
        "tool_choice": either({"enum": ["auto", "none", "required"]}, obj({"type": {"enum": ["function", "custom"]}, "name": S}, "type", "name")),
        "stream": B,
        "previous_response_id": {"type": ["string", "null"], "maxLength": 0,
                                 "description": "refused: the gateway stores no responses"},
        "reasoning": obj({"effort": S, "summary": NULL_OR_S}), "text": obj({"format": O}),
        "include": arr(S), "store": B, "parallel_tool_calls": B, "prompt_cache_key": S, "metadata": O,
        **_sampling(limits, "max_output_tokens", top_k=False),
    }  # fmt: skip
    return obj(props, "model", "input")


def google_body(limits: Limits) -> dict[str, Any]:
    """``:generateContent`` / ``:streamGenerateContent`` (snake_case spellings are accepted too)."""
    part = obj({
        "text": S, "thought": B, "thoughtSignature": S,
        "functionCall": obj({"name": S, "id": S, "args": O}, "name"),
        "functionResponse": obj({"name": S, "id": S, "response": O}, "name"),
        "inlineData": obj({"mimeType": S, "data": S}), "fileData": obj({"mimeType": S, "fileUri": S}),
    })  # fmt: skip
    content = obj({"role": {"enum": ["user", "model", "function"]}, "parts": arr(part)})
    declaration = obj({"name": S, "description": S, "parameters": O, "parametersJsonSchema": O}, "name")
    config = obj({
        **_sampling(limits, "maxOutputTokens"),
        "stopSequences": _stops(limits),
        "seed": {"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 63) - 1},
        "candidateCount": {"enum": [1]},
        "thinkingConfig": obj({"includeThoughts": B, "thinkingBudget": I}),
        "responseMimeType": S, "responseSchema": O, "responseJsonSchema": O,
    })  # fmt: skip
    calling = obj({"mode": {"enum": ["AUTO", "ANY", "NONE", "VALIDATED"]}, "allowedFunctionNames": arr(S)})
    props = {
        "contents": arr(content, minItems=1, maxItems=limits.max_messages),
        "systemInstruction": either(S, obj({"parts": arr(obj({"text": S}))})),
        "tools": arr(obj({"functionDeclarations": arr(declaration, maxItems=limits.max_tools)}), maxItems=limits.max_tools),
        "toolConfig": obj({"functionCallingConfig": calling}),
        "generationConfig": config,
        "safetySettings": arr(O), "cachedContent": S, "labels": O, "model": S,
    }
    return obj(props, "contents")


# ------------------------------------------------------------------------------ responses

ERRORS = {  # provider -> its error body (``render_error``)
    "anthropic": obj({"type": const("error"), "error": obj({"type": S, "message": S}, "type", "message")}, "type", "error"),
    "openai": obj({"error": obj({"message": S, "type": S, "param": NULL_OR_S, "code": NULL_OR_S}, "message", "type")}, "error"),
    "google": obj({"error": obj({"code": I, "message": S, "status": S}, "code", "message", "status")}, "error"),
}
ERROR_STATUSES = {
    "400": "invalid request (the message names the field), or the prompt does not fit the context",
    "401": "missing or invalid session key", "404": "no such route (e.g. a control character in the path)", "408": "request body not received in time",
    "413": "request body over the size limit", "415": "unsupported content-encoding",
    "429": "too many calls in flight for this key or session (Retry-After)",
    "502": "engine unreachable or failed", "503": "event log (Kafka) unavailable, or paused too long: not recorded, retry",
    "504": "engine timed out",
}  # fmt: skip
SUCCESS = {
    "anthropic": obj({"id": {"type": "string", "pattern": "^msg_"}, "type": const("message"), "content": arr(O), "usage": O},
                     "id", "type", "content", "usage"),
    "openai.chat": obj({"id": {"type": "string", "pattern": "^chatcmpl-"}, "object": const("chat.completion"),
                        "choices": arr(O, minItems=1), "usage": O}, "id", "object", "choices"),
    "openai.responses": obj({"id": {"type": "string", "pattern": "^resp_"}, "object": const("response"),
                             "status": {"enum": ["completed", "incomplete"]}, "output": arr(O), "usage": O},
                            "id", "object", "status", "output"),
    "google": obj({"candidates": arr(O, minItems=1), "usageMetadata": O, "responseId": S}, "candidates", "responseId"),
}


def sse_of(event: dict[str, Any], *, done: bool = False) -> dict[str, Any]:
    """``text/event-stream`` whose every event's ``data`` is JSON matching ``event`` (Chat ends with ``[DONE]``)."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": event}
    return {"text/event-stream": {"schema": obj({"event": S, "data": either(const("[DONE]"), data) if done else data}, "data")}}


SSE = {  # one event of each provider's stream
    "anthropic": sse_of(obj({"type": S}, "type")),
    "openai.chat": sse_of(obj({"id": {"type": "string", "pattern": "^chatcmpl-"}, "object": const("chat.completion.chunk"),
                               "choices": arr(O)}, "id", "object", "choices"), done=True),
    "openai.responses": sse_of(obj({"type": S, "sequence_number": I}, "type", "sequence_number")),
    "google": sse_of(obj({"candidates": arr(O, minItems=1), "responseId": S}, "candidates", "responseId")),
}


def _errors(family: str) -> dict[str, Any]:
    out = {}
    for status, why in ERROR_STATUSES.items():
        resp: dict[str, Any] = {"description": why, "content": {"application/json": {"schema": ERRORS[family]}}}
        if status == "429":
            resp["headers"] = {"Retry-After": {"required": True, "schema": S}}
        out[status] = resp
    return out


def _post(op_id: str, family: str, body: dict[str, Any], ok: dict[str, Any] | None, *, stream: str = "",
          params: list | None = None, headers: list | None = None) -> dict[str, Any]:
    """A model-API operation answering ``ok`` as JSON, and/or (``stream``: the SUCCESS key) an event stream."""
    content = {"application/json": {"schema": ok}} if ok else {}
    if stream:
        content.update(SSE[stream])
    op = {
        "operationId": op_id,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": {"description": "success in the provider's shape", "content": content}, **_errors(family)},
    }
    if params or headers:
        op["parameters"] = (params or []) + (headers or [])
    return {"post": op}


def _get(op_id: str, schema: dict[str, Any]) -> dict[str, Any]:
    ok = {"description": "ok", "content": {"application/json": {"schema": schema}}}
    return {"get": {"operationId": op_id, "security": [], "responses": {"200": ok}}}


MODEL_LISTS = either(obj({"object": const("list"), "data": arr(obj({"id": S}, "id"))}, "data"),
                     obj({"data": arr(obj({"id": S, "type": const("model")}, "id")), "has_more": B}, "data"),
                     obj({"models": arr(obj({"name": S}, "name"))}, "models"))


def openapi_document(limits: Limits | None = None, max_body_bytes: int = 32 * 1024 * 1024) -> dict[str, Any]:
    """The whole document for a gateway with ``limits`` and body limit ``max_body_bytes``."""
    limits = limits or Limits()
    model = {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[^/:?#%\\x00-\\x1f]+$"}}
    alt = {"name": "alt", "in": "query", "required": False, "schema": {"enum": ["sse", "json"]}}
    version = [{"name": "anthropic-version", "in": "header", "required": False, "schema": S}]
    count = obj({"input_tokens": {"type": "integer", "minimum": 0}}, "input_tokens")
    gen = "/v1beta/models/{model}:"
    paths = {
        "/v1/messages": _post("anthropicMessages", "anthropic", anthropic_body(limits), SUCCESS["anthropic"], stream="anthropic",
                              headers=version),
        "/v1/messages/count_tokens": _post("anthropicCountTokens", "anthropic", anthropic_body(limits, count_only=True),
                                           count, headers=version),
        "/v1/chat/completions": _post("chatCompletions", "openai", chat_body(limits), SUCCESS["openai.chat"], stream="openai.chat"),
        "/v1/responses": _post("responses", "openai", responses_body(limits), SUCCESS["openai.responses"], stream="openai.responses"),
        "/v1/responses/input_tokens": _post("responsesInputTokens", "openai", responses_body(limits),
                                            obj({"object": const("response.input_tokens"), **count["properties"]}, "input_tokens")),
        gen + "generateContent": _post("generateContent", "google", google_body(limits), SUCCESS["google"], params=[model]),
        # alt=sse: an event stream; without it, as Google answers, the same chunks as one JSON array.
        gen + "streamGenerateContent": _post("streamGenerateContent", "google", google_body(limits),
                                             arr(SUCCESS["google"], minItems=1), stream="google", params=[model, alt]),
        gen + "countTokens": _post("countTokens", "google", either(google_body(limits),
                                   obj({"generateContentRequest": google_body(limits)}, "generateContentRequest")),
                                   obj({"totalTokens": {"type": "integer", "minimum": 0}}, "totalTokens"), params=[model]),
        "/v1/models": _get("listModels", MODEL_LISTS),
        "/health": _get("health", obj({"status": const("ok"), "served_model": S, "policy_version": I}, "status")),
    }
    schemes = {
        "anthropicKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        "bearer": {"type": "http", "scheme": "bearer"},
        "googleKey": {"type": "apiKey", "in": "header", "name": "x-goog-api-key"},
        "googleQueryKey": {"type": "apiKey", "in": "query", "name": "key"},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "polarstream gateway",
            "version": "1",
            "description": (
                "Anthropic Messages, OpenAI Chat Completions and Responses, and Gemini generateContent, recorded "
                "token by token. Every path also works under any base prefix and under /s/{session_key}/ (the key "
                f"in the path instead of a header). Bodies: JSON, at most {max_body_bytes} bytes (gzip/deflate "
                f"accepted), nested at most {limits.max_json_depth} levels. Any of the key schemes works on any route."
            ),
        },
        "paths": paths,
        "components": {"securitySchemes": schemes},
        "security": [{name: []} for name in schemes],
    }
