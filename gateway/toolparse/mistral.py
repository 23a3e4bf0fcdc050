"""Mistral's ``[TOOL_CALLS]`` markup (vLLM's ``mistral`` tool parser) and its ``[THINK]...[/THINK]`` reasoning
(vLLM's ``mistral`` reasoning parser): Mistral Small 3.x, Devstral, Magistral, Ministral.

Two call shapes, told apart by what follows each ``[TOOL_CALLS]``:

- tokenizers before v11: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, one JSON list of calls;
- v11 and later, once per call: ``[TOOL_CALLS]f[ARGS]{...}`` (v11 puts ``[CALL_ID]abc123456`` before
  ``[ARGS]``; with the ``[ARGS]`` token decoded away it reads ``[TOOL_CALLS]f{...}``).

There is no closing marker: a call runs to the next ``[TOOL_CALLS]`` or the end. What follows a call's JSON
in its stretch stays text. Turns end with ``</s>``, taken off the end when the text still has it.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from ..canonical import Tool, ToolCall
from .base import ParsedOutput, ReasoningParser, Signature, ToolParser, arguments_json, json_object

OPEN, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits
THINK, END_THINK = "[THINK]", "[/THINK]"
EOS = "</s>"
# name, optional [CALL_ID]id, optional [ARGS]: whatever follows is the arguments' JSON
_HEAD = re.compile(r"\s*([^\s\[\]{}\"]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_-]*\s*)?(\[ARGS\])?\s*")
_DECODER = json.JSONDecoder()


class _Cut(Exception):
    """The text ended inside a call."""


def _decode(body: str, pos: int, what: str, last: bool) -> tuple[Any, int]:
    """The JSON value at ``body[pos:]`` and where it ends; _Cut when the last call's JSON runs off the end."""
    try:
        return _DECODER.raw_decode(body, pos)
    except json.JSONDecodeError as e:
        if last and (e.pos >= len(body.rstrip()) or e.msg.startswith("Unterminated string")):
            raise _Cut() from None
        raise ValueError(f"{what} is not valid JSON ({e.msg} at char {e.pos - pos})") from None


def _arguments(args: Any, name: str) -> str:
    if isinstance(args, str):  # some models give the arguments as a JSON string
        args = json_object(args, f"tool call {name!r}: arguments string")
    if not isinstance(args, dict):
        raise ValueError(f"tool call {name!r}: arguments must be a JSON object")
    return arguments_json(args)


def _listed_call(obj: Any) -> tuple[str, str]:
    """One ``{"name": ..., "arguments": ...}`` of the JSON-list shape -> (name, arguments JSON text)."""
    if not isinstance(obj, dict):
        raise ValueError("tool call list items must be JSON objects")
    if not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError('tool call JSON needs a string "name"')
    return obj["name"], _arguments(obj.get("arguments", obj.get("parameters", {})), obj["name"])


def _stretch(body: str, last: bool) -> tuple[list[tuple[str, str]], int]:
    """The calls of the text after one ``[TOOL_CALLS]`` (up to the next) and where they end; ValueError
    naming the problem, or _Cut."""
    start = len(body) - len(body.lstrip())
    if start == len(body):
        if last:
            raise _Cut()
        raise ValueError(f"{OPEN} with no call after it")
    if body.startswith((ARGS, CALL_ID), start):
        raise ValueError(f"tool call has no function name before {body[start:].split(']')[0]}]")
    if body[start] in "[{":  # the JSON-list shape (a single object is taken as a list of one)
        value, end = _decode(body, start, "tool call list", last)
        items = value if isinstance(value, list) else [value]
        if not items:
            raise ValueError("tool call list is empty")
        return [_listed_call(item) for item in items], end
    head = _HEAD.match(body)
    if head and head.end() == len(body) and last:  # cut in the name, the call id, or right after [ARGS]
        raise _Cut()
    if not head or not (head.group(2) or body.startswith("{", head.end())):
        raise ValueError(f"{OPEN} is followed by neither a JSON list nor name[ARGS]{{...}}")
    name, pos = head.group(1), head.end()
    args, end = _decode(body, pos, f"tool call {name!r}: arguments", last)
    return [(name, _arguments(args, name))], end


def call_id() -> str:
    """A fresh call id as Mistral's templates take them: 9 letters and digits (the v3-v11 templates refuse
    any other id, in the call and in its result; vLLM's Mistral parser makes the same kind)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def parse(text: str, tools: dict[str, Tool]) -> ParsedOutput:
    """Text and calls of ``[TOOL_CALLS]`` markup; a stretch that does not parse stays text and is named."""
    if text.rstrip().endswith(EOS):
        text = text.rstrip()[: -len(EOS)]
    first = text.find(OPEN)
    if first < 0:
        return ParsedOutput(text=text)
    stretches = text[first + len(OPEN):].split(OPEN)
    pieces, calls, errors = [text[:first]], [], []
    for i, body in enumerate(stretches):
        try:
            found, end = _stretch(body, last=i == len(stretches) - 1)
        except _Cut:
            errors.append(f"unterminated {OPEN} call (generation stopped inside a tool call)")
            pieces.append(OPEN + body)
            continue
        except ValueError as e:
            errors.append(str(e))
            pieces.append(OPEN + body)
            continue
        calls.extend(ToolCall(id=call_id(), name=name, arguments=args) for name, args in found)
        pieces.append(body[end:])
    rest = "".join(pieces)
    return ParsedOutput(text=rest.strip() if calls else rest, tool_calls=calls, parse_error="; ".join(errors))


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest) as vLLM's ``mistral`` reasoning parser reads it: what lies between ``[THINK]`` and
    ``[/THINK]`` is reasoning, the text before and after it the rest. A ``[THINK]`` never closed (the
    generation stopped while thinking) makes all after it reasoning; a ``[/THINK]`` without ``[THINK]`` is
    dropped and the text kept (Mistral templates put no ``[THINK]`` into the prompt)."""
    start = text.find(THINK)
    if start < 0:
        return "", text.replace(END_THINK, "", 1)
    before, inner = text[:start], text[start + len(THINK):]
    end = inner.find(END_THINK)
    if end < 0:
        return inner.strip(), before
    after = inner[end + len(END_THINK):]
    return inner[:end].strip(), (before + after) if before.strip() else after.lstrip("\n")


def _detect(sig: Signature) -> bool:
    return sig.has(OPEN)


PARSER = ToolParser("mistral", parse, _detect, reasoning="mistral", markers=(OPEN,))
REASONING = ReasoningParser("mistral", split_reasoning, lambda sig: sig.has(END_THINK))
