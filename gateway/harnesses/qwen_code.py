"""Qwen Code (OpenAI Chat Completions, streaming with include_usage).

OPENAI_BASE_URL/OPENAI_API_KEY/OPENAI_MODEL are enough; no settings file. Without ``--yolo`` the edit,
write and shell tools are not offered. In text-only runs it may add a memory-extraction side request.
"""

from __future__ import annotations

from ._npm import npm_launch
from .base import HarnessContext, Launch


def launch(ctx: HarnessContext) -> Launch:
    """argv/env for ``qwen -p`` against the gateway."""
    env = {"OPENAI_API_KEY": ctx.session_key, "OPENAI_BASE_URL": f"{ctx.base_url}/v1", "OPENAI_MODEL": ctx.model}
    return npm_launch("qwen_code", ctx, ["-p", ctx.instruction, "--yolo"], env, api="openai.chat")
