"""DeepSeek tool calls (vLLM's ``deepseek_v31`` and ``deepseek_v3``), one call per
``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` inside ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``:

- V3.1 (and V3.2-Exp): ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``
- V3 / R1-0528: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``

Each call is parsed on its own, by its shape, so both parsers read both; they differ in which template
they detect. The bars and blanks are the fullwidth ``｜`` (U+FF5C) and ``▁`` (U+2581); each marker is one
token. Reasoning is ``<think>...</think>`` (think.py).
"""

from __future__ import annotations

import re

from ..canonical import Tool
from .base import ParsedOutput, Signature, ToolParser, arguments_json, json_object, scan

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
EOS = "<｜end▁of▁sentence｜>"  # ends every assistant turn

# One call, with the section's opener before it and its closer after it when they are there. The body
# never spans another call's opener: a call missing its end stays text and the next one still parses.
_CALL = re.compile(rf"(?:{CALLS_BEGIN}\s*)?{CALL_BEGIN}((?:(?!{CALL_BEGIN}).)*?){CALL_END}(?:\s*{CALLS_END})?",
                   re.DOTALL)
# V3's arguments: the function name on its own line, then one ```json fence.
_FENCED = re.compile(r"([^\n`]*)\n```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL)


def _call(body: str) -> tuple[str, str]:
    """One call's body -> (name, arguments JSON text); raises ValueError naming the problem."""
    if SEP not in body:
        raise ValueError(f"tool call has no {SEP} between name and arguments")
    head, _, tail = body.partition(SEP)
    tail = tail.strip()
    if not tail.startswith("{") and "```" in tail:  # V3 / R1: type<sep>name\n```json\n{...}\n```
        m = _FENCED.fullmatch(tail)
        if not m:
            raise ValueError(f"tool call {head.strip()!r}: arguments are not one ```json block after the name")
        name, body_json = m.group(1).strip(), m.group(2)
    else:  # V3.1: name<sep>{...}
        name, body_json = head.strip(), tail
    if not name:
        raise ValueError("tool call has no function name")
    return name, arguments_json(json_object(body_json, f"tool call {name!r}: arguments"))


def parse(text: str, tools: dict[str, Tool]) -> ParsedOutput:
    """Text and calls of DeepSeek markup; a truncated or unreadable call is left as text and named."""
    if text.rstrip().endswith(EOS):  # the engine keeps or drops the final stop token
        text = text.rstrip()[:-len(EOS)]
    out = scan(text, _CALL, lambda m: [_call(m.group(1))], CALL_BEGIN, closer=CALL_END, what="DeepSeek tool call")
    # A section opener left with no call after it: cut before the first call, or a section of no calls.
    start = out.text.rfind(CALLS_BEGIN)
    if start >= 0 and CALL_BEGIN not in out.text[start:]:
        problem = (f"holds no {CALL_BEGIN}...{CALL_END} call" if CALLS_END in out.text[start:]
                   else "is unterminated (generation stopped inside a tool call)")
        out.parse_error = "; ".join(filter(None, [out.parse_error, f"tool calls section {problem}"]))
    return out


def _template_shows(sig: Signature) -> bool:
    """The template renders this markup (the tokens alone are shared by V3, R1, V3.1 and later)."""
    return SEP in sig.template and CALL_BEGIN in sig.template and "｜DSML｜" not in sig.template


PARSER = ToolParser("deepseek_v31", parse, lambda sig: _template_shows(sig) and "```json" not in sig.template,
                    reasoning="deepseek_v3", markers=(CALLS_BEGIN, CALL_BEGIN))
V3 = ToolParser("deepseek_v3", parse, lambda sig: _template_shows(sig) and "```json" in sig.template,
                reasoning="deepseek_r1", markers=(CALLS_BEGIN, CALL_BEGIN))
