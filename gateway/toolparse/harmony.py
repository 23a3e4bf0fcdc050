"""OpenAI harmony (gpt-oss): vLLM's tool parser ``openai`` and reasoning parser ``openai_gptoss``.

A completion is a run of harmony messages; the generation prompt ends in ``<|start|>assistant``, so the first
one starts at its header's rest::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer<|return|>

The recipient may also stand before the channel (``<|start|>assistant to=functions.f<|channel|>commentary json``,
as the chat template renders past calls). Recipient-less analysis messages are the reasoning; a message to
``functions.NAME`` (on any channel) is a call with JSON arguments; final and recipient-less commentary messages
are the text, without the control tokens. The engine drops the final stop token (``<|call|>`` / ``<|return|>``),
so the last message may have no end token: a call whose arguments are not complete JSON there was cut short.
A message that does not parse stays in the text as written, and ``parse_error`` names it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from ..canonical import Tool, ToolCall
from .base import ParsedOutput, ReasoningParser, Signature, ToolParser, arguments_json, json_object, new_call_id

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
FUNCTIONS = "functions."
_END = re.compile(r"<\|(?:end|call|return)\|>")
_CONTROL = re.compile(r"<\|(?:start|channel|message|constrain|end|call|return)\|>")
_ROLE = re.compile(r"[^\s<]*")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]*)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>([^\s<]*)")


@dataclass
class _Message:
    raw: str  # as written: its <|start|> (but for the first) and its end token included
    header: str  # role, recipient, channel and content type: everything before <|message|>
    body: str | None  # None: no <|message|> in it
    cut: bool  # the completion's last message, with no end token
    role: str
    recipient: str
    channel: str


def _split(text: str) -> Iterator[str | _Message]:
    """``text`` as plain-text pieces and messages, in order; their raw texts joined give ``text`` back."""
    segments = text.split(START)
    for i, seg in enumerate(segments):
        if i == 0 and not _CONTROL.search(seg):  # not harmony at all (or nothing before the first <|start|>)
            if seg:
                yield seg
            continue
        end = _END.search(seg)
        part, stray = (seg[:end.end()], seg[end.end():]) if end else (seg, "")
        inner = part[:end.start()] if end else part
        header, sep, body = inner.partition(MESSAGE)
        role = "assistant" if i == 0 else _ROLE.match(header).group(0)  # the first one's role is the prompt's
        recipient = _RECIPIENT.search(header[len(role) if i else 0:])
        channel = _CHANNEL_NAME.search(header)
        yield _Message(raw=(START if i else "") + part, header=header, body=body if sep else None,
                       cut=not end and i == len(segments) - 1, role=role,
                       recipient=recipient.group(1) if recipient else "", channel=channel.group(1) if channel else "")
        if stray:
            yield stray


def _call(m: _Message) -> ToolCall:
    """A message to functions.NAME -> the call; raises ValueError naming the problem."""
    name = m.recipient[len(FUNCTIONS):]
    if not name:
        raise ValueError(f"tool call message to {m.recipient!r} names no function")
    if m.body is None:
        if m.cut:
            raise ValueError(f"unterminated tool call {name!r} (generation stopped inside a tool call's header)")
        raise ValueError(f"tool call {name!r} has no <|message|>")
    body = m.body.strip()
    try:
        if not body and m.cut:
            raise ValueError("arguments are empty")
        args = json_object(body, f"tool call {name!r}: arguments") if body else {}
    except ValueError as e:
        if m.cut:  # its <|call|> may be the dropped stop token, but not with arguments short of JSON
            raise ValueError(f"unterminated tool call {name!r} (generation stopped inside a tool call: {e})") from None
        raise
    return ToolCall(id=new_call_id(), name=name, arguments=arguments_json(args))


def _problem(m: _Message) -> str:
    """Why a message that is not a call is not text either ('' when it is fine)."""
    if m.body is None and m.cut:
        return "unterminated harmony message (generation stopped before <|message|>)"
    if m.role != "assistant":
        return f"harmony message from {m.role!r}, not the assistant"
    if m.recipient:
        return f"harmony message to {m.recipient!r} is not a function call (only functions.NAME recipients are tools)"
    if m.body is None:
        return f"harmony message has no <|message|> (header {m.header!r})"
    return ""


def parse(text: str, tools: dict[str, Tool]) -> ParsedOutput:
    """Text and calls of harmony messages; recipient-less analysis messages (reasoning) are left out."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    pieces: list[str] = []
    for item in _split(text):
        if isinstance(item, str):
            if item.strip() or item == text:  # whitespace between messages is not the answer's
                pieces.append(item)
            continue
        if item.role == "assistant" and item.recipient.startswith(FUNCTIONS):
            try:
                calls.append(_call(item))
            except ValueError as e:
                errors.append(str(e))
                pieces.append(item.raw)
            continue
        problem = _problem(item)
        if problem:
            errors.append(problem)
            pieces.append(item.raw)
        elif item.channel != "analysis":
            pieces.append(item.body or "")
    rest = "\n".join(p for p in pieces if p)
    return ParsedOutput(text=rest.strip() if calls else rest, tool_calls=calls, parse_error="; ".join(errors))


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest): the recipient-less analysis messages' text, and the completion without them."""
    reasoning: list[str] = []
    rest: list[str] = []
    for item in _split(text):
        if (isinstance(item, _Message) and item.channel == "analysis" and not item.recipient
                and item.role == "assistant" and item.body is not None):
            reasoning.append(item.body.strip())
        else:
            rest.append(item if isinstance(item, str) else item.raw)
    if not reasoning:
        return "", text
    return "\n".join(r for r in reasoning if r), "".join(rest)


def _detect(sig: Signature) -> bool:
    return sig.has(CHANNEL) and sig.has(MESSAGE)


PARSER = ToolParser("openai", parse, _detect, reasoning="openai_gptoss", markers=("to=" + FUNCTIONS,))
REASONING = ReasoningParser("openai_gptoss", split_reasoning, _detect)
