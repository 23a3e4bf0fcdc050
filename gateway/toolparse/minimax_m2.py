"""MiniMax-M2 tool calls (vLLM's ``minimax_m2``; M2.1 and M2.5 write the same markup): one or more
``<invoke>`` elements inside ``<minimax:tool_call>...</minimax:tool_call>``::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Parameter values are text, converted by the tool schema's declared type. The template writes string
values as they are (no framing newlines, no escaping), so a string value is kept verbatim; other types
are JSON (``tojson``). Reasoning is ``<think>...</think>`` (think.py); the generation prompt ends with
``<think>\\n``, so a completion opens inside it. Turns end with ``[e~[`` (the EOS token).
"""

from __future__ import annotations

import re

from ..canonical import Tool
from .base import ParsedOutput, Signature, ToolParser, arguments_json, param_type, scan, typed_value

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
EOS = "[e~["  # ends every assistant turn

_BLOCK = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.DOTALL)
_INVOKE = re.compile(r"<invoke\b([^>]*)>(.*?)</invoke>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter\b([^>]*)>(.*?)</parameter>", re.DOTALL)
# name="x", name='x' or name=x; other attributes a model echoes from the schema (type=, description=) are ignored.
_NAME = re.compile(r"""\bname\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")


def _name(attributes: str) -> str:
    m = _NAME.search(attributes)
    return next((g for g in m.groups() if g is not None), "").strip() if m else ""


def _leftover(pattern: re.Pattern[str], body: str) -> str:
    """What of ``body`` is neither a ``pattern`` element nor whitespace (shortened for an error)."""
    rest = pattern.sub("", body).strip()
    return rest if len(rest) <= 40 else rest[:37] + "..."


def _invoke(attributes: str, body: str, tools: dict[str, Tool]) -> tuple[str, str]:
    """One ``<invoke>`` -> (name, arguments JSON text); raises ValueError naming the problem."""
    name = _name(attributes)
    if not name:
        raise ValueError('tool call <invoke> has no name="..."')
    if stray := _leftover(_PARAMETER, body):
        raise ValueError(f"tool call {name!r}: text outside complete <parameter> elements ({stray!r})")
    args = {}
    for p in _PARAMETER.finditer(body):
        key = _name(p.group(1))
        if not key:
            raise ValueError(f'tool call {name!r}: <parameter> has no name="..."')
        kind = param_type(tools, name, key)
        value = p.group(2)
        args[key] = typed_value(value if kind in ("string", "str", "text") else value.strip(), kind)
    return name, arguments_json(args)


def _block(body: str, tools: dict[str, Tool]) -> list[tuple[str, str]]:
    """One ``<minimax:tool_call>`` block -> its calls, in order; raises ValueError naming the problem."""
    invokes = list(_INVOKE.finditer(body))
    if not invokes:
        raise ValueError("tool call block has no complete <invoke name=...>...</invoke> element")
    if stray := _leftover(_INVOKE, body):
        raise ValueError(f"tool call block holds text outside complete <invoke> elements ({stray!r})")
    return [_invoke(m.group(1), m.group(2), tools) for m in invokes]


def parse(text: str, tools: dict[str, Tool]) -> ParsedOutput:
    """Text and calls of ``<minimax:tool_call>`` blocks; a truncated or unreadable block is left as text."""
    stripped = text.rstrip()
    text = stripped[:-len(EOS)] if stripped.endswith(EOS) else text
    return scan(text, _BLOCK, lambda m: _block(m.group(1), tools), OPEN, closer=CLOSE, what=f"{OPEN} block")


def _detect(sig: Signature) -> bool:
    return sig.has(OPEN)


PARSER = ToolParser("minimax_m2", parse, _detect, reasoning="minimax_m2", markers=(OPEN,))
