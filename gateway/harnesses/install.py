"""Installing the real harness CLIs from npm into a shared cache.

Each harness gets its own npm prefix under ``<cache>/npm/<name>`` so their dependency trees never
collide and one broken install leaves the others usable. Versions are pinned to the ones measured in
shared/docs/harnesses.md (the newest that run on Node 20): the request shapes we rely on were recorded
against exactly these builds.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NpmHarness:
    name: str  # our harness name
    package: str  # npm package
    version: str  # pinned version
    bin: str  # executable name under node_modules/.bin

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


NPM_HARNESSES: dict[str, NpmHarness] = {
    h.name: h
    for h in (
        NpmHarness("claude_code", "@anthropic-ai/claude-code", "2.1.197", "claude"),
        NpmHarness("codex", "@openai/codex", "0.171.0", "codex"),
        NpmHarness("gemini_cli", "@google/gemini-cli", "0.61.0", "gemini"),
        NpmHarness("qwen_code", "@qwen-code/qwen-code", "0.15.10", "qwen"),
        NpmHarness("opencode", "opencode-ai", "1.18.33", "opencode"),
        NpmHarness("pi", "@mariozechner/pi-coding-agent", "0.73.1", "pi"),
    )
}


class HarnessNotInstalled(RuntimeError):
    """The CLI of a harness is not in the npm cache; ``polarstream harness install`` fixes it."""


def npm_root(cache_dir: Path) -> Path:
    """Directory holding one npm prefix per harness (and npm's download cache)."""
    return Path(cache_dir) / "npm"


def prefix(name: str, cache_dir: Path) -> Path:
    """The npm prefix that holds one harness (mounted read-only into sandboxes)."""
    return npm_root(cache_dir) / _known(name).name


def bin_path(name: str, cache_dir: Path) -> Path:
    """Absolute path of the harness executable; raises HarnessNotInstalled if it is absent."""
    h = _known(name)
    path = prefix(name, cache_dir) / "node_modules" / ".bin" / h.bin
    if not path.exists():
        raise HarnessNotInstalled(f"{name}: {h.spec} is not installed in {npm_root(cache_dir)}; run `polarstream harness install {name}`")
    return path


def installed_version(name: str, cache_dir: Path) -> str | None:
    """Version recorded in the installed package.json, or None when not installed."""
    import json

    h = _known(name)
    pkg = prefix(name, cache_dir) / "node_modules" / h.package / "package.json"
    try:
        return json.loads(pkg.read_text()).get("version")
    except (OSError, ValueError):
        return None


def install(name: str, cache_dir: Path, *, force: bool = False, log=print) -> dict:
    """Install one pinned harness with ``npm install --prefix``; a no-op when that version is present.

    npm's own download cache lives next to the prefixes, so re-installs after a wipe reuse tarballs.
    Returns a small report: name, version, status (present|installed|failed), seconds, detail.
    """
    h = _known(name)
    if not force and installed_version(name, cache_dir) == h.version and (prefix(name, cache_dir) / "node_modules" / ".bin" / h.bin).exists():
        return {"name": name, "version": h.version, "status": "present", "seconds": 0.0, "detail": ""}
    npm = shutil.which("npm")
    if npm is None:
        return {"name": name, "version": h.version, "status": "failed", "seconds": 0.0, "detail": "npm not found on PATH (install Node.js 20+)"}
    target = prefix(name, cache_dir)
    target.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--prefix", str(target), "--cache", str(npm_root(cache_dir) / ".npm-cache"),
           "--no-audit", "--no-fund", "--loglevel", "error", h.spec]
    log(f"installing {h.spec} into {target}")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    took = round(time.monotonic() - t0, 1)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"name": name, "version": h.version, "status": "failed", "seconds": took, "detail": " | ".join(tail)}
    return {"name": name, "version": h.version, "status": "installed", "seconds": took, "detail": ""}


def _known(name: str) -> NpmHarness:
    try:
        return NPM_HARNESSES[name]
    except KeyError:
        raise ValueError(f"unknown npm harness {name!r}; expected one of {', '.join(NPM_HARNESSES)}") from None
