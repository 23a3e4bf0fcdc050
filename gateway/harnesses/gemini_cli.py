"""Gemini CLI (Google generateContent, streaming; a non-stream router call without ``-m``).

Two settings are both needed (harnesses.md): ``security.auth.selectedType = gemini-api-key`` (with only
GOOGLE_GEMINI_BASE_URL the CLI picks the ``gateway`` auth type and rejects it headless, rc 41) and a
trusted workspace (else rc 55). ``-m`` skips the model-router side request; ``--yolo`` offers and runs
the shell and write tools.
"""

from __future__ import annotations

import json

from ._npm import npm_launch
from .base import HarnessContext, Launch, option

SETTINGS = {
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
}


def launch(ctx: HarnessContext) -> Launch:
    """argv/env/settings for ``gemini -p`` against the gateway."""
    args = ["-p", ctx.instruction, "--yolo"]
    if not option(ctx, "router", False):
        args[:0] = ["-m", ctx.model]
    fmt = option(ctx, "output_format", "", ("", "json", "text"))
    if fmt:
        args += ["--output-format", fmt]
    env = {"GEMINI_API_KEY": ctx.session_key, "GOOGLE_GEMINI_BASE_URL": ctx.base_url, "GEMINI_CLI_TRUST_WORKSPACE": "true"}
    files = {".gemini/settings.json": json.dumps(SETTINGS, indent=2)}
    return npm_launch("gemini_cli", ctx, args, env, files, api="google.generate_content")
