"""pi (any of four APIs, chosen per provider in ``~/.pi/agent/models.json``).

One provider entry per API, all pointing at the gateway; ``api`` in the harness config picks which one
the run uses; ``max_tokens`` caps each answer (the model's ``maxTokens``). PI_OFFLINE stops its update and
telemetry traffic, so there are no side requests.
"""

from __future__ import annotations

import json

from ._npm import npm_launch
from .base import HarnessConfigError, HarnessContext, Launch, option

# our option value -> (pi api name, provider API recorded by the gateway, base URL suffix)
APIS = {
    "chat": ("openai-completions", "openai.chat", "/v1"),
    "responses": ("openai-responses", "openai.responses", "/v1"),
    "anthropic": ("anthropic-messages", "anthropic.messages", ""),
    "google": ("google-generative-ai", "google.generate_content", "/v1beta"),
}


def models_json(base_url: str, key: str, model: str, max_tokens: int | None = None) -> dict:
    """models.json with a ``polar-<api>`` provider for each of the four APIs. ``max_tokens``: the
    model's ``maxTokens``, which pi sends as every request's output limit (else its default, 16384)."""
    entry = {"id": model, **({"maxTokens": max_tokens} if max_tokens is not None else {})}
    return {
        "providers": {
            f"polar-{name}": {"baseUrl": base_url + suffix, "api": pi_api, "apiKey": key, "models": [entry]}
            for name, (pi_api, _, suffix) in APIS.items()
        }
    }


def launch(ctx: HarnessContext) -> Launch:
    """argv/env/models.json for ``pi -p`` against the gateway."""
    api = option(ctx, "api", "chat", tuple(APIS))
    max_tokens = option(ctx, "max_tokens", None)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise HarnessConfigError(f"harness.config.max_tokens: {max_tokens!r} is not a positive integer")
    agent_dir = f"{ctx.home}/.pi/agent"
    env = {"PI_OFFLINE": "1", "PI_TELEMETRY": "0", "PI_CODING_AGENT_DIR": agent_dir}
    files = {".pi/agent/models.json": json.dumps(models_json(ctx.base_url, ctx.session_key, ctx.model, max_tokens), indent=2)}
    args = ["-p", "--provider", f"polar-{api}", "--model", ctx.model, ctx.instruction]
    return npm_launch("pi", ctx, args, env, files, api=APIS[api][1])
