"""Recognise harness side requests (titles, model routers, topic checks) so the core records them apart.

Side calls are real model calls worth keeping, but they are not turns of the agent's conversation:
marking them keeps them out of the session's prefix chain. The shapes below were seen in the real CLIs
(shared/docs/harnesses.md §1): Claude Code's title request asks for JSON output with no tools, Gemini
CLI's router asks for a JSON schema with no tools, opencode's title request starts its system prompt
with "You are a title generator". The markers are a parameter so a deployment can add its own.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MARKERS: tuple[str, ...] = (
    "You are a title generator",  # opencode, every provider
    "Task Routing AI",  # Gemini CLI's model router
    "Analyze if this message indicates a new conversation topic",  # Claude Code topic detection (1.x)
    "Summarize this coding conversation",  # Claude Code session titles (1.x)
    "You are an assistant for performing a web search tool use",  # Claude Code's WebSearch helper call
)


def is_side_call(
    *,
    system: str,
    has_tools: bool,
    structured_output: bool = False,
    only_server_tools: bool = False,
    markers: Sequence[str] = DEFAULT_MARKERS,
) -> bool:
    """Whether a request is a harness's side request rather than a turn of the agent loop.

    ``structured_output``: the request asks for JSON (a schema or JSON mode); an agent turn never does
    while offering no tools. ``only_server_tools``: every tool offered runs on the provider's servers
    (Claude Code's WebSearch helper), which no agent loop here can use.
    """
    if structured_output and not has_tools:
        return True
    if only_server_tools:
        return True
    return any(m in system for m in markers)
