"""What every family's parser shares: the parsed output, the registry's entry types, and a scanner for
markup that wraps each call (or each group of calls) in an opening and a closing marker.

A parser reads the decoded completion text (special tokens kept, reasoning already split off) and
returns the plain text, the tool calls, and ``parse_error``. A block that does not parse stays in the
text where it was and is named in ``parse_error``: the harness sees what the model wrote and the event
says why no tool call came of it (a truncated call, invalid JSON, an unknown shape).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..canonical import Tool, ToolCall


@dataclass
class ParsedOutput:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_error: str = ""


@dataclass(frozen=True)
class Signature:
    """What a served model shows of its markup: the chat template's text and its special tokens."""

    template: str = ""
    special_tokens: frozenset[str] = frozenset()

    def has(self, *markers: str) -> bool:
        """Any of ``markers`` in the template or among the special tokens."""
        return any(m in self.template or m in self.special_tokens for m in markers)


@dataclass(frozen=True)
class ToolParser:
    """One family's tool-call markup, named as vLLM's ``--tool-call-parser`` names it."""

    name: str
    parse: Callable[[str, dict[str, Tool]], ParsedOutput]  # (text without reasoning, tools by name)
    detect: Callable[[Signature], bool]  # this family's template / special tokens
    reasoning: str  # the reasoning parser this family's models pair with (vLLM's name)
    markers: tuple[str, ...] = ()  # what opens a call in this markup (a description of the family)


@dataclass(frozen=True)
class ReasoningParser:
    """How a family marks reasoning, named as vLLM's ``--reasoning-parser`` names it."""

    name: str
    split: Callable[[str], tuple[str, str]]  # completion text -> (reasoning, the rest)
    detect: Callable[[Signature], bool]


class ParserChoiceError(ValueError):
    """No parser fits the served model (or an unknown name was asked for); one line that names the choices."""


def new_call_id() -> str:
    """A fresh tool-call id; the gateway remembers it to match the harness's echo later."""
    return "call_" + uuid.uuid4().hex[:24]


def arguments_json(args: Any) -> str:
    """A call's arguments as the JSON object text the providers carry."""
    return json.dumps(args, ensure_ascii=False)


def json_object(body: str, what: str) -> dict[str, Any]:
    """``body`` as a JSON object; ValueError naming ``what`` and the problem otherwise. Arguments given as
    a JSON string holding an object (some models do) count as that object."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON ({e.msg} at char {e.pos})") from None
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError:
            raise ValueError(f"{what} is a string, not a JSON object") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be a JSON object")
    return obj


def param_type(tools: dict[str, Tool], fn: str, param: str) -> str:
    """The JSON-schema type a tool declares for a parameter ("string" when it says nothing)."""
    tool = tools.get(fn)
    props = (tool.parameters or {}).get("properties", {}) if tool else {}
    spec = props.get(param) if isinstance(props, dict) else None
    t = spec.get("type", "string") if isinstance(spec, dict) else "string"
    return t[0] if isinstance(t, list) and t else t if isinstance(t, str) else "string"


def typed_value(value: str, type_name: str) -> Any:
    """Parameter text of an XML-style markup -> JSON value, by the tool schema's declared type (text stays
    text; what does not parse as its type stays as the model wrote it rather than an invented value)."""
    if type_name in ("string", "str", "text"):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        if type_name == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value


def scan(text: str, block: re.Pattern[str], parse_block: Callable[[re.Match[str]], list[tuple[str, ...]]],
         opener: str, *, closer: str = "", what: str = "") -> ParsedOutput:
    """Tool calls of every ``block`` match in ``text``, the text around them kept.

    ``parse_block`` turns one match into [(name, arguments JSON)] (or (name, arguments, id) where the
    model names its calls itself), or raises ValueError: that block then
    stays in the text and its error goes to ``parse_error``. An ``opener`` left in the text after the last
    parsed block (with no ``closer`` after it) is a generation cut inside a call, and is named too.
    Text is stripped at the ends when calls were found (the markup's own newlines are not the answer's).
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    pieces: list[str] = []
    pos = 0
    for m in block.finditer(text):
        try:
            found = parse_block(m)
        except ValueError as e:
            errors.append(str(e))
            continue
        pieces.append(text[pos:m.start()])
        pos = m.end()
        calls.extend(ToolCall(id=(f[2] if len(f) > 2 else new_call_id()), name=f[0], arguments=f[1]) for f in found)
    pieces.append(text[pos:])
    rest = "".join(pieces)
    tail = rest.rfind(opener) if opener else -1
    if tail >= 0 and not (closer and closer in rest[tail:]):
        errors.append(f"unterminated {what or opener} (generation stopped inside a tool call)")
    return ParsedOutput(text=rest.strip() if calls else rest, tool_calls=calls, parse_error="; ".join(errors))


NO_REASONING = ReasoningParser("none", lambda text: ("", text), lambda sig: False)  # families without reasoning markup
