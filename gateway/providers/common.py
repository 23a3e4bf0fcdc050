"""Helpers every adapter shares: field validation, SSE framing, text pieces, ids and placeholders.

Validation errors name the offending field with a JSON-path-like location (``messages.2.content``)
so a harness author can see at once what the gateway refused.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import orjson

from gateway.canonical import Message, RequestError, Tool, ToolCall
from gateway.providers.arguments import normalize_arguments

TEXT_JOIN = "\n"  # how several text blocks of one message become one string (fixed, so prompts are stable)
IMAGE_PLACEHOLDER = "[image]"  # the served models are text-only; the placeholder keeps the turn's shape


def bad(field: str, problem: str) -> RequestError:
    """A 400 naming the field."""
    return RequestError(400, f"{field}: {problem}")


def obj(value: Any, field: str) -> dict[str, Any]:
    """``value`` as a JSON object, or a 400 naming ``field``."""
    if not isinstance(value, Mapping):
        raise bad(field, f"expected an object, got {type_name(value)}")
    return dict(value)


def items(value: Any, field: str) -> list[Any]:
    """``value`` as a JSON array, or a 400 naming ``field``."""
    if not isinstance(value, list):
        raise bad(field, f"expected an array, got {type_name(value)}")
    return value


def get(
    body: Mapping[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    field: str = "",
    *,
    required: bool = False,
    default: Any = None,
) -> Any:
    """``body[key]`` checked against ``kind`` (bool is never an int here); ``null`` counts as absent."""
    field = field or key
    value = body.get(key)
    if value is None:
        if required:
            raise bad(field, "Field required")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if int in kinds and isinstance(value, float) and value.is_integer():
        return int(value)  # JSON has one number type; google-genai sends topK as 3.0
    if isinstance(value, bool) and bool not in kinds:
        raise bad(field, f"expected {kind_name(kinds)}, got boolean")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kinds):
        raise bad(field, f"expected {kind_name(kinds)}, got {type_name(value)}")
    return value


def positive_int(body: Mapping[str, Any], key: str, field: str = "", *, required: bool = False) -> int | None:
    """An integer >= 1 (token limits), or None when absent."""
    value = get(body, key, int, field, required=required)
    if value is not None and value < 1:
        raise bad(field or key, f"must be at least 1, got {value}")
    return value


def stop_list(value: Any, field: str) -> list[str]:
    """Stop sequences given as one string or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    seqs = items(value, field)
    for i, s in enumerate(seqs):
        if not isinstance(s, str):
            raise bad(f"{field}.{i}", f"expected a string, got {type_name(s)}")
    return list(seqs)


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}


def type_name(value: Any) -> str:
    """JSON's name for a Python value's type, for error messages."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def kind_name(kinds: tuple[type, ...]) -> str:
    return " or ".join(_JSON_TYPES.get(k, k.__name__) for k in kinds)


def ignored_fields(body: Mapping[str, Any], known: set[str]) -> list[str]:
    """Top-level keys the adapter does not use: recorded in extras (never dropped silently)."""
    return sorted(k for k in body if k not in known)


def tool_names_by_id(messages: list[Message]) -> dict[str, str]:
    """Call id -> tool name over the assistant turns so far (tool results name their tool)."""
    return {c.id: c.name for m in messages for c in m.tool_calls}


# ------------------------------------------------------------------------ shared request parsing


def preamble(body: Any, recorded: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every parser's first step: the body as an object, and the provider fields recorded as they are."""
    body = obj(body, "body")
    return body, {k: body[k] for k in recorded if k in body}


def nonempty_items(body: Mapping[str, Any], key: str, what: str) -> list[Any]:
    """A required array with at least one entry (``messages``, ``contents``); ``what`` names an entry."""
    value = items(get(body, key, list, required=True), key)
    if not value:
        raise bad(key, f"at least one {what} is required")
    return value


def note_ignored(body: Mapping[str, Any], known: set[str], extras: dict[str, Any]) -> None:
    """Record the top-level fields the adapter does not use (never dropped silently)."""
    if ignored := ignored_fields(body, known):
        extras["ignored_fields"] = ignored


def parts_text(value: Any, field: str, *, text_kinds: tuple[str, ...], image_kinds: tuple[str, ...]) -> str:
    """OpenAI-style content: a string, or typed parts joined as text (images and others as placeholders).

    Chat calls its parts ``text``/``image_url``, Responses ``input_text``/``output_text``/``input_image``;
    both have ``refusal``. Unknown kinds stay visible as ``[kind]`` rather than vanishing.
    """
    if value is None or isinstance(value, str):
        return value or ""
    texts = []
    for j, part in enumerate(items(value, field)):
        part = obj(part, f"{field}.{j}")
        kind = get(part, "type", str, f"{field}.{j}.type", required=True)
        if kind in text_kinds:
            texts.append(get(part, "text", str, f"{field}.{j}.text", required=True))
        elif kind == "refusal":
            texts.append(get(part, "refusal", str, f"{field}.{j}.refusal", default=""))
        elif kind in image_kinds:
            texts.append(IMAGE_PLACEHOLDER)
        else:
            texts.append(f"[{kind}]")
    return TEXT_JOIN.join(texts)


def tool_choice_mode(value: Any) -> str | None:
    """OpenAI's ``tool_choice`` when absent or a string (auto/none/required); None when it is an object."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad("tool_choice", f"expected 'auto', 'none', 'required' or a tool, got {value!r}")
        return value
    return None


def function_tool(fn: Mapping[str, Any], field: str, *, prefix: str = "") -> Tool:
    """An OpenAI function tool (``name``, ``description``, ``parameters``) as a canonical Tool."""
    name = get(fn, "name", str, f"{field}.name", required=True)
    return Tool(
        name=f"{prefix}{name}",
        description=get(fn, "description", str, f"{field}.description", default=""),
        parameters=get(fn, "parameters", dict, f"{field}.parameters", default={"type": "object", "properties": {}}),
    )


def function_call(call_id: str, fn: Mapping[str, Any], field: str, *, name: str = "") -> ToolCall:
    """An OpenAI function call echo (``name`` + ``arguments`` text in ``fn``) as a canonical ToolCall."""
    name = name or get(fn, "name", str, f"{field}.name", required=True)
    return ToolCall(call_id, name, normalize_arguments(get(fn, "arguments", str, f"{field}.arguments", default="{}")))


# ------------------------------------------------------------------------------------ rendering


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event; ``event:`` line first when the provider names its events."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def pieces(text: str, size: int) -> Iterator[str]:
    """``text`` cut into deltas of ``size`` characters (``size`` <= 0: one delta)."""
    if size <= 0 or len(text) <= size:
        yield text
        return
    for i in range(0, len(text), size):
        yield text[i : i + size]


def prefixed(value: str, prefix: str) -> str:
    """``value`` with the provider's id prefix (``msg_``, ``resp_``...) unless it already has it."""
    return value if value.startswith(prefix) else prefix + value


def signature(*parts: str) -> str:
    """A deterministic stand-in for a provider's opaque reasoning signature.

    Harnesses echo signatures verbatim; making it a function of the content keeps two renders of the
    same answer byte-identical (retries, replays).
    """
    h = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return base64.b64encode(b"polarstream:" + h).decode()


def error_status(status: int, table: Mapping[int, str], default: str) -> str:
    """The provider's error type for an HTTP status (5xx without an entry: ``default``)."""
    return table.get(status, default if status >= 500 else table.get(400, default))


def error_type(err: RequestError, table: Mapping[int, str], default: str) -> str:
    """The provider's error type: an explicit ``kind`` it knows wins, else the status decides.

    ``invalid_request_error`` is RequestError's default kind, so it never overrides a status (a 503
    raised without a kind is still an overload, not a bad request).
    """
    if err.kind != "invalid_request_error" and err.kind in table.values():
        return err.kind
    return error_status(err.status, table, default)
