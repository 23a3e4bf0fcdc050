"""Shared bits of the npm-installed CLIs: where the binary is and what the sandbox must expose."""

from __future__ import annotations

from .base import HarnessContext, Launch, base_env
from .install import bin_path, prefix


def npm_launch(name: str, ctx: HarnessContext, args: list[str], env: dict[str, str], files: dict[str, str] | None = None, api: str = "") -> Launch:
    """A Launch of the npm CLI ``name``: its prefix read-only, its bin dir on PATH, the common env."""
    exe = bin_path(name, ctx.cache_dir)
    full_env = base_env(ctx, extra_path=str(exe.parent))
    full_env.update(env)
    return Launch(argv=[str(exe), *args], env=full_env, files=files or {}, ro_paths=[prefix(name, ctx.cache_dir)], api=api)
