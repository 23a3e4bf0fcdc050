"""Tool-call arguments: one rendering for what adapters parse, one equality key for matching echoes.

Harnesses echo the calls the model made imperfectly: Claude Code re-orders the keys of ``input`` into
schema order, Qwen Code, opencode and pi re-serialize ``arguments`` compactly. The core matches an
echoed call to the one it generated with ``same_arguments`` (parse, then dump with sorted keys and no
whitespace), so those rewrites do not look like a rewritten history.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

UNPARSED_KEY = "_unparsed_arguments"  # wraps arguments text that is not a JSON object (see arguments_object)


def normalize_arguments(value: str | Mapping[str, Any] | None) -> str:
    """Arguments as the adapters store them in ``ToolCall.arguments``: JSON text, keys in the order given.

    Objects (Anthropic ``input``, Gemini ``args``) are dumped with ``json.dumps`` defaults and
    ``ensure_ascii=False``; text that parses is re-dumped the same way, so every provider yields the
    same text for the same call. Text that does not parse is kept as it is: it is what the harness sent.
    """
    if value is None:
        return "{}"
    if isinstance(value, Mapping):
        return json.dumps(value, ensure_ascii=False)
    try:
        return json.dumps(json.loads(value), ensure_ascii=False)
    except (ValueError, RecursionError):  # nested past Python's recursion limit: kept as text too
        return value


def canonical_arguments(value: str | Mapping[str, Any] | None) -> str:
    """Equality key for arguments: parsed, then dumped with sorted keys and compact separators.

    Text that is not JSON becomes its stripped self, so two broken strings still compare as text.
    """
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return value.strip()
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def same_arguments(a: str | Mapping[str, Any] | None, b: str | Mapping[str, Any] | None) -> bool:
    """Whether two renderings of arguments denote the same call (key order and spacing ignored)."""
    if isinstance(a, str) and a == b:  # most echoes are verbatim: skip parsing both (every call compares them all)
        return True
    return canonical_arguments(a) == canonical_arguments(b)


def arguments_object(text: str) -> dict[str, Any]:
    """Arguments text as the JSON object that Anthropic ``input`` and Gemini ``args`` must be.

    The core only emits tool calls whose arguments parsed, so the fallback is for robustness: text that
    is not a JSON object is wrapped under ``_unparsed_arguments`` (visible, never silently dropped).
    """
    try:
        value = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        return {UNPARSED_KEY: text}
    return value if isinstance(value, dict) else {UNPARSED_KEY: text}


def arguments_text(text: str) -> str:
    """Arguments text to stream as a JSON object: the model's own text when it is one, else its wrapping."""
    obj = arguments_object(text)
    if UNPARSED_KEY in obj and len(obj) == 1:
        return json.dumps(obj, ensure_ascii=False)
    return text if text.strip() else "{}"
