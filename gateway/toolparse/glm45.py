"""GLM-4.5 / GLM-4.6 calls (vLLM's ``glm45`` tool parser; reasoning is ``<think>``, in think.py):

``<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n</tool_call>``

The function name comes first, then one ``<arg_key>``/``<arg_value>`` pair per argument. Values are text:
the chat template writes strings bare and everything else as JSON, so they are converted by the tool
schema's declared type. Each of the ten markers is a single token. Hermes shares ``<tool_call>``: a body
that is not this markup (a JSON object, a sentence) is refused as malformed, not guessed at. GLM-4.7's
form without the newlines reads the same.
"""

from __future__ import annotations

import re

from ..canonical import Tool
from .base import ParsedOutput, Signature, ToolParser, arguments_json, param_type, scan, typed_value

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, VALUE = "<arg_key>", "<arg_value>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PAIR = re.compile(r"\s*<arg_key>([^<]*)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"[^\s<>{}\[\]\"'=,]+")
# A GLM turn ends at <|user|> or <|observation|> (its template writes no end-of-turn token) or at EOS.
_END = ("<|observation|>", "<|user|>", "<|endoftext|>")


def _call(body: str, tools: dict[str, Tool]) -> tuple[str, str]:
    """One ``<tool_call>`` body -> (name, arguments JSON text); raises ValueError naming the problem."""
    cut = body.find(KEY)
    head, rest = (body, "") if cut < 0 else (body[:cut], body[cut:])
    name = head.strip()
    if not name:
        raise ValueError("tool call has no function name before its arguments")
    if not _NAME.fullmatch(name):
        found = "a JSON object" if name.startswith("{") else repr(name[:40])
        raise ValueError(f"tool call body is not <arg_key>/<arg_value> markup (a function name was expected, "
                         f"found {found})")
    args = {}
    pos = 0
    while m := _PAIR.match(rest, pos):
        key, value = m.group(1).strip(), m.group(2)
        if KEY in value or VALUE in value or "</arg_key>" in value:
            raise ValueError(f"tool call {name!r}: <arg_value> of {key!r} is not closed")
        kind = param_type(tools, name, key)
        # Strings are written bare (exactly); anything else is JSON, where surrounding space means nothing.
        args[key] = value if kind in ("string", "str", "text") else typed_value(value.strip(), kind)
        pos = m.end()
    if rest[pos:].strip():
        raise ValueError(f"tool call {name!r}: unreadable argument markup at {rest[pos:].strip()[:40]!r}")
    return name, arguments_json(args)


def parse(text: str, tools: dict[str, Tool]) -> ParsedOutput:
    """Text and calls of ``<tool_call>`` blocks; a truncated last block is left as text and named."""
    tail = text.rstrip()
    end = next((e for e in _END if tail.endswith(e)), "")
    if end:  # the stop token, when the engine kept it
        text = tail[:-len(end)]
    return scan(text, _BLOCK, lambda m: [_call(m.group(1), tools)], OPEN, closer=CLOSE)


def _detect(sig: Signature) -> bool:
    return sig.has(OPEN) and sig.has(KEY) and sig.has(VALUE)


PARSER = ToolParser("glm45", parse, _detect, reasoning="glm45", markers=(OPEN,))
