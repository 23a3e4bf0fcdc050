"""Kimi-K2 tool calls (vLLM's ``kimi_k2``): Kimi-K2-Instruct, K2-Thinking and their successors.

All calls of a turn sit in one section, each call named by an id ``functions.NAME:INDEX``::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

Each marker is one token of the tokenizer (ids 163595-163599, added but not "special", so a decode that
skips special tokens still keeps them); turns end with ``<|im_end|>``. The function name is the id less
its ``functions.`` prefix and ``:INDEX`` suffix. The id stays the call's id, as vLLM returns it: the
template renders it back in the call and in ``## Return of <id>`` before the tool's result, so a harness
that echoes it gives the model its own id again (a fresh gateway id there would be text it never wrote).
Reasoning is ``<think>...</think>``, which K2-Thinking may also end by opening the tool-call section
without a ``</think>`` (vLLM's ``kimi_k2`` reasoning parser does the same): ``REASONING`` reads both.
"""

from __future__ import annotations

import re

from ..canonical import Tool
from .base import ParsedOutput, ReasoningParser, Signature, ToolParser, arguments_json, json_object, scan
from .think import split_reasoning

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
EOT = "<|im_end|>"  # ends every turn
THINK_OPEN = "<think>"

# The section markers, also in the singular spelling (<|tool_call_section_begin|>) that vLLM accepts too.
_SECTION_BEGIN = r"<\|tool_calls?_section_begin\|>"
_SECTION_END = r"<\|tool_calls?_section_end\|>"
_CB, _CE = re.escape(CALL_BEGIN), re.escape(CALL_END)
# One call, with the section's opener before it and its closer after it when they are there. The body
# never spans another call's opener: a call missing its end stays text and the next one still parses.
_CALL = re.compile(rf"(?:{_SECTION_BEGIN}\s*)?{_CB}((?:(?!{_CB}).)*?){_CE}(?:\s*{_SECTION_END})?", re.DOTALL)
_ID = re.compile(r"(\S+):(\d+)")  # functions.NAME:INDEX (vLLM also reads NAME:INDEX)
_OPEN_SECTION = re.compile(_SECTION_BEGIN)


def _name(call_id: str, tools: dict[str, Tool]) -> str:
    """The function name in a call id; ValueError when the id is not ``functions.NAME:INDEX``."""
    m = _ID.fullmatch(call_id)
    if not m:
        raise ValueError(f"tool call id {call_id[:80]!r} is not functions.NAME:INDEX")
    name = m.group(1).removeprefix("functions.")
    if not name:
        raise ValueError(f"tool call id {call_id!r} has no function name")
    # vLLM keeps only the last dotted part; prefer the whole name, unless only the last part is a tool.
    last = name.rsplit(".", 1)[-1]
    return last if name not in tools and last in tools else name


def _call(body: str, tools: dict[str, Tool]) -> tuple[str, str, str]:
    """One call's body (id, argument marker, JSON) -> (name, arguments JSON text, id); raises ValueError."""
    if ARG_BEGIN not in body:
        raise ValueError(f"tool call has no {ARG_BEGIN} between its id and its arguments")
    head, _, args = body.partition(ARG_BEGIN)
    name = _name(head.strip(), tools)
    args = args.strip() or "{}"  # a call of a tool without parameters may leave the arguments out
    return name, arguments_json(json_object(args, f"tool call {name!r}: arguments")), head.strip()


def parse(text: str, tools: dict[str, Tool]) -> ParsedOutput:
    """Text and calls of Kimi-K2 markup; a truncated or unreadable call is left as text and named."""
    text = text.rstrip()
    text = text[:-len(EOT)] if text.endswith(EOT) else text
    out = scan(text, _CALL, lambda m: [_call(m.group(1), tools)], CALL_BEGIN, closer=CALL_END,
               what="Kimi-K2 tool call")
    # A section opener left with no call after it: cut before its first call, or a section of no calls.
    opened = [m.end() for m in _OPEN_SECTION.finditer(out.text)]
    if opened and CALL_BEGIN not in out.text[opened[-1]:]:
        rest = out.text[opened[-1]:]
        problem = (f"holds no {CALL_BEGIN}...{CALL_END} call" if re.search(_SECTION_END, rest)
                   else "is unterminated (generation stopped inside a tool call)")
        out.parse_error = "; ".join(filter(None, [out.parse_error, f"tool calls section {problem}"]))
    return out


def split(text: str) -> tuple[str, str]:
    """(reasoning, rest): ``<think>...</think>``, or a leading ``<think>`` that the tool-call section ends.

    The section counts as the end only after a leading ``<think>`` (K2-Thinking writes it itself); text
    before a section with no ``<think>`` is the answer's own (Kimi-K2-Instruct does not think).
    """
    head = text.lstrip()
    section = _OPEN_SECTION.search(head)
    close = head.find("</think>")
    if head.startswith(THINK_OPEN) and section and (close < 0 or section.start() < close):
        rest = head[section.start():]
        return head[len(THINK_OPEN):section.start()].strip(), rest.replace("</think>", "", 1)
    return split_reasoning(text)


def _detect(sig: Signature) -> bool:
    """The template or the tokens show Kimi's section markers (no other family spells them this way)."""
    return sig.has(SECTION_BEGIN) or (sig.has(CALL_BEGIN) and sig.has(ARG_BEGIN))


PARSER = ToolParser("kimi_k2", parse, _detect, reasoning="kimi_k2",
                    markers=(SECTION_BEGIN, "<|tool_call_section_begin|>", CALL_BEGIN))
REASONING = ReasoningParser("kimi_k2", split, lambda sig: _detect(sig) and sig.has("</think>"))
