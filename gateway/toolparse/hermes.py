"""Calls inside ``<tool_call>...</tool_call>`` blocks, in two markups (vLLM's ``hermes`` and ``qwen3_coder``):

- Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``
- Qwen3-Coder XML: ``<tool_call><function=f><parameter=x>value</parameter></function></tool_call>``

Each block is parsed on its own, by its shape, so one model may mix both (both parsers read both).
"""

from __future__ import annotations

import re

from ..canonical import Tool
from .base import ParsedOutput, Signature, ToolParser, arguments_json, json_object, param_type, scan, typed_value

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
# Qwen3-Coder sometimes emits a bare <function=...> block without the <tool_call> wrapper.
_BARE_FUNCTION = re.compile(r"<function=([^>\n]+)>.*?</function>", re.DOTALL)


def _json_call(body: str) -> tuple[str, str]:
    """Hermes JSON body -> (name, arguments JSON text); raises ValueError naming the problem."""
    obj = json_object(body, "tool call")
    if not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError('tool call JSON needs a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit arguments as a JSON string
        args = json_object(args, f"tool call {obj['name']!r}: arguments string")
    if not isinstance(args, dict):
        raise ValueError(f"tool call {obj['name']!r}: arguments must be a JSON object")
    return obj["name"], arguments_json(args)


def _xml_call(body: str, tools: dict[str, Tool]) -> tuple[str, str]:
    """Qwen3-Coder XML body -> (name, arguments JSON text); raises ValueError naming the problem."""
    m = _FUNCTION.search(body)
    if not m:
        raise ValueError("tool call XML has no complete <function=...>...</function> element")
    name = m.group(1).strip()
    args = {}
    for p in _PARAMETER.finditer(m.group(2)):
        key = p.group(1).strip()
        value = p.group(2)
        # The format puts each value on its own lines; those framing newlines are not part of it.
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = typed_value(value, param_type(tools, name, key))
    return name, arguments_json(args)


def _block(body: str, tools: dict[str, Tool]) -> tuple[str, str]:
    stripped = body.strip()
    if stripped.startswith("<function="):
        return _xml_call(stripped, tools)
    if stripped.startswith("{"):
        return _json_call(stripped)
    raise ValueError("tool call block is neither JSON nor <function=...> XML")


def parse(text: str, tools: dict[str, Tool]) -> ParsedOutput:
    """Text and calls of ``<tool_call>`` blocks; a truncated last block is left as text and named."""
    if OPEN not in text and _BARE_FUNCTION.search(text):
        return scan(text, _BARE_FUNCTION, lambda m: [_block(m.group(0), tools)], "")
    return scan(text, _BLOCK, lambda m: [_block(m.group(1), tools)], OPEN, closer=CLOSE)


HERMES = ToolParser("hermes", parse, lambda sig: sig.has(OPEN), reasoning="qwen3", markers=(OPEN,))
QWEN3_CODER = ToolParser("qwen3_coder", parse, lambda sig: sig.has(OPEN) and sig.has("<function=", "<parameter="),
                         reasoning="qwen3", markers=(OPEN, "<function="))
