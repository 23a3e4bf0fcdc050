"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (vLLM's ``llama3_json``).

The completion is a bare JSON object ``{"name": "f", "parameters": {...}}`` (some models say
``"arguments"``), optionally after ``<|python_tag|>``; several calls are separated by ``;`` (or newlines).
There is no closing marker, so what counts as a call attempt is decided by where an object stands:

- after ``<|python_tag|>``, at the very start of the completion, or chained (``;``) after a call: it is a
  call, and one that does not parse stays text with ``parse_error`` naming the problem;
- after other text: a complete object with ``"name"`` and ``"parameters"``/``"arguments"`` (naming a
  declared tool, when tools are declared) is a call; other JSON in prose stays text without an error,
  unless it is an object opening ``{"name":`` that is cut off by the end of the generation, or holds a
  ``"parameters"`` key but is not valid JSON.
"""

from __future__ import annotations

import json
import re

from ..canonical import Tool, ToolCall
from .base import ParsedOutput, Signature, ToolParser, arguments_json, json_object, new_call_id

TAG = "<|python_tag|>"
HEADER = "<|start_header_id|>"
END_MARKERS = ("<|eot_id|>", "<|eom_id|>")  # end of turn; <|eom_id|> after a call in ipython mode
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:')
_KEYED = re.compile(r'\{\s*"')  # a JSON object with keys opens so
_CALL_KEY = re.compile(r'\{\s*"(?:name|parameters|arguments)"\s*:')
_ARGS_KEY = re.compile(r'"(?:parameters|arguments)"\s*:')
_SEPARATOR = re.compile(r"\s*;?\s*")  # between calls: "; ", ";", ";\n" or a newline
_SPACE = re.compile(r"\s*")
_CANDIDATE = re.compile(r"\{|" + re.escape(TAG))
_DECODER = json.JSONDecoder()
UNTERMINATED = "unterminated tool call JSON (generation stopped inside a tool call)"


def _extent(text: str, start: int) -> int:
    """End of the brace-balanced value opening at ``text[start]`` (strings and escapes respected); -1 when
    the text ends first."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def _decode(body: str, start: int, window: int = 4096) -> tuple[dict, int]:
    """``raw_decode`` of the object at ``body[start]`` through a growing window: a decode error counts
    the lines before it, so decoding the whole text at every brace of a long reply would be quadratic."""
    while True:
        piece = body[start:start + window]
        try:
            obj, n = _DECODER.raw_decode(piece)
            return obj, start + n
        except json.JSONDecodeError as e:
            whole = start + window >= len(body)
            if whole or (e.pos < len(piece) - 64 and not e.msg.startswith("Unterminated string")):
                raise  # an error the rest of the text cannot mend
        window *= 4


def _call(obj: dict) -> tuple[str, str]:
    """A decoded call object -> (name, arguments JSON text); raises ValueError naming the problem."""
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError('tool call JSON needs a string "name"')
    if "parameters" not in obj and "arguments" not in obj:
        raise ValueError(f'tool call {name!r} needs "parameters" (or "arguments")')
    args = obj["arguments"] if "arguments" in obj else obj["parameters"]
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        args = json_object(args, f"tool call {name!r}: arguments string")
    if not isinstance(args, dict):
        raise ValueError(f"tool call {name!r}: parameters must be a JSON object")
    return name.strip(), arguments_json(args)


def _strip_end(text: str) -> str:
    """The text without a trailing end-of-turn marker (the engine usually drops it, but not always)."""
    body = text.rstrip()
    for marker in END_MARKERS:
        if body.endswith(marker):
            return body[: -len(marker)]
    return text


def _chained(body: str, end: int) -> int:
    """``end`` when another object follows the one ending there after a separator ("; ", a newline), else -1."""
    nxt = _SEPARATOR.match(body, end).end()
    return end if nxt < len(body) and body[nxt] == "{" else -1


def _read(body: str, start: int, clear: bool, tools: dict[str, Tool]) -> tuple[int, dict | None, str]:
    """The object opening at ``body[start]``: (its end or -1 when the text ends first, the object when it
    is a call attempt, the error when it is a malformed one). Neither object nor error: not a call."""
    if not clear:  # most braces are prose or code: a keyless look, then the C decoder, rules them out quickly
        if not _KEYED.match(body, start):
            return start + 1, None, ""
        try:
            obj, end = _decode(body, start)
        except json.JSONDecodeError:
            if not _NAME_FIRST.match(body, start):
                return start + 1, None, ""  # an object may still start inside
        else:
            name = obj.get("name")
            shaped = isinstance(name, str) and ("parameters" in obj or "arguments" in obj)
            return end, (obj if shaped and (not tools or name in tools) else None), ""
    end = _extent(body, start)
    if end < 0:  # the generation ended inside this object
        return -1, None, UNTERMINATED
    try:
        return end, json_object(body[start:end], "tool call"), ""
    except ValueError as e:
        if clear or _ARGS_KEY.search(body, start, end):  # (not clear: it opens with {"name":)
            return end, None, str(e)
        return start + 1, None, ""


def parse(text: str, tools: dict[str, Tool]) -> ParsedOutput:
    """Text and calls of Llama 3 JSON tool calls; a malformed call attempt stays in the text and is named."""
    body = _strip_end(text)
    lead = len(body) - len(body.lstrip())  # where the completion's first object would start
    calls: list[ToolCall] = []
    errors: list[str] = []
    pieces: list[str] = []
    pos = i = 0  # body[pos:] is not yet emitted; the next candidate is looked for from i
    chain = -1  # end of the call (attempt) just read when a ";"-separated one follows: its separator goes with it
    while m := _CANDIDATE.search(body, i):
        span, clear, chain, start = (chain if chain >= 0 else m.start()), chain >= 0, -1, m.start()
        if m.group() == TAG:  # <|python_tag|>: what follows is a call
            start, clear = _SPACE.match(body, m.end()).end(), True
            if start < len(body) and body[start] != "{":
                errors.append(f"{TAG} is followed by no JSON tool call (built-in tool or code calls are not supported)")
                i = m.end()
                continue
        elif start == lead and _CALL_KEY.match(body, start):
            clear = True  # the completion opens with a call object
        end, obj, error = _read(body, start, clear, tools) if start < len(body) else (-1, None, UNTERMINATED)
        if end < 0:
            errors.append(error)
            break
        i = end
        if obj is not None:
            try:
                name, args = _call(obj)
            except ValueError as e:
                error = str(e)
            else:
                pieces.append(body[pos:span])
                calls.append(ToolCall(id=new_call_id(), name=name, arguments=args))
                pos = end
        if error:
            errors.append(error)
        if obj is not None or error:
            chain = _chained(body, end)
    pieces.append(body[pos:])
    rest = "".join(pieces)
    return ParsedOutput(text=rest.strip() if calls else rest, tool_calls=calls, parse_error="; ".join(errors))


def detect(sig: Signature) -> bool:
    """Llama 3 headers and the JSON call format (``{"name": ..., "parameters": ...}``) in the template; the
    pythonic Llama templates ([f(x=1)]) and xLAM's (``"arguments"`` in a list) show no ``"parameters"``."""
    t = sig.template
    return HEADER in t and '{"name": ' in t and '"parameters": ' in t and "<tool_call>" not in t


PARSER = ToolParser("llama3_json", parse, detect, reasoning="none", markers=(TAG, '{"name"'))
