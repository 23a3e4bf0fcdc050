"""Harnesses that are not npm CLIs: ``command`` (any program) and ``builtin`` (our small Python agent)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .base import HarnessConfigError, HarnessContext, Launch, base_env, option

_PLACEHOLDER = re.compile(r"\{(instruction|model|base_url|session_key|workspace|home|python)\}")


def provider_env(ctx: HarnessContext) -> dict[str, str]:
    """The usual variables of all four provider SDKs, so most programs find the gateway unchanged."""
    return {
        "OPENAI_BASE_URL": f"{ctx.base_url}/v1",
        "OPENAI_API_KEY": ctx.session_key,
        "ANTHROPIC_BASE_URL": ctx.base_url,
        "ANTHROPIC_API_KEY": ctx.session_key,
        "GOOGLE_GEMINI_BASE_URL": ctx.base_url,
        "GEMINI_API_KEY": ctx.session_key,
    }


def expand(arg: str, ctx: HarnessContext) -> str:
    """Replace ``{instruction}``, ``{model}``... in one argv element; other braces are left alone."""
    values = {"instruction": ctx.instruction, "model": ctx.model, "base_url": ctx.base_url, "session_key": ctx.session_key,
              "workspace": ctx.workspace, "home": ctx.home, "python": ctx.python}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], arg)


def launch_command(ctx: HarnessContext) -> Launch:
    """Run ``HarnessSpec.command`` with placeholders expanded and the provider env set."""
    if not ctx.command:
        raise HarnessConfigError("harness.command: the `command` harness needs a non-empty argv list")
    env = base_env(ctx)
    env.update(provider_env(ctx))
    env["POLAR_INSTRUCTION"] = ctx.instruction
    env.update({str(k): str(v) for k, v in option(ctx, "env", {}).items()})
    return Launch(argv=[expand(a, ctx) for a in ctx.command], env=env, api=option(ctx, "api", "openai.chat"))


BUILTIN_SOURCE = Path(__file__).with_name("builtin.py")


def launch_builtin(ctx: HarnessContext) -> Launch:
    """Run the builtin agent (copied into the private HOME, so the sandbox needs no repo access)."""
    agent_cfg = {
        "max_turns": int(option(ctx, "max_turns", 8)),
        "stream": bool(option(ctx, "stream", False)),
        "temperature": option(ctx, "temperature", None),
        "max_tokens": option(ctx, "max_tokens", None),
        "system": option(ctx, "system", None),
    }
    env = base_env(ctx)
    env.update(provider_env(ctx))
    env.update({"POLAR_INSTRUCTION": ctx.instruction, "POLAR_AGENT_CONFIG": json.dumps(agent_cfg)})
    files = {".polar/agent.py": BUILTIN_SOURCE.read_text()}
    return Launch(argv=[ctx.python, "-I", f"{ctx.home}/.polar/agent.py"], env=env, files=files, api="openai.chat")
