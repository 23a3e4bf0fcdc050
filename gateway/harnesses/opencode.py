"""opencode (Chat Completions, Anthropic Messages or Responses, chosen by the provider config).

The config travels in OPENCODE_CONFIG_CONTENT (the form measured in harnesses.md). ``api`` picks the
provider: ``chat`` (a custom @ai-sdk/openai-compatible provider, the model name passes through), or the
built-in ``anthropic`` / ``openai`` providers with their base URL replaced (these need a model name the
provider knows; the gateway maps any name to its served model). The prompt goes as separate words:
one argv element with spaces reached the model wrapped in literal quotes.
"""

from __future__ import annotations

import json

from ._npm import npm_launch
from .base import HarnessContext, Launch, option

APIS = {"chat": "openai.chat", "anthropic": "anthropic.messages", "responses": "openai.responses"}
DEFAULT_MODELS = {"anthropic": "claude-sonnet-4-5", "responses": "gpt-5"}


def config(api: str, base_url: str, key: str, model: str) -> tuple[dict, str]:
    """(opencode config, ``provider/model`` id) for one API."""
    if api == "chat":
        provider = {
            "polar": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "polarstream",
                "options": {"baseURL": f"{base_url}/v1", "apiKey": key},
                "models": {model: {"name": model, "tool_call": True}},
            }
        }
        return {"$schema": "https://opencode.ai/config.json", "provider": provider, "model": f"polar/{model}"}, f"polar/{model}"
    name = "anthropic" if api == "anthropic" else "openai"
    provider = {name: {"options": {"baseURL": f"{base_url}/v1", "apiKey": key}}}
    return {"$schema": "https://opencode.ai/config.json", "provider": provider, "model": f"{name}/{model}"}, f"{name}/{model}"


def launch(ctx: HarnessContext) -> Launch:
    """argv/env for ``opencode run`` against the gateway."""
    api = option(ctx, "api", "chat", tuple(APIS))
    model = option(ctx, "model", DEFAULT_MODELS.get(api, ctx.model))
    cfg, model_id = config(api, ctx.base_url, ctx.session_key, model)
    env = {
        "OPENCODE_CONFIG_CONTENT": json.dumps(cfg),
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    }
    words = [w for w in ctx.instruction.split(" ") if w]
    return npm_launch("opencode", ctx, ["run", "-m", model_id, *words], env, api=APIS[api])
