"""Token-in, token-out: build a call's prompt ids from the session's previous call when possible.

When a request's history is the previous request's history + the assistant turn the gateway generated
+ something new (tool results, a user turn), the new prompt is::

    previous prompt ids + previous sampled ids + bridge(appended messages)

so the sampled tokens are never re-tokenized and the sequence trained on is the sequence sampled.
Harnesses echo the generated turn imperfectly (re-ordered or compacted arguments, added or dropped ids,
signatures, a moved ``cache_control``), so the echo is matched by tool-call id first, then by canonical
content. Anything else renders afresh and names the reason, which becomes ``ChainInfo.break_reason``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from .canonical import ChatRequest, Message, Tool, ToolCall
from .providers.arguments import same_arguments
from .sessions import Turn
from .template import SAMPLED, ChainBreak, ChatTemplate, TemplateError, TurnHistory

log = logging.getLogger("polarstream.gateway")


@dataclass
class PromptPlan:
    prompt_ids: list[int]
    extends_call_index: int | None = None  # set: prompt = that call's prompt + sampled ids + bridge
    break_reason: str = ""  # set when a new chain starts
    history_offset: int = 0  # messages already covered by the extended call (what the event may omit)


def _leading_system(messages: Sequence[Message]) -> tuple[list[str], int]:
    n = 0
    while n < len(messages) and messages[n].role == "system":
        n += 1
    return [m.content for m in messages[:n]], n


def same_tools(a: Sequence[Tool], b: Sequence[Tool]) -> bool:
    """Tool sets equal by name, description and schema, in order (order changes the rendered prompt)."""
    return [(t.name, t.description, t.parameters) for t in a] == [(t.name, t.description, t.parameters) for t in b]


def _same_calls(echoed: Sequence[ToolCall], generated: Sequence[ToolCall]) -> bool:
    if len(echoed) != len(generated):
        return False
    by_id = {c.id: c for c in generated}
    if all(c.id in by_id for c in echoed):  # ids kept: pair by id, the arguments must still agree
        pairs = [(c, by_id[c.id]) for c in echoed]
    else:  # ids dropped or replaced (Gemini CLI, Responses via opencode/pi): pair in order
        pairs = list(zip(echoed, generated))
    return all(e.name == g.name and same_arguments(e.arguments, g.arguments) for e, g in pairs)


def echo_matches(echoed: Message, generated_text: str, generated_calls: Sequence[ToolCall]) -> bool:
    """Whether ``echoed`` is the harness's copy of the assistant turn the gateway generated.

    Reasoning is ignored (harnesses drop or clear thinking); text is compared without surrounding
    whitespace, and a turn that made tool calls may come back without its text.
    """
    if echoed.role != "assistant" or not _same_calls(echoed.tool_calls, generated_calls):
        return False
    text = echoed.content.strip()
    return text == generated_text.strip() or (not text and bool(generated_calls))


def same_message(a: Message, b: Message) -> bool:
    """Equality of two echoes of one history message (what two consecutive requests both sent)."""
    return (
        a.role == b.role
        and (a.content == b.content or a.content.strip() == b.content.strip())
        and a.tool_call_id == b.tool_call_id
        and _same_calls(a.tool_calls, b.tool_calls)
    )


def divergence(prev: Turn, req: ChatRequest) -> str:
    """Why ``req`` does not extend ``prev`` ('' when it does, 'retry' when it repeats it)."""
    if not same_tools(req.tools, prev.tools):
        return "tools_changed"
    if _leading_system(req.messages) != _leading_system(prev.messages):
        return "system_changed"
    n = len(prev.messages)
    msgs = req.messages
    if len(msgs) == n and all(same_message(a, b) for a, b in zip(msgs, prev.messages)):
        return "retry"
    if len(msgs) < n:
        return "history_shortened"
    if not all(same_message(a, b) for a, b in zip(msgs[:n], prev.messages)):
        return "rewritten_history"
    if not echo_matches(msgs[n], prev.text, prev.tool_calls):
        return "assistant_turn_changed" if msgs[n].role == "assistant" else "assistant_turn_missing"
    if len(msgs) == n + 1:
        return "assistant_prefill"  # the request ends with our own turn: nothing to bridge to
    return ""


WINDOW_CHECK_EVERY = 16  # bridges checked against a full render: a chain's first extension and every Nth call


class WholeRender(Exception):
    """Raised, with ``cheap_only``, where a plan would render the whole history."""


def _bridge(template: ChatTemplate, prev: Turn, req: ChatRequest, *, check: bool, cheap_only: bool = False,
            turns: TurnHistory = SAMPLED) -> list[int]:
    """The bridge after ``prev``'s sampled ids, rendered from a window of the history.

    Rendering the whole history twice to diff it costs time in proportion to the session; the glue only
    depends on the turns around it. The window keeps what templates look at (the leading system
    messages, the first turn after them, the echoed assistant turn) and drops the middle, and at first
    the tool definitions too (ChatML-style templates put them in the system block only). It is checked
    against the full render on ``check`` calls and whenever something other than tool results is
    appended (templates that place tools before the last user turn); each disagreement takes one step
    back (window without tools -> window with tools -> full render) for this template, for good.
    ChainBreak (from the full render) when the request cannot extend ``prev``'s tokens.
    """
    n = len(prev.messages)
    appended = req.messages[n + 1 :]

    def full() -> list[int]:
        if cheap_only:
            raise WholeRender
        return template.bridge_ids(req.messages[: n + 1], appended, req.tools, prev.completion_ids, reasoning=req.reasoning,
                                   turns=turns)

    _, k = _leading_system(req.messages)
    level = template.window_level
    if level == 0 or n <= k + 1:  # nothing to leave out
        return full()
    window = [*req.messages[: k + 1], req.messages[n]]

    def windowed(level: int) -> list[int] | None:
        try:
            return template.bridge_ids(window, appended, req.tools if level == 1 else (), prev.completion_ids,
                                       reasoning=req.reasoning, turns=turns)
        except (TemplateError, ChainBreak):  # the full render decides
            return None

    bridge = windowed(level)
    first_window = n <= k + 3  # the chain's first extension with something left out: always checked
    if bridge is not None and not check and not first_window and (level == 1 or all(m.role == "tool" for m in appended)):
        return bridge
    expected = full()
    if bridge != expected:
        level -= 1  # this level just failed: the next one down is the first worth rendering
        while level > 0 and windowed(level) != expected:
            level -= 1
        log.warning("chat template glue differs when rendered from a window at level %d: level %d from now on",
                    template.window_level, level)
        template.window_level = level
    return expected


def plan_prompt(template: ChatTemplate, prev: Turn | None, req: ChatRequest, *, cheap_only: bool = False,
                turns: TurnHistory = SAMPLED) -> PromptPlan | None:
    """The prompt ids for ``req`` and how they relate to the session's main chain.

    With ``cheap_only``, None instead of a plan that renders the whole history (a first call, a break, a
    checked bridge): the gateway plans the common case, an extension rendered from a window, on its
    event loop, and sends only those to a worker thread (a thread hop per call, and the GIL handed back
    and forth with the loop, cost more than the window's render)."""

    def fresh(reason: str) -> PromptPlan:
        if cheap_only:
            raise WholeRender
        return PromptPlan(template.prompt_ids(req.messages, req.tools, reasoning=req.reasoning), break_reason=reason)

    try:
        if req.side_call:
            return fresh("side_call")
        if prev is None:
            return fresh("first_call")
        reason = divergence(prev, req)
        if reason == "retry":
            # The same request again (the harness did not get, or did not accept, the answer): the same
            # prompt ids as that call, so it extends what that call extended (a sibling of it).
            return PromptPlan(list(prev.prompt_ids), prev.extends_call_index, "retry")
        if reason:
            return fresh(reason)
        n = len(prev.messages)
        check = prev.extends_call_index is None or (prev.call_index + 1) % WINDOW_CHECK_EVERY == 0
        bridge = _bridge(template, prev, req, check=check, cheap_only=cheap_only, turns=turns)
        return PromptPlan([*prev.full_sequence, *bridge], extends_call_index=prev.call_index, history_offset=n)
    except ChainBreak as e:
        return fresh(e.reason)
    except WholeRender:
        return None
