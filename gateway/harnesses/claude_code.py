"""Claude Code (Anthropic Messages, always streaming).

Recipe from harnesses.md: ANTHROPIC_BASE_URL/ANTHROPIC_API_KEY point it at the gateway (the key goes out
as ``x-api-key``); CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC drops the title-generation side request;
ANTHROPIC_MODEL / ANTHROPIC_DEFAULT_HAIKU_MODEL name the main and small models. Tools run without
prompts via --dangerously-skip-permissions, which Claude Code refuses as root unless IS_SANDBOX=1 —
true here: it only ever runs inside our runtime.
"""

from __future__ import annotations

from ._npm import npm_launch
from .base import HarnessContext, Launch, option


def launch(ctx: HarnessContext) -> Launch:
    """argv/env for ``claude -p`` against the gateway."""
    allowed = option(ctx, "allowed_tools", None)
    perms = ["--allowedTools", *allowed] if allowed else ["--dangerously-skip-permissions"]
    args = ["-p", ctx.instruction, *perms, "--output-format", option(ctx, "output_format", "json", ("json", "text", "stream-json"))]
    if args[-1] == "stream-json":
        args.append("--verbose")  # Claude Code requires --verbose with stream-json in print mode
    env = {
        "ANTHROPIC_BASE_URL": ctx.base_url,
        "ANTHROPIC_API_KEY": ctx.session_key,
        "ANTHROPIC_MODEL": ctx.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": option(ctx, "small_model", ctx.model),
        "CLAUDE_CONFIG_DIR": f"{ctx.home}/.claude",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",
    }
    if not option(ctx, "side_requests", False):
        env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
    return npm_launch("claude_code", ctx, args, env, api="anthropic.messages")
