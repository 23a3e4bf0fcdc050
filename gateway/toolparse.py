"""Tool-call and reasoning parsers for the served model's raw completion text.

The engine only ever sees and returns token ids; the gateway decodes them and parses the text here.
Two markups live inside ``<tool_call>...</tool_call>`` blocks:

- Hermes / Qwen2.5: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``
- Qwen3-Coder XML: ``<tool_call><function=f><parameter=x>value</parameter></function></tool_call>``

Each block is parsed on its own, by its shape, so one model may mix both. A block that does not parse
stays in the text where it was and is named in ``parse_error``: the harness sees what the model wrote and
the event says why no tool call came of it (a truncated call, invalid JSON, an unknown shape).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .canonical import Tool, ToolCall

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
# Qwen3-Coder sometimes emits a bare <function=...> block without the <tool_call> wrapper.
_BARE_FUNCTION = re.compile(r"<function=([^>\n]+)>.*?</function>", re.DOTALL)


@dataclass
class ParsedOutput:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_error: str = ""


def new_call_id() -> str:
    """A fresh tool-call id; the gateway remembers it to match the harness's echo later."""
    return "call_" + uuid.uuid4().hex[:24]


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest): a leading ``<think>...</think>`` becomes reasoning.

    A ``</think>`` without an opening tag counts too: Qwen3-style templates put ``<think>`` into the
    generation prompt, so the completion starts inside the thinking block.
    """
    end = text.find("</think>")
    if end < 0:
        return "", text
    head = text[:end]
    start = head.find("<think>")
    if start >= 0:
        if head[:start].strip():  # <think> after real text: not a leading block, leave as is
            return "", text
        head = head[start + len("<think>") :]
    return head.strip(), text[end + len("</think>") :].lstrip("\n")


def _arguments_text(args: Any) -> str:
    return json.dumps(args, ensure_ascii=False)


def _parse_json_call(body: str) -> tuple[str, str]:
    """Hermes JSON body -> (name, arguments JSON text); raises ValueError naming the problem."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"tool call is not valid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError('tool call JSON needs a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ValueError(f"tool call {obj['name']!r}: arguments string is not valid JSON") from None
    if not isinstance(args, dict):
        raise ValueError(f"tool call {obj['name']!r}: arguments must be a JSON object")
    return obj["name"], _arguments_text(args)


def _param_type(tools: dict[str, Tool], fn: str, param: str) -> str:
    tool = tools.get(fn)
    props = (tool.parameters or {}).get("properties", {}) if tool else {}
    spec = props.get(param) if isinstance(props, dict) else None
    t = spec.get("type", "string") if isinstance(spec, dict) else "string"
    return t[0] if isinstance(t, list) and t else t if isinstance(t, str) else "string"


def _convert(value: str, type_name: str) -> Any:
    """XML parameter text -> JSON value, by the tool schema's declared type (text stays text)."""
    if type_name in ("string", "str", "text"):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        if type_name == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value  # keep what the model wrote rather than invent a value


def _parse_xml_call(body: str, tools: dict[str, Tool]) -> tuple[str, str]:
    """Qwen3-Coder XML body -> (name, arguments JSON text); raises ValueError naming the problem."""
    m = _FUNCTION.search(body)
    if not m:
        raise ValueError("tool call XML has no complete <function=...>...</function> element")
    name = m.group(1).strip()
    args: dict[str, Any] = {}
    for p in _PARAMETER.finditer(m.group(2)):
        key = p.group(1).strip()
        value = p.group(2)
        # The format puts each value on its own lines; those framing newlines are not part of it.
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = _convert(value, _param_type(tools, name, key))
    return name, _arguments_text(args)


def _parse_block(body: str, tools: dict[str, Tool]) -> tuple[str, str]:
    stripped = body.strip()
    if stripped.startswith("<function="):
        return _parse_xml_call(stripped, tools)
    if stripped.startswith("{"):
        return _parse_json_call(stripped)
    raise ValueError("tool call block is neither JSON nor <function=...> XML")


def parse_tool_calls(text: str, tools: list[Tool] | None = None) -> ParsedOutput:
    """Split completion text (reasoning already removed) into plain text and tool calls.

    Text between and around parsed blocks is kept (joined, stripped at the ends). An unclosed
    ``<tool_call>`` at the end (a truncated generation) is left as text and flagged.
    """
    by_name = {t.name: t for t in tools or []}
    calls: list[ToolCall] = []
    errors: list[str] = []
    pieces: list[str] = []
    pos = 0
    blocks = list(_BLOCK.finditer(text))
    if not blocks and "<tool_call>" not in text:
        blocks = list(_BARE_FUNCTION.finditer(text))
    for m in blocks:
        body = m.group(1) if m.re is _BLOCK else m.group(0)
        try:
            name, arguments = _parse_block(body, by_name)
        except ValueError as e:
            errors.append(str(e))
            continue  # the block stays in the text
        pieces.append(text[pos : m.start()])
        pos = m.end()
        calls.append(ToolCall(id=new_call_id(), name=name, arguments=arguments))
    pieces.append(text[pos:])
    rest = "".join(pieces)
    tail = rest.rfind("<tool_call>")
    if tail >= 0 and "</tool_call>" not in rest[tail:]:
        errors.append("unterminated <tool_call> (generation stopped inside a tool call)")
    if calls:
        rest = rest.strip()
    return ParsedOutput(text=rest, tool_calls=calls, parse_error="; ".join(errors))


def parse_completion(text: str, tools: list[Tool] | None = None) -> ParsedOutput:
    """Reasoning, text and tool calls of one decoded completion."""
    reasoning, rest = split_reasoning(text)
    out = parse_tool_calls(rest, tools)
    out.reasoning = reasoning
    return out
