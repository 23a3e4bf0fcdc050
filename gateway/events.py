"""Build the ``CallRecorded`` event of one call (pure: everything it needs is passed in).

Prompt ids are stored as a ``PromptDelta`` against an earlier call of the session whenever they share a
prefix with it: the extended call when the prompt was built token-in/token-out, else the session's
latest call (side calls and fresh renders usually share at least the system prompt and tools). The
normalized request is stored incrementally the same way: an extending call records only the messages
after those of the call it extends (``messages_offset``), and tools only when a chain starts, so a
long session costs linear, not quadratic, bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from schemas import CallOutput, CallRecorded, ChainInfo, Timings, ToolCallOut, Usage, encode_prompt
from schemas.session_keys import SessionClaims

from .canonical import ChatRequest, Message, Tool
from .tokens import PromptPlan
from .toolparse import ParsedOutput
from .upstream import Generation


def message_dict(m: Message) -> dict[str, Any]:
    """``dataclasses.asdict(m)`` without its deep copies (a history is tens of KB, copied for nothing)."""
    return {"role": m.role, "content": m.content,
            "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls],
            "tool_call_id": m.tool_call_id, "name": m.name, "reasoning": m.reasoning, "is_error": m.is_error}


def tool_dict(t: Tool) -> dict[str, Any]:
    """``dataclasses.asdict(t)``, sharing the schema dict (records are encoded at once, never mutated)."""
    return {"name": t.name, "description": t.description, "parameters": t.parameters}


def normalized_request(req: ChatRequest, plan: PromptPlan) -> dict[str, Any]:
    """The request as recorded: new messages only when extending, tools only at a chain start."""
    offset = plan.history_offset if plan.extends_call_index is not None else 0
    out: dict[str, Any] = {
        "messages_offset": offset,
        "messages": [message_dict(m) for m in req.messages[offset:]],
        "sampling": dataclasses.asdict(req.sampling),
        "stream": req.stream,
        "tool_choice": req.tool_choice,
        "reasoning": req.reasoning,
    }
    if plan.extends_call_index is None:
        out["tools"] = [tool_dict(t) for t in req.tools]
    else:
        out["tools_as_call"] = plan.extends_call_index  # unchanged: extending requires the same tools
    if req.extras:
        out["extras"] = req.extras
    return out


def build_call_record(
    *,
    claims: SessionClaims,
    call_index: int,
    req: ChatRequest,
    plan: PromptPlan,
    gen: Generation,
    parsed: ParsedOutput,
    finish_reason: str,
    policy_version: int,
    served_model: str,
    harness: str,
    base: tuple[int, list[int]] | None,
    received_at: float,
    total_ms: float,
    event_id: str | None = None,
) -> CallRecorded:
    """One call's event. ``base`` = (call_index, full sequence) of the call to encode the prompt against."""
    delta = encode_prompt(plan.prompt_ids, base[0], base[1]) if base is not None else None
    extra = {"event_id": event_id} if event_id else {}
    return CallRecorded(
        **extra,
        session_id=claims.session_id,
        group_id=claims.group_id,
        task_id=claims.task_id,
        sample_index=claims.sample_index,
        attempt=claims.attempt,
        call_index=call_index,
        provider=req.provider,
        model=req.model,
        served_model=served_model,
        policy_version=policy_version,
        harness=harness,
        side_call=req.side_call,
        request=normalized_request(req, plan),
        prompt_ids=None if delta is not None else list(plan.prompt_ids),
        prompt_delta=delta,
        completion_ids=gen.completion_ids,
        completion_logprobs=gen.logprobs,
        finish_reason=finish_reason,
        output=CallOutput(
            text=parsed.text,
            reasoning=parsed.reasoning,
            tool_calls=[ToolCallOut(id=c.id, name=c.name, arguments=c.arguments) for c in parsed.tool_calls],
            parse_error=parsed.parse_error,
        ),
        usage=Usage(prompt_tokens=len(plan.prompt_ids), completion_tokens=len(gen.completion_ids)),
        timings=Timings(received_at=received_at, upstream_ms=gen.upstream_ms, total_ms=total_ms),
        chain=ChainInfo(extends_call_index=plan.extends_call_index, break_reason=plan.break_reason),
    )


def build_failed_record(*, error: str, **call: Any) -> CallRecorded:
    """The event of a call the harness got an error for: ``error`` = "<status> <kind>: <message>";
    ``call`` = ``build_call_record``'s keywords less ``gen``, ``parsed`` and ``finish_reason``.

    Nothing was sampled (no completion ids or logprobs, ``finish_reason`` "error"); the prompt is the
    one the gateway planned (empty when the chat could not even be rendered), so a context-length
    error shows how long it was. Consumers never train on such a call.
    """
    empty = Generation(completion_ids=[], logprobs=[], finish_reason="error")
    record = build_call_record(gen=empty, parsed=ParsedOutput(), finish_reason="error", **call)
    record.error = error
    return record


# Substrings of User-Agent headers seen from the real CLIs (shared/docs/harnesses.md) -> harness name.
_HARNESS_AGENTS = (
    ("claude-cli", "claude_code"),
    ("codex", "codex"),
    ("geminicli", "gemini_cli"),
    ("qwencode", "qwen_code"),
    ("opencode", "opencode"),
    ("pi-coding-agent", "pi"),
)


def harness_from_user_agent(user_agent: str) -> str:
    """The harness name for a User-Agent, or '' when it is not one we know."""
    ua = user_agent.lower()
    return next((name for needle, name in _HARNESS_AGENTS if needle in ua), "")
