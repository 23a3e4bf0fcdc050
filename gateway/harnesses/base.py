"""What every harness adapter takes and returns.

An adapter is a pure function ``launch(ctx) -> Launch``: from the gateway base URL, the session key, the
model name, the instruction and the paths the harness will see, it produces the argv, the environment
and the config files (relative to the run's private HOME). The node writes the files, the runtime
runs the argv; the adapter does no I/O, so each one is unit-tested by looking at what it produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A system PATH that works inside a sandbox that exposes only /usr and /bin.
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class HarnessContext:
    """Everything an adapter needs, with paths as the harness will see them (inside the runtime)."""

    base_url: str  # gateway base URL reachable from the harness, no trailing slash
    session_key: str  # goes where the harness puts its API key: it binds every call to the session
    model: str  # model name the harness asks for (the gateway serves its own model under any name)
    instruction: str
    workspace: str  # the harness's cwd
    home: str  # private HOME for this run
    python: str = "python3"  # interpreter inside the runtime (the builtin harness needs it)
    cache_dir: Path = Path.home() / ".cache" / "polarstream"  # where the npm CLIs are installed (host path)
    config: dict[str, Any] = field(default_factory=dict)  # HarnessSpec.config
    command: tuple[str, ...] = ()  # HarnessSpec.command (for the `command` harness)
    session_id: str = ""
    task_id: str = ""


@dataclass
class Launch:
    """A ready-to-run harness invocation."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # path relative to HOME -> content
    ro_paths: list[Path] = field(default_factory=list)  # host paths the runtime must expose read-only
    api: str = ""  # provider API the harness will speak (for logs and metrics)


class HarnessConfigError(ValueError):
    """A HarnessSpec the adapter cannot turn into a launch (unknown option value, missing command)."""


def base_env(ctx: HarnessContext, extra_path: str = "") -> dict[str, str]:
    """Environment shared by every harness: private HOME and XDG dirs, no proxies, no colour, no TTY.

    Every probe in harnesses.md ran this way; the XDG variables keep CLIs that ignore HOME from
    writing into the real user's config directories.
    """
    path = f"{extra_path}:{SYSTEM_PATH}" if extra_path else SYSTEM_PATH
    return {
        "PATH": path,
        "HOME": ctx.home,
        "XDG_CONFIG_HOME": f"{ctx.home}/.config",
        "XDG_DATA_HOME": f"{ctx.home}/.local/share",
        "XDG_CACHE_HOME": f"{ctx.home}/.cache",
        "XDG_STATE_HOME": f"{ctx.home}/.local/state",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        # Polar's names, so custom commands and evaluators can find their session.
        "POLAR_SESSION_ID": ctx.session_id,
        "POLAR_TASK_ID": ctx.task_id,
        "POLAR_BASE_URL": ctx.base_url,
        "POLAR_SESSION_KEY": ctx.session_key,
        "POLAR_MODEL": ctx.model,
    }


def option(ctx: HarnessContext, key: str, default: Any, allowed: tuple[Any, ...] | None = None) -> Any:
    """A config option with a default; a value outside ``allowed`` is a HarnessConfigError naming it."""
    value = ctx.config.get(key, default)
    if allowed is not None and value not in allowed:
        raise HarnessConfigError(f"harness.config.{key}: {value!r} is not one of {', '.join(map(str, allowed))}")
    return value
