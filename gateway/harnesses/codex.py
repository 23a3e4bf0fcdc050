"""Codex (OpenAI Responses only, always streaming).

Codex ignores OPENAI_BASE_URL and rejects ``wire_api = "chat"``; what works is a custom model provider in
``$CODEX_HOME/config.toml`` with ``wire_api = "responses"``. A custom provider also avoids the Responses
WebSocket attempts the built-in ``openai`` provider makes first. The key is read from the env var named
by ``env_key`` and sent as a Bearer token.
"""

from __future__ import annotations

import json

from ._npm import npm_launch
from .base import HarnessContext, Launch, option

KEY_VAR = "POLAR_API_KEY"


def config_toml(base_url: str, model: str) -> str:
    """The config.toml that routes Codex to the gateway (json.dumps gives valid TOML basic strings)."""
    return (
        f"model = {json.dumps(model)}\n"
        'model_provider = "polar"\n\n'
        "[model_providers.polar]\n"
        'name = "polarstream gateway"\n'
        f"base_url = {json.dumps(base_url + '/v1')}\n"
        f'env_key = "{KEY_VAR}"\n'
        'wire_api = "responses"\n'
    )


def launch(ctx: HarnessContext) -> Launch:
    """argv/env/config for ``codex exec`` against the gateway."""
    sandbox = option(ctx, "sandbox", "bypass", ("bypass", "workspace-write", "read-only"))
    # Our runtime is the sandbox; Codex's own bubblewrap would nest inside it, so bypass by default.
    mode = ["--dangerously-bypass-approvals-and-sandbox"] if sandbox == "bypass" else ["-s", sandbox]
    args = ["exec", "--skip-git-repo-check", *mode]
    if option(ctx, "json", False):
        args.append("--json")
    args.append(ctx.instruction)
    env = {KEY_VAR: ctx.session_key, "CODEX_HOME": f"{ctx.home}/.codex"}
    files = {".codex/config.toml": config_toml(ctx.base_url, ctx.model)}
    return npm_launch("codex", ctx, args, env, files, api="openai.responses")
