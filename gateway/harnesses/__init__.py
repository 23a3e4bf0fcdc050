"""Harness adapters: how each agent program is pointed at the gateway.

``launch(name, ctx)`` returns the argv, environment and config files of one run. The six real CLIs
follow the recipes measured in shared/docs/harnesses.md; ``command`` runs any program with the usual
provider variables set; ``builtin`` is our small stdlib-only agent used by tests and the demo.
"""

from __future__ import annotations

from collections.abc import Callable

from . import claude_code, codex, gemini_cli, opencode, pi, qwen_code
from .base import HarnessConfigError, HarnessContext, Launch
from .generic import launch_builtin, launch_command
from .install import NPM_HARNESSES, HarnessNotInstalled

ADAPTERS: dict[str, Callable[[HarnessContext], Launch]] = {
    "claude_code": claude_code.launch,
    "codex": codex.launch,
    "gemini_cli": gemini_cli.launch,
    "qwen_code": qwen_code.launch,
    "opencode": opencode.launch,
    "pi": pi.launch,
    "command": launch_command,
    "builtin": launch_builtin,
}


def launch(name: str, ctx: HarnessContext) -> Launch:
    """The Launch of harness ``name``; unknown names and bad options raise HarnessConfigError."""
    try:
        adapter = ADAPTERS[name]
    except KeyError:
        raise HarnessConfigError(f"harness.name: unknown harness {name!r}; expected one of {', '.join(ADAPTERS)}") from None
    return adapter(ctx)


__all__ = ["ADAPTERS", "NPM_HARNESSES", "HarnessConfigError", "HarnessContext", "HarnessNotInstalled", "Launch", "launch"]
